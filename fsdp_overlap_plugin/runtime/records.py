"""Per-graph records that survive FX graph cache hits.

On an FX graph cache hit inductor loads compiled code without running our passes, so
nothing would say what they did to the graph, nor check it. Each record the passes make
is therefore also written next to inductor's cache, under

    <cache_dir>/fsdp_overlap/<pass uuid>/rank<r>/<graph id>/<forward|backward|inference|joint>.json

The pass uuid identifies the config, plan, model structure and pass source (the same
uuid is part of the FX graph cache key); the graph id is the fingerprint of the graph
Dynamo traced, so every graph of a model with graph breaks has its own records; the rank
is there because a rank's local shard shapes, and so its schedule, may differ from
another rank's. When the compile wiring sees a graph compiled with no record made, it
loads them from here and marks them ``from_cache``.

What a record holds is read here too: ``record_name`` (what graph it is of) and
``summarize_pass`` (one pass's statistics in a few numbers), shared by the compile
wiring's log line and ``report.format_report``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "KINDS",
    "SUMMARY_STATS",
    "cache_hits",
    "current",
    "load_graph_records",
    "record_name",
    "save_record",
    "store_dir",
    "summarize_pass",
]

_NAMES = ("joint", "forward", "backward", "inference")
#: The kinds of training graph (an inference graph is a forward with ``inference: true``).
KINDS = ("forward", "backward")


def store_dir(uuid: str, graph_id: str | None, rank: int = 0) -> Path:
    from .._torch_compat import inductor_cache_dir

    return Path(inductor_cache_dir()) / "fsdp_overlap" / uuid / f"rank{rank}" / (graph_id or "unknown")


def record_name(record: dict) -> str:
    """What a record is of: "forward", "backward", "joint", or "inference" (a forward
    compiled under ``no_grad``)."""
    return "inference" if record.get("inference") else record["graph"]


# The few numbers of each pass a summary line shows (the report keeps them all); keyed
# by the pass names of ``compile.pass_table.POST_GRAD_PASSES``.
SUMMARY_STATS = {
    "gather_group": ("moved",),
    "manual_bucketing": (
        "buckets",
        "prefetched",
        "deferred_rs_waits",
        "gathers_first",
        "unbucketed_all_gathers",
        "unbucketed_reduce_scatters",
    ),
    "overlap_grad_reduce": ("matched", "launches_advanced", "waits_sunk"),
    "all_to_all": ("rewritten",),
    "tied": ("merged", "params", "left"),
    "pin_order": ("dependencies",),
}


def summarize_pass(name: str, stats: Any) -> str:
    """``name(key=value, ...)`` with the keys worth a glance; zero 'unbucketed' counts omitted."""
    if not isinstance(stats, dict):
        return name
    shown = [
        f"{key}={stats[key]}"
        for key in SUMMARY_STATS.get(name, ())
        if key in stats and not (key.startswith("unbucketed") and not stats[key])
    ]
    return f"{name}({', '.join(shown)})" if shown else name


def cache_hits(cache: list[dict]) -> int:
    """How many of ``state.compile_cache``'s Dynamo graphs were loaded from the compile
    cache: AOT autograd hit, or FX graph hits and no miss (the report's compile-cache
    line and the compile progress line both count so)."""
    return sum(1 for c in cache if c["aot_autograd"] == "hit" or (c["fx_graph"]["hit"] and not c["fx_graph"]["miss"]))


def current(records: list[dict], fullgraph: bool) -> list[dict]:
    """The training records of the graphs that run now, and every inference record.

    With ``fullgraph`` each Dynamo graph is the whole forward, and a later one was compiled
    because an earlier one's guards failed (a new sequence length): the latest replaces
    the earlier ones, so the latest is what runs, not their sum. With graph breaks the
    graphs are pieces of one forward, all of which run."""
    training = [r for r in records if not r.get("inference")]
    if not fullgraph or not training:
        return list(records)
    latest = max(r.get("dynamo_graph", 0) for r in training)
    return [r for r in records if r.get("inference") or r.get("dynamo_graph", 0) == latest]


def save_record(uuid: str, record: dict, *, rank: int = 0) -> None:
    """Keep a graph's record where a later cache hit can find it (atomic write)."""
    try:
        directory = store_dir(uuid, record.get("graph_id"), rank)
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, default=str)
        os.replace(tmp, directory / f"{record_name(record)}.json")
    except OSError:
        pass  # a read-only cache dir only costs the report and the check on a later cache hit


def load_graph_records(uuid: str, graph_id: str, *, rank: int = 0) -> list[dict]:
    """Every record stored for one graph (joint first, then forward, backward, inference)."""
    directory = store_dir(uuid, graph_id, rank)
    out = []
    for name in _NAMES:
        try:
            out.append(json.loads((directory / f"{name}.json").read_text()))
        except (OSError, ValueError):
            continue
    return out
