"""Merge several all-gathers (or reduce-scatters) of one group and dtype into one.

All-gather of shards ``x_1..x_m`` (each ``[s_j0, ...]``, ``n_j`` elements), as FSDP2
does it: each rank writes its shards straight into its own slot of the output buffer,
and the collective fills the other slots in place, so no separate input buffer stays
alive while the collective is in flight (it would cost one shard of the bucket per
gather in flight: 1.5 MiB per block of the benchmark GPT, twice at the start of the
backward)::

    out = fsdp_overlap.fill_slot([x_j], W, r, dtype)   # [W * N], slot r = this rank's shards
    slot = slice(out, 0, r * N, (r + 1) * N)           # N = sum n_j
    ag = all_gather_into_tensor_out(slot, W, group, out=out); w = wait(ag)  # rank-major
    rows = view(w, [W, N]); parts = fsdp_overlap.split_gathered(rows, n_j)  # one copy-out
    out_j = view(parts[j], [W * s_j0, ...])            # == the old wait_j

``r`` makes the rewritten graph differ between ranks (as torch's own
``fx_passes/bucketing.py`` merge does), so the compile cache keys carry the rank
(``OverlapState.cache_key``). Where the group is not a process group of this process
(hand-built graphs) the rank is unknown, and the functional form is used instead: the
concatenated shards are the collective's own input,
``all_gather_into_tensor(cat(reshape(x_j, [-1])), W, group)``.

Reduce-scatter of gradients ``y_1..y_m`` (each ``[W * c_j0, ...]``)::

    flat = fsdp_overlap.pack_rows([y_j], W, dtype)   # row r of [W, sum c_j] = rank r's chunks
    rs = reduce_scatter_tensor(flat, op, W, group); w = wait(rs)
    out_j = reshape(split_with_sizes(w, N_j / W)[j], [c_j0, ...])   # == the old wait_j

The copy-in (``fill_slot``, ``pack_rows``) and the copy-out (``split_gathered``) are our
custom ops (``ops.py``): one extern call per bucket, where ATen nodes had inductor
generate a copy kernel per member, bucket and use (compile time, benchmarks/RESULTS.md).
A member that is a dtype cast made only for the collective (``param_dtype`` /
``reduce_dtype``: ``convert_element_type`` or ``_to_copy(x, dtype=...)`` with the
collective as its one user) is passed
uncast, and the op's copy converts (the same rounding), so the cast needs no buffer.

Element positions change only by concatenation, so each output element is reduced from
the same inputs; on two ranks the sum is bitwise identical (addition of two numbers is
commutative).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx

from .._torch_compat import FakeTensor, detect_fake_mode
from .graph import C10D, group_name, node_args, wait_of
from .ops import FILL_SLOT, PACK_ROWS, SPLIT_GATHERED

__all__ = [
    "SPLIT_GATHERED",
    "MergeResult",
    "Retired",
    "bucket_key",
    "graph_fake_mode",
    "merge_all_gathers",
    "merge_reduce_scatters",
]

aten = torch.ops.aten
_CAST = torch.ops.prims.convert_element_type.default
_TO_COPY = torch.ops.aten._to_copy.default
_COPIED_META = ("nn_module_stack", "fwd_nn_module_stack", "stack_trace", "custom", "seq_nr")


class MergeResult:
    """The nodes a merge created that the bucketing moves: the new launch, its wait, and
    the nodes after the wait (the views that replace the old waits)."""

    def __init__(self, start: fx.Node, wait: fx.Node, outputs_side: list[fx.Node]):
        self.start = start
        self.wait = wait
        self.outputs_side = outputs_side  # the wait and the views that replace old waits


class _Builder:
    """Creates nodes before an anchor and gives each a fake ``meta["val"]`` built
    directly from the shape the merge knows (no op dispatch: a dispatched fake op costs
    about 0.4 ms, direct construction about 0.01 ms, and inductor recomputes the values
    of new nodes after its custom passes anyway)."""

    def __init__(
        self, graph: fx.Graph, anchor: fx.Node, template: fx.Node, extra_meta: dict, fake_mode: Any, like: Any
    ):
        self.graph = graph
        self.anchor = anchor
        self.template = template
        self.extra_meta = extra_meta
        self.created: list[fx.Node] = []
        self.fake_mode = fake_mode
        self.dtype = getattr(like, "dtype", None)
        self.device = getattr(like, "device", None)

    def tensor(self, shape: list[int], stride: list[int] | None = None) -> Any:
        if self.fake_mode is None or self.dtype is None:
            return None
        stride = stride or _contiguous_strides(shape)
        meta = torch.empty_strided(shape, stride, dtype=self.dtype, device="meta")
        return FakeTensor(self.fake_mode, meta, self.device)

    def call(self, target: Callable, *args: Any, val: Any = None, kwargs: dict | None = None) -> fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, tuple(args), kwargs or {})
        for key in _COPIED_META:
            if key in self.template.meta:
                node.meta[key] = self.template.meta[key]
        node.meta.update(self.extra_meta)
        if val is not None:
            node.meta["val"] = val
        self.created.append(node)
        return node


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return list(reversed(strides))


def _shape(node: fx.Node) -> list[int]:
    val = node.meta.get("val")
    if val is None:
        raise ValueError(f"bucketing needs shape metadata (meta['val']) on {node.name}")
    return [int(s) for s in val.shape]


def graph_fake_mode(graph: fx.Graph) -> Any:
    """The fake mode of the graph's metadata (from its inputs), or None for bare graphs."""
    vals = [n.meta.get("val") for n in graph.find_nodes(op="placeholder")]
    vals = [v for v in vals if isinstance(v, torch.Tensor)]
    return detect_fake_mode(vals) if vals else None


