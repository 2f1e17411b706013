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
    S  -> first other wait after S a prefetch launches before the previous bucket's wait,
                                   so its copy-in cannot be fused into later kernels

Only the order is constrained; no computation changes.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

import torch
import torch.fx as fx

from .._torch_compat import preserve_node_ordering
from .graph import is_collective, is_wait, wait_of

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
_ANCHORS = {getattr(aten, name).default for name in _ANCHOR_NAMES if hasattr(aten, name)}
# by identity: an OpOverload's hash is Python code, and this is asked of every node
_ANCHOR_IDS = frozenset(id(op) for op in _ANCHORS)


def is_anchor(node: fx.Node) -> bool:
    """A compute node inductor emits as its own kernel (never fused away)."""
    return node.op == "call_function" and id(node.target) in _ANCHOR_IDS


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
