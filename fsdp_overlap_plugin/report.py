"""The schedule report: what the passes did to each compiled graph.

``schedule_report(model)`` returns a JSON-serialisable dict; ``format_report`` turns it
into the summary the examples print. Records are also written next to inductor's FX
graph cache, keyed by the pass uuid, because on a cache hit inductor loads compiled
code without running the passes: the report then shows the stored record and says
that it came from the cache.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch.nn as nn

__all__ = ["schedule_report", "format_report", "save_record", "load_record"]

_KINDS = ("forward", "backward")


def _store_dir(uuid: str) -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "fsdp_overlap" / uuid


def save_record(uuid: str, record: dict) -> None:
    """Keep a graph's record where a later cache hit can find it (atomic write)."""
    if record.get("inference"):
        return
    try:
        directory = _store_dir(uuid)
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, default=str)
        os.replace(tmp, directory / f"{record['graph']}.json")
    except OSError:
        pass  # a read-only cache dir only costs the report on a later cache hit


def load_record(uuid: str, kind: str) -> dict | None:
    path = _store_dir(uuid) / f"{kind}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def schedule_report(model: nn.Module) -> dict[str, Any]:
    """Per compiled graph (``"forward"``, ``"backward"``): collective counts before and
    after the passes, and what each pass returned. Call it after the first step."""
    from .compile import get_state

    state = get_state(model)
    if state is None:
        raise ValueError("schedule_report: this model was not prepared by fsdp_overlap_plugin.parallelize().")
    config = state.config
    report: dict[str, Any] = {
        "mode": "eager fully_shard" if state.fallback else ("compiled" if config.compile else "eager fully_shard"),
        "fallback_reason": state.fallback,
        "world_size": state.world_size,
        "mesh": list(state.mesh_shape),
        "device_type": state.device_type,
        "backend": config.backend if config.compile and not state.fallback else None,
        "passes": {
            "manual_bucketing": config.manual_bucketing and config.compile,
            "overlap_grad_reduce": config.overlap_grad_reduce and config.compile,
        },
        "plan": state.plan,
        "reshard": state.reshard,
        "unbucketed_params": state.unbucketed_params,
        "config": config.to_dict(),
        "graphs": list(state.records),
    }
    for kind in _KINDS:
        record = next((r for r in reversed(state.records) if r["graph"] == kind and not r.get("inference")), None)
        if record is None and config.compile and not state.fallback:
            record = load_record(state.uuid(), kind)
            if record is not None:
                record = dict(record, from_cache=True)
        report[kind] = record
    return report


def _arrow(record: dict | None, key: str) -> str:
    if not record:
        return "-"
    return f"{record['before'].get(key, 0)} -> {record['after'].get(key, 0)}"


def format_report(report: dict[str, Any]) -> str:
    """A short human-readable summary of ``schedule_report``."""
    lines = []
    mesh = "x".join(str(s) for s in report["mesh"])
    on = [name for name, enabled in report["passes"].items() if enabled]
    lines.append(
        f"fsdp-overlap schedule: {report['mode']}, world {report['world_size']} (mesh {mesh}), "
        f"backend {report['backend']}, passes: {', '.join(on) or 'none'}"
    )
    if report.get("fallback_reason"):
        lines.append(f"  fell back to eager: {report['fallback_reason']}")
    lines.append(f"  plan: {len(report['plan'])} buckets: " + " ".join(str(b) for b in report["plan"]))
    header = f"  {'graph':<9} {'all-gathers':>12} {'reduce-scatters':>16} {'all-reduces':>12} {'waits':>10}  passes"
    lines.append(header)
    for kind in _KINDS:
        record = report.get(kind)
        if record is None:
            lines.append(f"  {kind:<9} (not compiled yet)")
            continue
        notes = []
        for name, stats in record.get("passes", {}).items():
            if isinstance(stats, dict):
                shown = ", ".join(
                    f"{k}={v}" for k, v in stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                )
                notes.append(f"{name}({shown})" if shown else name)
        if record.get("from_cache"):
            notes.append("[from FX graph cache]")
        lines.append(
            f"  {kind:<9} {_arrow(record, 'all_gather'):>12} {_arrow(record, 'reduce_scatter'):>16} "
            f"{_arrow(record, 'all_reduce'):>12} {_arrow(record, 'wait'):>10}  {'; '.join(notes)}"
        )
    reshard = report.get("reshard") or {}
    if reshard:
        lines.append(
            f"  reshard after forward: {reshard.get('resharded', 0)} all-gathers re-gathered in backward, "
            f"{reshard.get('kept_gathered', 0)} kept"
            + (f" ({reshard['kept_bucket']})" if reshard.get("kept_bucket") else "")
        )
    if report.get("unbucketed_params"):
        lines.append(f"  parameters in no bucket (gathered one by one): {', '.join(report['unbucketed_params'])}")
    return "\n".join(lines)
