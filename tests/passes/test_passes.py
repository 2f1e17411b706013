"""The two overlap passes on FX graphs built without a process group.

Hand-built graphs (``fsdp_overlap_plugin.testing``) pin down exact node orders; graphs
traced from the GPT with a fake process group check the passes on what torch really
produces. ``SimulatedRank`` runs graphs before and after a pass and the outputs must be
bitwise identical (float64).
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx

from fsdp_overlap_plugin import OverlapConfigError
from fsdp_overlap_plugin.passes import (
    annotate_activation_checkpointing,
    annotate_reshard,
    manual_bucketing,
    merge_tied_reductions,
    overlap_grad_reduce,
    pin_collective_order,
    reduce_scatter_as_all_to_all,
    use_gather_group,
)
from fsdp_overlap_plugin.passes.graph import (
    C10D,
    collective_of_wait,
    effective_target,
    is_all_gather,
    is_collective,
    is_control_deps,
    is_preparation_op,
    is_reduce_scatter,
    is_view,
    is_wait,
    module_path,
)
from fsdp_overlap_plugin.passes.ops import FILL_SLOT, PACK_ROWS, SPLIT_GATHERED
from fsdp_overlap_plugin.testing import (
    GraphBuilder,
    SimulatedRank,
    fsdp_backward_graph,
    fsdp_forward_graph,
    random_inputs,
)

aten = torch.ops.aten
PLAN = [f"blocks.{i}" for i in range(4)]


def _tag(node: fx.Node) -> str:
    bucket = node.meta.get("fsdp_overlap_bucket")
    if bucket is None:
        path = module_path(node) or ""
        bucket = path.split(".")[1] if path.startswith("blocks.") else path
    return str(bucket)


def sequence(gm: fx.GraphModule) -> str:
    """Collectives, waits and matmuls in graph order: AG<bucket>, RS<bucket>, W<bucket>
    (all-gather wait), Wrs<bucket> (reduce-scatter wait), mm. Lints the graph first."""
    gm.graph.lint()
    out = []
    for n in gm.graph.nodes:
        if is_all_gather(n):
            out.append(f"AG{_tag(n)}")
        elif is_reduce_scatter(n):
            out.append(f"RS{_tag(n)}")
        elif is_wait(n):
            coll = collective_of_wait(n)
            out.append(("W" if is_all_gather(coll) else "Wrs") + _tag(coll))
        elif n.target is aten.mm.default:
            out.append("mm")
    return " ".join(out)


def simulate(gm: fx.GraphModule, inputs: list) -> list[torch.Tensor]:
    return [o for o in SimulatedRank(gm, rank=1, world=2).run(*inputs) if isinstance(o, torch.Tensor)]


def assert_same_outputs(
    before: fx.GraphModule, after: fx.GraphModule, seed: int = 0, dtype: torch.dtype | None = None
) -> None:
    after.graph.lint()
    inputs = random_inputs(before, seed=seed, dtype=dtype)
    for got, want in zip(simulate(after, inputs), simulate(before, inputs), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def compute_nodes(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """(name, operation) of every node that computes, seen through control_deps wrappers."""
    return [
        (n.name, str(effective_target(n)))
        for n in gm.graph.nodes
        if n.op == "call_function"
        and not (is_collective(n) or is_wait(n) or is_view(n))
        and "fsdp_overlap_bucket" not in n.meta
    ]


# ------------------------------------------------------------------ the pass protocol
@pytest.mark.parametrize("builder", [fsdp_forward_graph, fsdp_backward_graph])
def test_every_pass_returns_statistics_and_leaves_the_module_to_the_wiring(builder):
    """``pass(gm, ...) -> dict``: a pass rewrites the graph and tags nodes, but neither
    writes ``gm.meta`` nor regenerates ``gm.forward`` (the wiring recompiles once)."""
    gm = builder()
    code = gm.code
    results = [
        annotate_activation_checkpointing(gm),
        annotate_reshard(gm, PLAN),
        use_gather_group(gm, "7"),
        merge_tied_reductions(gm),
        manual_bucketing(gm, PLAN),
        overlap_grad_reduce(gm),
        reduce_scatter_as_all_to_all(gm),
        pin_collective_order(gm),
    ]
    assert all(isinstance(stats, dict) for stats in results)
    assert results[4]["buckets"] == 4
    assert "fsdp_overlap" not in gm.meta
    assert gm.code == code
    gm.graph.lint()


def test_inductor_frees_dead_buffers_when_the_passes_are_on():
    """Inductor's buffer reuse (a dead buffer kept for the next allocation of its size)
    kept a bucket's dead gradients alive across the next bucket's copy-out; with the
    passes on it is off, and so is the peak-memory reordering that would undo the
    prefetch order. Passes off: inductor's own settings."""
    from fsdp_overlap_plugin.compile.inductor import inductor_options
    from fsdp_overlap_plugin.config.schema import OverlapConfig
    from fsdp_overlap_plugin.runtime.state import OverlapState

    def options(**overrides):
        config = OverlapConfig.coerce(None, backend="inductor", **overrides)
        st = OverlapState(config=config, plan=[[p] for p in PLAN], device_type="cpu", world_size=2, mesh_shape=(2,))
        return inductor_options(st, lambda *a: None, lambda *a: None)

    on = options()
    assert on["allow_buffer_reuse"] is False and on["reorder_for_peak_memory"] is False
    off = options(manual_bucketing=False, overlap_grad_reduce=False)
    assert "allow_buffer_reuse" not in off and "reorder_for_peak_memory" not in off


