"""transformers' ``Trainer`` through the plugin, launched as its users launch it:

    accelerate launch --config_file configs/overlap.yaml --num_processes 2 examples/hf_trainer.py ...

The example is an ordinary ``Trainer`` script with one line of ours (``import
fsdp_overlap_plugin.accelerate``). Before: the run was plain ``DistributedDataParallel``
(``MULTI_CPU``, plain ``Parameter``s, nothing compiled), with no word from the plugin. Now the
``Trainer``'s own ``accelerator.prepare`` shards and compiles the model with the passes
(``accelerate/adopt.py``), and its features keep working: gradient accumulation, clipping,
evaluation during training, step checkpoints, ``resume_from_checkpoint``, ``save_model``, bf16.

Compared with the same script in one process without the plugin (``python
examples/hf_trainer.py --batch 8``: the same global batches): losses, gradient norms and
evaluation losses within 1e-5; the exported folder loads with plain ``from_pretrained``. A
run resumed from a step checkpoint (the same inductor cache: its graphs come from it) ends
with bit-for-bit the weights of the uninterrupted run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import _hf
import pytest
import torch
from _accelerate import OVERLAP_YAML, ROOT, accelerate_launch, copy_yaml, launch_env, output
from _export import assert_same_tensors, folder_tensors, load_without_plugin

# CI runs it on torch 2.11 (.ci/test-torch), the torch of the GPU machines a Trainer user would bring
pytestmark = [pytest.mark.slow, pytest.mark.oldest_torch]

EXAMPLE = ROOT / "examples" / "hf_trainer.py"
PLAIN = ROOT / "tests" / "fixtures" / "hf_trainer_plain.py"
STEPS, SAVE, EVAL, ACCUMULATE = 6, 2, 3, 2
ARGS = ("--steps", str(STEPS), "--save-steps", str(SAVE), "--eval-steps", str(EVAL), "--grad-accum", str(ACCUMULATE))
RUNNER = ("-m", "fsdp_overlap_plugin.accelerate")


def _one_process(root: Path, name: str, *args: str) -> dict:
    """The example in one process, without the plugin (no launcher: nothing adopts its
    Accelerator), on the global batch of the 2-rank run."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--batch", "8", "--output-dir", str(root / name), *args],
        cwd=ROOT,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, output(proc)[-4000:]
    assert "fsdp-overlap" not in output(proc)  # not adopted: a plain transformers run
    return {"text": output(proc)}


