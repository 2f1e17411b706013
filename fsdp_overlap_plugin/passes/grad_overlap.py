"""Gradient overlap: launch each reduce-scatter when its gradient is ready, wait late.

For each FSDP gradient reduce-scatter (with the nodes that exist only to prepare its
input: views, padding, bucket copy-in, dtype casts)::

    before:  grad -> ... compute ... -> pad -> cat -> rs -> wait -> view -> (use)
    after:   grad -> pad -> cat -> rs -> ... compute ... -> wait -> view -> (use)

1. **launch advance**: the preparation nodes and the launch move to just after the
   latest of (their inputs, the last barrier, the last collective on the same process
   group that this pass does not own; under a memory budget also the wait of the
   reduce-scatter before it on the group). A barrier is a graph input/output or a node
   with side effects or mutation, which includes releasing a tensor's storage; FSDP
   parameter all-gathers and the matched reduce-scatters are owned, everything else on
   the group (tensor-parallel collectives, for instance) keeps its order relative to
   them.
2. **wait sinking**: the wait and the view/alias DAG of its result are held back until
   the first node that really consumes them, each branch separately (a view used early
   keeps its early consumer), never past a barrier, and never past the launch of the
   next gradient reduce-scatter on the same group (FSDP2's bound: one in flight while
   the next is issued), or, under a memory budget (``wait_before_copy_in``), never past
   the first preparation node (the copy-in) of that next one: one full-size input
   alive at a time. A reduce-scatter holds its full-size input (and an all-to-all its
   full-size output) until its wait, and a gradient's first use is the graph's output:
   sunk that far, every bucket's gradients stayed alive, unsharded, until the end of the
   backward (a GPT of 15M parameters at batch 1: 124 MiB per rank against eager FSDP2's
   52; benchmarks/RESULTS.md). On HSDP the replica all-reduce consumes the waited
   result, so reduce-scatter -> wait -> all-reduce stays in order.

Compute nodes, arithmetic, tensor-parallel collectives and outputs are untouched; only
positions change, the same way on every rank. Works on graphs the bucketing pass
rewrote, including nodes it wrapped in ``control_deps``. Runs in O(nodes + edges).
Returns its statistics (``overlap_grad_reduce``).
"""

from __future__ import annotations

from collections import defaultdict

import torch.fx as fx

from .graph import (
    data_users,
    group_name,
    is_barrier,
    is_collective,
    is_fsdp_all_gather,
    is_fsdp_reduce_scatter,
    is_preparation_op,
    is_view,
    merge_duplicate_waits,
    wait_of,
)
from .order import relink

__all__ = ["overlap_grad_reduce"]


class _Reduction:
    def __init__(self, launch: fx.Node, preparation: list[fx.Node], realization: list[fx.Node]):
        self.launch = launch
        self.preparation = preparation  # in graph order, excluding the launch
        self.realization = realization  # the wait and the views of its result


def _preparation(launch: fx.Node, index: dict[fx.Node, int]) -> list[fx.Node]:
    """Nodes that exist only to build this launch's input (all their users inside)."""
    chain = {launch}
    frontier = list(launch.all_input_nodes)
    while frontier:
        node = frontier.pop()
        if node in chain or not is_preparation_op(node):
            continue
        # A node with a consumer outside the chain is shared compute and stays. One
        # rejected because a sibling user was not in the chain yet is pushed again
        # when that sibling joins (every joining node pushes its inputs).
        if all(user in chain for user in node.users):
            chain.add(node)
            frontier.extend(node.all_input_nodes)
    chain.discard(launch)
    return sorted(chain, key=index.__getitem__)


def _realization(wait: fx.Node) -> list[fx.Node]:
    out, stack = [wait], [wait]
    seen = {wait}
    while stack:
        for user in data_users(stack.pop()):
            if user not in seen and is_view(user):
                seen.add(user)
                out.append(user)
                stack.append(user)
    return out


def _collect(nodes: list[fx.Node], index: dict[fx.Node, int]) -> list[_Reduction]:
    matches = []
    for node in nodes:
        if not is_fsdp_reduce_scatter(node):
            continue
        wait = wait_of(node)
        if wait is None or len(data_users(node)) != 1:
            continue
        realization = sorted(_realization(wait), key=index.__getitem__)
        matches.append(_Reduction(node, _preparation(node, index), realization))
    return matches


