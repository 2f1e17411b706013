"""``explain`` and ``timeline``: what the passes did to each graph, read from a
``schedule_report`` JSON, as text (per bucket: launches, waits and the compute between
them) or as a picture of the cost model's lanes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..report.costmodel import draw_timeline, predicted, report_rates
from ..report.schedule_text import _ms, hidden_comm, overlap_lines, report_predicted
from .errors import CliError
from .options import GRAPHS, rate_arg
from .text import format_bytes, format_flops, table

__all__ = ["cmd_explain", "cmd_timeline", "explain_report", "rate_arg", "summarize_schedule", "GRAPHS"]

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
#: How a reduce-scatter the passes sent as an all-to-all plus a local sum is named.
SENT_AS_ALL_TO_ALL = "reduce-scatter, sent as all-to-all"
#: The node-order words: a collective with no compute between its launch and its wait
#: cannot hide behind any. Not "exposed": exposed and hidden are the cost model's predicted
#: time (``report.schedule_text.hidden_comm``), which the "predicted" lines print.
CANNOT_HIDE = "cannot hide"


def _bucket_label(plan: list[list[str]] | None, bucket: int | None, module: str | None) -> str:
    if bucket is None:
        return f"unbucketed ({module})" if module else "unbucketed"
    if plan and 0 <= bucket < len(plan):
        return f"bucket {bucket} [{', '.join(plan[bucket])}]"
    return f"bucket {bucket}"


def carried_reduce_scatters(record: dict[str, Any], items: list[dict[str, Any]], report: dict[str, Any]) -> set[str]:
    """Names of the all-to-all launches in ``items`` (a graph's schedule after the passes)
    that carry a gradient reduce-scatter: ``reduce_scatter_impl`` all_to_all /
    receive_first rewrites each one into an all-to-all plus a local sum, and the record
    counts them (``after["reduce_scatter_as_all_to_all"]``). When the graph holds other
    all-to-alls too, the ones on the exchange groups the report names (receive_first),
    else the bucketed ones, if that gives the count; otherwise none (shown as all-to-all)."""
    count = int((record.get("after") or {}).get("reduce_scatter_as_all_to_all") or 0)
    a2a = [i for i in items if i.get("op") == "all_to_all"]
    if not count or not a2a:
        return set()
    groups = set((report.get("reduce_scatter") or {}).get("groups") or [])
    for chosen in (
        a2a,
        [i for i in a2a if groups and i.get("group") in groups],
        [i for i in a2a if i.get("bucket") is not None],
    ):
        if len(chosen) == count:
            return {str(i.get("name")) for i in chosen}
    return set()


def summarize_schedule(
    items: list[dict[str, Any]], as_reduce_scatter: set[str] | frozenset[str] = frozenset()
) -> list[dict[str, Any]]:
    """Per (bucket, collective kind): launch and wait positions in graph order, and the
    compute that lies between each launch and its wait (what can hide it).

    A wait is matched to its launch by ``of`` (the launch's ``name``). Compute between
    launch and wait is summed over the union of a group's launch-wait intervals, so a
    compute item is counted once per group even when several collectives span it.

    ``as_reduce_scatter``: names of all-to-all launches that carry a gradient
    reduce-scatter (``carried_reduce_scatters``); they are grouped as that bucket's
    ``reduce_scatter``, with ``sent_as_all_to_all`` counting them.
    """
    launches: dict[str, int] = {}
    waits: dict[str, int] = {}
    for i, item in enumerate(items):
        if item.get("op") in COLLECTIVES:
            launches[str(item.get("name") or f"#{i}")] = i
        elif item.get("op") == "wait" and item.get("of") is not None:
            waits.setdefault(item["of"], i)
    groups: dict[tuple, dict[str, Any]] = {}
    for name, li in launches.items():
        item = items[li]
        carried = item["op"] == "all_to_all" and name in as_reduce_scatter
        op = "reduce_scatter" if carried else item["op"]
        key = (item.get("bucket") if item.get("bucket") is not None else ("module", item.get("module")), op)
        g = groups.setdefault(
            key,
            {
                "bucket": item.get("bucket"),
                "module": item.get("module") if item.get("bucket") is None else None,
                "op": op,
                "launches": [],
                "waits": [],
                "bytes": 0,
                "unwaited": [],
                "sent_as_all_to_all": 0,
            },
        )
        g["sent_as_all_to_all"] += carried
        g["launches"].append(li)
        g["bytes"] += int(item.get("bytes") or 0)
        wi = waits.get(name)
        if wi is None:
            g["unwaited"].append(name)
        else:
            g["waits"].append(wi)
    out = []
    for g in groups.values():
        covered: set[int] = set()
        for li in g["launches"]:
            wi = waits.get(str(items[li].get("name") or f"#{li}"), li)
            covered.update(range(li + 1, wi))
        between = [items[i] for i in sorted(covered) if items[i].get("op") == "compute"]
        g["compute_between_flops"] = sum(int(c.get("flops") or 0) for c in between)
        g["compute_between_items"] = len(between)
        g["overlapped"] = bool(between)
        out.append(g)
    out.sort(key=lambda g: min(g["launches"]))
    return out


def _positions(idx: list[int]) -> str:
    if not idx:
        return "-"
    if len(idx) <= 4:
        return ",".join(f"#{i}" for i in idx)
    return f"#{idx[0]}..#{idx[-1]} ({len(idx)})"


def explain_report(report: dict[str, Any], graphs: tuple[str, ...] = GRAPHS) -> dict[str, Any]:
    """The per-bucket order of launches and waits of each graph, before and after the passes."""
    if not isinstance(report, dict) or not any(k in report for k in GRAPHS):
        raise CliError("not a schedule report: expected a JSON object with 'forward' / 'backward' graph records.")
    out: dict[str, Any] = {"plan": report.get("plan"), "graphs": {}, "predicted": report_predicted(report)[0]}
    for kind in graphs:
        record = report.get(kind)
        if record is None:
            out["graphs"][kind] = {"compiled": False, "has_schedule": False}
            continue
        schedule = record.get("schedule")
        entry: dict[str, Any] = {
            "compiled": True,
            "has_schedule": isinstance(schedule, dict),
            "counts": {"before": record.get("before"), "after": record.get("after")},
            "from_cache": bool(record.get("from_cache")),
        }
        if isinstance(schedule, dict):
            for phase in ("before", "after"):
                items = schedule.get(phase) or []
                if not isinstance(items, list) or not all(isinstance(i, dict) and "op" in i for i in items):
                    raise CliError(f"{kind}.schedule.{phase}: expected a list of items with an 'op' key.")
                carried = carried_reduce_scatters(record, items, report) if phase == "after" else set()
                entry[phase] = {
                    "items": items,
                    "buckets": summarize_schedule(items, carried),
                    "reduce_scatters_as_all_to_all": sorted(carried),
                }
        out["graphs"][kind] = entry
    return out


def _explain_lines(report: dict[str, Any], result: dict[str, Any], sequence: bool) -> list[str]:
    plan = result.get("plan")
    lines = []
    if "mode" in report:
        on = [n for n, v in (report.get("passes") or {}).items() if v]
        lines.append(
            f"report  {report.get('mode')}, world {report.get('world_size')}, backend {report.get('backend')}, "
            f"passes: {', '.join(on) or 'none'}"
        )
    if plan:
        lines.append(f"plan    {len(plan)} buckets: " + "  ".join(f"{i} [{', '.join(b)}]" for i, b in enumerate(plan)))
    for r in report.get("recompiles") or []:
        lines.append(f"compiled again (graph {r['graph']}): {r['reason']}; the graphs below are the latest compile's")
    sizes = report.get("dynamic_sizes") or []
    if sizes:
        lines.append(
            "sizes   symbolic: "
            + ", ".join(f"{s['input']} dim {s['dim']} = {s['size']}" for s in sizes)
            + "; bytes and FLOPs below are counted at the values traced ("
            + ", ".join(dict.fromkeys(f"{s['size']} = {s['traced_at']}" for s in sizes))
            + "); the collectives are the same at every value"
        )
    overlap = overlap_lines(report)
    if overlap:
        lines.append("step    " + overlap[0].strip())
        lines += ["       " + line.strip() for line in overlap[1:]]
    pred = result.get("predicted") or {}
    for kind, entry in result["graphs"].items():
        lines.append("")
        if not entry["compiled"]:
            lines.append(f"{kind}: no record (not compiled yet when the report was written)")
            continue
        if not entry["has_schedule"]:
            counts = entry["counts"]
            shown = ""
            if counts.get("before") and counts.get("after"):
                shown = "; counts only: " + ", ".join(
                    f"{k} {counts['before'].get(k, 0)} -> {counts['after'].get(k, 0)}"
                    for k in ("all_gather", "reduce_scatter", "all_reduce", "wait")
                )
            lines.append(
                f"{kind}: this record has no 'schedule' (the per-node order before and after the passes); it was "
                f"written by a version of fsdp-overlap without it{shown}"
            )
            continue
        cache = " (record from the FX graph cache)" if entry["from_cache"] else ""
        lines.append(f"{kind} graph{cache}")
        if kind in pred:
            b, a = pred[kind]["before"], pred[kind]["after"]
            lines.append(
                f"  communication hidden behind compute (predicted): {_ms(hidden_comm(a))} of {_ms(a['comm_s'])} ms, "
                f"{_ms(hidden_comm(b))} of {_ms(b['comm_s'])} before the passes; exposed (compute waiting for it) "
                f"{_ms(a['exposed_comm_s'])} ms, {_ms(b['exposed_comm_s'])} before"
            )
        for phase in ("before", "after"):
            groups = entry[phase]["buckets"]
            parts = []
            for op in COLLECTIVES:
                mine = [g for g in groups if g["op"] == op]
                if not mine:
                    continue
                launches = sum(len(g["launches"]) for g in mine)
                # node order only: bytes no compute lies between launch and wait for (they cannot hide);
                # how much is hidden or exposed is time, the cost model's (the "predicted" line)
                bare = sum(g["bytes"] for g in mine if not g["overlapped"])
                carried = sum(g.get("sent_as_all_to_all", 0) for g in mine)
                sent = f" ({'all' if carried == launches else carried} sent as all-to-all)" if carried else ""
                parts.append(
                    f"{op} {launches} launches{sent} in {len(mine)} buckets, {sum(g['overlapped'] for g in mine)} with "
                    f"compute between launch and wait, {format_bytes(bare)} of "
                    f"{format_bytes(sum(g['bytes'] for g in mine))} without ({CANNOT_HIDE})"
                )
            lines.append(
                f"  {phase + ' the passes:':<19}{len(entry[phase]['items'])} items; {'; '.join(parts) or 'no collectives'}"
            )
        carried = entry["after"]["reduce_scatters_as_all_to_all"]
        if carried:
            rs = report.get("reduce_scatter") or {}
            impl = f" (reduce_scatter_impl: {rs['requested']} -> {rs['impl']})" if rs.get("impl") else ""
            lines.append(
                f"  after the passes, {len(carried)} gradient reduce-scatter{'s' if len(carried) != 1 else ''} ran as "
                f"all-to-all plus a local sum{impl}: each rank receives every rank's copy of its own chunk and adds "
                "them up; listed below as reduce_scatter, sent as all-to-all"
            )
        lines.append("  per bucket (#n = position in graph order; compute between launch and wait can hide it):")
        keyed: dict[tuple, dict[str, Any]] = {}
        for phase in ("before", "after"):
            for g in entry[phase]["buckets"]:
                key = (g["bucket"] if g["bucket"] is not None else ("m", g["module"]), g["op"])
                keyed.setdefault(key, {})[phase] = g
        for (_, op), phases in keyed.items():
            any_g = phases.get("after") or phases.get("before")
            lines.append(f"    {_bucket_label(plan, any_g['bucket'], any_g['module'])}  {op}")
            for phase in ("before", "after"):
                g = phases.get(phase)
                if g is None:
                    lines.append(f"      {phase + ':':<8}none")
                    continue
                n = g["compute_between_items"]
                between = (
                    f"{format_flops(g['compute_between_flops'])} of compute in between ({n} item{'s' if n != 1 else ''})"
                    if g["overlapped"]
                    else f"nothing in between: {CANNOT_HIDE}"
                )
                unwaited = f"; never waited in this graph: {len(g['unwaited'])}" if g["unwaited"] else ""
                sent = ""
                if g.get("sent_as_all_to_all"):
                    some = "" if g["sent_as_all_to_all"] == len(g["launches"]) else f"{g['sent_as_all_to_all']} "
                    sent = f" ({some}{SENT_AS_ALL_TO_ALL})"
                lines.append(
                    f"      {phase + ':':<8}{len(g['launches'])} launch{'es' if len(g['launches']) != 1 else ''} "
                    f"{_positions(g['launches'])}{sent}, wait{'s' if len(g['waits']) != 1 else ''} "
                    f"{_positions(sorted(g['waits']))}, "
                    f"{format_bytes(g['bytes'])}; {between}{unwaited}"
                )
        if sequence:
            for phase in ("before", "after"):
                lines.append(f"  {kind} {phase} the passes, in graph order:")
                grid = [["#", "op", "name", "bucket", "module", "bytes", "flops", "waits on"]]
                carried = set(entry[phase]["reduce_scatters_as_all_to_all"])
                for i, item in enumerate(entry[phase]["items"]):
                    grid.append(
                        [
                            str(i),
                            "all_to_all (reduce-scatter)" if item.get("name") in carried else item["op"],
                            str(item.get("name") or ""),
                            "" if item.get("bucket") is None else str(item["bucket"]),
                            str(item.get("module") or ""),
                            format_bytes(item.get("bytes") or 0) if item.get("bytes") else "",
                            format_flops(item.get("flops") or 0) if item.get("flops") else "",
                            str(item.get("of") or ""),
                        ]
                    )
                lines += table(grid, right={0, 3, 5, 6}, indent="    ")
    return lines


def _is_report(data: Any) -> bool:
    return isinstance(data, dict) and any(k in data for k in GRAPHS)


def _load_report(text: str) -> tuple[Path, dict]:
    """The schedule report in the JSON file ``text``: the report itself (``json.dump(
    schedule_report(model), f)``, the demo's --report-json), or one under a ``"report"`` key
    (the examples' --metrics files: ``{"losses": [...], "report": {...}}``)."""
    path = Path(text)
    if not path.is_file():
        raise CliError(f"report {str(path)!r} does not exist.")
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise CliError(f"{path}: not valid JSON ({exc}).") from None
    if _is_report(data):
        return path, data
    if isinstance(data, dict) and _is_report(data.get("report")):
        return path, data["report"]
    keys = ", ".join(repr(k) for k in list(data)[:8]) if isinstance(data, dict) else None
    raise CliError(
        f"{path}: not a schedule report: expected a JSON object with 'forward' / 'backward' graph records "
        "(json.dump(schedule_report(model), f), or the demo's --report-json), or one whose 'report' key holds one "
        "(the examples' --metrics files); "
        + (f"this one has the keys {keys}" if keys else f"this one is a {type(data).__name__}, not an object")
        + ("" if not isinstance(data, dict) or "report" not in data else ", and its 'report' is not a schedule report")
        + "."
    )


def cmd_explain(args: argparse.Namespace) -> tuple[int, dict[str, Any], list[str]]:
    path, report = _load_report(args.report)
    graphs = tuple(args.graph) if args.graph else GRAPHS
    result = explain_report(report, graphs)
    out = {"command": "explain", "report": str(path), **result}
    lines = _explain_lines(report, result, args.sequence)
    code = 0
    if not any(g.get("has_schedule") for g in result["graphs"].values()):
        lines.append("")
        lines.append(
            "nothing to explain: no graph record carries a 'schedule'. Write the report with "
            "json.dump(schedule_report(model), f) from a version of fsdp-overlap that records it."
        )
        code = 1
    if args.png:
        try:
            draw_timeline(report, args.png)
        except ImportError as exc:
            lines.append(
                f"--png: cannot draw {args.png}: {exc}. Install matplotlib: pip install 'fsdp-overlap-plugin[viz]'."
            )
            out["png"] = None
            code = 1
        else:
            lines.append(f"timeline written to {args.png}")
            out["png"] = str(args.png)
    return code, out, lines


def cmd_timeline(args: argparse.Namespace) -> tuple[int, dict[str, Any], list[str]]:
    path, report = _load_report(args.report)
    rates = report_rates(report)
    for key in ("flops", "mem", "link"):
        if getattr(args, key) is not None:
            rates[key] = getattr(args, key)
    try:
        draw_timeline(report, args.out, rates)
    except ValueError as exc:
        raise CliError(f"{path}: {exc}") from None
    except ImportError as exc:
        return 1, {"command": "timeline", "png": None, "error": str(exc)}, [f"cannot draw {args.out}: {exc}"]
    numbers = predicted(report, rates)
    lines = [
        f"rates: {rates['flops']:.3g} FLOP/s compute, {rates['mem']:.3g} B/s memory, "
        f"{rates['link'] * 8 / 1e6:.0f} Mbit/s link (a model for comparing schedules, not a measurement)"
    ]
    for kind, phases in numbers.items():
        b, a = phases["before"], phases["after"]
        lines.append(
            f"{kind}: predicted {b['total_s'] * 1e3:.1f} -> {a['total_s'] * 1e3:.1f} ms; exposed communication "
            f"{b['exposed_comm_s'] * 1e3:.1f} -> {a['exposed_comm_s'] * 1e3:.1f} ms"
        )
    lines.append(f"timeline written to {args.out}")
    return 0, {"command": "timeline", "png": str(args.out), "rates": rates, "predicted": numbers}, lines