def test_the_wiring_runs_one_list_of_passes_each_where_it_applies():
    from fsdp_overlap_plugin.compile.pass_table import JOINT_PASSES, POST_GRAD_PASSES
    from fsdp_overlap_plugin.config.schema import OverlapConfig
    from fsdp_overlap_plugin.runtime.state import OverlapState

    def state(**overrides):
        config = OverlapConfig.coerce(None, **overrides)
        return OverlapState(config=config, plan=[[p] for p in PLAN], device_type="cpu", world_size=2, mesh_shape=(2,))

    def names(entries, kind, st):
        return [e.name for e in entries if e.applies_to(kind, st)]

    assert [e.name for e in POST_GRAD_PASSES] == [
        "gather_group",
        "tied",
        "manual_bucketing",
        "overlap_grad_reduce",
        "all_to_all",
        "pin_order",
    ]
    inductor = state(backend="inductor")
    assert names(POST_GRAD_PASSES, "forward", inductor) == ["manual_bucketing", "pin_order"]
    assert names(POST_GRAD_PASSES, "backward", inductor) == [
        "tied",
        "manual_bucketing",
        "overlap_grad_reduce",
        "pin_order",
    ]
    eager = state(backend="aot_eager", reduce_scatter_impl="all_to_all")
    # what runs is what parallelize resolved (reduce_scatter_choice), not the config's word
    assert names(POST_GRAD_PASSES, "backward", eager)[-1] == "overlap_grad_reduce"
    eager.reduce_scatter_impl = "all_to_all"
    eager.gather_group = "7"
    assert names(POST_GRAD_PASSES, "forward", eager) == ["gather_group", "manual_bucketing"]
    assert names(POST_GRAD_PASSES, "backward", eager) == [
        "gather_group",
        "tied",
        "manual_bucketing",
        "overlap_grad_reduce",
        "all_to_all",
    ]
    assert names(JOINT_PASSES, "joint", inductor) == ["reshard"]
    inductor.checkpointed = ["blocks.0"]
    assert names(JOINT_PASSES, "joint", inductor) == ["checkpointing", "reshard"]


# ------------------------------------------------------------------ manual bucketing
def test_forward_buckets_and_prefetches_one_ahead():
    gm = fsdp_forward_graph()
    assert sequence(gm).count("AG") == 8
    stats = manual_bucketing(gm, PLAN)
    assert sequence(gm) == "AG0 AG1 W0 mm mm AG2 W1 mm mm AG3 W2 mm mm W3 mm mm"
    assert (stats["all_gathers_before"], stats["all_gathers_after"], stats["buckets"]) == (8, 4, 4)


def test_under_a_budget_prefetch_launches_after_the_copy_out():
    # with max_prefetch_bytes, bucket k + 1's all-gather launches just after bucket k's
    # wait and copy-out (FSDP2's order), still before bucket k's compute: bucket k's
    # gathered buffer and its copies never meet bucket k + 1's buffer
    gm = fsdp_forward_graph()
    inputs = random_inputs(gm)
    expected = simulate(gm, inputs)
    stats = manual_bucketing(gm, PLAN, max_prefetch_bytes=2 * 512)
    assert stats["prefetch_depths"] == [1, 1, 1, 1]
    assert sequence(gm) == "AG0 W0 AG1 mm mm W1 AG2 mm mm W2 AG3 mm mm W3 mm mm"
    assert all(torch.equal(a, b) for a, b in zip(simulate(gm, inputs), expected))


def test_backward_prefetches_and_defers_reduce_scatter_waits():
    gm = fsdp_backward_graph()
    stats = manual_bucketing(gm, PLAN)
    assert sequence(gm) == (
        "AG3 mm AG2 W3 mm mm mm RS3 mm AG1 W2 mm mm mm RS2 Wrs3 mm AG0 W1 mm mm mm RS1 Wrs2 mm W0 mm mm mm RS0 Wrs1 Wrs0"
    )
    assert stats["reduce_scatters_after"] == 4 and stats["deferred_rs_waits"] == 3


