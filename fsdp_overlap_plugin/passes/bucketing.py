"""Manual bucketing: one collective per plan entry, prefetched one bucket ahead.

Per plan entry (bucket), the FSDP all-gathers are merged into one all-gather and the
gradient reduce-scatters into one reduce-scatter, per (process group, size, dtype[, op]).
Then the schedule is set by bucket, in the order the graph consumes them.

Forward (all-gathers only), before and after::

    ag_0 -> wait_0 -> compute_0 -> ag_1 -> wait_1 -> compute_1 -> ag_2 -> wait_2 -> ...
    ag_0 -> ag_1 -> wait_0 -> compute_0 -> ag_2 -> wait_1 -> compute_1 -> ag_3 -> ...

    bucket i+1's all-gather launches just before bucket i's wait, so it is queued
    behind bucket i's and runs while bucket i computes. During bucket i's copy-out
    (gathered buffer -> one tensor per parameter) three buckets meet: bucket i twice
    and bucket i+1's buffer. Under a memory budget (``max_prefetch_bytes``) it launches
    just after bucket i's copy-out instead (FSDP2's order), so the buckets the budget
    counts are all that is alive::

    ag_0 -> wait_0 -> ag_1 -> compute_0 -> wait_1 -> ag_2 -> compute_1 -> ...

    at the cost of the copy's duration of link time per bucket (on 2 CPU ranks at 300
    Mbit, with the reduce-scatter order below, 9-13% of the step; on a GPU the copy runs
    at memory bandwidth).

Backward (buckets in reverse; all-gathers exist when parameters were resharded)::

    ag_N -> wait_N -> compute_N -> rs_N -> wait_rs_N -> ag_N-1 -> wait_N-1 -> compute_N-1 -> rs_N-1 ...
    ag_N -> ag_N-1 -> wait_N -> compute_N -> ag_N-2 -> rs_N -> wait_N-1 -> compute_N-1 -> rs_N-1 -> wait_rs_N ...

    the previous bucket's all-gather is prefetched the same way; reduce-scatter N's wait
    is deferred until reduce-scatter N-1 has launched (queued back to back); and where an
    all-gather and a reduce-scatter are ready at the same point, the all-gather (which
    the next compute needs) is issued first: NCCL/HCCL run one communicator's
    collectives in issue order. Under a memory budget reduce-scatter N's wait goes just
    before bucket N-1's gradients are packed for their own reduce-scatter instead
    (FSDP2's bound: one bucket's full-size gradient input in flight at a time, not two)::

    ... -> compute_N-1 -> wait_rs_N -> rs_N-1 -> ...

Collectives of modules no plan entry covers are left exactly where they are and
counted in the statistics. The pass never looks at tensor values or timing, so every
rank makes the same decisions; the one rank-dependent constant is where a merged
all-gather copies this rank's shards into its output (``merge.py``). Returns its
statistics (``manual_bucketing``); each merged collective and its wait carry their
bucket in ``node.meta["fsdp_overlap_bucket"]``.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Mapping

import torch
import torch.fx as fx

from .._torch_compat import preserve_node_ordering
from ..contract import BucketIndex, check_disjoint
from .graph import (
    C10D,
    collective_of_wait,
    data_users,
    dynamo_module_path,
    group_name,
    is_all_gather,
    is_all_reduce,
    is_fsdp_all_gather,
    is_fsdp_reduce_scatter,
    is_preparation_op,
    is_reduce_scatter,
    is_selection,
    is_view,
    is_wait,
    merge_duplicate_waits,
    node_args,
    numel_hint,
    owner_module,
    param_fqn,
    wait_of,
)
from .merge import Retired, bucket_key, graph_fake_mode, merge_all_gathers, merge_reduce_scatters
from .order import Positions, repair_order
from .prefetch import PrefetchPlan, prefetch_plan

__all__ = ["manual_bucketing", "use_gather_group"]


class _Unit:
    """One launch of a bucket after merging: the collective, its wait, and the nodes
    that must travel with the wait (views of the waited result)."""

    def __init__(self, bucket: int, start: fx.Node, wait: fx.Node):
        self.bucket = bucket
        self.start = start
        self.wait = wait

    def output_side(self) -> list[fx.Node]:
        out, stack, seen = [self.wait], [self.wait], {self.wait}
        while stack:
            for user in stack.pop().users:
                if user not in seen and (is_view(user) or _is_merge_output(user)):
                    seen.add(user)
                    out.append(user)
                    stack.append(user)
        return out


def _is_merge_output(node: fx.Node) -> bool:
    # the reshape copies a merged all-gather makes per parameter belong with its wait
    return node.meta.get("fsdp_overlap_merge") == "output"


def _normalize(plans: list) -> list[list[str]]:
    return [[entry] if isinstance(entry, str) else list(entry) for entry in plans]


def manual_bucketing(
    gm: fx.GraphModule,
    module_bucket_plans: list,
    *,
    insert_overlap_deps: bool = False,
    prefetch_depth: int = 1,
    max_prefetch_bytes: int | None = None,
    kept: tuple[int, int] = (0, 0),
    group_ranks: Mapping[str, int] | None = None,
) -> dict:
    """Bucket and reorder the FSDP collectives of ``gm`` per ``module_bucket_plans``.

    Args:
        gm: a forward or backward graph (post-grad ATen, or the graph aot_eager runs).
        module_bucket_plans: entries are a module FQN or a list of FQNs, relative to the
            compiled root; entries must not share modules (``OverlapConfigError``).
        insert_overlap_deps: wrap waits in ``control_deps`` so a later scheduler keeps the
            prefetch order (for inductor; not needed when the graph runs as it is).
        prefetch_depth, max_prefetch_bytes: how many buckets ahead all-gathers launch,
            within a budget of gathered bytes (``passes/prefetch.py``).
        kept: ``(buckets, bytes)`` the forward kept gathered, for a backward graph (they
            count at its top).
        group_ranks: this process's rank in each process group, by the group's name
            (``merge_all_gathers``); resolved by the caller, so the pass needs none.

    Returns statistics: collectives before and after, merges, moves
    (``prefetched``, ``deferred_rs_waits``, ``gathers_first``), what stayed unbucketed
    (``unbucketed_*`` counts and modules) and ``left_unbucketed`` (see that function).
    Changes only ``gm.graph``; the caller regenerates ``gm.forward`` (``gm.recompile()``)
    if it runs the code.
    """
    buckets = _normalize(module_bucket_plans)
    check_disjoint(buckets)
    index = BucketIndex(buckets)
    graph = gm.graph
    stats: dict = {
        "all_gathers_before": 0,
        "reduce_scatters_before": 0,
        "merged_all_gathers": 0,
        "merged_reduce_scatters": 0,
        "prefetched": 0,
        "deferred_rs_waits": 0,
        "gathers_first": 0,
        "unbucketed_all_gathers": 0,
        "unbucketed_reduce_scatters": 0,
    }
    stats["duplicate_waits_merged"] = merge_duplicate_waits(graph)
    gather_groups: dict[tuple, list[fx.Node]] = {}
    scatter_groups: dict[tuple, list[fx.Node]] = {}
    unbucketed: Counter[str] = Counter()
    for node in graph.nodes:
        if is_fsdp_all_gather(node) and wait_of(node) is not None:
            kind, groups = "all_gathers", gather_groups
        elif is_fsdp_reduce_scatter(node) and wait_of(node) is not None:
            kind, groups = "reduce_scatters", scatter_groups
        else:
            continue
        stats[f"{kind}_before"] += 1
        path = owner_module(node)
        bucket = index.bucket_of(path)
        if bucket is None:
            stats[f"unbucketed_{kind}"] += 1
            unbucketed[path or "<no module>"] += 1
            continue
        groups.setdefault((bucket, *bucket_key(node)), []).append(node)

    fake_mode = graph_fake_mode(graph)
    retired = Retired()
    merge_gathers = functools.partial(merge_all_gathers, group_ranks=group_ranks)
    gather_units = _merge(graph, gather_groups, merge_gathers, fake_mode, retired, stats, "merged_all_gathers")
    scatter_units = _merge(
        graph, scatter_groups, merge_reduce_scatters, fake_mode, retired, stats, "merged_reduce_scatters"
    )
    rewired_scatter_users = retired.rewired
    retired.finish(graph)
    if rewired_scatter_users:
        # a merged reduce-scatter launches at its last gradient: users of an earlier
        # member's result other than the graph output (an HSDP all-reduce, a branch)
        # must move after it
        repair_order(graph)

    pos = Positions(graph)
    deps: dict[fx.Node, list[fx.Node]] = {}
    _place_gather_waits(gather_units, pos)
    stats["prefetched"], plan = _prefetch(gather_units, pos, deps, prefetch_depth, max_prefetch_bytes, kept)
    stats["prefetch_depths"], stats["prefetch_peak_bytes"] = plan.depths, plan.peak_bytes
    stats["deferred_rs_waits"], reordered = _defer_scatter_waits(
        scatter_units, pos, deps, before_copy_in=max_prefetch_bytes is not None
    )
    stats["gathers_first"] = _gathers_before_scatters(gather_units, pos)
    if reordered:
        repair_order(graph)
    # HSDP: each member's reduced shard is then all-reduced across replicas; one
    # all-reduce of the bucket's whole reduce-scatter result replaces them, and its wait
    # is deferred past the next bucket's all-reduce launch
    reduce_units = [r for r in (_merge_replica_all_reduces(graph, u) for u in scatter_units) if r is not None]
    stats["merged_all_reduces"] = len(reduce_units)
    stats["deferred_ar_waits"] = _defer_replica_waits(graph, reduce_units)
    if insert_overlap_deps and deps:
        preserve_node_ordering(graph, deps)

    stats["buckets"] = len({u.bucket for u in gather_units + scatter_units})
    stats["all_gathers_after"] = stats["all_gathers_before"] - sum(len(v) - 1 for v in gather_groups.values())
    stats["reduce_scatters_after"] = stats["reduce_scatters_before"] - sum(len(v) - 1 for v in scatter_groups.values())
    stats["unbucketed_modules"] = sorted(unbucketed)
    stats["left_unbucketed"] = left_unbucketed(graph, index)
    return stats


def left_unbucketed(graph: fx.Graph, index: BucketIndex) -> list[dict]:
    """FSDP collectives the bucketing left as they were, grouped by plan entry and kind.

    Each group: ``entry`` (the plan index the collective's parameter belongs to, or None
    when no entry covers it), ``kind``, ``count``, and one example's ``param`` FQN and
    ``dynamo_path`` (the module source Dynamo recorded). A group with an entry means a
    plan entry's collective was not bucketed: the caller treats it as an error
    (``on_unbucketed``); one without an entry is a parameter outside the plan.
    """
    groups: dict[tuple, dict] = {}
    for node in graph.nodes:
        if "fsdp_overlap_bucket" in node.meta:
            continue
        if is_all_gather(node):
            kind, fsdp = "all_gather", is_fsdp_all_gather(node)
        elif is_reduce_scatter(node):
            kind, fsdp = "reduce_scatter", is_fsdp_reduce_scatter(node)
        else:
            continue
        if not fsdp:
            continue  # not a parameter's collective (tensor parallelism): not ours to bucket
        owner = owner_module(node)
        entry = index.bucket_of(owner)
        group = groups.setdefault(
            (entry, kind, owner if entry is None else None),
            {
                "entry": entry,
                "modules": index.buckets[entry] if entry is not None else None,
                "kind": kind,
                "count": 0,
                "owner": owner,
                "param": param_fqn(node),
                "dynamo_path": dynamo_module_path(node),
            },
        )
        group["count"] += 1
    return list(groups.values())


# Between a member's piece of a merged reduce-scatter and its HSDP all-reduce there are a
# few views and copies (getitem, reshape, the narrow of a padded shard, a cast); a chain
# longer than this is not such a path.
_ALL_REDUCE_REACH = 16


def _all_reduce_of(node: fx.Node) -> fx.Node | None:
    """The all-reduce that ``node`` reaches through single-user views and copies, if any."""
    cur = node
    for _ in range(_ALL_REDUCE_REACH):
        users = data_users(cur)
        if len(users) != 1:
            return None
        user = users[0]
        if is_all_reduce(user):
            return user if wait_of(user) is not None else None
        if not is_selection(user):
            return None
        cur = user
    return None


def _merge_replica_all_reduces(graph: fx.Graph, unit: _Unit) -> _Unit | None:
    """One all-reduce of a merged reduce-scatter's result instead of one per member.

    ``wait -> split -> piece_i -> (views) -> all_reduce_i -> wait_i`` becomes
    ``wait -> all_reduce -> wait' -> split -> piece_i -> (views)``: the all-reduce is
    elementwise, so reducing the whole bucket and then selecting each member's part
    gives exactly the same values. A bucket with one reduce-scatter member (an embedding
    alone in its entry, a tied weight whose other read is the entry's only parameter:
    ``wait -> (views) -> all_reduce -> wait``) has nothing to merge; its all-reduce is
    the bucket's unit as it is, so it is deferred like the merged ones. Returns the
    bucket's all-reduce unit, or None (a member without its own all-reduce, or
    all-reduces over different groups or ops: left as they are)."""
    wait = unit.wait
    if not is_reduce_scatter(unit.start) or len(wait.users) != 1:
        return None
    splits = [u for u in wait.users if u.target is torch.ops.aten.split_with_sizes.default]
    if not splits:
        single = _all_reduce_of(wait)
        if single is None:
            return None
        single_wait = wait_of(single)
        for node in (single, single_wait):
            node.meta["fsdp_overlap_bucket"] = unit.bucket
        return _Unit(unit.bucket, single, single_wait)
    split = splits[0]
    reduces = [_all_reduce_of(piece) for piece in split.users]
    if len(reduces) < 2 or any(r is None for r in reduces):
        return None
    if len({(node_args(r)[1], group_name(r)) for r in reduces}) != 1:
        return None
    op, group = node_args(reduces[0])[1:3]
    with graph.inserting_after(wait):
        reduce = graph.call_function(C10D.all_reduce.default, (wait, op, group))
    with graph.inserting_after(reduce):
        reduced = graph.call_function(C10D.wait_tensor.default, (reduce,))
    for node in (reduce, reduced):
        node.meta.update({k: v for k, v in wait.meta.items() if k in ("val", "tensor_meta", "custom", "stack_trace")})
        node.meta["fsdp_overlap_bucket"] = unit.bucket
    split.replace_input_with(wait, reduced)
    for old in reduces:
        old_wait = wait_of(old)
        old_wait.replace_all_uses_with(node_args(old)[0])
        graph.erase_node(old_wait)
        graph.erase_node(old)
    return _Unit(unit.bucket, reduce, reduced)


def _defer_replica_waits(graph: fx.Graph, units: list[_Unit]) -> int:
    """Defer each merged replica all-reduce's wait (with the split and views of its
    result) to just after the next bucket's all-reduce launch, the rule the
    reduce-scatter waits follow without a budget: two in flight on the replica group
    while the next is issued, so each runs behind the next bucket's backward. The bytes
    in flight are the buckets' reduced shards, gradients the step keeps anyway (1/shard
    of a reduce-scatter's input), so a memory budget does not change the rule. Returns
    how many waits moved."""
    if len(units) < 2:
        return 0
    pos = Positions(graph)
    order = sorted(units, key=lambda u: pos[u.start])
    deferred = 0
    reordered = False
    for current, nxt in zip(order, order[1:]):
        if pos[current.wait] > pos[nxt.start]:
            continue
        side = current.output_side()
        if pos.move_after(side, nxt.start):
            deferred += 1
            members = set(side)
            reordered |= any(u.op != "output" and u not in members for n in side for u in n.users)
    if reordered:
        repair_order(graph)
    return deferred


def _merge(graph, groups, merge_fn, fake_mode, retired, stats, counter) -> list[_Unit]:
    units = []
    for (bucket, *_), members in groups.items():
        if len(members) == 1:
            start = members[0]
            start.meta["fsdp_overlap_bucket"] = bucket
            units.append(_Unit(bucket, start, wait_of(start)))
            continue
        if is_fsdp_all_gather(members[0]):
            # Parameter shards exist from the start: launch where the first member did,
            # hoisting the other members' casts/padding there, so nothing that used an
            # early member's result has to move.
            anchor = members[0]
            _hoist_inputs(members[1:], anchor)
        else:
            # A reduce-scatter needs every member's gradient: launch at the last one.
            anchor = members[-1]
        result = merge_fn(
            graph,
            members,
            anchor=anchor,
            extra_meta={"fsdp_overlap_bucket": bucket},
            fake_mode=fake_mode,
            retired=retired,
        )
        for node in result.outputs_side[1:]:
            node.meta["fsdp_overlap_merge"] = "output"
        stats[counter] += 1
        units.append(_Unit(bucket, result.start, result.wait))
    return units


def _hoist_inputs(members: list[fx.Node], anchor: fx.Node) -> None:
    """Move the (parameter-derived, computation-free) input chains of ``members`` to
    just before ``anchor``, inputs before their users (post-order walk)."""
    seen: set[fx.Node] = set()

    def visit(node: fx.Node) -> None:
        if node in seen or node.op in ("placeholder", "get_attr"):
            return
        seen.add(node)
        for arg in node.all_input_nodes:
            visit(arg)
        anchor.prepend(node)

    for member in members:
        for arg in member.all_input_nodes:
            visit(arg)


def _place_gather_waits(units: list[_Unit], pos: Positions) -> None:
    """Each all-gather wait (with the views of its result) goes just before the first
    node that uses the gathered parameters, so no wait blocks earlier than needed."""
    for unit in units:
        side = unit.output_side()
        members = set(side)
        consumers = [u for n in side for u in n.users if u not in members]
        if consumers:
            pos.move_before(side, min(consumers, key=pos.__getitem__))


def _prefetch(
    units: list[_Unit], pos: Positions, deps: dict, depth: int, budget: int | None, kept: tuple[int, int]
) -> tuple[int, PrefetchPlan]:
    """Launch each unit's all-gather ``depth`` units ahead (in consumption order) where the
    budget allows (``prefetch_plan``): just before the wait of the unit ``depth``
    earlier, or, under a budget, just after that unit's copy-out (so its gathered buffer
    is freed before this one is allocated); or at the top of the graph. With depth 1:
    unit i+1's all-gather just before unit i's wait.

    The first unit launches at the top of the graph: in backward, the bucket computed
    before it is the one the forward kept gathered, and its compute is what hides this
    first re-gather.
    """
    order = sorted(units, key=lambda u: pos[u.wait])
    plan = prefetch_plan([_gathered_bytes(u) for u in order], depth, budget, kept)
    moved = 0
    inputs = pos.graph.find_nodes(op="placeholder")
    top = inputs[-1] if inputs else None  # launches at the top go after the inputs, in order
    for k, (unit, ahead) in enumerate(zip(order, plan.depths)):
        if ahead == 0:
            continue  # over the budget: launched where the graph has it
        point = k - ahead
        if point < 0:
            if top is not None and pos[unit.start] > pos[top]:
                if pos.move_after(pos.ancestors_after(unit.start, pos[top]), top):
                    moved += 1
                top = unit.start
            continue
        if budget is None:
            target = order[point].wait
        else:
            side = order[point].output_side()
            target = max(side, key=pos.__getitem__).next
        if pos[unit.start] < pos[target]:
            continue  # already launched early enough
        chain = pos.ancestors_after(unit.start, pos[target])
        if pos.move_before(chain, target):
            moved += 1
        deps.setdefault(target, []).append(unit.start)
    return moved, plan


def _gathered_bytes(unit: _Unit) -> int:
    val = unit.wait.meta.get("val")
    if val is None:
        return 0
    return numel_hint(val) * val.element_size()


def _defer_scatter_waits(units: list[_Unit], pos: Positions, deps: dict, before_copy_in: bool) -> tuple[int, bool]:
    """Defer reduce-scatter k's wait over the compute that follows it: to just after
    reduce-scatter k+1 (next in launch order) has launched, so the two are queued back to
    back; or, ``before_copy_in`` (under a memory budget), to just before reduce-scatter
    k+1 starts building its input (its copy-in), so one full-size input is alive at a
    time (FSDP2's bound). Returns how many waits moved, and whether a moved result has a
    consumer other than the graph output (an HSDP all-reduce) that may now sit before
    it."""
    order = sorted(units, key=lambda u: pos[u.start])
    deferred = 0
    reordered = False
    for current, nxt in zip(order, order[1:]):
        side = current.output_side()
        if before_copy_in:
            target = _first_preparation(nxt.start)
            moved = pos.move_before(side, target)
            deps.setdefault(target, []).append(current.wait)
        else:
            if pos[current.wait] > pos[nxt.start]:
                continue
            moved = pos.move_after(side, nxt.start)
            deps.setdefault(current.wait, []).append(nxt.start)
        if moved:
            deferred += 1
            members = set(side)
            reordered |= any(u.op != "output" and u not in members for n in side for u in n.users)
    return deferred, reordered


def _first_preparation(start: fx.Node) -> fx.Node:
    """The first of the nodes directly before a reduce-scatter launch that exist only to
    build its input (its bucket's copy-in), or the launch itself."""
    node = start
    while node.prev.op not in ("root", "placeholder") and _feeds_only_scatters(node.prev):
        node = node.prev
    return node


def _gathers_before_scatters(units: list[_Unit], pos: Positions) -> int:
    """Where an all-gather launch directly follows reduce-scatter launches (nothing but
    their preparation, views and waits in between), issue the all-gather first."""
    hoisted = 0
    for unit in units:
        cursor = unit.start.prev
        earliest = None
        while cursor.op not in ("root", "placeholder"):
            if is_reduce_scatter(cursor):
                earliest = cursor
            elif not (is_view(cursor) or _is_scatter_wait(cursor) or _feeds_only_scatters(cursor)):
                break  # an all-gather's wait: a launch placed after that bucket's copy-out
            cursor = cursor.prev
        if earliest is None:
            continue
        # the reduce-scatter's own preparation nodes stay attached to it
        target = _first_preparation(earliest)
        chain = pos.ancestors_after(unit.start, pos[target])
        if pos.move_before(chain, target):
            hoisted += 1
    return hoisted


def _is_scatter_wait(node: fx.Node) -> bool:
    if not is_wait(node):
        return False
    collective = collective_of_wait(node)
    return collective is not None and is_reduce_scatter(collective)


def _feeds_only_scatters(node: fx.Node) -> bool:
    """A preparation node (layout only, no real compute) of reduce-scatter launches."""
    if not is_preparation_op(node) or not node.users:
        return False
    return all(is_reduce_scatter(u) or _feeds_only_scatters(u) for u in node.users)


def use_gather_group(gm: fx.GraphModule, group: str) -> dict:
    """Run every FSDP all-gather of ``gm`` on process group ``group`` (same ranks as the
    shard group, its own communicator): on NCCL/HCCL a reduce-scatter issued earlier on
    the shard group then cannot delay the next prefetch. Returns ``{"moved": n}``, the
    all-gathers moved. Only arguments change; the caller recompiles ``gm`` if it runs its
    code."""
    moved = 0
    for node in gm.graph.nodes:
        if is_fsdp_all_gather(node) and node.op == "call_function" and node.args[2] != group:
            node.update_arg(2, group)
            moved += 1
    return {"moved": moved}