def _advance_launches(
    nodes: list[fx.Node], matches: list[_Reduction], barriers: set[fx.Node], after_previous_wait: bool
) -> tuple[list[fx.Node], int]:
    index = {n: i for i, n in enumerate(nodes)}
    by_launch = {m.launch: m for m in matches}
    by_wait = {m.realization[0]: m for m in matches} if after_previous_wait else {}
    last_barrier = -1
    last_unowned: dict = defaultdict(lambda: -1)
    last_wait: dict = defaultdict(lambda: -1)  # group -> the last matched reduce-scatter's wait
    boundary: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        if node in by_launch:
            group = group_name(node)
            # never above the wait of the reduce-scatter before it on the group (the
            # bound the sinking keeps: one full-size input in flight at a time)
            boundary[node] = max(last_barrier, last_unowned[group], last_wait[group])
        elif node in by_wait:
            last_wait[group_name(by_wait[node].launch)] = i
        elif node.op == "call_function":
            if node in barriers:
                last_barrier = i
            elif is_collective(node) and not is_fsdp_all_gather(node):
                last_unowned[group_name(node)] = i
    anchored: dict[fx.Node, list[list[fx.Node]]] = defaultdict(list)
    moving: set[fx.Node] = set()
    for match in sorted(matches, key=lambda m: index[m.launch]):
        chain = [*match.preparation, match.launch]
        members = set(chain)
        inputs = [a for n in chain for a in n.all_input_nodes if a not in members]
        ready = max([boundary[match.launch], *(index[a] for a in inputs)])
        if ready + 1 >= index[chain[0]]:
            continue  # already launched as early as it can be
        anchored[nodes[ready]].append(chain)
        moving.update(chain)
    advanced = sum(len(v) for v in anchored.values())
    if not advanced:
        return nodes, 0
    order: list[fx.Node] = []

    def emit(node: fx.Node) -> None:
        order.append(node)
        for chain in anchored.pop(node, ()):
            for member in chain:
                emit(member)

    for node in nodes:
        if node not in moving:
            emit(node)
    return order, advanced


def _sink_waits(
    nodes: list[fx.Node], matches: list[_Reduction], barriers: set[fx.Node], before_copy_in: bool
) -> tuple[list[fx.Node], set[fx.Node]]:
    sinkable = {n for m in matches for n in m.realization}
    by_launch = {m.launch: m for m in matches}
    last_launched: dict = {}  # group -> the last reduce-scatter launched on it
    capped: set[fx.Node] = set()  # waits (and views) of reduce-scatters a later one superseded
    index = {n: i for i, n in enumerate(nodes)}
    order: list[fx.Node] = []
    pending: dict[fx.Node, None] = {}  # insertion-ordered set
    fixed_before: dict[fx.Node, int] = {}
    fixed_emitted = 0
    sunk: set[fx.Node] = set()

    def flush(node: fx.Node) -> None:
        for arg in node.all_input_nodes:
            if arg in pending:
                flush(arg)
        if node not in pending:
            return
        del pending[node]
        order.append(node)
        if fixed_emitted > fixed_before[node]:
            sunk.add(node)  # some node that came after it now runs before it

    def cap(group) -> None:
        # FSDP2's bound: the reduce-scatter launched last on ``group`` is waited here.
        # Each holds its full-size input (and an all-to-all its full-size output) until
        # its wait: waits sunk to the graph's end would hold every gradient unsharded.
        older = last_launched.get(group)
        for waiting in older.realization if older is not None else ():
            capped.add(waiting)
            if waiting in pending:
                flush(waiting)

    # under a memory budget a wait stops before the next reduce-scatter's copy-in (one
    # full-size input alive at a time), otherwise just after the next launch
    copy_ins = {(m.preparation or [m.launch])[0]: m for m in matches} if before_copy_in else {}
    for node in nodes:
        if node in copy_ins:
            cap(group_name(copy_ins[node].launch))
        if node in sinkable:
            pending[node] = None
            fixed_before[node] = fixed_emitted
            if node in capped:
                flush(node)  # a later reduce-scatter on its group has launched: no further
            continue
        if node.op == "output" or node in barriers:
            for waiting in sorted(pending, key=index.__getitem__):
                flush(waiting)
        else:
            for arg in node.all_input_nodes:
                if arg in pending:
                    flush(arg)
        order.append(node)
        fixed_emitted += 1
        match = by_launch.get(node)
        if match is not None:
            if not before_copy_in:
                cap(group_name(node))
            last_launched[group_name(node)] = match
    return order, sunk


def overlap_grad_reduce(gm: fx.GraphModule, *, wait_before_copy_in: bool = False) -> dict:
    """Advance gradient reduce-scatter launches and sink their waits (see module doc).
    ``wait_before_copy_in`` (under a memory budget): a wait sinks no further than the next
    reduce-scatter's copy-in, and no launch advances above the previous one's wait;
    otherwise no further than the next reduce-scatter's launch.
    Returns ``{"matched", "launches_advanced", "wait_view_nodes_sunk", "waits_sunk"}``:
    the reduce-scatters found, launches moved earlier, wait/view nodes moved later, and
    waits among them. Changes only ``gm.graph``; the caller regenerates ``gm.forward``."""
    graph = gm.graph
    merged_waits = merge_duplicate_waits(graph)
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    matches = _collect(nodes, index)
    barriers = {n for n in nodes if n.op == "call_function" and is_barrier(n)}
    order, advanced = _advance_launches(nodes, matches, barriers, wait_before_copy_in)
    order, sunk = _sink_waits(order, matches, barriers, wait_before_copy_in)
    if advanced or sunk or merged_waits:
        relink(graph, order)
    stats = {
        "matched": len(matches),
        "launches_advanced": advanced,
        "wait_view_nodes_sunk": len(sunk),
        "waits_sunk": sum(1 for m in matches if m.realization[0] in sunk),
    }
    return stats