def test_backward_under_a_budget_holds_one_bucket_of_each_kind_in_flight():
    # FSDP2's order: each prefetch after the copy-out of the bucket before it, and
    # reduce-scatter k's wait deferred over bucket k - 1's compute to just before bucket
    # k - 1's gradients are packed (one full-size input alive at a time)
    gm = fsdp_backward_graph()
    inputs = random_inputs(gm)
    expected = simulate(gm, inputs)
    stats = manual_bucketing(gm, PLAN, max_prefetch_bytes=2**20)
    assert sequence(gm) == (
        "AG3 mm W3 AG2 mm mm mm RS3 mm W2 AG1 mm mm mm Wrs3 RS2 mm W1 AG0 mm mm mm Wrs2 RS1 mm W0 mm mm mm Wrs1 RS0 Wrs0"
    )
    assert stats["deferred_rs_waits"] == 3
    assert all(torch.equal(a, b) for a, b in zip(simulate(gm, inputs), expected))


def test_merged_reduce_scatter_launches_right_after_its_last_gradient_or_the_previous_wait():
    gm = fsdp_backward_graph()
    manual_bucketing(gm, PLAN)
    overlap_grad_reduce(gm)
    nodes = list(gm.graph.nodes)
    for rs in [n for n in nodes if is_reduce_scatter(n)]:
        bucket = rs.meta["fsdp_overlap_bucket"]
        grads = [n for n in nodes if n.target is aten.mm.default and module_path(n).startswith(f"blocks.{bucket}.")]
        weight_grads = [g for g in grads if any(u.target is PACK_ROWS for u in g.users)]  # the merged copy-in
        last = max(weight_grads, key=nodes.index)
        # ... or after the wait of the reduce-scatter before it, where that comes later
        # (one full-size input in flight at a time)
        waits = [n for n in nodes[: nodes.index(rs)] if is_wait(n) and is_reduce_scatter(collective_of_wait(n))]
        start = max([last, *waits[-1:]], key=nodes.index)
        between = nodes[nodes.index(start) + 1 : nodes.index(rs)]
        assert between and all(n.meta.get("fsdp_overlap_bucket") == bucket for n in between), between


def test_plan_entries_that_overlap_raise():
    with pytest.raises(OverlapConfigError, match="overlap"):
        manual_bucketing(fsdp_forward_graph(), [["blocks.0"], ["blocks.0.lin1"]])


def test_uncovered_collectives_stay_and_are_reported():
    gm = fsdp_forward_graph()
    stats = manual_bucketing(gm, ["blocks.0", "blocks.1"])
    assert sequence(gm) == "AG0 AG1 W0 mm mm W1 mm mm AG2 W2 mm AG2 W2 mm AG3 W3 mm AG3 W3 mm"
    assert stats["unbucketed_all_gathers"] == 4
    assert stats["unbucketed_modules"] == ["blocks.2.lin0", "blocks.2.lin1", "blocks.3.lin0", "blocks.3.lin1"]


def test_separate_gather_group_moves_only_all_gathers():
    gm = fsdp_backward_graph()
    manual_bucketing(gm, PLAN)
    assert use_gather_group(gm, "7") == {"moved": 4}
    groups = {(("AG" if is_all_gather(n) else "RS"), n.args[-1]) for n in gm.graph.nodes if is_collective(n)}
    assert groups == {("AG", "7"), ("RS", "0")}


def _two_bucket_backward():
    """Backward through blocks 2, 1, 0 (one weight each; bucket 0 has no gradient)."""
    g = GraphBuilder()
    w = [g.placeholder(f"w{i}", (4, 8)) for i in range(3)]
    act, grad = g.placeholder("act", (4, 8)), g.placeholder("tangents_1", (4, 8))
    outs = []
    for b in (2, 1):
        weight = g.gather(w[b], f"blocks.{b}")
        new_grad = g.call(aten.mm.default, grad, weight, module=f"blocks.{b}", backward=True)
        grad_w = g.call(aten.mm.default, g.call(aten.t.default, grad), act, module=f"blocks.{b}", backward=True)
        outs.append(g.reduce_scatter(grad_w, f"blocks.{b}"))
        grad = new_grad
    weight0 = g.gather(w[0], "blocks.0")
    outs.append(g.call(aten.mm.default, grad, weight0, module="blocks.0", backward=True))
    return g.finish(outs)


def test_all_gather_is_issued_before_a_ready_reduce_scatter():
    # bucket 2's gradient reduce-scatter and bucket 0's prefetch become ready at the
    # same point (nothing but the wait of bucket 1 between them): gather first
    gm = _two_bucket_backward()
    stats = manual_bucketing(gm, ["blocks.0", "blocks.1", "blocks.2"])
    assert sequence(gm) == "AG2 AG1 W2 mm mm AG0 RS2 W1 mm mm RS1 Wrs2 Wrs1 W0 mm"
    assert stats["gathers_first"] == 1
    # a budget of one bucket: no prefetch; each all-gather sits right after the
    # reduce-scatter before it and still goes first
    gm = _two_bucket_backward()
    stats = manual_bucketing(gm, ["blocks.0", "blocks.1", "blocks.2"], max_prefetch_bytes=4 * 8 * 4 * 2)
    assert stats["prefetch_depths"] == [1, 0, 0]
    assert sequence(gm) == "AG2 W2 mm mm AG1 RS2 W1 mm mm Wrs2 AG0 RS1 Wrs1 W0 mm"
    assert stats["gathers_first"] == 2


