"""Bad input, rank divergence, graph breaks, compile failures, crash and resume,
determinism: a clear error at startup, on every rank, never a hang.

The scenarios on 2 gloo ranks run one after the other in one job (``scenarios``, each from
a fresh Dynamo, each undoing what it broke on rank 1), the late rank last; the tests
assert on what each returned. Crash and resume launches torchrun."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.nn as nn
from _dist import free_port, run_ranks
from _fake import fake_world
from _train import full_params, make_model, train_reference, train_sharded

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.compile.diagnostics import GraphBreakError
from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn

ROOT = Path(__file__).resolve().parents[2]

# (config, model overrides, words the message must contain)
BAD_INPUTS = [
    ({"bakend": "inductor"}, {}, ["unknown key 'bakend'", "'backend'"]),
    ({"manual_bucketing": "yes"}, {}, ["manual_bucketing", "true or false"]),
    ({"param_dtype": "bf61"}, {}, ["param_dtype", "'bf16'"]),
    ({"reduce_dtype": "int8"}, {}, ["reduce_dtype", "bf16, fp16, fp32"]),
    ({"bucket_plans": ["blocks.0", "block.1"]}, {}, ["bucket_plans[1]", "'block.1'", "'blocks.1'"]),
    ({"bucket_plans": ["layers.*"]}, {}, ["pattern 'layers.*' matches no module"]),
    ({"bucket_plans": ["blocks.0", "blocks.0.attn"]}, {}, ["overlap", "'blocks.0'", "'blocks.0.attn'"]),
    ({"bucket_plans": []}, {}, ["bucket_plans", "empty", "manual_bucketing: false"]),
    ({"mesh": {"replicate": 3}}, {}, ["mesh.replicate=3 does not divide the world size 2", "[1, 2]"]),
    ({"mesh": {"replicate": 2, "shard": 2}}, {}, ["world size is 2"]),
    ({"activation_checkpointing": ["blokcs.*"]}, {}, ["activation_checkpointing[0]", "'blokcs.*'"]),
    ({"rank_check": "eror"}, {}, ["rank_check", "'error'"]),
    ({"on_compile_error": "skip"}, {}, ["on_compile_error", "raise, eager"]),
    ({"on_unbucketed": "ignore"}, {}, ["on_unbucketed", "error, warn"]),
]


def _bad_inputs(rank: int, world: int) -> dict:
    """Each bad config fails in parallelize() on this rank before any collective: no mesh
    is built (which would talk to the other ranks) and the group stays usable."""
    import fsdp_overlap_plugin.shard.sharding as sharding

    meshes = []
    real = sharding.init_device_mesh
    sharding.init_device_mesh = lambda *a, **k: meshes.append(a) or real(*a, **k)
    messages = []
    for config, model_kwargs, _ in BAD_INPUTS:
        try:
            fo.parallelize(gpt_small(**model_kwargs), config, backend="aot_eager")
            messages.append(None)
        except fo.OverlapConfigError as exc:
            messages.append(str(exc))
    sharding.init_device_mesh = real
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(), nn.Linear(4, 4))
        fo.resolve_plan(model, {"bucket_plans": ["0", "1", "2"]})
    import torch.distributed as dist

    dist.barrier()  # the process group is healthy: nobody is stuck in a collective
    return {"messages": messages, "meshes": len(meshes), "warnings": [str(w.message) for w in caught]}


@pytest.mark.slow
def test_bad_input_fails_on_every_rank_before_any_collective(scenarios):
    for rank, result in enumerate(r["bad_inputs"] for r in scenarios):
        assert result["meshes"] == 0, rank
        for (config, _, words), message in zip(BAD_INPUTS, result["messages"]):
            assert message is not None, (rank, config)
            for word in words:
                assert word in message, (rank, config, message)
        assert any("bucket ['1'] owns no parameters" in w for w in result["warnings"]), result["warnings"]


# ------------------------------------------------------------------- rank divergence
def _diverged(rank: int, world: int, mode: str) -> dict:
    import fsdp_overlap_plugin.models.gpt as gpt

    torch._dynamo.reset()
    real_gelu = gpt.F.gelu
    if rank == 1:
        gpt.F.gelu = torch.relu  # rank 1 runs different model code
    try:
        model = make_model()
        fo.parallelize(model, backend="aot_eager", rank_check=mode, rank_check_timeout=60)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                losses = train_sharded(model, rank, world, steps=2)
                error = None
            except Exception as exc:
                losses, error = None, f"{type(exc).__name__}: {exc}"
    finally:
        gpt.F.gelu = real_gelu
    return {"error": error, "losses": losses, "warnings": [str(w.message) for w in caught]}


@pytest.mark.slow
def test_different_graphs_stop_every_rank_naming_the_node(scenarios):
    for rank, result in enumerate(r["rank_check_error"] for r in scenarios):
        error = result["error"]
        assert error is not None and "RankMismatchError" in error, (rank, error)
        assert "the ranks compiled different graphs" in error
        assert "rank 0 has `call_function gelu (2, 16, 256) float32`" in error
        assert "rank 1 has `call_function _VariableFunctionsClass.relu (2, 16, 256) float32`" in error
        assert "gpt.py" in error  # the source line of the differing node


@pytest.mark.slow
def test_rank_check_warn_warns_and_trains(scenarios):
    for rank, result in enumerate(r["rank_check_warn"] for r in scenarios):
        assert result["error"] is None, result["error"]
        assert len(result["losses"]) == 2
        assert any("compiled different graphs" in w for w in result["warnings"]), rank


def _late_rank(rank: int, world: int) -> dict:
    import time

    torch._dynamo.reset()
    model = make_model()
    fo.parallelize(model, backend="aot_eager", rank_check_timeout=3)
    if rank == 1:
        time.sleep(8)  # never compiles within rank 0's deadline
        return {"error": None}
    start = time.monotonic()
    try:
        train_sharded(model, rank, world, steps=1)
        return {"error": None}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}


@pytest.mark.slow
def test_rank_check_cannot_hang(scenarios):
    result = scenarios[0]["late_rank"]
    assert "RankTimeoutError" in result["error"] and "only 1 of 2 ranks" in result["error"]
    assert result["seconds"] < 30


# ---------------------------------------------------------------------- graph breaks
class BreakingBlock(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        x = self.inner(x)
        torch._dynamo.graph_break()  # the line the error must name
        return x


def _breaking_model():
    torch.manual_seed(0)
    model = gpt_small()
    model.blocks[1] = BreakingBlock(model.blocks[1])
    return model


def test_graph_break_with_fullgraph_names_the_line():
    with fake_world(2):
        model = fo.parallelize(_breaking_model(), backend="aot_eager", bucket_plans=["blocks.*"])
        x, _ = fixed_batches(1, 2, 16, 256)[0]
        with pytest.raises(GraphBreakError) as info:
            model(x)
    message = str(info.value)
    assert "fullgraph: true" in message and "test_reliability.py" in message and "fullgraph: false" in message


def test_graph_break_without_fullgraph_warns_with_counts():
    with fake_world(2):
        model = fo.parallelize(_breaking_model(), backend="aot_eager", fullgraph=False, bucket_plans=["blocks.*"])
        x, y = fixed_batches(1, 2, 16, 256)[0]
        with pytest.warns(UserWarning, match=r"split the forward into \d+ compiled graphs") as caught:
            loss_fn(model(x), y).backward()
        report = fo.schedule_report(model)
    text = next(str(w.message) for w in caught if "graph breaks" in str(w.message))
    match = re.search(r"(\d+) of the model's 53 parameter reads were traced into them", text)
    assert match and int(match.group(1)) == 53 and "bucketed per graph" in text
    # every compiled graph is reported, and the blocks are bucketed in whichever graph
    # holds them (each block's frame is compiled on its own after the break)
    forward = [g for g in report["graphs"] if g["graph"] == "forward"]
    assert len(forward) > 1 and report["forward"]["graphs"] == len(forward)
    assert [g["label"] for g in forward] == [f"forward {i} of {len(forward)}" for i in range(1, len(forward) + 1)]
    assert report["forward"]["before"]["all_gather"] == 53
    assert report["forward"]["passes"]["manual_bucketing"]["buckets"] == 4  # one per block
    assert "forward total" in fo.format_report(report)
    # the modules outside the plan are named once each, not once per graph
    uncovered = [str(w.message) for w in caught if "no bucket_plans entry covers" in str(w.message)]
    named = [
        m for w in uncovered for m in ("tok_emb", "pos_emb", "norm", "head") if f"modules {m}" in w or f", {m}" in w
    ]
    assert sorted(named) == ["head", "norm", "pos_emb", "tok_emb"]


# ------------------------------------------------------------------ compile failures
def _compile_failures(rank: int, world: int) -> dict:
    """Compilation fails on rank 1 only, with ``on_compile_error`` "raise" then "eager":
    what each run ended with, and on rank 0 the single-process reference ("ref")."""
    import fsdp_overlap_plugin.compile.backends as fo_compile

    ref_losses, ref_params = train_reference(make_model()) if rank == 0 else (None, None)
    out: dict = {"ref": (ref_losses, ref_params)}
    real = fo_compile.run_passes
    if rank == 1:  # compilation fails on one rank only

        def broken(*args, **kwargs):
            raise RuntimeError("injected compile failure")

        fo_compile.run_passes = broken
    try:
        for on_error in ("raise", "eager"):
            out[on_error] = _compile_failure(rank, world, on_error)
    finally:
        fo_compile.run_passes = real
    return out


def _compile_failure(rank: int, world: int, on_error: str) -> dict:
    torch._dynamo.reset()
    model = make_model()
    fo.parallelize(model, backend="aot_eager", on_compile_error=on_error)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            losses = train_sharded(model, rank, world)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "error": None,
        "losses": losses,
        "params": full_params(model),
        "warnings": [str(w.message) for w in caught],
        "mode": fo.schedule_report(model)["mode"],
    }


@pytest.mark.slow
def test_compile_failure_on_one_rank_falls_back_to_eager_on_all(scenarios):
    ref_losses, ref_params = scenarios[0]["compile_failure"]["ref"]
    for rank, result in enumerate(r["compile_failure"]["eager"] for r in scenarios):
        assert result["error"] is None, result["error"]
        assert result["mode"] == "eager after a compile failure"
        assert any("injected compile failure" in w and "uncompiled" in w for w in result["warnings"]), rank
        # the eager forward is the plugin's by design: its gathers are no bypass of the compiled one
        assert not [w for w in result["warnings"] if "gathered outside the plugin" in w], rank
        for got, want in zip(result["losses"], ref_losses):
            assert got == pytest.approx(want, rel=1e-5)
        for name, want in ref_params.items():
            torch.testing.assert_close(result["params"][name], want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_compile_failure_on_one_rank_stops_all_with_raise(scenarios):
    results = [r["compile_failure"]["raise"] for r in scenarios]
    assert "injected compile failure" in results[1]["error"]
    assert results[0]["error"].startswith("PeerCompileError: fsdp-overlap: compilation failed on another rank")
    assert "(rank 1: RuntimeError: injected compile failure)" in results[0]["error"]


# ------------------------------------------------------------------- crash and resume
_LAUNCH_ENV = ("MASTER_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_", "ROLE_", "TORCHELASTIC_",
               "ACCELERATE_")  # fmt: skip


def _torchrun(tmp: Path, name: str, *extra: str) -> list[dict]:
    import os

    log = tmp / f"{name}.jsonl"
    output = tmp / f"{name}.out"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        str(ROOT / "examples" / "resumable_train.py"), "--dir", str(tmp / name), "--loss-log", str(log), *extra,
    ]  # fmt: skip
    # a clean launch environment: nothing a test in this process may have left behind
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_ENV)}
    env["OMP_NUM_THREADS"] = "1"
    with open(output, "w") as out:
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=300, env=env)
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun {name} timed out; its output ends:\n{output.read_text()[-6000:]}")
    assert proc.returncode == 0, output.read_text()[-6000:]
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.slow
def test_killed_rank_restarts_from_the_last_checkpoint_with_the_same_losses(tmp_path):
    clean = _torchrun(tmp_path, "clean")
    crashed = _torchrun(tmp_path, "crashed", "--crash-at", "7")
    assert [r["attempt"] for r in clean] == [0] * 10
    assert {r["attempt"] for r in crashed} == {0, 1}  # it did die and restart
    resumed = [r for r in crashed if r["attempt"] == 1]
    assert resumed[0]["step"] == 6  # from the checkpoint written after step 6
    final = {r["step"]: r["loss"] for r in crashed}  # the last attempt's value of each step
    assert final == {r["step"]: r["loss"] for r in clean}  # bitwise, every step


def _interrupted_save(rank: int, world: int, workdir: str) -> dict:
    from fsdp_overlap_plugin.shard.checkpoint import load_latest, save

    path = str(Path(workdir) / "ckpt")

    torch._dynamo.reset()
    model = fo.parallelize(make_model(), backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_sharded(model, rank, world, steps=2)
    save(path, model, opt, step=2)
    saved = full_params(model)
    train_sharded(model, rank, world, steps=1)
    import torch.distributed as dist

    if rank == 0:  # what a crash during the next save leaves behind: a partial directory
        partial = Path(path) / ".step_00000003.partial"
        partial.mkdir()
        (partial / "__0_0.distcp").write_bytes(b"half a file")
    dist.barrier()
    fresh = fo.parallelize(make_model(seed=9), backend="aot_eager")
    step, _ = load_latest(path, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3))
    loaded = full_params(fresh)
    save(path, model, opt, step=3)  # the next save clears the leftover and completes
    return {"step": step, "same": all(torch.equal(loaded[k], v) for k, v in saved.items()),
            "listing": sorted(p.name for p in Path(path).iterdir())}  # fmt: skip


@pytest.mark.slow
def test_interrupted_save_leaves_the_previous_checkpoint_loadable(scenarios):
    result = scenarios[0]["interrupted_save"]
    assert result["step"] == 2 and result["same"]
    assert result["listing"] == ["latest", "step_00000002", "step_00000003"]


# ------------------------------------------------------------------------ determinism
def _twice(rank: int, world: int) -> dict:
    from _fake import GraphCapture

    out = {}
    for run in ("first", "second"):
        torch._dynamo.reset()
        with pytest.MonkeyPatch.context() as mp:
            capture = GraphCapture(mp)
            model = fo.parallelize(make_model(seed=3), backend="aot_eager")
            losses = train_sharded(model, rank, world, steps=3)
        out[run] = {
            "losses": losses,
            "graphs": [str(after.graph) for _, _, after in capture.graphs],
            "rank_free": [_rank_free(after) for _, _, after in capture.graphs],
        }
    return out


def _rank_free(gm) -> tuple[str, list[tuple]]:
    """The graph's text with the rank-dependent constants of each merged all-gather's
    copy-in (the one place a pass writes something rank-dependent, passes/merge.py: the
    rank ``fill_slot`` writes at, and the slot the collective sends) replaced by words,
    and those slots as (dim, start, end, buffer numel, fill_slot's rank)."""
    from fsdp_overlap_plugin.passes.ops import FILL_SLOT

    lines, slots = [], []
    for node in gm.graph.nodes:
        line = node.format_node()
        if node.target is FILL_SLOT:
            _, size, rank, _ = node.args
            line = line.replace(f", {size}, {rank}, ", f", {size}, r, ")
        elif node.target is torch.ops.aten.slice.Tensor and getattr(node.args[0], "target", None) is FILL_SLOT:
            buffer, dim, start, end = node.args
            slots.append((dim, start, end, buffer.meta["val"].numel(), buffer.args[2]))
            line = line.replace(
                f"args = (%{buffer.name}, {dim}, {start}, {end})", f"args = (%{buffer.name}, {dim}, r*N)"
            )
        lines.append(line)
    return "\n".join(lines), slots


@pytest.mark.slow
def test_same_seed_same_losses_and_same_graphs_on_every_rank(scenarios):
    results = [r["twice"] for r in scenarios]
    for result in results:
        assert result["first"]["losses"] == result["second"]["losses"]  # bitwise, run to run
    for result in results:
        assert result["first"]["graphs"] == result["second"]["graphs"]  # run to run, the same graphs
    # every rank: the same graphs (same schedule), except where a merged all-gather copies
    # this rank's shards in: slot r of W of its output buffer
    texts = [[text for text, _ in result["first"]["rank_free"]] for result in results]
    assert texts[0] == texts[1]
    assert len(results[0]["first"]["graphs"]) == 2
    slots = [[graph_slots for _, graph_slots in result["first"]["rank_free"]] for result in results]
    assert any(slots[0]) and [len(s) for s in slots[0]] == [len(s) for s in slots[1]]
    for rank, per_graph in enumerate(slots):
        for dim, start, end, numel, fill_rank in (slot for graph in per_graph for slot in graph):
            assert dim == 0 and numel == len(results) * (end - start) and start == rank * (end - start)
            assert fill_rank == rank


# ------------------------------------------------------------- the scenarios' one job
def _scenarios(rank: int, world: int, workdir: str) -> dict:
    """Every 2-rank scenario of this module on the same ranks, one after the other (one job
    instead of eight): what each returned, by name. Each starts from a fresh Dynamo and a
    new model, and puts back what it broke on rank 1; the late rank, which leaves rank 0
    without its peer's compile, comes last."""
    out = {"bad_inputs": _bad_inputs(rank, world), "twice": _twice(rank, world)}
    out["interrupted_save"] = _interrupted_save(rank, world, workdir)
    for mode in ("error", "warn"):
        out[f"rank_check_{mode}"] = _diverged(rank, world, mode)
    out["compile_failure"] = _compile_failures(rank, world)
    out["late_rank"] = _late_rank(rank, world)
    return out


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> list[dict]:
    return run_ranks(_scenarios, str(tmp_path_factory.mktemp("interrupted_save")))


def test_troubleshooting_lists_every_bad_input_tried():
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    for config, _, _ in BAD_INPUTS:
        assert f"`{json.dumps(config)}`" in text, config