def _retire(
    graph: fx.Graph,
    launch: fx.Node,
    replacement: fx.Node,
    retired: Retired | None,
    *,
    reorders: bool,
    cast: fx.Node | None = None,
) -> None:
    """Replace ``launch``'s wait by ``replacement`` and erase both (now, or with
    ``retired``), then ``cast``: the member's dtype cast the merged op absorbed."""
    wait = wait_of(launch)
    dead = [wait, launch] + ([cast] if cast is not None else [])
    if retired is None:
        wait.replace_all_uses_with(replacement)
        for node in dead:
            graph.erase_node(node)
        return
    for user in list(wait.users):
        if user.op == "output":
            retired.outputs[wait] = replacement  # rewritten in one go by Retired.finish
        else:
            user.replace_input_with(wait, replacement)
            retired.rewired += reorders  # this user may now sit before its new input
    retired.nodes.extend(dead)


def _uncast(node: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """``(x, cast)`` when ``node`` only converts a floating ``x`` to another dtype
    (``convert_element_type``, or ``_to_copy`` with nothing but a dtype) and the
    collective is its one user: the merged op converts instead. Else ``(node, None)``."""
    if node.op != "call_function" or len(node.users) != 1 or not node.args:
        return node, None
    source = node.args[0]
    val = source.meta.get("val") if isinstance(source, fx.Node) else None
    if not (isinstance(val, torch.Tensor) and val.is_floating_point()):
        return node, None
    if node.target is _CAST or (node.target is _TO_COPY and len(node.args) == 1 and set(node.kwargs) == {"dtype"}):
        return source, node
    return node, None


class Retired:
    """Old launches and waits replaced by merges, erased together at the end.

    Gradients all flow to the graph's single output node; replacing them there one by
    one rewrites that node's whole argument list each time (quadratic in the number of
    parameters), so the output is rewritten once instead.
    """

    def __init__(self) -> None:
        self.outputs: dict[fx.Node, fx.Node] = {}
        self.nodes: list[fx.Node] = []
        self.rewired = 0

    def finish(self, graph: fx.Graph) -> None:
        if self.outputs:
            output = graph.output_node()
            output.args = fx.node.map_arg(output.args, lambda n: self.outputs.get(n, n))
        for node in self.nodes:
            graph.erase_node(node)
        self.outputs.clear()
        self.nodes.clear()


def merge_all_gathers(
    graph: fx.Graph,
    gathers: list[fx.Node],
    *,
    anchor: fx.Node,
    extra_meta: dict,
    fake_mode: Any = None,
    retired: Retired | None = None,
    group_ranks: Mapping[str, int] | None = None,
) -> MergeResult:
    """Replace ``gathers`` (same group, size and dtype; each with one wait) by one
    all-gather inserted before ``anchor``. Old launches and waits are erased now, or
    handed to ``retired`` to be erased by ``retired.finish(graph)``.

    ``group_ranks`` maps a group's name to this process's rank in it (data the caller
    resolved; a pass never looks up a process group). With the rank, the members are
    copied straight into this rank's slot of the output (``FILL_SLOT``); without it (a
    hand-built graph), they are concatenated first."""
    first = gathers[0]
    size = node_args(first)[1]
    group = node_args(first)[2]
    inputs = [node_args(ag)[0] for ag in gathers]
    builder = _Builder(graph, anchor, first, extra_meta, fake_mode, first.meta.get("val"))
    shapes = [_shape(x) for x in inputs]
    numels = [math.prod(s) for s in shapes]
    total = sum(numels)
    t = builder.tensor
    rank = (group_ranks or {}).get(group) if isinstance(group, str) else None
    like = first.meta.get("val")
    casts: list[fx.Node | None] = [None] * len(gathers)
    if rank is None or not isinstance(like, torch.Tensor):
        flats = [builder.call(aten.reshape.default, x, [-1], val=t([n])) for x, n in zip(inputs, numels)]
        cat = builder.call(aten.cat.default, flats, val=t([total]))
        start = builder.call(C10D.all_gather_into_tensor.default, cat, size, group, val=t([size * total]))
    else:
        sources, casts = map(list, zip(*(_uncast(x) for x in inputs)))
        out = builder.call(FILL_SLOT, sources, size, rank, like.dtype, val=t([size * total]))
        slot = builder.call(aten.slice.Tensor, out, 0, rank * total, (rank + 1) * total, val=t([total]))
        start = builder.call(
            C10D.all_gather_into_tensor_out.default, slot, size, group, kwargs={"out": out}, val=t([size * total])
        )
    launch_side = len(builder.created)  # from the inputs up to and including the launch
    wait = builder.call(C10D.wait_tensor.default, start, val=t([size * total]))
    rows = builder.call(aten.view.default, wait, [size, total], val=t([size, total]))
    pieces = [t([size, n]) for n in numels]
    parts = builder.call(SPLIT_GATHERED, rows, numels, val=pieces if all(p is not None for p in pieces) else None)
    for j, (ag, shape) in enumerate(zip(gathers, shapes)):
        piece = builder.call(operator.getitem, parts, j, val=pieces[j])
        full = [size * shape[0], *shape[1:]]
        out = builder.call(aten.view.default, piece, full, val=t(full))
        # launched where the first member was: every user of a member comes later
        _retire(graph, ag, out, retired, reorders=False, cast=casts[j])
    return MergeResult(start, wait, builder.created[launch_side:])


def merge_reduce_scatters(
    graph: fx.Graph,
    scatters: list[fx.Node],
    *,
    anchor: fx.Node,
    extra_meta: dict,
    fake_mode: Any = None,
    retired: Retired | None = None,
) -> MergeResult:
    """Replace ``scatters`` (same group, size, op and dtype; each with one wait) by one
    reduce-scatter inserted before ``anchor``. Old launches and waits are erased now, or
    handed to ``retired`` to be erased by ``retired.finish(graph)``."""
    first = scatters[0]
    _, op, size, group = node_args(first)[:4]
    inputs = [node_args(rs)[0] for rs in scatters]
    builder = _Builder(graph, anchor, first, extra_meta, fake_mode, first.meta.get("val"))
    shapes = [_shape(y) for y in inputs]
    chunks = [math.prod(s) // size for s in shapes]
    total = sum(chunks)
    t = builder.tensor
    dtype = inputs[0].meta["val"].dtype  # the collective's (``_shape`` checked every input has a value)
    sources, casts = map(list, zip(*(_uncast(y) for y in inputs)))
    flat = builder.call(PACK_ROWS, sources, size, dtype, val=t([size * total]))
    start = builder.call(C10D.reduce_scatter_tensor.default, flat, op, size, group, val=t([total]))
    launch_side = len(builder.created)  # from the inputs up to and including the launch
    wait = builder.call(C10D.wait_tensor.default, start, val=t([total]))
    pieces = [t([c]) for c in chunks]
    parts = builder.call(
        aten.split_with_sizes.default, wait, chunks, val=pieces if all(p is not None for p in pieces) else None
    )
    for j, (rs, shape) in enumerate(zip(scatters, shapes)):
        piece = builder.call(operator.getitem, parts, j, val=pieces[j])
        out_shape = [shape[0] // size, *shape[1:]]
        out = builder.call(aten.reshape.default, piece, out_shape, val=t(out_shape))
        # launched where the last member was: users of earlier members may come before
        _retire(graph, rs, out, retired, reorders=True, cast=casts[j])
    return MergeResult(start, wait, builder.created[launch_side:])


def bucket_key(node: fx.Node) -> tuple:
    """Collectives that may share one launch: same kind, group, size, op and dtype."""
    args = node_args(node)
    val = node.meta.get("val")
    dtype = val.dtype if isinstance(val, torch.Tensor) else None
    if len(args) == 4:  # reduce_scatter_tensor(input, op, size, group)
        return ("reduce_scatter", group_name(node), args[2], args[1], dtype)
    return ("all_gather", group_name(node), args[1], dtype)