def test_all_gather_after_a_copy_out_is_not_hoisted_above_its_wait():
    # under a budget that fits every prefetch, bucket 0's all-gather follows bucket 1's
    # wait (and copy-out), which follows bucket 2's reduce-scatter: it stays there
    gm = _two_bucket_backward()
    stats = manual_bucketing(gm, ["blocks.0", "blocks.1", "blocks.2"], max_prefetch_bytes=2**20)
    assert stats["prefetch_depths"] == [1, 1, 1]
    assert sequence(gm) == "AG2 W2 AG1 mm mm RS2 W1 AG0 mm mm Wrs2 RS1 Wrs1 W0 mm"
    assert stats["gathers_first"] == 0


def test_bucketing_is_deterministic():
    a, b = fsdp_backward_graph(), fsdp_backward_graph()
    manual_bucketing(a, PLAN)
    manual_bucketing(b, PLAN)
    assert [n.name for n in a.graph.nodes] == [n.name for n in b.graph.nodes]
    assert str(a.graph) == str(b.graph)


# -------------------------------------------------------------- gradient overlap
def test_grad_overlap_launches_early_and_waits_when_the_next_reduce_scatter_launches():
    """Each launch moves up to its gradient; each wait sinks towards its first use (here
    the output), but no further than just after the next reduce-scatter's launch on its
    group: FSDP2's bound, one in flight while the next is issued. Without it every
    gradient's full-size input stayed alive until the end of the backward."""
    gm = fsdp_backward_graph()
    stats = overlap_grad_reduce(gm)
    assert sequence(gm) == (
        "AG3 W3 mm RS3 mm AG3 W3 mm RS3 Wrs3 mm AG2 W2 mm RS2 Wrs3 mm AG2 W2 mm RS2 Wrs2 mm "
        "AG1 W1 mm RS1 Wrs2 mm AG1 W1 mm RS1 Wrs1 mm AG0 W0 mm RS0 Wrs1 mm AG0 W0 mm RS0 Wrs0 mm Wrs0"
    )
    assert stats == {"matched": 8, "launches_advanced": 8, "wait_view_nodes_sunk": 7, "waits_sunk": 7}
    nodes = list(gm.graph.nodes)
    assert nodes[-2].op != "output" and is_wait(nodes[-2])  # the last one: at its use
    assert_reduce_scatters_bounded(gm)


def test_grad_overlap_under_a_budget_waits_before_the_next_copy_in():
    """wait_before_copy_in (a memory budget): each wait comes just before the next
    reduce-scatter on its group starts building its input, and no launch moves above
    the wait before it: one full-size input alive at a time (waiting after the next
    launch held two)."""
    gm = fsdp_backward_graph()
    original = copy.deepcopy(gm)
    stats = overlap_grad_reduce(gm, wait_before_copy_in=True)
    assert sequence(gm) == (
        "AG3 W3 mm RS3 mm AG3 W3 mm Wrs3 RS3 mm AG2 W2 mm Wrs3 RS2 mm AG2 W2 mm Wrs2 RS2 mm "
        "AG1 W1 mm Wrs2 RS1 mm AG1 W1 mm Wrs1 RS1 mm AG0 W0 mm Wrs1 RS0 mm AG0 W0 mm Wrs0 RS0 mm Wrs0"
    )
    assert stats["matched"] == 8 and stats["waits_sunk"] == 7
    assert_reduce_scatters_bounded(gm, before_copy_in=True)
    assert_same_outputs(original, gm)


def _first_preparation(launch: fx.Node) -> fx.Node:
    """The first node of the contiguous run before ``launch`` that only builds its input."""
    chain, node = {launch}, launch
    while is_preparation_op(node.prev) and node.prev.users and all(u in chain for u in node.prev.users):
        node = node.prev
        chain.add(node)
    return node


