"""A graph's schedule as a list of events: what the report records before and after the
passes, and what the cost model plays.

Pure FX, like the passes: no process group, no tensor values (sizes and FLOPs come from
each node's fake ``meta["val"]``).
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.fx as fx

from ..contract import BucketIndex
from .graph import (
    collective_of_wait,
    effective_target,
    group_name,
    is_all_gather,
    is_all_reduce,
    is_collective,
    is_reduce_scatter,
    is_view,
    is_wait,
    module_path,
    node_args,
    numel_hint,
    size_hint,
)

__all__ = ["graph_events"]

aten = torch.ops.aten


def _tensor_bytes(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return numel_hint(val) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_tensor_bytes(v) for v in val)
    return 0


def _is_attention(target: Any) -> bool:
    try:
        return _is_attention_cached(target)
    except TypeError:  # an unhashable callable
        return "scaled_dot_product" in str(target)


@functools.cache
def _is_attention_cached(target: Any) -> bool:
    # str() of an op overload builds its name each time: once per target, not per node
    return "scaled_dot_product" in str(target)


def _flops(node: fx.Node) -> int:
    """Rough FLOPs of a node: 2*M*N*K for matmuls, 4*B*H*L*S*D for attention, one per
    output element otherwise. Good enough to draw and compare schedules. A dynamic size
    counts at the value it had when the graph was traced (``size_hint``, no guard)."""
    target = effective_target(node)
    args = node_args(node)

    def shape(i: int) -> list[int]:
        arg = args[i] if i < len(args) else None
        val = getattr(arg, "meta", {}).get("val")
        return [size_hint(s) for s in val.shape] if isinstance(val, torch.Tensor) else []

    try:
        if target is aten.mm.default:
            (m, k), (_, n) = shape(0), shape(1)
            return 2 * m * n * k
        if target is aten.addmm.default:
            (m, k), (_, n) = shape(1), shape(2)
            return 2 * m * n * k
        if target is aten.bmm.default:
            (b, m, k), (_, _, n) = shape(0), shape(1)
            return 2 * b * m * n * k
        if _is_attention(target):
            b, h, lq, d = shape(0)
            return 4 * b * h * lq * shape(1)[2] * d
    except ValueError:
        pass
    val = node.meta.get("val")
    return numel_hint(val) if isinstance(val, torch.Tensor) else 0


def _group_words(node: fx.Node) -> str | None:
    group = group_name(node)
    return None if group is None else str(group)


def graph_events(graph: fx.Graph, plan: list[list[str]]) -> list[dict]:
    """The graph's schedule as a list: each launch, each wait, and runs of compute merged
    into one item, in graph order. Items: ``{"op": "all_gather" | "reduce_scatter" |
    "all_reduce" | "collective" | "wait" | "compute", "name", "bucket", "module",
    "bytes", "flops", "of"}`` (``of``: the launch a wait waits on), and a launch's
    ``group`` (its process group's name). Bytes and FLOPs of a graph compiled for dynamic
    sizes are counted at the sizes it was traced with."""
    index = BucketIndex(plan)
    events: list[dict] = []

    def bucket(node: fx.Node) -> int | None:
        b = node.meta.get("fsdp_overlap_bucket")
        return b if b is not None else index.bucket_of(module_path(node))

    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if is_wait(node):
            coll = collective_of_wait(node)
            events.append(
                {
                    "op": "wait",
                    "name": node.name,
                    "bucket": bucket(coll) if coll is not None else None,
                    "module": module_path(node),
                    "bytes": 0,
                    "flops": 0,
                    "of": coll.name if coll is not None else None,
                }
            )
        elif is_collective(node):
            op = (
                "all_gather"
                if is_all_gather(node)
                else "reduce_scatter"
                if is_reduce_scatter(node)
                else "all_reduce"
                if is_all_reduce(node)
                else "all_to_all"
                if "all_to_all" in str(node.target)
                else "collective"
            )
            # bytes a rank receives: the gathered output, or the reduce-scatter input
            size = (
                _tensor_bytes(node.meta.get("val"))
                if op == "all_gather"
                else _tensor_bytes(getattr(node_args(node)[0], "meta", {}).get("val"))
            )
            events.append(
                {
                    "op": op,
                    "name": node.name,
                    "bucket": bucket(node),
                    "module": module_path(node),
                    "bytes": size,
                    "flops": 0,
                    "of": None,
                    "group": _group_words(node),
                }
            )
        elif not is_view(node) and node.target is not operator.getitem:
            flops, size = _flops(node), _tensor_bytes(node.meta.get("val"))
            if events and events[-1]["op"] == "compute":
                events[-1]["flops"] += flops
                events[-1]["bytes"] += size
                events[-1]["nodes"] += 1
            else:
                events.append(
                    {
                        "op": "compute",
                        "name": node.name,
                        "bucket": None,
                        "module": module_path(node),
                        "bytes": size,
                        "flops": flops,
                        "of": None,
                        "nodes": 1,
                    }
                )
    return events
