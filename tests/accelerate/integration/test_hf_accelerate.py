"""The real ``accelerate launch --config_file <yaml> --num_processes 2 examples/hf_accelerate.py``
with a Hugging Face Llama (tied embeddings) and GPT-2 (tests/_hf.py's, as ``--config-json``) on
a CPU-only machine: 2 gloo ranks, losses bitwise equal to the core's ``parallelize()``
on the same model, data and optimizer, the bucket counts the plan says; ``--export`` writes
the folder Accelerate's recipe writes; and ``--weights`` of a ``save_pretrained`` checkpoint
is what the run starts from.

The YAML is configs/overlap.yaml with ``fsdp_overlap_backend: aot_eager`` (compile time is
not the point; the passes run the same). Each launch runs once per module (``launched``): the
Llama one also exports, for the export test. The core references of all three launches
(Llama, GPT-2, Llama with its layers checkpointed) come from one 2-rank job (``core``).
"""

from __future__ import annotations

import json
import math
import os

import _accelerate
import _hf
import pytest
import torch
from _accelerate import accelerate_launch, copy_yaml, core_losses, output, rank_lines
from _dist import run_ranks

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin import OverlapConfig
from fsdp_overlap_plugin.models import counting_sequences

pytestmark = pytest.mark.slow

EXAMPLE = _accelerate.ROOT / "examples" / "hf_accelerate.py"
STEPS = 4
# examples/hf_accelerate.py's settings, repeated by the core reference
BATCH_PER_RANK = 4
SEQ = 32
LR = 3e-3
MAX_GRAD_NORM = 1.0


def global_batches(steps: int, world: int = 2) -> list[torch.Tensor]:
    tokens = counting_sequences(steps * BATCH_PER_RANK * world, SEQ, _hf.VOCAB)
    return list(tokens.split(BATCH_PER_RANK * world))


def _core_reference(rank: int, world: int, steps: int, family: str = "llama", checkpointed: tuple = ()) -> list[float]:
    """The example's training through the core ``parallelize()`` and plain torch (no
    Accelerate): the same seeded model, this rank's slice of each global batch, AdamW,
    clipping; the mean loss over ranks per step."""
    model = fo.parallelize(
        _hf.build(family, seed=0), OverlapConfig(backend="aot_eager", activation_checkpointing=list(checkpointed))
    )
    batches = [(ids,) for ids in global_batches(steps, world)]
    return core_losses(model, batches, rank, world, BATCH_PER_RANK, LR, MAX_GRAD_NORM, loss=_hf.loss)


def hf_launch(config, *args: str):
    """``accelerate launch ... examples/hf_accelerate.py ARGS``."""
    return accelerate_launch(config, *args, script=EXAMPLE)


def _core_references(rank: int, world: int, steps: int) -> dict[str, list[float]]:
    """``_core_reference`` of every launch the tests compare, one after the other on the same
    ranks (one job: the ranks start and import once)."""
    return {
        "llama": _core_reference(rank, world, steps, "llama"),
        "gpt2": _core_reference(rank, world, steps, "gpt2"),
        "llama, layers checkpointed": _core_reference(rank, world, steps, "llama", ("model.layers.*",)),
    }