def assert_reduce_scatters_bounded(gm: fx.GraphModule, before_copy_in: bool = False) -> None:
    """Reduce-scatter k's wait comes after reduce-scatter k + 1's launch and before
    k + 2's (at most two in flight, one between launches); with ``before_copy_in`` (a
    memory budget) after compute that follows its own launch and before reduce-scatter
    k + 1's input is built (its copy-in, then its launch). The last one's wait comes
    after every matmul (it sinks to its use, the output)."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    launches = [n for n in nodes if is_reduce_scatter(n)]
    waits = {collective_of_wait(n): index[n] for n in nodes if is_wait(n) and is_reduce_scatter(collective_of_wait(n))}
    assert len(waits) == len(launches) >= 2
    mms = [i for i, n in enumerate(nodes) if effective_target(n) is aten.mm.default]
    compute = [i for i, n in enumerate(nodes) if _is_compute(n)]
    for k, launch in enumerate(launches[:-1]):
        if before_copy_in:
            assert any(index[launch] < i < waits[launch] for i in compute), (k, "no compute overlapped")
            assert waits[launch] < index[_first_preparation(launches[k + 1])], (k, waits[launch])
        else:
            after = index[launches[k + 2]] if k + 2 < len(launches) else len(nodes)
            assert index[launches[k + 1]] < waits[launch] < after, (k, waits[launch])
    assert waits[launches[-1]] > max(mms)


def _is_compute(node: fx.Node) -> bool:
    return node.op == "call_function" and not (
        is_view(node) or is_wait(node) or is_collective(node) or is_preparation_op(node)
    )


def _reduction_graph(extra=None, group="0"):
    """grad = mm(a, b); [extra]; rs(grad) -> wait -> output."""
    g = GraphBuilder(group=group)
    a, b, c = g.placeholder("a", (4, 8)), g.placeholder("b", (8, 8)), g.placeholder("c", (4, 8))
    grad = g.call(aten.mm.default, a, b, module="blocks.0", backward=True)
    other = g.call(aten.relu.default, c, module="blocks.1", backward=True)
    marker = extra(g, grad, other) if extra else None
    reduced = g.reduce_scatter(grad, "blocks.0")
    late = g.call(aten.relu.default, other, module="blocks.1", backward=True)
    return g.finish([reduced, late]), marker


def _names(gm):
    return [n.name for n in gm.graph.nodes]


def test_wait_branch_with_early_consumer_keeps_it():
    g = GraphBuilder()
    a, b, c = g.placeholder("a", (4, 8)), g.placeholder("b", (8, 8)), g.placeholder("c", (2, 8))
    grad = g.call(aten.mm.default, a, b, module="blocks.0", backward=True)
    reduced = g.reduce_scatter(grad, "blocks.0")
    early_view = g.call(aten.view.default, reduced, [16], backward=True)
    late_view = g.call(aten.t.default, reduced, backward=True)
    early_use = g.call(aten.add.Tensor, early_view, g.call(aten.view.default, c, [16]))
    filler = g.call(aten.relu.default, c)
    gm = g.finish([early_use, late_view, filler])
    wait = reduced
    overlap_grad_reduce(gm)
    names = _names(gm)
    # the early branch still feeds its consumer before the filler compute...
    assert (
        names.index(wait.name) < names.index(early_view.name) < names.index(early_use.name) < names.index(filler.name)
    )
    # ...and the other branch sank to its own first use (the output)
    assert names.index(late_view.name) > names.index(filler.name)


def test_storage_release_is_never_crossed():
    def release(g, grad, other):
        alias = g.call(aten.view.default, grad, [32])
        return g.call(aten.resize_.default, alias, [0])

    gm, rel = _reduction_graph(release)
    overlap_grad_reduce(gm)
    names = _names(gm)
    rs = next(n for n in gm.graph.nodes if is_reduce_scatter(n))
    assert names.index(rel.name) < names.index(rs.name)  # not advanced above the release

    # and a wait is never sunk below a release that follows it
    g = GraphBuilder()
    a, b, c = g.placeholder("a", (4, 8)), g.placeholder("b", (8, 8)), g.placeholder("c", (4, 8))
    grad = g.call(aten.mm.default, a, b, module="blocks.0", backward=True)
    wait = g.reduce_scatter(grad, "blocks.0")
    free = g.call(aten.resize_.default, g.call(aten.view.default, grad, [32]), [0])
    later = g.call(aten.relu.default, c)
    gm = g.finish([wait, later])
    overlap_grad_reduce(gm)
    names = _names(gm)
    assert names.index(wait.name) < names.index(free.name)


def test_same_group_unowned_collective_is_a_barrier_other_group_is_not():
    def tp_reduce(group):
        def extra(g, grad, other):
            ar = g.call(C10D.all_reduce.default, other, "sum", group)
            return g.call(C10D.wait_tensor.default, ar)

        return extra

    same, _ = _reduction_graph(tp_reduce("0"))
    overlap_grad_reduce(same)
    seq = [n.name for n in same.graph.nodes if is_collective(n)]
    assert seq[0].startswith("all_reduce")  # the reduce-scatter stayed behind it

    other, _ = _reduction_graph(tp_reduce("tp"))
    overlap_grad_reduce(other)
    seq = [n.name for n in other.graph.nodes if is_collective(n)]
    assert seq[0].startswith("reduce_scatter")  # advanced past a collective of another group


def test_hsdp_all_reduce_stays_after_its_wait():
    g = GraphBuilder()
    a, b, c = g.placeholder("a", (4, 8)), g.placeholder("b", (8, 8)), g.placeholder("c", (4, 8))
    grad = g.call(aten.mm.default, a, b, module="blocks.0", backward=True)
    reduced = g.reduce_scatter(grad, "blocks.0")
    ar = g.call(C10D.all_reduce.default, reduced, "avg", "replicate", module="blocks.0", backward=True)
    ar_wait = g.call(C10D.wait_tensor.default, ar, module="blocks.0", backward=True)
    filler = g.call(aten.relu.default, c)
    gm = g.finish([ar_wait, filler])
    overlap_grad_reduce(gm)
    names = _names(gm)
    assert names.index(reduced.name) + 1 == names.index(ar.name)  # wait sank to the all-reduce
    assert names.index(ar.name) < names.index(ar_wait.name)


def _hsdp_backward(params_per_block: tuple[int, ...]) -> fx.GraphModule:
    """A backward over ``blocks.b`` (in reverse) with ``params_per_block[b]`` weights each;
    every weight gradient is reduce-scattered, then all-reduced over the replicas (HSDP)."""
    g = GraphBuilder()
    grad = g.placeholder("tangents_1", (4, 8))
    outputs = []
    for b in reversed(range(len(params_per_block))):
        for p in range(params_per_block[b]):
            module = f"blocks.{b}.lin{p}"
            act = g.placeholder(f"act_{b}_{p}", (4, 8))
            grad_w = g.call(aten.mm.default, g.call(aten.t.default, grad), act, module=module, backward=True)
            grad = g.call(aten.mm.default, grad, g.placeholder(f"w_{b}_{p}", (8, 8)), module=module, backward=True)
            reduced = g.reduce_scatter(grad_w, module)
            ar = g.call(C10D.all_reduce.default, reduced, "avg", "replicate", module=module, backward=True)
            outputs.append(g.call(C10D.wait_tensor.default, ar, module=module, backward=True))
    return g.finish([*outputs, grad])


@pytest.mark.parametrize("params_per_block", [(1, 2, 2, 1), (2, 2, 2, 2), (1, 1, 1)])
def test_hsdp_every_replica_all_reduce_but_the_last_is_waited_after_the_next_launch(params_per_block):
    """A bucket with one parameter (an embedding alone, a tied weight's bucket) has no
    all-reduces to merge; its all-reduce is deferred like a merged one (it was left
    waited at once, and so was the one before it: 1 of 4 for a tied Llama)."""
    gm = _hsdp_backward(params_per_block)
    before = copy.deepcopy(gm)
    buckets = len(params_per_block)
    stats = manual_bucketing(gm, [f"blocks.{b}" for b in range(buckets)])
    assert stats["merged_all_reduces"] == buckets
    assert stats["deferred_ar_waits"] == buckets - 1
    nodes = list(gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    reduces = [n for n in nodes if n.target is C10D.all_reduce.default]
    assert [r.meta["fsdp_overlap_bucket"] for r in reduces] == list(reversed(range(buckets)))
    waits = {r: next(u for u in r.users if is_wait(u)) for r in reduces}
    for ar, nxt in zip(reduces, reduces[1:]):
        assert at[ar] < at[nxt] < at[waits[ar]], (ar, nxt)
        # and behind the matmuls that run after it launched, where any do (each
        # all-reduce launches when its reduce-scatter is waited, after the next bucket's
        # backward: the last two launch after every matmul)
        later = [n for n in nodes[at[ar] :] if n.target is aten.mm.default]
        assert any(at[n] < at[waits[ar]] for n in later) == bool(later), ar
        assert bool(later) == (ar.meta["fsdp_overlap_bucket"] >= 2), ar
    assert at[waits[reduces[-1]]] > at[reduces[-1]]
    assert_same_outputs(before, gm)


def test_tensor_parallel_collectives_are_untouched():
    g = GraphBuilder()
    x, w = g.placeholder("x", (4, 8)), g.placeholder("w", (4, 8))
    h = g.call(aten.relu.default, x)
    tp = g.call(C10D.all_gather_into_tensor.default, h, 2, "tp")  # input is computed: not FSDP
    tp_wait = g.call(C10D.wait_tensor.default, tp)
    weight = g.gather(w, "blocks.0")
    out = g.call(aten.mm.default, tp_wait, g.call(aten.t.default, weight))
    gm = g.finish([out])
    before = _names(gm)
    manual_bucketing(gm, ["blocks.0"])
    overlap_grad_reduce(gm)
    after = _names(gm)
    assert [n for n in after if n in (tp.name, tp_wait.name, h.name)] == [h.name, tp.name, tp_wait.name]
    assert after.index(tp_wait.name) - after.index(tp.name) == before.index(tp_wait.name) - before.index(tp.name)


@pytest.mark.parametrize("budget", [None, 2**20])
def test_grad_overlap_handles_nodes_wrapped_in_control_deps(budget):
    gm = fsdp_backward_graph()
    original = copy.deepcopy(gm)
    manual_bucketing(gm, PLAN, insert_overlap_deps=True, max_prefetch_bytes=budget)
    # each prefetch launches before the wait of the bucket it follows (under a budget:
    # before that bucket's compute), and each reduce-scatter's wait comes after the next
    # launch (under a budget: before the next copy-in)
    wrapped = {effective_target(n) for n in gm.graph.nodes if is_control_deps(n)}
    assert wrapped == ({C10D.wait_tensor.default} if budget is None else {aten.mm.default, PACK_ROWS})
    stats = overlap_grad_reduce(gm, wait_before_copy_in=budget is not None)
    assert stats["matched"] == 4
    nodes = list(gm.graph.nodes)
    last_mm = max(i for i, n in enumerate(nodes) if effective_target(n) is aten.mm.default)
    rs_waits = [i for i, n in enumerate(nodes) if is_wait(n) and is_reduce_scatter(collective_of_wait(n))]
    assert len(rs_waits) == 4 and max(rs_waits) > last_mm  # the last wait sank below all compute
    assert_reduce_scatters_bounded(gm, before_copy_in=budget is not None)
    assert_same_outputs(original, gm)


# --------------------------------------------------------- numerics and invariants
@pytest.mark.parametrize("builder", [fsdp_forward_graph, fsdp_backward_graph])
@pytest.mark.parametrize("passes", ["bucketing", "grad_overlap", "both", "both+pin"])
def test_simulated_rank_outputs_identical(builder, passes):
    before = builder(dtype=torch.float64)
    after = copy.deepcopy(before)
    if "both" in passes or passes == "bucketing":
        manual_bucketing(after, PLAN)
    if "both" in passes or passes == "grad_overlap":
        overlap_grad_reduce(after)
    if passes.endswith("pin"):
        pin_collective_order(after)
    assert_same_outputs(before, after)
    assert sorted(compute_nodes(before)) == sorted(compute_nodes(after))


@pytest.mark.parametrize("builder", [fsdp_forward_graph, fsdp_backward_graph])
def test_pointwise_adds_one_op_per_weight_each(builder):
    plain, dense = builder(blocks=3, params_per_block=2), builder(blocks=3, params_per_block=2, pointwise=2)
    extra = [n for n in dense.graph.nodes if n.target is torch.ops.aten.mul.Tensor]
    assert len(dense.graph.nodes) - len(plain.graph.nodes) == len(extra) == 3 * 2 * 2
    bucketed = copy.deepcopy(dense)
    manual_bucketing(bucketed, [["blocks.0"], ["blocks.1"], ["blocks.2"]])
    assert_same_outputs(dense, bucketed)


def test_grad_overlap_keeps_compute_order():
    before = fsdp_backward_graph()
    after = copy.deepcopy(before)
    overlap_grad_reduce(after)
    assert compute_nodes(before) == compute_nodes(after)


@pytest.mark.parametrize("first", ["none", "both"])
def test_reduce_scatter_as_all_to_all_computes_the_same(first):
    before = fsdp_backward_graph(dtype=torch.float64)
    after = copy.deepcopy(before)
    if first == "both":
        manual_bucketing(after, PLAN)
        overlap_grad_reduce(after)
    stats = reduce_scatter_as_all_to_all(after)
    assert stats["rewritten"] == (4 if first == "both" else 8)
    assert not any(is_reduce_scatter(n) for n in after.graph.nodes)
    assert_same_outputs(before, after)


@pytest.mark.parametrize("rank", [0, 1])
def test_merged_all_gather_writes_this_ranks_shards_into_its_slot_of_the_output(rank):
    """Given this process's rank in the graph's group (data, no process group), a merged
    all-gather is FSDP2's: one call of ``fsdp_overlap::fill_slot`` copies the shards into
    slot ``rank`` of a fresh output buffer and the collective fills it in place (no
    separate input buffer alive during the collective). The copy-in is not a barrier:
    the gradient pass still moves reduce-scatters across it."""
    from fsdp_overlap_plugin.passes.graph import is_barrier

    gm = fsdp_forward_graph(dtype=torch.float64)  # group "0"
    inputs = random_inputs(gm)  # float64, the dtype of the buffer the merge allocates
    before = simulate(copy.deepcopy(gm), inputs)
    manual_bucketing(gm, PLAN, group_ranks={"0": rank})
    gathers = [n for n in gm.graph.nodes if is_all_gather(n)]
    assert len(gathers) == 4 and all(n.target is C10D.all_gather_into_tensor_out.default for n in gathers)
    total = 2 * 8 * 8 // 2  # two [8, 8] weights per block, half of each per rank
    for ag in gathers:
        slot, world, _ = ag.args
        out = ag.kwargs["out"]
        assert world == 2 and out.target is FILL_SLOT and not is_barrier(out) and is_preparation_op(out)
        shards, size, slot_rank, dtype = out.args
        assert size == 2 and slot_rank == rank and dtype == torch.float64
        assert [s.op for s in shards] == ["placeholder", "placeholder"]  # the shards themselves
        assert slot.target is aten.slice.Tensor and slot.args == (out, 0, rank * total, (rank + 1) * total)
        # the copy-out: one split_gathered call per bucket, each parameter a view of its piece
        (wait,) = ag.users
        (rows,) = wait.users
        assert rows.target is aten.view.default and rows.args[1] == [2, total]
        (split,) = rows.users
        assert split.target is SPLIT_GATHERED and split.args[1] == [8 * 8 // 2, 8 * 8 // 2]
        pieces = sorted(split.users, key=lambda n: n.args[1])
        assert [p.args[1] for p in pieces] == [0, 1] and all(p.target is operator.getitem for p in pieces)
        assert all(next(iter(p.users)).target is aten.view.default for p in pieces)
    assert [torch.equal(a, b) for a, b in zip(before, simulate(gm, inputs))] == [True] * len(before)


def test_merged_reduce_scatter_packs_the_gradients_in_one_call():
    """A merged reduce-scatter's input is one ``fsdp_overlap::pack_rows`` call on the
    gradients themselves (row r: rank r's chunk of each), outputs bitwise unchanged."""
    gm = fsdp_backward_graph(dtype=torch.float64)
    before = copy.deepcopy(gm)
    manual_bucketing(gm, PLAN)
    scatters = [n for n in gm.graph.nodes if is_reduce_scatter(n)]
    assert len(scatters) == 4
    for rs in scatters:
        packed = rs.args[0]
        assert packed.target is PACK_ROWS and packed.args[1:] == (2, torch.float64)
        assert [g.target for g in packed.args[0]] == [aten.mm.default, aten.mm.default]  # the weight gradients
    assert_same_outputs(before, gm, dtype=torch.float64)


def test_fill_slot_and_pack_rows_lay_out_a_merged_collectives_input():
    """The copy-in ops' values, their conversion to the collective's dtype (the same
    rounding as ``.to``), and their fake tensors' shapes."""
    a, b = torch.randn(2, 3), torch.randn(5)
    out = FILL_SLOT([a, b], 3, 1, torch.float32)
    assert out.shape == (3 * 11,) and torch.equal(out[11:22], torch.cat([a.reshape(-1), b]))
    half = FILL_SLOT([a, b], 2, 0, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half[:11], torch.cat([a.reshape(-1), b]).to(torch.bfloat16))
    g1, g2 = torch.randn(4, 3), torch.randn(2)  # on 2 ranks: chunks of 6 and 1 elements
    rows = PACK_ROWS([g1, g2], 2, torch.float32).view(2, 7)
    assert torch.equal(rows[0], torch.cat([g1[:2].reshape(-1), g2[:1]]))
    assert torch.equal(rows[1], torch.cat([g1[2:].reshape(-1), g2[1:]]))
    bf = [g1.to(torch.bfloat16), g2.to(torch.bfloat16)]
    wide = PACK_ROWS(bf, 2, torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide.view(2, 7), rows.to(torch.bfloat16).float())
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake_out = FILL_SLOT([mode.from_tensor(a), mode.from_tensor(b)], 2, 1, torch.bfloat16)
        fake_rows = PACK_ROWS([mode.from_tensor(t) for t in bf], 2, torch.float32)
    assert (tuple(fake_out.shape), fake_out.dtype) == ((22,), torch.bfloat16)
    assert (tuple(fake_rows.shape), fake_rows.dtype) == ((14,), torch.float32)


def test_split_gathered_copies_each_members_columns_out():
    """The copy-out op (``fsdp_overlap::split_gathered``): contiguous copies of each
    member's columns of the rank-major rows, equal to the views they replace, and its
    fake tensor's shapes; the flat buffer can be freed after it."""
    rows = torch.arange(2 * 7, dtype=torch.float32).view(2, 7)
    parts = SPLIT_GATHERED(rows, [3, 4])
    assert [p.shape for p in parts] == [(2, 3), (2, 4)] and all(p.is_contiguous() for p in parts)
    assert torch.equal(parts[0], rows[:, :3]) and torch.equal(parts[1], rows[:, 3:])
    assert all(p.untyped_storage().data_ptr() != rows.untyped_storage().data_ptr() for p in parts)
    # a member [2, 2] sharded on 2 ranks: its full tensor is its piece viewed as [4, 2]
    shard0, shard1 = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0]])
    gathered = torch.stack(
        [torch.cat([shard0.reshape(-1), torch.zeros(1)]), torch.cat([shard1.reshape(-1), torch.ones(1)])]
    )
    full, _ = SPLIT_GATHERED(gathered, [2, 1])
    assert torch.equal(full.view(2, 2), torch.cat([shard0, shard1]))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = SPLIT_GATHERED(mode.from_tensor(rows), [3, 4])
    assert [tuple(f.shape) for f in fake] == [(2, 3), (2, 4)]


def test_merged_all_gather_of_a_group_with_no_process_group_gathers_the_concatenated_shards():
    gm = fsdp_forward_graph()  # no process group here: group "0" names none
    manual_bucketing(gm, PLAN)
    gathers = [n for n in gm.graph.nodes if is_all_gather(n)]
    assert len(gathers) == 4 and all(n.target is C10D.all_gather_into_tensor.default for n in gathers)
    assert all(n.args[0].target is aten.cat.default for n in gathers)
