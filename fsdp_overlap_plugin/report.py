"""The schedule report: what the passes did to each compiled graph.

``schedule_report(model)`` returns a JSON-serialisable dict; ``format_report`` turns it
into the summary the examples print. Records are also written next to inductor's FX
graph cache, keyed by the pass uuid, because on a cache hit inductor loads compiled
code without running the passes: the report then shows the stored record and says
that it came from the cache.
"""

from __future__ import annotations

import json
import operator
import os
import tempfile
from pathlib import Path
from typing import Any

import torch.nn as nn

__all__ = [
    "draw_timeline",
    "format_report",
    "graph_events",
    "load_record",
    "predicted",
    "save_record",
    "schedule_report",
    "simulate",
]

_KINDS = ("forward", "backward")


def _tensor_bytes(val: Any) -> int:
    import torch

    if isinstance(val, torch.Tensor):
        return int(val.numel()) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_tensor_bytes(v) for v in val)
    return 0


def _flops(node: Any) -> int:
    """Rough FLOPs of a node: 2*M*N*K for matmuls, 4*B*H*L*S*D for attention, one per
    output element otherwise. Good enough to draw and compare schedules."""
    import torch

    from .passes.graph import effective_target, node_args

    aten = torch.ops.aten
    target = effective_target(node)
    args = node_args(node)

    def shape(i: int) -> list[int]:
        arg = args[i] if i < len(args) else None
        val = getattr(arg, "meta", {}).get("val")
        return list(val.shape) if isinstance(val, torch.Tensor) else []

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
        if "scaled_dot_product" in str(target):
            b, h, lq, d = shape(0)
            return 4 * b * h * lq * shape(1)[2] * d
    except ValueError:
        pass
    val = node.meta.get("val")
    return int(val.numel()) if isinstance(val, torch.Tensor) else 0


def graph_events(graph: Any, plan: list[list[str]]) -> list[dict]:
    """The graph's schedule as a list: each launch, each wait, and runs of compute merged
    into one item, in graph order. Items: ``{"op": "all_gather" | "reduce_scatter" |
    "all_reduce" | "collective" | "wait" | "compute", "name", "bucket", "module",
    "bytes", "flops", "of"}`` (``of``: the launch a wait waits on)."""
    from .passes.graph import (
        collective_of_wait,
        is_all_gather,
        is_all_reduce,
        is_collective,
        is_reduce_scatter,
        is_view,
        is_wait,
        module_path,
        node_args,
    )
    from .passes.plan_index import BucketIndex

    index = BucketIndex(plan)
    events: list[dict] = []

    def bucket(node: Any) -> int | None:
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
        "mode": (
            "eager after a compile failure"
            if state.fallback
            else ("compiled" if config.compile else "eager fully_shard")
        ),
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
    if not report["reshard"] and config.compile and not state.fallback:
        stored = load_record(state.uuid(), "joint")
        if stored is not None:
            report["reshard"] = {k: v for k, v in stored.items() if k != "graph"} | {"from_cache": True}
    report["predicted"] = predicted(report)
    return report


