"""transformers' ``Trainer`` at data-parallel 2 x tensor-parallel 2 through the plugin, launched
as its users launch it (4 gloo ranks):

    accelerate launch --config_file TP.yaml --num_processes 4 -m fsdp_overlap_plugin.accelerate \\
        tests/fixtures/hf_trainer_tensor_parallel.py '{}' OUT

``TP.yaml`` is configs/overlap.yaml with ``parallelism_config_tp_size: 2`` and
``fsdp_overlap_tp_plan: auto`` (transformers' own plan of a tiny tied Llama built from a
config). The script is an ordinary ``Trainer`` script: SGD, gradient accumulation 2,
``max_grad_norm`` clipping (some steps cut, some not). Two jobs: ``tokens``, the default
``average_tokens_across_devices=True`` with labels padded with ``-100`` to a different length in
every row (the ranks count different numbers of tokens), the tensor size from the YAML;
``per_rank``, ``average_tokens_across_devices=False`` (each data-parallel rank's loss the mean
over its own batch; no padding, so that is the one process's mean too), the tensor size said in
the script instead (``TrainingArguments(parallelism_config=ParallelismConfig(dp_shard_size=2,
tp_size=2))``, the launch's YAML without ``parallelism_config``).

The Trainer scales the loss for tensor parallelism itself: ``num_items_in_batch`` is the
token count gathered over every rank divided by ``get_tp_size()`` (the two ranks of a pair
count the same batch), and the loss is multiplied by ``num_processes // get_tp_size()``
(the data-parallel size; the plugin's gradient reduce-scatter averages over it). Both read
the tensor size from ``accelerator.parallelism_config``, which the launch's
``parallelism_config_tp_size`` sets (the two divisions cancel). Without the averaging, transformers 5.24 still divides the
rank's own count by ``get_tp_size()``: the losses and gradients were twice the reference's,
silently, until the plugin's ``Trainer`` adapter took that count undivided
(fsdp_overlap_plugin/accelerate/trainer.py). Checked here against the same script in one process
without the plugin, on the global batch: each pair's data loader gave it the same batches and
the reference saw the two pairs' batches together; losses, gradient norms (before clipping)
and final weights within 1e-5.

And examples/hf_trainer.py as shipped, launched with the same YAML on 4 ranks (AdamW,
evaluation, step checkpoints, ``save_model``): losses, gradient norms and evaluation losses
within 1e-5 of the example in one process, the exported folder its weights; a launch resumed
from a step checkpoint (torch.distributed.checkpoint of the 2-D model, through the Trainer's
FSDP helpers) trains the last steps bit for bit again.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from _accelerate import OVERLAP_YAML, ROOT, accelerate_launch, launch_env, output
from _export import assert_same_tensors, folder_tensors

pytestmark = [pytest.mark.slow, pytest.mark.middle_torch]

SCRIPT = ROOT / "tests" / "fixtures" / "hf_trainer_tensor_parallel.py"
WORLD, TP = 4, 2
DP = WORLD // TP
STEPS, ACCUMULATE, PER_RANK, MAX_GRAD_NORM = 4, 2, 2, 1.2  # the script's TrainingArguments
TOL = 1e-5
RUNNER = ("--num_processes", str(WORLD), "-m", "fsdp_overlap_plugin.accelerate")


def _yaml(path, parallelism: bool = True):
    """configs/overlap.yaml at 4 ranks, tp_plan auto; ``parallelism``: with the launch's
    ``parallelism_config`` (without, the script's TrainingArguments must say it)."""
    data = yaml.safe_load(OVERLAP_YAML.read_text())
    data["num_processes"] = WORLD
    if parallelism:
        data["parallelism_config"] = {"parallelism_config_dp_shard_size": DP, "parallelism_config_tp_size": TP}
    data["fsdp_config"].update(
        fsdp_overlap_backend="aot_eager", fsdp_sync_module_states=True, fsdp_overlap_tp_plan="auto"
    )
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


#: The two jobs: the Trainer's default (tokens counted over every rank, rows padded to different
#: lengths), and each data-parallel rank's loss the mean over its own batch
#: (average_tokens_across_devices=False; no padding, so every rank counts as many tokens and the
#: one-process mean over the global batch is the mean of the ranks' means).
#: max_grad_norm: between the job's smallest and largest gradient norm, so clipping cuts some steps.
#: ``per_rank`` says the tensor size in the script, TrainingArguments(parallelism_config=
#: ParallelismConfig(dp_shard_size=2, tp_size=2)) (transformers' own spelling), not in the YAML;
#: ``tokens`` in the YAML (``parallelism_config_tp_size``).
JOBS = {
    "tokens": {},
    "per_rank": {
        "average_tokens_across_devices": False,
        "padded": False,
        "max_grad_norm": 0.9,
        "parallelism": [DP, TP],
    },
}


def _job(root, name: str, options: dict) -> dict:
    proc = accelerate_launch(
        _yaml(root / f"{name}.yaml", parallelism="parallelism" not in options),
        json.dumps(options),
        str(root / name),
        script=SCRIPT,
        launcher_args=RUNNER,
        env={"TORCHINDUCTOR_COMPILE_THREADS": "1"},
    )
    text = output(proc)
    assert proc.returncode == 0, text[-6000:]
    # the reference: one process, no launcher (nothing adopts its Accelerator), the global batch
    reference = {k: v for k, v in options.items() if k != "parallelism"}
    reference["per_device_train_batch_size"] = DP * PER_RANK
    single = subprocess.run(
        [sys.executable, str(SCRIPT), json.dumps(reference), str(root / f"{name}-single")],
        cwd=ROOT,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert single.returncode == 0, output(single)[-4000:]
    assert "fsdp-overlap" not in output(single)
    return {
        "text": text,
        "ranks": [torch.load(root / name / f"rank{r}.pt", weights_only=False) for r in range(WORLD)],
        "single": torch.load(root / f"{name}-single" / "rank0.pt", weights_only=False),
    }


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    """Each job launched when a test first asks for it (``-k per_rank`` launches only that one)."""
    root = tmp_path_factory.mktemp("hf_trainer_tp")

    class Jobs(dict):
        def __missing__(self, name: str) -> dict:
            self[name] = _job(root, name, JOBS[name])
            return self[name]

    return Jobs()


def _history(run: dict, key: str) -> list[float]:
    return [entry[key] for entry in run["log_history"] if key in entry and "train_runtime" not in entry]


@pytest.mark.parametrize("job", JOBS)
def test_the_trainer_runs_the_model_split_over_the_tensor_pairs(jobs, job):
    runs = jobs[job]
    text = runs["text"]
    assert text.count("fsdp-overlap summary: 4 ranks (2 data-parallel x 2 tensor-parallel)") == 1, text[-6000:]
    assert text.count("trained: LlamaForCausalLM") == WORLD
    for rank in runs["ranks"]:
        # transformers' plan applied by the plugin (tp_plan: auto), on Accelerate's mesh
        assert rank["q_proj"]["type"] == "DTensor" and rank["q_proj"]["mesh"][-1] == "tp", rank["q_proj"]
        assert rank["q_proj"]["placements"][-1] == "S(0)", rank["q_proj"]  # colwise
        # what the Trainer divides its token count by and multiplies the loss by
        assert rank["world"] == WORLD and rank["tp_size"] == TP
    assert runs["single"]["world"] == 1 and runs["single"]["tp_size"] == 1


@pytest.mark.parametrize("job", JOBS)
def test_each_tensor_parallel_pair_gets_the_same_batches_and_the_pairs_the_global_batch(jobs, job):
    ranks, single = jobs[job]["ranks"], jobs[job]["single"]
    micro = STEPS * ACCUMULATE  # the loaders may collate one batch more than they train on
    for step in range(micro):
        for dp in range(DP):
            assert torch.equal(ranks[dp * TP]["batches"][step], ranks[dp * TP + 1]["batches"][step]), (step, dp)
        assert not torch.equal(ranks[0]["batches"][step], ranks[TP]["batches"][step]), step
        together = torch.cat([ranks[dp * TP]["batches"][step] for dp in range(DP)])
        assert torch.equal(together, single["batches"][step]), step


@pytest.mark.parametrize("job", JOBS)
def test_losses_gradient_norms_and_weights_match_one_process(jobs, job):
    """``per_rank`` failed before the plugin's fix (``trainer._counting_each_pair_once``): the
    Trainer divided each rank's own token count by the tensor size, and every loss and
    gradient came out twice the one process's (first loss 9.15 for 4.58)."""
    ranks, single = jobs[job]["ranks"], jobs[job]["single"]
    ref = {key: _history(single, key) for key in ("loss", "grad_norm")}
    assert len(ref["loss"]) == STEPS and len(ref["grad_norm"]) == STEPS
    # clipping cuts some steps and leaves others: a wrong gradient scale shows in the weights
    # (the unclipped steps) as well as in the logged norms
    max_norm = JOBS[job].get("max_grad_norm", MAX_GRAD_NORM)
    assert min(ref["grad_norm"]) < max_norm < max(ref["grad_norm"]), ref["grad_norm"]
    for rank in ranks:
        for key in ("loss", "grad_norm"):
            ours = _history(rank, key)
            assert len(ours) == STEPS
            assert max(abs(a - b) for a, b in zip(ours, ref[key])) <= TOL, (key, ours, ref[key])
        assert rank["params"].keys() == single["params"].keys()
        worst = max((rank["params"][k] - single["params"][k]).abs().max().item() for k in single["params"])
        assert worst <= TOL, worst


# ---------------------------------------------------------------- examples/hf_trainer.py
EXAMPLE = ROOT / "examples" / "hf_trainer.py"
EXAMPLE_ARGS = ("--steps", "6", "--save-steps", "2", "--eval-steps", "3", "--grad-accum", "2")


def _example_history(path) -> dict[str, list[float]]:
    logs = json.loads(path.read_text())["log_history"]
    return {key: [entry[key] for entry in logs if key in entry] for key in ("loss", "grad_norm", "eval_loss")}


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> dict:
    """The example as shipped (AdamW, evaluation every 3 steps, a step checkpoint every 2,
    ``save_model`` at the end), at dp 2 x tp 2; the one process; and a second launch resumed
    from checkpoint-4 of the first (checkpoint-6 removed, as a kill during it would leave it)."""
    root = tmp_path_factory.mktemp("hf_trainer_tp_example")
    config = _yaml(root / "tp.yaml")

    def launch(name: str, *args: str) -> dict:
        proc = accelerate_launch(
            config,
            *EXAMPLE_ARGS,
            "--output-dir",
            str(root / name),
            "--metrics",
            str(root / f"{name}.json"),
            "--export",
            str(root / f"{name}-export"),
            *args,
            script=EXAMPLE,
            launcher_args=("--num_processes", str(WORLD)),
            env={"TORCHINDUCTOR_COMPILE_THREADS": "1"},
        )
        assert proc.returncode == 0, output(proc)[-6000:]
        return {"text": output(proc), "history": _example_history(root / f"{name}.json")}

    out = {"root": root, "plugin": launch("plugin")}
    single = subprocess.run(
        [sys.executable, str(EXAMPLE), "--batch", str(DP * 4), *EXAMPLE_ARGS, "--output-dir", str(root / "single")]
        + ["--metrics", str(root / "single.json"), "--export", str(root / "single-export")],
        cwd=ROOT,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert single.returncode == 0, output(single)[-4000:]
    out["single"] = {"history": _example_history(root / "single.json")}
    shutil.copytree(root / "plugin", root / "resumed")
    shutil.rmtree(root / "resumed" / "checkpoint-6")
    out["resumed"] = launch("resumed", "--resume", "latest")
    return out


def test_the_example_trains_evaluates_and_exports_like_one_process(example):
    ours, single = example["plugin"]["history"], example["single"]["history"]
    assert "fsdp-overlap summary: 4 ranks (2 data-parallel x 2 tensor-parallel)" in example["plugin"]["text"]
    assert len(ours["loss"]) == 6 and len(ours["eval_loss"]) == 2
    for key in ("loss", "grad_norm", "eval_loss"):
        assert max(abs(a - b) for a, b in zip(ours[key], single[key])) <= TOL, (key, ours[key], single[key])
    # save_model: the full weights, gathered over both dimensions (AdamW: an element whose
    # gradient is near 0 moves by up to lr whatever its size; test_hf_trainer.py's tolerance)
    root = example["root"]
    exported, reference = folder_tensors(root / "plugin-export"), folder_tensors(root / "single-export")
    assert exported.keys() == reference.keys()
    for key in exported:
        torch.testing.assert_close(exported[key], reference[key], rtol=1e-5, atol=1e-4)


def test_the_examples_step_checkpoints_resume_bit_for_bit(example):
    root = example["root"]
    for step in (2, 4, 6):
        shards = {p.name for p in (root / "plugin" / f"checkpoint-{step}" / "pytorch_model_fsdp_0").iterdir()}
        assert shards == {".metadata", *(f"__{r}_0.distcp" for r in range(WORLD))}
    assert example["resumed"]["history"] == example["plugin"]["history"]  # steps 5-6 trained again, equal
    assert_same_tensors(folder_tensors(root / "resumed-export"), folder_tensors(root / "plugin-export"))
