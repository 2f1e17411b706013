"""The second run of a job, on a warm compile cache, with uneven shards.

A vocabulary of 97 on 2 ranks gives 49- and 48-row shards (33/33/31 on 3 ranks). Every
rank traces the same Dynamo graph (DTensor inputs carry global shapes) but compiles
different code; AOT autograd keys its cache on the traced graph, so until the passes'
``uuid()`` carried each rank's local shard shapes (``OverlapState.cache_key``) a warm
cache handed rank 0 the code rank 1 had compiled and the second run died with
``AssertionError: expected size 48==49``. Each inductor test here runs a job twice against
one cache directory, in fresh processes: the second run must be a cache hit (inductor's own
counters, reported as ``schedule_report(model)["compile_cache"]``) with the same losses
and parameters, bit for bit, as the first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import _accelerate
import _hf
import pytest
import torch
from _dist import run_ranks

pytestmark = pytest.mark.slow

VOCAB = 97  # uneven shards on 2 and 3 ranks
# torch 2.11's AOT autograd cache refuses our graphs ("Bypassing autograd cache due to:
# Unsupported call_function target ...TensorVariable.method_redistribute.<locals>.
# redistribute_fn_with_prim_types": Dynamo traces DTensor.redistribute as a local function);
# there inductor's FX graph cache alone serves the second run. 2.13 to 2.15 take them.
AOT_CACHE_TAKES_DTENSOR_GRAPHS = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)
GLOBAL_BATCH = 6  # divisible by 2 and 3
STEPS = 3
LR = 0.5
MODEL = dict(n_layer=2, d_model=32, n_head=4, vocab_size=VOCAB, block_size=32)


def _model():
    from fsdp_overlap_plugin.models import gpt_small

    torch.manual_seed(0)
    return gpt_small(**MODEL)


def _batches():
    from fsdp_overlap_plugin.models import fixed_batches

    return fixed_batches(STEPS, GLOBAL_BATCH, 16, VOCAB)


def _train(rank: int, world: int, backend: str, config: dict | None = None) -> dict:
    from _train import full_params, train_sharded

    import fsdp_overlap_plugin as fo

    model = fo.parallelize(_model(), backend=backend, **(config or {}))
    shards = {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}
    losses = train_sharded(model, rank, world, lr=LR, data=_batches())
    report = fo.schedule_report(model)
    return {
        "losses": losses,
        "params": full_params(model),
        "shards": shards,
        "compile_cache": report["compile_cache"],
        "from_cache": [g.get("from_cache", False) for g in report["graphs"]],
        "text": fo.format_report(report),
    }


def _reference() -> list[float]:
    from _train import train_reference

    return train_reference(_model(), lr=LR, data=_batches())[0]


def _run_twice(cache: str, backend: str, world: int, config: dict | None = None) -> tuple[list[dict], list[dict]]:
    env = {"TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    cold = run_ranks(_train, backend, config, world=world, env=env)
    warm = run_ranks(_train, backend, config, world=world, env=env)
    return cold, warm


def _assert_same_training(cold: list[dict], warm: list[dict]) -> None:
    for rank, (a, b) in enumerate(zip(cold, warm)):
        assert b["losses"] == a["losses"], (rank, a["losses"], b["losses"])  # bitwise
        for name, value in a["params"].items():
            assert torch.equal(b["params"][name], value), (rank, name)


# 2 ranks: CI runs it on 2.15 (on 2.11 an HSDP job's and the Trainer's second runs load from
# the cache: test_hsdp_cache, test_hf_trainer); 3 ranks on 2.13
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.newest_torch), 3])
def test_inductor_second_run_is_a_cache_hit_with_the_same_numbers(tmp_path, world):
    """With activation checkpointing of both blocks: the report still says what the
    joint-graph pass tagged, read from its saved record on the warm run."""
    config = {"activation_checkpointing": ["blocks.*"], "activation_checkpointing_policy": "matmuls_saved"}
    cold, warm = _run_twice(str(tmp_path / "cache"), "inductor", world, config)
    # the shards really are uneven: the ranks' embedding shards differ in rows
    rows = [r["shards"]["tok_emb.weight"][0] for r in cold]
    assert sum(rows) == VOCAB and len(set(rows)) == 2, rows
    for rank in range(world):
        first, second = cold[rank]["compile_cache"], warm[rank]["compile_cache"]
        assert [c["aot_autograd"] for c in first] == ["miss" if AOT_CACHE_TAKES_DTENSOR_GRAPHS else "bypass"], first
        assert all(c["fx_graph"]["miss"] > 0 for c in first), first
        # the second run compiled nothing: AOT autograd's cache hit (where it takes the graph),
        # inductor loaded both graphs
        assert [c["aot_autograd"] for c in second] == ["hit" if AOT_CACHE_TAKES_DTENSOR_GRAPHS else "bypass"], second
        assert all(c["fx_graph"] == {"hit": 2, "miss": 0, "bypass": 0} for c in second), (rank, second)
        assert cold[rank]["from_cache"] == [False, False] and warm[rank]["from_cache"] == [True, True]
        assert "compile cache: 1 of 1 Dynamo graphs loaded from the cache" in warm[rank]["text"]
        if AOT_CACHE_TAKES_DTENSOR_GRAPHS:
            assert "(AOT autograd hit" in warm[rank]["text"]
        for run in (cold[rank], warm[rank]):
            assert "activation checkpointing (matmuls_saved): 2 modules (blocks.0, blocks.1);" in run["text"]
            assert "forward ops recomputed in backward" in run["text"]
    _assert_same_training(cold, warm)
    reference = _reference()
    for got, want in zip(cold[0]["losses"], reference):
        assert abs(got - want) < 1e-4, (cold[0]["losses"], reference)


def test_aot_eager_consults_no_compile_cache(tmp_path):
    """aot_eager compiles nothing to disk: no compile cache is consulted (the report says
    so by listing none), here on 3 ranks with uneven shards, equal to 1 process."""
    runs = run_ranks(_train, "aot_eager", None, world=3, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")})
    assert all(r["compile_cache"] == [] for r in runs)
    reference = _reference()
    for got, want in zip(runs[0]["losses"], reference):
        assert abs(got - want) < 1e-5, (runs[0]["losses"], reference)


def _cache_env(cache: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    env.update(TORCHINDUCTOR_AUTOGRAD_CACHE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_accelerate.ROOT), env.get("PYTHONPATH", "")) if p)
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "FSDP_OVERLAP_CONFIG"):
        env.pop(name, None)
    return env


def _assert_report_hit(cold: dict, warm: dict) -> None:
    first, second = cold["report"]["compile_cache"], warm["report"]["compile_cache"]
    assert first and all(c["aot_autograd"] == "miss" for c in first), first
    assert all(c["aot_autograd"] == "hit" and c["fx_graph"]["miss"] == 0 for c in second), second
    assert all(g.get("from_cache") for g in warm["report"]["graphs"]), warm["report"]["graphs"]


def test_lightning_trainer_second_run_is_a_cache_hit(tmp_path):
    """examples/hf_lightning.py (Trainer, strategy fsdp_overlap, bf16-mixed, inductor) on a
    tied Llama with vocabulary 97, twice against one cache. One decoder layer: what the cache
    keys is the same for one as for many (the passes' buckets, the shards), and the cold run's
    C++ compile is most of this test's time."""
    config_json = tmp_path / "config.json"
    _hf.config("llama", num_hidden_layers=1).to_json_file(config_json)
    env = _cache_env(str(tmp_path / "cache"))
    runs = []
    for n in range(2):
        metrics = tmp_path / f"metrics{n}.json"
        cmd = [sys.executable, "examples/hf_lightning.py", "--config-json", str(config_json), "--steps", "3"]
        proc = subprocess.run(
            [*cmd, "--metrics", str(metrics)],
            cwd=_accelerate.ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        runs.append(json.loads(metrics.read_text()))
    cold, warm = runs
    assert cold["report"]["backend"] == "inductor"
    _assert_report_hit(cold, warm)
    assert warm["rank_losses"] == cold["rank_losses"]  # bitwise, on every rank


def test_accelerate_launch_second_run_is_a_cache_hit(tmp_path, monkeypatch):
    """accelerate launch examples/hf_accelerate.py (inductor) on GPT-2 with vocabulary 97,
    twice against one cache (one block, as the Lightning test's)."""
    config_json = tmp_path / "config.json"
    _hf.config("gpt2", n_layer=1).to_json_file(config_json)
    yaml_path = _accelerate.copy_yaml(tmp_path / "hf.yaml", fsdp_overlap_backend="inductor")
    for name, value in _cache_env(str(tmp_path / "cache")).items():
        if name.startswith("TORCHINDUCTOR_"):
            monkeypatch.setenv(name, value)
    runs = []
    for n in range(2):
        metrics = tmp_path / f"metrics{n}.json"
        proc = _accelerate.accelerate_launch(
            yaml_path,
            "--config-json",
            str(config_json),
            "--steps",
            "3",
            "--metrics",
            str(metrics),
            script=_accelerate.ROOT / "examples" / "hf_accelerate.py",
        )
        assert proc.returncode == 0, _accelerate.output(proc)[-6000:]
        runs.append(json.loads(metrics.read_text()))
    cold, warm = runs
    assert cold["report"]["backend"] == "inductor"
    _assert_report_hit(cold, warm)
    assert warm["losses"] == cold["losses"]  # bitwise


def test_cache_key_carries_the_rank_only_where_merged_all_gathers_write_at_its_offset():
    """A merged all-gather copies this rank's shards to offset ``rank * N`` of its output
    (passes/merge.py): with bucketing on, two ranks with equal shards compile different
    code, so their cache keys differ; with it off they still share entries. ``uuid()``,
    which the rank agreement uses, is the same on every rank either way."""
    import dataclasses

    from fsdp_overlap_plugin.config.schema import OverlapConfig
    from fsdp_overlap_plugin.runtime.state import OverlapState

    def keys(**config):
        state = OverlapState(OverlapConfig(**config), [["blocks.0"]], "cpu", 2, (2,), local_layout="even")
        ranks = [dataclasses.replace(state, rank=r) for r in (0, 1)]
        return [s.cache_key() for s in ranks], [s.uuid() for s in ranks]

    (on0, on1), (uuid0, uuid1) = keys(manual_bucketing=True)
    assert on0 != on1 and uuid0 == uuid1
    (off0, off1), _ = keys(manual_bucketing=False)
    assert off0 == off1


def test_uuid_is_the_same_on_every_shard_group_of_an_hsdp_mesh():
    """On a 2x2 mesh, ranks 0-1 and ranks 2-3 shard over different process groups, each
    with its own gather group and receive-first group (names "1" and "2", say). ``uuid()``
    keys the rank agreement, so it must not carry those names: with them, ranks 0-1 and
    2-3 waited for each other under different keys until rank_check_timeout. The names
    still reach the cache key (the compiled graphs name the groups)."""
    import dataclasses

    from fsdp_overlap_plugin.config.schema import OverlapConfig
    from fsdp_overlap_plugin.runtime.state import OverlapState

    base = OverlapState(
        OverlapConfig(separate_gather_group=True), [["blocks.0"]], "cpu", 4, (2, 2), local_layout="even"
    )
    groups = [
        dataclasses.replace(base, rank=r, gather_group=g, exchange_groups={s: f"fsdp_overlap_receive_first:{s}"})
        for r, g, s in ((0, "5", "1"), (2, "6", "2"))
    ]
    assert groups[0].uuid() == groups[1].uuid()
    assert dataclasses.replace(groups[1], rank=0).cache_key() != groups[0].cache_key()
    # whether there is a gather group, and a receive-first group, at all still changes uuid()
    with_gather_group = dataclasses.replace(base, gather_group="5")
    assert with_gather_group.uuid() != base.uuid()  # differs in the gather group only
    assert with_gather_group.uuid() != groups[0].uuid()  # differs in the receive-first group only