# The few numbers of each pass a summary line shows (the report keeps them all).
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
        notes = [summarize_pass(name, stats) for name, stats in record.get("passes", {}).items()]
        if record.get("from_cache"):
            notes.append("[from FX graph cache]")
        lines.append(
            f"  {kind:<9} {_arrow(record, 'all_gather'):>12} {_arrow(record, 'reduce_scatter'):>16} "
            f"{_arrow(record, 'all_reduce'):>12} {_arrow(record, 'wait'):>10}  {'; '.join(notes)}"
        )
    for kind, phases in (report.get("predicted") or {}).items():
        b, a = phases["before"], phases["after"]
        lines.append(
            f"  predicted {kind} (cost model, {report['device_type']} rates): exposed communication "
            f"{b['exposed_comm_s'] * 1e3:.1f} -> {a['exposed_comm_s'] * 1e3:.1f} ms of {a['comm_s'] * 1e3:.1f} ms"
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


# ------------------------------------------------------------------ cost model, timeline
# Rough rates per device type for the *predicted* timeline: a model to compare schedules,
# not a measurement. FLOP/s, memory bytes/s, and link bytes/s per rank.
DEFAULT_RATES = {
    "cpu": {"flops": 5e10, "mem": 1e10, "link": 300e6 / 8},  # one core; the 300 Mbit benchmark link
    "cuda": {"flops": 4e14, "mem": 3e12, "link": 2.5e10},  # H100-class bf16, NVLink-ish
    "npu": {"flops": 3e14, "mem": 1.6e12, "link": 2.5e10},
}


def simulate(events: list[dict], *, world: int, flops: float, mem: float, link: float) -> dict:
    """Play a schedule on a two-lane machine: compute runs items in order; one link runs
    collectives in issue order, each taking the bytes a ring collective sends per rank
    ((world-1)/world of the full tensor) over ``link`` bytes/s; a wait blocks compute until
    its collective is done. Returns the lanes and the predicted exposed communication
    (time compute spent blocked in waits)."""
    t_compute = t_link = 0.0
    done: dict[str, float] = {}
    compute, comm, blocked = [], [], []
    exposed = 0.0
    share = (world - 1) / world if world > 1 else 0.0
    for ev in events:
        op = ev["op"]
        if op == "compute":
            dur = max(ev.get("flops", 0) / flops, ev.get("bytes", 0) / mem)
            compute.append((t_compute, t_compute + dur, ev.get("module")))
            t_compute += dur
        elif op == "wait":
            end = done.get(ev.get("of") or "", t_compute)
            if end > t_compute:
                blocked.append((t_compute, end, ev.get("bucket")))
                exposed += end - t_compute
                t_compute = end
        else:
            start = max(t_compute, t_link)
            dur = ev.get("bytes", 0) * share / link
            comm.append((start, start + dur, op, ev.get("bucket")))
            t_link = start + dur
            done[ev["name"]] = t_link
    total = max([t_compute] + [end for end in done.values()])
    busy = sum(b - a for a, b, *_ in comm)
    return {
        "total_s": total,
        "exposed_comm_s": exposed,
        "comm_s": busy,
        "compute_s": sum(b - a for a, b, _ in compute),
        "compute": compute,
        "comm": comm,
        "blocked": blocked,
    }


def predicted(report: dict, rates: dict | None = None) -> dict:
    """Predicted total and exposed-communication seconds per graph, before/after passes."""
    rates = rates or DEFAULT_RATES.get(report.get("device_type") or "cpu", DEFAULT_RATES["cpu"])
    out = {}
    for kind in _KINDS:
        record = report.get(kind)
        if not record or "schedule" not in record:
            continue
        out[kind] = {}
        for phase in ("before", "after"):
            sim = simulate(record["schedule"][phase], world=report["world_size"], **rates)
            out[kind][phase] = {k: round(sim[k], 6) for k in ("total_s", "exposed_comm_s", "comm_s", "compute_s")}
    return out


def draw_timeline(report: dict, path: str, rates: dict | None = None) -> str:
    """Draw compute and communication lanes of each graph before and after the passes
    (the cost model of ``simulate``) as a PNG. Needs matplotlib (the ``viz`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("the timeline needs matplotlib: pip install 'fsdp-overlap-plugin[viz]'") from None
    rates = rates or DEFAULT_RATES.get(report.get("device_type") or "cpu", DEFAULT_RATES["cpu"])
    rows = [
        (kind, phase) for kind in _KINDS if (report.get(kind) or {}).get("schedule") for phase in ("before", "after")
    ]
    if not rows:
        raise ValueError("the report has no recorded schedules (run a training step first)")
    sims = {row: simulate(report[row[0]]["schedule"][row[1]], world=report["world_size"], **rates) for row in rows}
    horizon = max(s["total_s"] for s in sims.values()) or 1.0
    colors = {
        "all_gather": "#4c72b0",
        "reduce_scatter": "#dd8452",
        "all_to_all": "#dd8452",
        "all_reduce": "#8172b3",
        "collective": "#937860",
    }
    fig, axes = plt.subplots(len(rows), 1, figsize=(12, 1.35 * len(rows) + 0.8), sharex=True, squeeze=False)
    for ax, row in zip(axes[:, 0], rows):
        sim = sims[row]
        ax.broken_barh([(a, b - a) for a, b, _ in sim["compute"]], (10, 8), facecolors="#55a868")
        ax.broken_barh([(a, b - a) for a, b, *_ in sim["blocked"]], (10, 8), facecolors="#c44e52", hatch="//")
        for a, b, op, bucket in sim["comm"]:
            ax.broken_barh([(a, b - a)], (0, 8), facecolors=colors.get(op, "#937860"), edgecolor="white", linewidth=0.4)
            if bucket is not None and (b - a) > horizon / 60:
                ax.text((a + b) / 2, 4, str(bucket), ha="center", va="center", fontsize=6, color="white")
        ax.set_yticks([4, 14], ["comm", "compute"], fontsize=8)
        ax.set_xlim(0, horizon * 1.01)
        ax.set_title(
            f"{row[0]} graph, {row[1]} the passes: {sim['total_s'] * 1e3:.1f} ms predicted, "
            f"{sim['exposed_comm_s'] * 1e3:.1f} ms of communication exposed",
            fontsize=9,
            loc="left",
        )
    axes[-1, 0].set_xlabel(
        "seconds (cost model: green compute, red = compute waiting, blue all-gather, orange reduce-scatter; "
        "numbers = bucket)",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
