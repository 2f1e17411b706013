"""The schedule report: what the passes did to each compiled graph.

``schedule_report(model)`` returns a JSON-serialisable dict of every compiled graph and
the totals per kind; ``format_report`` turns it into the summary the examples print. A
graph loaded from the FX graph cache (its passes did not run in this process) shows the
record stored when it was compiled (``records.py``), marked as from the cache.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.nn as nn

__all__ = [
    "draw_timeline",
    "format_report",
    "graph_events",
    "predicted",
    "schedule_report",
    "simulate",
    "total_of",
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


def schedule_report(model: nn.Module) -> dict[str, Any]:
    """What the passes did, per compiled graph, and in total. Call it after the first step.

    ``report["graphs"]``: one record per compiled graph (training forward and backward
    graphs, and inference graphs compiled under ``no_grad``), each with its collective
    counts before and after the passes, what each pass returned, the schedule, ``label``
    ("forward 2 of 3") and ``from_cache`` when an FX graph cache hit loaded it.
    ``report["compile_cache"]``: per Dynamo graph (inductor backend), what AOT autograd's
    and inductor's FX graph caches did, from inductor's own counters.
    ``report["forward"]`` / ``report["backward"]``: the training graph of that kind when
    there is one, or the totals over all of them (``graphs: n``) when graph breaks made
    several; None before the first step.
    """
    from .compile import get_state

    state = get_state(model)
    if state is None:
        raise ValueError("schedule_report: this model was not prepared by fsdp_overlap_plugin.parallelize().")
    config = state.config
    graphs = _labelled(state.records)
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
        "reshard": reshard_total(state.reshard),
        "activation_checkpointing": checkpointing_total(state),
        "unbucketed_params": state.unbucketed_params,
        "adjustments": list(state.adjustments),
        "config": config.to_dict(),
        "graphs": graphs,
        "compile_cache": list(state.compile_cache),
    }
    for kind in _KINDS:
        training = [r for r in graphs if r["graph"] == kind and not r.get("inference")]
        report[kind] = training[0] if len(training) == 1 else (total_of(training) if training else None)
    report["predicted"] = predicted(report)
    return report


def reshard_total(graphs: list[dict]) -> dict:
    """The reshard-after-forward statistics of every joint graph, added up ({} if none)."""
    if not graphs:
        return {}
    kept = [g["kept_bucket"] for g in graphs if g.get("kept_bucket")]
    return {
        "all_gathers": sum(g.get("all_gathers", 0) for g in graphs),
        "resharded": sum(g.get("resharded", 0) for g in graphs),
        "kept_gathered": sum(g.get("kept_gathered", 0) for g in graphs),
        "kept_bucket": "; ".join(dict.fromkeys(kept)) or None,
        "tied": [t for g in graphs for t in g.get("tied") or []],
        "graphs": len(graphs),
        "from_cache": all(g.get("from_cache") for g in graphs),
    }


def checkpointing_total(state: Any) -> dict:
    """Activation checkpointing: the modules, the policy, and what the joint-graph pass
    tagged over all joint graphs ({} when nothing is checkpointed)."""
    if not state.checkpointed:
        return {}
    graphs = [g["checkpointing"] for g in state.reshard if g.get("checkpointing")]
    traced = list(dict.fromkeys(m for g in graphs for m in g["regions"]))
    return {
        "modules": list(state.checkpointed),
        "policy": state.config.activation_checkpointing_policy,
        "traced": traced,
        "recompute": sum(g["recompute"] for g in graphs),
        "saved_by_policy": sum(g["saved_by_policy"] for g in graphs),
    }


def _labelled(records: list[dict]) -> list[dict]:
    """Copies of the records with ``label``: "forward", or "forward 2 of 3" when several."""
    from .records import record_name

    totals: dict[str, int] = {}
    for record in records:
        totals[record_name(record)] = totals.get(record_name(record), 0) + 1
    seen: dict[str, int] = {}
    out = []
    for record in records:
        key = record_name(record)
        seen[key] = seen.get(key, 0) + 1
        label = key if totals[key] == 1 else f"{key} {seen[key]} of {totals[key]}"
        out.append(dict(record, label=label))
    return out


def _add(a: Any, b: Any) -> Any:
    if isinstance(a, bool) or isinstance(b, bool):
        return a or b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a + b
    if isinstance(a, list) and isinstance(b, list):
        return a + b
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _add(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in {**a, **b}}
    return a


def total_of(records: list[dict]) -> dict:
    """One record summing several graphs of one kind: collective counts and every numeric
    pass statistic added up, lists joined. It has no schedule (those are per graph)."""
    total: dict[str, Any] = {
        "graph": records[0]["graph"],
        "graphs": len(records),
        "label": f"{records[0]['graph']} total",
    }
    for key in ("before", "after", "passes"):
        value: Any = {}
        for record in records:
            value = _add(value, record.get(key, {}))
        total[key] = value
    total["left_unbucketed"] = [g for r in records for g in r.get("left_unbucketed") or []]
    total["from_cache"] = all(r.get("from_cache") for r in records)
    return total


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


def _arrow(record: dict | None, key: str) -> str:
    if not record:
        return "-"
    return f"{record['before'].get(key, 0)} -> {record['after'].get(key, 0)}"


def _cache_summary(cache: list[dict]) -> str:
    """One line for ``report["compile_cache"]``: "2 of 2 Dynamo graphs loaded from the
    cache (AOT autograd hit, FX graph hits 2)"."""
    hits = [c for c in cache if c["aot_autograd"] == "hit" or (c["fx_graph"]["hit"] and not c["fx_graph"]["miss"])]
    aot = sorted({c["aot_autograd"] or "off" for c in cache})
    fx = {k: sum(c["fx_graph"][k] for c in cache) for k in ("hit", "miss", "bypass")}
    return (
        f"{len(hits)} of {len(cache)} Dynamo graphs loaded from the cache (AOT autograd {'/'.join(aot)}; "
        f"FX graph hits {fx['hit']}, misses {fx['miss']}, bypasses {fx['bypass']})"
    )


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
    width = max([9] + [len(r.get("label", "")) for r in report.get("graphs") or []]) + 1
    lines.append(
        f"  {'graph':<{width}} {'all-gathers':>12} {'reduce-scatters':>16} {'all-reduces':>12} {'waits':>10}  passes"
    )

    def row(label: str, record: dict) -> str:
        notes = [
            summarize_pass(name, stats)
            for name, stats in record.get("passes", {}).items()
            if not (name == "tied" and not stats.get("merged") and not stats.get("left"))  # no tied parameter
        ]
        if record.get("from_cache"):
            notes.append("[from FX graph cache]")
        return (
            f"  {label:<{width}} {_arrow(record, 'all_gather'):>12} {_arrow(record, 'reduce_scatter'):>16} "
            f"{_arrow(record, 'all_reduce'):>12} {_arrow(record, 'wait'):>10}  {'; '.join(notes)}"
        )

    graphs = report.get("graphs") or []
    for kind in _KINDS:
        record = report.get(kind)
        if record is None:
            lines.append(
                f"  {kind:<{width}} "
                + ("(eager: no compiled graph)" if report["mode"] != "compiled" else "(not compiled yet)")
            )
            continue
        several = [g for g in graphs if g["graph"] == kind and not g.get("inference")]
        if len(several) > 1:
            lines.extend(row(g["label"], g) for g in several)
            lines.append(row(f"{kind} total", record))
        else:
            lines.append(row(kind, record))
    lines.extend(row(g["label"], g) for g in graphs if g.get("inference"))
    for kind, phases in (report.get("predicted") or {}).items():
        b, a = phases["before"], phases["after"]
        lines.append(
            f"  predicted {kind} (cost model, {report['device_type']} rates): exposed communication "
            f"{b['exposed_comm_s'] * 1e3:.1f} -> {a['exposed_comm_s'] * 1e3:.1f} ms of {a['comm_s'] * 1e3:.1f} ms"
        )
    cache = report.get("compile_cache") or []
    if cache:
        lines.append("  compile cache: " + _cache_summary(cache))
    reshard = report.get("reshard") or {}
    if reshard:
        lines.append(
            f"  reshard after forward: {reshard.get('resharded', 0)} all-gathers re-gathered in backward, "
            f"{reshard.get('kept_gathered', 0)} kept"
            + (f" ({reshard['kept_bucket']})" if reshard.get("kept_bucket") else "")
        )
        for t in reshard.get("tied") or []:
            lines.append(
                f"  tied parameter {t['param']}: {t['reads']} reads, gathered once in the forward, "
                + (
                    "kept gathered for the backward (a read is in the kept bucket)"
                    if t["kept"]
                    else "re-gathered once in the backward"
                )
            )
    ac = report.get("activation_checkpointing") or {}
    if ac:
        modules = ac["modules"]
        names = ", ".join(modules) if len(modules) <= 3 else f"{modules[0]}, ..., {modules[-1]}"
        line = f"  activation checkpointing ({ac['policy']}): {len(modules)} modules ({names})"
        if ac["traced"] or ac["recompute"]:
            line += f"; {ac['recompute']} forward ops recomputed in backward, {ac['saved_by_policy']} saved"
        lines.append(line)
    if report.get("unbucketed_params"):
        lines.append(f"  parameters in no bucket (gathered one by one): {', '.join(report['unbucketed_params'])}")
    for note in report.get("adjustments") or []:
        lines.append(f"  adjusted: {note}")
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
    """Predicted total and exposed-communication seconds per kind of graph, before/after
    the passes: the sum over that kind's training graphs (one, without graph breaks)."""
    rates = rates or DEFAULT_RATES.get(report.get("device_type") or "cpu", DEFAULT_RATES["cpu"])
    keys = ("total_s", "exposed_comm_s", "comm_s", "compute_s")
    out: dict = {}
    for kind in _KINDS:
        records = [
            r for r in report.get("graphs") or [] if r["graph"] == kind and not r.get("inference") and "schedule" in r
        ]
        if not records and (report.get(kind) or {}).get("schedule"):
            records = [report[kind]]  # a report written before per-graph records
        if not records:
            continue
        out[kind] = {}
        for phase in ("before", "after"):
            sims = [simulate(r["schedule"][phase], world=report["world_size"], **rates) for r in records]
            out[kind][phase] = {k: round(sum(sim[k] for sim in sims), 6) for k in keys}
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
