"""The passes on graphs torch really produces (GPT, fake process group, one process)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from _fake import GraphCapture, fake_world
from test_passes import assert_reduce_scatters_bounded, assert_same_outputs, compute_nodes

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn
from fsdp_overlap_plugin.passes import manual_bucketing, overlap_grad_reduce, pin_collective_order
from fsdp_overlap_plugin.passes.graph import is_all_gather

pytestmark = pytest.mark.torch_sensitive  # CI runs its quick tests on both ends of its torch matrix (2.11, 2.15)

ISSUE_PLAN = [["tok_emb", "pos_emb"], "blocks.0", "blocks.1", "blocks.2", "blocks.3", ["norm", "head"]]


def _step(model):
    x, y = fixed_batches(1, 2, 16, 256)[0]
    loss_fn(model(x), y).backward()


@pytest.fixture(scope="module")
def traced():
    """Forward/backward graphs of a float64 GPT before any pass (passes run on copies)."""
    with fake_world(2), pytest.MonkeyPatch.context() as mp:
        capture = GraphCapture(mp)
        torch.manual_seed(0)
        model = gpt_small(vocab_size=255).double()  # odd vocabulary: padded shards
        fo.parallelize(model, backend="aot_eager", bucket_plans=ISSUE_PLAN)
        _step(model)
        graphs = {"forward": capture.get("forward"), "backward": capture.get("backward"), "model": model}
    return graphs


def test_issue_plan_gives_six_all_gathers_and_six_reduce_scatters(traced):
    report = fo.schedule_report(traced["model"])
    assert report["forward"]["after"]["all_gather"] == 6
    assert report["backward"]["after"]["reduce_scatter"] == 6
    assert report["forward"]["passes"]["manual_bucketing"]["buckets"] == 6


@pytest.mark.parametrize("kind", ["forward", "backward"])
@pytest.mark.parametrize("passes", ["bucketing", "grad_overlap", "both", "both+pin"])
def test_traced_graphs_compute_the_same(traced, kind, passes):
    before = traced[kind]
    after = copy.deepcopy(before)
    if passes in ("bucketing", "both", "both+pin"):
        manual_bucketing(after, ISSUE_PLAN)
    if passes in ("grad_overlap", "both", "both+pin"):
        overlap_grad_reduce(after)
    if passes == "both+pin":
        pin_collective_order(after)
    # float64 throughout: torch 2.11's fake CPU flash attention says its logsumexp is float32
    # for float64 inputs (the real kernel returns float64), and the placeholders carry that
    assert_same_outputs(before, after, dtype=torch.float64)
    assert sorted(compute_nodes(before)) == sorted(compute_nodes(after))


def test_traced_backward_waits_until_the_next_reduce_scatter(traced):
    """Each bucket's reduce-scatter wait sinks to just after the next bucket's launch
    (FSDP2's bound), the last one below all compute: not all of them to the end, where
    every bucket's full-size gradients stayed alive until the backward's last node."""
    gm = copy.deepcopy(traced["backward"])
    manual_bucketing(gm, ISSUE_PLAN)
    stats = overlap_grad_reduce(gm)
    assert stats["matched"] == 6
    assert_reduce_scatters_bounded(gm)
    nodes = list(gm.graph.nodes)
    # re-gathered: blocks.0-2; not the kept last two buckets (norm + head gathers less
    # than blocks.3, so blocks.3 stays too), nor the embeddings (their backward needs
    # only the indices)
    assert sum(1 for n in nodes if is_all_gather(n)) == 3


def test_traced_backward_under_a_budget_waits_before_the_next_copy_in(traced):
    """Under a memory budget each reduce-scatter's wait comes before the next bucket's
    gradients are packed, and the outputs stay the same (float64, simulated ranks)."""
    gm = copy.deepcopy(traced["backward"])
    manual_bucketing(gm, ISSUE_PLAN, max_prefetch_bytes=2**30)
    stats = overlap_grad_reduce(gm, wait_before_copy_in=True)
    assert stats["matched"] == 6
    assert_reduce_scatters_bounded(gm, before_copy_in=True)
    assert_same_outputs(traced["backward"], gm, dtype=torch.float64)


# a merged all-gather writes into the buffer it names with out= (passes/merge.py); an
# unmerged one returns a new buffer
_LAUNCH = re.compile(
    r"(?:(buf\d+) = torch\.ops\._c10d_functional\.all_gather_into_tensor\.default\("
    r"|torch\.ops\._c10d_functional\.all_gather_into_tensor_out\.default\(.*out=(buf\d+)\))"
)
_WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((buf\d+)\)")
_MM = re.compile(r"extern_kernels\.(mm|addmm|bmm)\(")
_KERNEL = re.compile(r"(extern_kernels\.\w+|cpp_fused_\w+)\(")


def _windows(code: str) -> list[tuple[int, int, int]]:
    """(launch line, wait line, matmuls between) for each all-gather in generated code."""
    launches, waits, mms = {}, {}, []
    for i, line in enumerate(code.splitlines()):
        if m := _LAUNCH.search(line):
            launches[m.group(1) or m.group(2)] = i
        elif m := _WAIT.search(line):
            waits.setdefault(m.group(1), i)
        elif _MM.search(line):
            mms.append(i)
    return [
        (s, waits[b], sum(1 for i in mms if s < i < waits[b]))
        for b, s in sorted(launches.items(), key=lambda kv: kv[1])
    ]


_SPLIT = re.compile(r"torch\.ops\.fsdp_overlap\.split_gathered\.default\(reinterpret_tensor\((buf\d+),")


def _copy_outs(code: str) -> list[tuple[int, int]]:
    """(wait line, copy-out line) of each merged all-gather's buffer in generated code."""
    waits, splits = {}, {}
    for i, line in enumerate(code.splitlines()):
        if m := _WAIT.search(line):
            waits.setdefault(m.group(1), i)
        elif m := _SPLIT.search(line):
            assert m.group(1) not in splits, line  # one copy-out per gathered buffer
            splits[m.group(1)] = i
    return [(waits.get(b, -1), i) for b, i in sorted(splits.items(), key=lambda kv: kv[1])]


def test_inductor_code_keeps_prefetch_order():
    from torch._inductor.utils import run_and_get_code

    with fake_world(2):
        torch.manual_seed(0)
        model = gpt_small()
        fo.parallelize(model, backend="inductor", bucket_plans=ISSUE_PLAN)
        _, codes = run_and_get_code(lambda: _step(model))
    forward, backward = codes[0], codes[1]
    fwd = _windows(forward)
    assert len(fwd) == 6
    for (start, _, _), (_, prev_wait, _) in zip(fwd[1:], fwd):
        assert start < prev_wait  # bucket i+1 launched before bucket i's wait
    # from blocks.1 on, each prefetch's wait comes after matmuls of the previous bucket
    assert all(mms >= 1 for _, _, mms in fwd[2:]), fwd
    bwd = _windows(backward)
    assert len(bwd) == 3 and all(mms >= 1 for _, _, mms in bwd), bwd  # blocks.2-0
    # each gathered bucket is copied out once, by one extern call after its wait (not a
    # generated copy kernel per weight and use)
    for code, gathers in ((forward, 6), (backward, 3)):
        copies = _copy_outs(code)
        assert len(copies) == gathers and all(0 <= wait < split for wait, split in copies), copies
        # and copied in by one extern call each, every gradient bucket packed by one call
        assert code.count("torch.ops.fsdp_overlap.fill_slot.default(") == gathers
    assert backward.count("torch.ops.fsdp_overlap.pack_rows.default(") == 6
    assert "fsdp_overlap.pack_rows" not in forward
    # inductor keeps each gradient reduce-scatter's wait before the launch two buckets on
    # (its full-size buffers die there, not at the end of the backward)
    scatters = _scatter_windows(backward)
    assert len(scatters) == 6, scatters
    for k, (_, wait) in enumerate(scatters[:-2]):
        assert scatters[k + 1][0] < wait < scatters[k + 2][0], scatters


def test_inductor_code_under_a_budget_keeps_fsdp2s_memory_order():
    """With max_prefetch_bytes, each prefetch is issued after the copy-out of the bucket
    before it (whose gathered buffer is freed there) and before that bucket's compute,
    and each reduce-scatter is waited before the next one's copy-in."""
    from torch._inductor.utils import run_and_get_code

    with fake_world(2):
        torch.manual_seed(0)
        model = gpt_small()
        fo.parallelize(model, backend="inductor", bucket_plans=ISSUE_PLAN, max_prefetch_bytes="1GiB")
        _, codes = run_and_get_code(lambda: _step(model))
    for code, gathers in ((codes[0], 6), (codes[1], 3)):
        windows, copies = _windows(code), _copy_outs(code)
        assert len(windows) == len(copies) == gathers
        for (start, _, _), (_, prev_split) in zip(windows[1:], copies):
            assert prev_split < start, (windows, copies)
        assert all(mms >= 1 for _, _, mms in windows[2:]), windows
    # and each gradient reduce-scatter's wait comes before the next bucket's gradients
    # are packed (one full-size input alive at a time), after compute that it overlaps
    backward = codes[1]
    scatters = _scatter_windows(backward)
    assert len(scatters) == 6, scatters
    lines = backward.splitlines()
    packs = [i for i, line in enumerate(lines) if "torch.ops.fsdp_overlap.pack_rows.default(" in line]
    kernels = [i for i, line in enumerate(lines) if _KERNEL.search(line)]
    for (launch, wait), (next_launch, _) in zip(scatters, scatters[1:]):
        next_pack = max(i for i in packs if i < next_launch)
        assert launch < wait < next_pack, scatters
        assert any(launch < i < wait for i in kernels), scatters


_SCATTER = re.compile(
    r"(buf\d+) = torch\.ops\._c10d_functional\.(?:all_to_all_single|reduce_scatter_tensor)\.default\("
)


def _scatter_windows(code: str) -> list[tuple[int, int]]:
    """(launch line, wait line) of each gradient reduce-scatter (or its all-to-all) in
    generated code, in launch order."""
    launches, waits = {}, {}
    for i, line in enumerate(code.splitlines()):
        if m := _SCATTER.search(line):
            launches[m.group(1)] = i
        elif m := _WAIT.search(line):
            waits.setdefault(m.group(1), i)
    return [(i, waits[b]) for b, i in sorted(launches.items(), key=lambda kv: kv[1])]


def test_merged_copy_ins_convert_instead_of_a_cast_per_member(monkeypatch):
    """param_dtype bf16, reduce_dtype fp32: the merged all-gather's copy-in takes the fp32
    shards and writes bf16 (no cast of its own per shard, as traced before the passes),
    the merged reduce-scatter's takes the bf16 gradients and writes fp32."""
    from fsdp_overlap_plugin.passes.ops import FILL_SLOT, PACK_ROWS

    casts = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)
    capture = GraphCapture(monkeypatch)
    with fake_world(2):
        torch.manual_seed(0)
        model = gpt_small()
        fo.parallelize(model, backend="aot_eager", bucket_plans=ISSUE_PLAN, param_dtype="bf16", reduce_dtype="fp32")
        _step(model)
    before = capture.get("forward", "before")
    assert sum(1 for n in before.graph.nodes if is_all_gather(n) and n.args[0].target in casts) == 53
    for kind, op, source_dtype, dtype, count in (
        ("forward", FILL_SLOT, torch.float32, torch.bfloat16, 6),
        ("backward", FILL_SLOT, torch.float32, torch.bfloat16, 3),
        ("backward", PACK_ROWS, torch.bfloat16, torch.float32, 6),
    ):
        gm = capture.get(kind, "after")
        calls = [n for n in gm.graph.nodes if n.target is op]
        assert len(calls) == count, kind
        for call in calls:
            members, target_dtype = call.args[0], call.args[-1]
            assert target_dtype == dtype and {m.meta["val"].dtype for m in members} == {source_dtype}, call
            assert not any(m.target in casts for m in members)
