"""Pin the collective order so it survives inductor's scheduling and fusion.

Inductor fuses cheap kernels across our carefully placed launches and waits. Seen on
CPU: the copy-in of a prefetched bucket (a concatenation of shards) was fused into the
next block's layer-norm kernel, which reads the previous bucket's gathered weights, so
the "prefetched" all-gather was issued only after the previous bucket's wait. This pass
turns the FX order of each collective window into explicit dependencies
(``control_deps``), all of which point from an earlier node to a later one, so no cycle
can appear::

    S = launch, W = its wait, A = a matmul/attention/convolution (an extern kernel
    inductor never fuses) between them

    S  -> first A after S          the launch happens before the compute it hides behind
    last A before W -> W           the wait is not pulled up above that compute
    S  -> first other wait after S a launch stays before the next wait (a later bucket's,
                                   a reduce-scatter's), so its copy-in cannot be fused into
                                   later kernels
    W  -> copy-in of the next S    a wait stays before the next merged launch's copy-in (seen:
                                   inductor emitted a reduce-scatter's wait after the next
                                   reduce-scatter's copy-in and launch, so two buckets'
                                   full-size buffers met again)

Only the order is constrained; no computation changes.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

import torch
import torch.fx as fx

from .._torch_compat import preserve_node_ordering
from .graph import effective_target, is_collective, is_wait, wait_of
from .ops import FILL_SLOT, PACK_ROWS

__all__ = ["pin_collective_order"]

aten = torch.ops.aten
_ANCHOR_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "convolution",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
_COPY_INS = (FILL_SLOT, PACK_ROWS)
_ANCHORS = {getattr(aten, name).default for name in _ANCHOR_NAMES if hasattr(aten, name)}
# by identity: an OpOverload's hash is Python code, and this is asked of every node
_ANCHOR_IDS = frozenset(id(op) for op in _ANCHORS)


def is_anchor(node: fx.Node) -> bool:
    """A compute node inductor emits as its own kernel (never fused away)."""
    return node.op == "call_function" and id(node.target) in _ANCHOR_IDS


def _copy_in(launch: fx.Node, after: int, index: dict[fx.Node, int]) -> fx.Node | None:
    """A merged collective's copy-in op (``fill_slot`` / ``pack_rows``) feeding ``launch``
    directly or through a view, placed after position ``after``; None if none."""
    for arg in launch.all_input_nodes:
        for node in (arg, *arg.all_input_nodes):
            if effective_target(node) in _COPY_INS and index.get(node, -1) > after:
                return node
    return None


def pin_collective_order(gm: fx.GraphModule) -> dict:
    """Add ordering dependencies that keep each collective's overlap window (see module
    doc). Returns ``{"windows_pinned", "dependencies"}``. Changes only ``gm.graph``; the
    caller regenerates ``gm.forward``."""
    graph = gm.graph
    nodes = list(graph.nodes)
    index: dict[fx.Node, int] = {}
    anchors: list[int] = []
    waits: list[int] = []
    launches: list[fx.Node] = []
    for i, node in enumerate(nodes):  # one walk: each node is classified once
        index[node] = i
        if is_anchor(node):
            anchors.append(i)
        elif is_wait(node):
            waits.append(i)
        elif is_collective(node):
            launches.append(node)
    deps: dict[fx.Node, dict[fx.Node, None]] = defaultdict(dict)  # dict: an ordered set
    starts = [index[n] for n in launches]
    for w in waits:
        k = bisect.bisect_right(starts, w)
        if k < len(starts):
            copy_in = _copy_in(launches[k], w, index)
            if copy_in is not None:
                deps[copy_in][nodes[w]] = None
    windows = 0
    for start in launches:
        wait = wait_of(start)
        if wait is None:
            continue
        s, w = index[start], index[wait]
        pinned = False
        k = bisect.bisect_right(anchors, s)
        if k < len(anchors) and anchors[k] < w:
            deps[nodes[anchors[k]]][start] = None
            last = anchors[bisect.bisect_left(anchors, w) - 1]
            deps[wait][nodes[last]] = None
            pinned = True
        k = bisect.bisect_right(waits, s)
        if k < len(waits) and waits[k] < w:
            deps[nodes[waits[k]]][start] = None
            pinned = True
        windows += pinned
    added = sum(len(v) for v in deps.values())
    if deps:
        preserve_node_ordering(graph, dict(deps))
    return {"windows_pinned": windows, "dependencies": added}