@pytest.fixture(scope="module")
def core() -> list[dict[str, list[float]]]:
    """Each rank's ``_core_references``."""
    return run_ranks(_core_references, STEPS, world=2, env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``launched(family)``: the launch of ``family``'s config for STEPS steps with
    ``--metrics``, run on first use and kept for the module; the Llama run also exports
    (``--export``), for ``test_the_example_exports_by_accelerates_recipe``."""
    runs: dict[str, dict] = {}

    def launch(family: str) -> dict:
        if family not in runs:
            root = tmp_path_factory.mktemp(f"launch_{family}")
            config_json = root / "config.json"
            _hf.config(family).to_json_file(config_json)
            yaml_path = copy_yaml(root / "hf.yaml", fsdp_overlap_backend="aot_eager")
            metrics, export = root / "metrics.json", root / "trained"
            args = ("--config-json", str(config_json), "--steps", str(STEPS), "--metrics", str(metrics))
            proc = hf_launch(yaml_path, *args, *(("--export", str(export)) if family == "llama" else ()))
            runs[family] = {"proc": proc, "yaml": yaml_path, "metrics": metrics, "export": export}
        return runs[family]

    return launch


def _assert_bucketed(report: dict, family: str) -> None:
    """Each plan entry one forward all-gather (a tied weight's reads are one gather, in its
    first entry) and one backward reduce-scatter, where before there was one per parameter
    (and per use of a tied weight)."""
    plain = _hf.build(family)
    forward, backward = _hf.expected_collectives(plain, report["plan"])
    assert report["plan"] == fo.auto_plan(plain)
    assert (forward, backward) == (4, 4)
    assert report["forward"]["after"]["all_gather"] == forward
    assert report["backward"]["after"]["reduce_scatter"] == backward
    params = len(list(plain.parameters()))
    uses = len(list(plain.named_parameters(remove_duplicate=False)))  # a tied weight twice
    assert report["forward"]["before"]["all_gather"] == params
    assert report["backward"]["before"]["reduce_scatter"] == uses
    assert report["forward"]["left_unbucketed"] == [] and report["backward"]["left_unbucketed"] == []


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # tied embeddings; no loss_type (adjusted)
def test_launch_trains_the_transformers_model_like_core_parallelize(launched, core, family):
    run = launched(family)
    proc, yaml_path, metrics = run["proc"], run["yaml"], run["metrics"]
    text = output(proc)
    assert proc.returncode == 0, text[-6000:]
    assert f"fsdp-overlap settings from {yaml_path} (--config_file of accelerate launch" in proc.stdout
    shards = rank_lines(text, type(_hf.build(family)).__name__)
    assert sorted(shards) == [0, 1]
    (local0, total), (local1, _) = shards[0], shards[1]
    assert local0 + local1 == total and local0 != local1  # vocabulary 97: uneven shards of the embedding
    assert "fsdp-overlap schedule: compiled, world 2" in proc.stdout and "plan: 4 buckets" in proc.stdout

    result = json.loads(metrics.read_text())
    report = result["report"]
    assert (report["world_size"], report["backend"], report["mode"]) == (2, "aot_eager", "compiled")
    assert report["config"] == OverlapConfig(backend="aot_eager").to_dict()
    _assert_bucketed(report, family)
    if family == "gpt2":
        assert any("loss_type None -> 'ForCausalLM'" in note for note in report["adjustments"])

    losses = [result["losses"][str(step)] for step in range(STEPS)]
    reference = [ranks[family] for ranks in core]
    print("launch losses:", losses, "core:", reference[0])
    assert reference[0] == reference[1]
    assert losses == reference[0], (losses, reference[0])  # bitwise
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def test_fsdp_activation_checkpointing_true_checkpoints_each_layer(tmp_path, core):
    """Accelerate's own key: every decoder layer recomputed in backward; the losses are the
    core's with activation_checkpointing of the same layers (which equal the losses without
    it: tests/shard/test_activation_checkpointing.py)."""
    config_json = tmp_path / "config.json"
    _hf.config("llama").to_json_file(config_json)
    yaml_path = copy_yaml(tmp_path / "hf.yaml", fsdp_overlap_backend="aot_eager", fsdp_activation_checkpointing=True)
    metrics = tmp_path / "metrics.json"
    proc = hf_launch(yaml_path, "--config-json", str(config_json), "--steps", str(STEPS), "--metrics", str(metrics))
    text = output(proc)
    assert proc.returncode == 0, text[-6000:]
    assert "activation checkpointing (full): 2 modules (model.layers.0, model.layers.1)" in proc.stdout
    result = json.loads(metrics.read_text())
    report = result["report"]
    assert report["config"]["activation_checkpointing"] == ["model.layers.0", "model.layers.1"]
    assert report["activation_checkpointing"]["traced"] == ["model.layers.0", "model.layers.1"]
    _assert_bucketed(report, "llama")
    # layers.0's bucket re-gathered once; layers.1 stays gathered for the backward beside the
    # last bucket (the final norm: the lm_head is tied to the embeddings), which gathers less
    kept = report["reshard"]["kept_buckets"]
    assert len(kept) == 2 and "'model.layers.1'" in kept[1], kept
    assert report["backward"]["after"]["all_gather"] == 1
    losses = [result["losses"][str(step)] for step in range(STEPS)]
    reference = [ranks["llama, layers checkpointed"] for ranks in core]
    assert losses == reference[0], (losses, reference[0])  # bitwise


def test_the_example_exports_by_accelerates_recipe(launched):
    """examples/hf_accelerate.py --export: the recipe as the README shows it (on the Llama
    launch of ``test_launch_trains_the_transformers_model_like_core_parallelize``)."""
    run = launched("llama")
    proc, trained = run["proc"], run["export"]
    assert proc.returncode == 0, output(proc)[-4000:]
    assert f"saved the trained model to {trained}" in output(proc)
    files = sorted(os.listdir(trained))
    assert files == ["config.json", "generation_config.json", "model.safetensors"], files


def test_weights_from_a_save_pretrained_checkpoint_are_used(tmp_path):
    # A checkpoint unlike a fresh initialisation: sharper embeddings (tied to the head).
    source = _hf.build("llama", seed=7)
    with torch.no_grad():
        source.model.embed_tokens.weight.normal_(std=1.0, generator=torch.Generator().manual_seed(7))
    folder = tmp_path / "checkpoint"
    source.save_pretrained(folder)
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()

    yaml_path = copy_yaml(tmp_path / "hf.yaml", fsdp_overlap_backend="aot_eager")
    metrics = tmp_path / "metrics.json"
    proc = hf_launch(yaml_path, "--weights", str(folder), "--steps", "1", "--metrics", str(metrics))
    assert proc.returncode == 0, output(proc)[-6000:]
    first = json.loads(metrics.read_text())["losses"]["0"]

    # The unsharded checkpoint on the same first global batch (both ranks' halves).
    from transformers import AutoModelForCausalLM

    batch = global_batches(1)[0]
    loaded = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    with torch.no_grad():
        expected = _hf.loss(loaded, batch).item()
        fresh = _hf.loss(_hf.build("llama", seed=0), batch).item()  # what the run would start from without it
    print(f"first loss {first!r}, unsharded checkpoint {expected!r}, fresh model {fresh!r}")
    # fp32 both; the launch averages the two ranks' mean losses (equal token counts, so the
    # same mean) with other matmul shapes and summation orders: rounding only, ~1e-7.
    assert math.isclose(first, expected, rel_tol=1e-5), (first, expected)
    assert abs(expected - fresh) > 1.0, (expected, fresh)  # the checkpoint's loss is unmistakable
