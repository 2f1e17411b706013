"""FX-cache record replay: what inductor's caches did while compiling one graph (their
counters), and the records our passes left for a graph compiled before, reloaded when
an FX graph cache hit skips the passes.
"""

from __future__ import annotations

from .. import _torch_compat as compat
from ..runtime.records import load_graph_records
from ..runtime.state import OverlapState

__all__ = ["cache_counters", "cache_use", "records_from_cache"]


def cache_counters() -> dict[str, int]:
    counters = compat.dynamo_counters()
    return {
        f"{group}.{key}": counters[group][key]
        for group, keys in (
            ("aot_autograd", ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")),
            ("inductor", ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")),
        )
        for key in keys
    }


def cache_use(index: int, graph_id: str, before: dict[str, int], after: dict[str, int]) -> dict:
    """What inductor's own counters say its caches did while compiling one Dynamo graph:
    the evidence behind the report's "from the compile cache", independent of our records."""
    delta = {key: after[key] - before[key] for key in after}
    aot = next((k for k in ("hit", "miss", "bypass") if delta[f"aot_autograd.autograd_cache_{k}"]), None)
    return {
        "graph": index,
        "graph_id": graph_id,
        "aot_autograd": aot,  # None: AOT autograd's cache was not consulted (it is off)
        "fx_graph": {k: delta[f"inductor.fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass")},
    }


def records_from_cache(state: OverlapState, graph_id: str, skip: set[str] = frozenset()) -> list[dict]:
    """The records the passes left for this graph when it was compiled before: on an FX
    graph cache hit inductor loads compiled code without running them. ``skip``: the kinds
    of graph ("forward", "backward") the passes ran on in this compile (a cache miss), whose
    fresh records stand."""
    records = [
        dict(r, from_cache=True)
        for r in load_graph_records(state.cache_key(), graph_id, rank=state.rank)
        if r["graph"] not in skip
    ]
    joints = {r.get("graph_id") for r in state.reshard}
    for record in records:
        if record["graph"] != "joint":
            state.records.append(record)
        elif graph_id not in joints:  # the joint pass ran (AOT autograd's cache missed): already there
            state.reshard.append(record)
    return [r for r in records if r["graph"] != "joint"]