def _history(path: Path) -> dict[str, list[float]]:
    logs = json.loads(path.read_text())["log_history"]
    return {key: [entry[key] for entry in logs if key in entry] for key in ("loss", "grad_norm", "eval_loss")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf_trainer")
    cache = {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor-cache")}

    def plugin_run(name: str, *args: str, config: Path = OVERLAP_YAML) -> dict:
        proc = accelerate_launch(
            config,
            *ARGS,
            "--output-dir",
            str(root / name),
            "--metrics",
            str(root / f"{name}.json"),
            *args,
            script=EXAMPLE,
            env=cache,
        )
        assert proc.returncode == 0, output(proc)[-6000:]
        return {"text": output(proc), "history": _history(root / f"{name}.json")}

    out = {"root": root}
    out["plugin"] = plugin_run("plugin", "--export", str(root / "plugin-export"))  # configs/overlap.yaml as shipped
    single = _one_process(
        root, "single", *ARGS, "--export", str(root / "single-export"), "--metrics", str(root / "s.json")
    )
    out["single"] = {**single, "history": _history(root / "s.json")}
    # killed after checkpoint-4, say: resume from the newest checkpoint left
    shutil.copytree(root / "plugin", root / "resumed")
    shutil.rmtree(root / "resumed" / f"checkpoint-{STEPS}")
    out["resumed"] = plugin_run("resumed", "--resume", "latest", "--export", str(root / "resumed-export"))
    return out


def test_the_trainer_trains_through_the_plugin_and_says_so(runs):
    text = runs["plugin"]["text"]
    # the environment variable it sets, and the adoption, each said once (rank 0)
    assert text.count("fsdp-overlap: set ACCELERATE_USE_CPU=true") == 1
    assert text.count("fsdp-overlap: this FSDP launch runs through fsdp-overlap on 2 cpu process(es)") == 1
    assert "Accelerate alone would run it as MULTI_CPU, DistributedDataParallel" in text
    # the summary, once, after the first optimizer step; the plan is the model's decoder layers
    assert text.count("fsdp-overlap summary: 2 ranks, compiled with inductor, both passes on") == 1
    assert "buckets: 6 (model.embed_tokens; model.layers.0 to model.layers.3, one each; model.norm + lm_head)" in text
    assert "forward 38 -> 6 parameter gathers" in text and "39 -> 6 gradient reduce-scatters" in text
    assert "DistributedDataParallel(" not in text and "find_unused_parameters" not in text


def test_losses_gradient_norms_and_evaluation_match_one_process(runs):
    ours, single = runs["plugin"]["history"], runs["single"]["history"]
    assert len(ours["loss"]) == STEPS and len(ours["eval_loss"]) == STEPS // EVAL
    for key in ("loss", "grad_norm", "eval_loss"):
        assert ours[key] == pytest.approx(single[key], rel=1e-5, abs=1e-6), key
    assert ours["loss"][-1] < ours["loss"][0]  # it trained


def test_step_checkpoints_are_sharded_and_resume_bit_for_bit(runs):
    root = runs["root"]
    for step in range(SAVE, STEPS + 1, SAVE):
        folder = root / "plugin" / f"checkpoint-{step}"
        for part in ("pytorch_model_fsdp_0", "optimizer_0"):  # the Trainer's FSDP layout, as on GPUs
            assert {p.name for p in (folder / part).iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
        assert (folder / "trainer_state.json").is_file() and (folder / "scheduler.pt").is_file()
    resumed = runs["resumed"]
    assert "fsdp-overlap summary" in resumed["text"]
    # the same inductor cache: the resumed run's graphs come from it
    assert "from the compile cache" in resumed["text"] and "0 of 1 graph from the compile cache" not in resumed["text"]
    assert resumed["history"]["loss"] == runs["plugin"]["history"]["loss"]  # steps 5-6 trained again, equal
    assert_same_tensors(folder_tensors(root / "resumed-export"), folder_tensors(root / "plugin-export"))


@pytest.mark.parametrize("lost", ["pytorch_model_fsdp_0/__1_0.distcp", "optimizer_0/.metadata"])
def test_resuming_from_a_checkpoint_a_kill_cut_short_stops_naming_the_last_complete_one(runs, tmp_path, lost):
    """The Trainer writes checkpoint-N in place: killed during the save, the folder lacks what
    was not written yet (a rank's shard; the index DCP writes last). resume_from_checkpoint=True
    takes the newest folder whatever it holds; torch's reader then failed deep inside, naming
    neither the problem nor where to resume from."""
    out = tmp_path / "out"
    shutil.copytree(runs["root"] / "plugin", out)
    (out / f"checkpoint-{STEPS}" / lost).unlink()
    proc = accelerate_launch(
        OVERLAP_YAML, *ARGS, "--output-dir", str(out), "--resume", "latest", script=EXAMPLE, timeout=300
    )
    text = output(proc)
    assert proc.returncode != 0 and "fsdp-overlap summary" not in text  # stopped before training
    assert f"the checkpoint {out / f'checkpoint-{STEPS}'} is incomplete: `{lost}`" in text, text[-4000:]
    assert f"The newest complete checkpoint beside it: {out / f'checkpoint-{STEPS - SAVE}'}" in text


def test_save_model_writes_a_folder_plain_from_pretrained_loads(runs):
    root = runs["root"]
    ours, single = folder_tensors(root / "plugin-export"), folder_tensors(root / "single-export")
    assert ours.keys() == single.keys()  # transformers' own names: the tied lm_head left out
    for key in ours:
        # Adam divides by the root of the second moment: an element whose gradient is near 0
        # moves by up to lr (3e-3) per step whatever the gradient's size, so summation-order
        # rounding shows there: 1.1e-5 on one element of 8192 here, bit for bit the same each run
        torch.testing.assert_close(ours[key], single[key], rtol=1e-5, atol=1e-4)
    # reference: the one-process model's logits on a probe, computed here
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / "single-export")
    probe = torch.arange(64).reshape(2, 32) % 256
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    torch.save({"probe": probe, "logits": logits, "params": {}}, root / "reference.pt")
    loaded = load_without_plugin({"export": (root / "plugin-export", root / "reference.pt")}, root)
    assert loaded["plugin imported"] is False
    # tied (TINY_LLAMA): the head is the embedding's tensor after loading, and the files hold
    # the embedding only (read from the safetensors headers, not from config.json)
    export = loaded["export"]
    assert export["head_is_embedding"] and export["head_shares_data"] and export["logits"] <= 1e-4
    assert _hf.head_storage_problems(root / "plugin-export", "llama", tied=True) == []


def test_bf16_trains_close_to_one_process_bf16(tmp_path):
    config = copy_yaml(tmp_path / "overlap.yaml", fsdp_overlap_backend="aot_eager")
    args = ("--steps", "3", "--bf16", "--metrics")
    proc = accelerate_launch(
        config, *args, str(tmp_path / "b.json"), "--output-dir", str(tmp_path / "b"), script=EXAMPLE
    )
    assert proc.returncode == 0, output(proc)[-6000:]
    # mixed_precision follows bf16=True: parameters gathered and computed in bf16 (the plugin's
    # param_dtype), where one process autocasts: the same within bf16 rounding
    assert "fsdp-overlap summary: 2 ranks, compiled with aot_eager, both passes on" in output(proc)
    _one_process(tmp_path, "single", *args, str(tmp_path / "s.json"))
    ours, single = _history(tmp_path / "b.json")["loss"], _history(tmp_path / "s.json")["loss"]
    assert len(ours) == 3 and ours == pytest.approx(single, rel=1e-3)


def test_a_script_that_never_imports_the_plugin_trains_through_it_under_its_runner(tmp_path):
    config = copy_yaml(tmp_path / "overlap.yaml", fsdp_overlap_backend="aot_eager")
    options = json.dumps({"save_strategy": "steps", "save_steps": 1})
    proc = accelerate_launch(config, options, str(tmp_path / "out"), script=PLAIN, launcher_args=RUNNER)
    text = output(proc)
    assert proc.returncode == 0, text[-6000:]
    assert text.count("fsdp-overlap summary: 2 ranks, compiled with aot_eager, both passes on") == 1
    assert text.count("trained: LlamaForCausalLM, parameters DTensor") == 2  # both ranks: sharded, not wrapped
    # two step checkpoints, read from the shards: Accelerate's FSDP helpers look each parameter
    # up through its gathering property (a full all-gather each) unless the plugin turns it off
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    assert text.count("parameter gathers while checkpointing: 0") == 2


def test_an_option_the_plugin_cannot_honour_stops_at_startup_naming_it(tmp_path):
    config = copy_yaml(tmp_path / "overlap.yaml", fsdp_overlap_backend="aot_eager")
    options = json.dumps({"torch_compile": True})
    proc = accelerate_launch(config, options, str(tmp_path / "out"), script=PLAIN, launcher_args=RUNNER)
    text = output(proc)
    assert proc.returncode != 0 and "trained:" not in text
    assert text.count("fsdp-overlap: configuration error:") == 1
    assert "TrainingArguments(torch_compile=True)" in text and "leave TrainingArguments' torch_compile off" in text
    assert "raised in Accelerator.prepare" in text
