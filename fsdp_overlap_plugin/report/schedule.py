"""The schedule report: what the passes did to each compiled graph.

``schedule_report(model)`` returns a JSON-serialisable dict of every compiled graph and
the totals per kind; ``format_report`` turns it into the summary the examples print. A
graph loaded from the FX graph cache (its passes did not run in this process) shows the
record stored when it was compiled (``runtime/records.py``), marked as from the cache.

Only reads: the records the compile wiring left on the model's ``OverlapState``
(``runtime/state.py``), the schedules in them (made by ``passes/events.py``) and the cost model
(``report/costmodel.py``, for ``report["predicted"]``). It imports no compile code.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..config.inductor_overlap import describe as describe_torch_passes
from ..config.inductor_overlap import summary_line as torch_passes_line
from ..config.parse import format_bytes
from ..config.schema import prefetch_words
from ..runtime.exchange import exchanges_run
from ..runtime.records import KINDS, SUMMARY_STATS, cache_hits, current, record_name, summarize_pass
from ..runtime.state import get_state
from .costmodel import predicted, resolve_rates

__all__ = [
    "SUMMARY_STATS",
    "checkpointing_total",
    "format_report",
    "headline",
    "hidden_comm",
    "overlap_lines",
    "report_predicted",
    "reshard_total",
    "schedule_report",
    "summarize_pass",
    "total_of",
]

# The graph column is at least this wide: "inference" fits without widening the table.
_GRAPH_COLUMN = len("inference")
# Checkpointed modules named in full in the summary line; more show as "first, ..., last".
_NAMED_MODULES = 3


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
    state = get_state(model)
    if state is None:
        raise ValueError("schedule_report: this model was not prepared by fsdp_overlap_plugin.parallelize().")
    config, switches = state.config, state.passes
    graphs = _labelled(state.records, switches.fullgraph)
    running = current(graphs, switches.fullgraph)
    joints = current(state.reshard, switches.fullgraph)
    backend = switches.backend if not state.fallback else None
    report: dict[str, Any] = {
        "mode": (
            "eager after a compile failure"
            if state.fallback
            else ("compiled" if switches.backend is not None else "eager fully_shard")
        ),
        "fallback_reason": state.fallback,
        # the plugin's compiled forward has run: no graph recorded after that means the passes
        # had nothing to do (passes off), never a step that bypassed the plugin
        "called": state.called,
        "world_size": state.world_size,
        "mesh": list(state.mesh_shape),
        "device_type": state.device_type,
        "backend": backend,
        "passes": {
            "manual_bucketing": switches.manual_bucketing,
            "overlap_grad_reduce": switches.overlap_grad_reduce,
        },
        "reduce_scatter": {
            "requested": config.reduce_scatter_impl,
            "impl": state.reduce_scatter_impl,
            "reason": state.reduce_scatter_reason,
            # receive_first: the group the all-to-alls run on, and how many ran there since
            # this model was parallelized (a run whose all-to-alls never reached it shows 0)
            "groups": sorted(state.exchange_groups.values()),
            "exchanges": exchanges_run(*state.exchange_groups.values()) - state.exchanges_before,
        },
        # which of inductor's own distributed passes ran on our graphs (inductor_overlap)
        "torch_passes": describe_torch_passes(switches.inductor_overlap, backend),
        "prefetch": prefetch_total(running, config),
        "plan": state.plan,
        "reshard": reshard_total(joints),
        "activation_checkpointing": checkpointing_total(state),
        "unbucketed_params": state.unbucketed_params,
        "adjustments": list(state.adjustments),
        "config": config.to_dict(),
        "graphs": graphs,
        "compile_cache": list(state.compile_cache),
        "recompiles": list(state.recompiles),
        "dynamic_sizes": (running[-1].get("dynamic_sizes") or []) if running else [],
    }
    for kind in KINDS:
        training = [r for r in running if r["graph"] == kind and not r.get("inference")]
        report[kind] = training[0] if len(training) == 1 else (total_of(training) if training else None)
    report["params"] = _param_totals(model, config)
    cost = resolve_rates(state.device_type, config.hardware, config.compute_profile)
    report["cost_model"] = {"device_type": state.device_type, **cost}
    report["predicted"] = predicted(report)
    return report


def _param_totals(model: nn.Module, config: Any) -> dict:
    """The model's parameters, each counted once (a tied weight is one parameter), and their
    bytes gathered in full in ``param_dtype``: what "gathered ahead" is measured against.
    A gathered tensor is as large as its padded shards (FSDP2 pads dim 0 to a multiple of
    the shard count: a vocabulary of 97 gathers 98 rows on 2 ranks), so that is counted."""
    params = list(model.parameters())  # unique: a tied weight appears once
    dtype = config.torch_param_dtype
    gathered = 0
    for p in params:
        shards = 1
        for mesh_dim, placement in enumerate(getattr(p, "placements", ())):
            if placement.is_shard():
                shards *= p.device_mesh.size(mesh_dim)
        rows = -(-p.shape[0] // shards) * shards if p.dim() else 1
        gathered += rows * (p.numel() // max(p.shape[0], 1) if p.dim() else 1) * (dtype or p.dtype).itemsize
    return {"count": sum(p.numel() for p in params), "gathered_bytes": gathered}


def prefetch_total(records: list[dict], config: Any) -> dict:
    """How far ahead each training graph's all-gathers launched (``manual_bucketing``'s
    ``prefetch_depths``, one per bucket in consumption order) and the gathered bytes that
    prefetching kept alive at most, per graph kind."""
    out: dict[str, Any] = {
        "depth": config.prefetch_depth,
        "max_bytes": config.max_prefetch_bytes,
        "order": config.memory_order,
    }
    for record in records:
        stats = (record.get("passes") or {}).get("manual_bucketing") or {}
        if record.get("inference") or "prefetch_depths" not in stats:
            continue
        # graph breaks: several graphs of one kind, each prefetching within itself
        kind = out.setdefault(record["graph"], {"depths": [], "peak_bytes": 0})
        kind["depths"] = kind["depths"] + stats["prefetch_depths"]
        kind["peak_bytes"] = max(kind["peak_bytes"], stats.get("prefetch_peak_bytes", 0))
    return out


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
        "kept_buckets": list(dict.fromkeys(str(b) for g in graphs for b in g.get("kept_buckets") or [])),
        "kept_bytes": sum(g.get("kept_bytes", 0) for g in graphs),
        "kept_to_cover": any(g.get("kept_to_cover") for g in graphs),
        "tied": [t for g in graphs for t in g.get("tied") or []],
        "graphs": len(graphs),
        "from_cache": all(g.get("from_cache") for g in graphs),
    }


def checkpointing_total(state: Any) -> dict:
    """Activation checkpointing: the modules, the policy, and what the joint-graph pass
    tagged over the joint graphs that run now ({} when nothing is checkpointed)."""
    if not state.checkpointed:
        return {}
    graphs = [g["checkpointing"] for g in current(state.reshard, state.passes.fullgraph) if g.get("checkpointing")]
    traced = list(dict.fromkeys(m for g in graphs for m in g["regions"]))
    return {
        "modules": list(state.checkpointed),
        "policy": state.config.activation_checkpointing_policy,
        "traced": traced,
        "recompute": sum(g["recompute"] for g in graphs),
        "saved_by_policy": sum(g["saved_by_policy"] for g in graphs),
    }


def _labelled(records: list[dict], fullgraph: bool = True) -> list[dict]:
    """Copies of the records with ``label``: "forward"; "forward 2 of 3" for the pieces
    of a forward split by graph breaks; "forward (compile 2 of 2)" for a forward compiled
    again (``fullgraph``: each compile is a whole forward, the latest runs)."""
    totals: dict[str, int] = {}
    for record in records:
        totals[record_name(record)] = totals.get(record_name(record), 0) + 1
    seen: dict[str, int] = {}
    out = []
    for record in records:
        key = record_name(record)
        seen[key] = seen.get(key, 0) + 1
        if totals[key] == 1:
            label = key
        elif fullgraph:
            label = f"{key} (compile {seen[key]} of {totals[key]})"
        else:
            label = f"{key} {seen[key]} of {totals[key]}"
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


def _arrow(record: dict | None, key: str) -> str:
    if not record:
        return "-"
    return f"{record['before'].get(key, 0)} -> {record['after'].get(key, 0)}"


def _cache_summary(cache: list[dict]) -> str:
    """One line for ``report["compile_cache"]``: "2 of 2 Dynamo graphs loaded from the
    cache (AOT autograd hit, FX graph hits 2)"."""
    aot = sorted({c["aot_autograd"] or "off" for c in cache})
    fx = {k: sum(c["fx_graph"][k] for c in cache) for k in ("hit", "miss", "bypass")}
    return (
        f"{cache_hits(cache)} of {len(cache)} Dynamo graphs loaded from the cache (AOT autograd {'/'.join(aot)}; "
        f"FX graph hits {fx['hit']}, misses {fx['miss']}, bypasses {fx['bypass']})"
    )


def _recompile_lines(report: dict[str, Any]) -> list[str]:
    """Why the forward was compiled more than once, and which sizes its graph keeps
    symbolic (the sizes the byte, FLOP and time estimates are counted at)."""
    lines = []
    for r in report.get("recompiles") or []:
        lines.append(f"  compiled again (graph {r['graph']}): {r['reason']}")
    sizes = report.get("dynamic_sizes") or []
    if sizes:
        named = ", ".join(f"{s['input']} dim {s['dim']} = {s['size']}" for s in sizes)
        at = ", ".join(dict.fromkeys(f"{s['size']} = {s['traced_at']}" for s in sizes))
        lines.append(
            f"  dynamic sizes: {named}; one graph serves every value (same buckets and collectives); "
            f"bytes, FLOPs and predictions below are counted at the traced values ({at})"
        )
    return lines


def _plan_words(plan: list) -> str:
    """The buckets in a few words: "tok_emb + pos_emb; blocks.0 to blocks.3, one each;
    norm + head". Runs of one-module buckets numbered 0, 1, 2, ... under one parent
    collapse into one phrase, so a 64-layer plan still fits on a line."""
    words: list[str] = []
    i = 0
    while i < len(plan):
        bucket = [str(m) for m in plan[i]]
        j = i
        if len(bucket) == 1 and bucket[0].rpartition(".")[2].isdigit():
            parent, _, first = bucket[0].rpartition(".")
            while (
                j + 1 < len(plan)
                and len(plan[j + 1]) == 1
                and str(plan[j + 1][0]) == f"{parent}.{int(first) + j + 1 - i}"
            ):
                j += 1
        if j > i + 1:
            words.append(f"{bucket[0]} to {plan[j][0]}, one each")
            i = j + 1
        else:
            words.append(" + ".join(bucket) or "(empty)")
            i += 1
    return "; ".join(words)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _flops_words(flops: float) -> str:
    return f"{flops / 1e12:.3g} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.3g} GFLOP/s"


def _link_words(link: float) -> str:
    """A link rate as its makers quote it: GB/s for accelerator links, Gbit/s below 1 GB/s."""
    return f"{link / 1e9:.3g} GB/s" if link >= 1e9 else f"{link * 8 / 1e9:.3g} Gbit/s"


def _rates_words(report: dict, cost: dict) -> str:
    rates = cost["rates"]
    words = f"{_flops_words(rates['flops'])} compute, {_link_words(rates['link'])} link per rank"
    if len(report.get("mesh") or []) == 2:
        words += f", {_link_words(rates['inter_link'])} between replicas"
    return words


def _rates_origin(report: dict, cost: dict) -> str:
    """Where the rates come from, in a few words (docs/performance.md has each source)."""
    config = report.get("config") or {}
    device = report.get("device_type") or "cpu"  # resolve_rates' own default
    if not config.get("hardware") and not cost.get("measured"):
        return f"{device} default {cost['preset']}, not measured here; set hardware or compute_profile"
    parts = []
    if config.get("hardware"):
        parts.append(f"hardware {cost['preset']}" + (" with your numbers" if cost.get("own") else ""))
    else:
        parts.append(f"{device} default {cost['preset']}")
    if cost.get("measured"):
        parts.append("compute measured by compute_profile")
    return "; ".join(parts)


def _replica_all_reduces_behind(backward: dict) -> int | None:
    """How many replica all-reduces of the backward's schedule (after the passes) are
    waited only after the next one has launched; None without a recorded schedule."""
    counts = _replica_all_reduce_overlap(backward)
    return None if counts is None else counts[0]


def _replica_all_reduce_overlap(backward: dict) -> tuple[int, int] | None:
    """``(deferred, computing)`` over the backward's recorded schedule (after the passes):
    the replica all-reduces waited only after the next one has launched, and those with
    backward compute between their launch and their wait (what the slow link hides
    behind). None without a recorded schedule."""
    events = (backward.get("schedule") or {}).get("after")
    if not events:
        return None
    at = {e["name"]: i for i, e in enumerate(events) if e["op"] != "wait"}
    waits = {e["of"]: i for i, e in enumerate(events) if e["op"] == "wait"}
    launched = [e["name"] for e in events if e["op"] == "all_reduce"]
    deferred = sum(1 for ar, nxt in zip(launched, launched[1:]) if waits.get(ar, -1) > at[nxt])
    computing = sum(
        1 for ar in launched if any(e["op"] == "compute" for e in events[at[ar] + 1 : waits.get(ar, len(events))])
    )
    return deferred, computing


def _hsdp_words(mesh: list[int], backward: dict, passes: dict) -> str:
    """HSDP in one line: what each of the two groups carries, and what the replica
    all-reduces overlap with (counted on the schedule: waited after the next launch, and
    with backward compute in flight)."""
    buckets = backward["after"].get("all_reduce", 0)
    counts = _replica_all_reduce_overlap(backward)
    if counts is None:  # a report without schedules: what the bucketing moved
        behind = ((backward.get("passes") or {}).get("manual_bucketing") or {}).get("deferred_ar_waits", 0)
        computing = None
    else:
        behind, computing = counts
    words = (
        f"  groups: each rank shards with {mesh[1]} ranks (parameter gathers and gradient reduce-scatters) and "
        f"is one of {mesh[0]} replicas, which all-reduce only their gradient shards ({buckets} all-reduces, "
        "the traffic between nodes): "
    )
    if behind:
        rest = "" if behind >= buckets - 1 else "; the others are waited before the next one starts"
        compute = (
            ""
            if computing is None
            else f"; {computing} of the {buckets} have backward compute in flight (an all-reduce that starts after the "
            "backward's last compute has none)"
        )
        return words + (
            f"each bucket's all-reduce starts when its reduce-scatter is done and {behind} of {buckets} are waited "
            f"only after the next one starts{rest}{compute}"
        )
    if not passes.get("manual_bucketing"):
        return words + "each is waited at once (bucketing is off)"
    if buckets <= 1:
        return words + "each is waited at once (one bucket has no next bucket to run behind)"
    return words + "each is waited before the next one starts"


def headline(report: dict[str, Any]) -> list[str]:
    """The first lines a practitioner reads, in plain words: how the model runs, its
    buckets, the collectives per step before -> after the passes, how much communication
    the cost model predicts hidden (with the rates it assumed, and why little can be hidden
    when compute is short), and the memory prefetching keeps gathered."""
    mode = report["mode"]
    mesh = report.get("mesh") or []
    ranks = f"{report['world_size']} ranks" + (f" ({mesh[0]} replicas of {mesh[1]} shards)" if len(mesh) == 2 else "")
    on = [name for name, enabled in report["passes"].items() if enabled]
    passes = {2: "both passes on", 1: f"only {on[0] if on else ''} on", 0: "passes off"}[len(on)]
    if mode == "compiled" and on and not report.get("graphs"):
        # no graph of the plugin's compile has reached the passes: "on" would say more than happened
        which = "both" if len(on) == 2 else on[0]
        first = (
            f"fsdp-overlap summary: {ranks}, compiled with {report['backend']}; "
            f"the passes ({which} on) have not run on anything yet"
        )
    elif mode == "compiled":
        first = f"fsdp-overlap summary: {ranks}, compiled with {report['backend']}, {passes}"
    elif report.get("fallback_reason"):
        first = f"fsdp-overlap summary: {ranks}, running uncompiled after a compile failure (no overlap passes)"
    else:
        first = f"fsdp-overlap summary: {ranks}, uncompiled (compile: false), plain FSDP2; the passes need compile"
    lines = [first]
    plan = report.get("plan") or []
    lines.append(
        f"  buckets: {len(plan)} ({_plan_words(plan)}): each is gathered by one collective, the next "
        "while the current one computes"
        if report["passes"].get("manual_bucketing")
        else f"  buckets: {len(plan)} planned ({_plan_words(plan)}), not merged: bucketing is off or not compiled"
    )
    if mode != "compiled":
        return lines
    fwd, bwd = report.get("forward"), report.get("backward")
    if not fwd and not bwd:
        lines.append(_not_run_words(report, bool(on)))
        return lines
    parts = []
    if fwd:
        parts.append(f"forward {_arrow(fwd, 'all_gather')} parameter gathers")
    if bwd:
        scatter = f"{_arrow(bwd, 'reduce_scatter')} gradient reduce-scatters"
        if bwd["after"].get("reduce_scatter_as_all_to_all"):
            # on gloo the all-to-all replaces a clone plus a full all-reduce (report["reduce_scatter"])
            why = ": half the bytes of gloo's own" if report.get("device_type") == "cpu" else ""
            scatter += f" (sent as all-to-alls{why})"
        parts.append(f"backward {_arrow(bwd, 'all_gather')} parameter re-gathers, {scatter}")
    for kind, record in (("forward", fwd), ("backward", bwd)):
        if record and (record["before"].get("all_reduce") or record["after"].get("all_reduce")):
            parts.append(f"{kind} {_arrow(record, 'all_reduce')} all-reduces")
    lines.append("  collectives per step (before -> after the passes): " + "; ".join(parts))
    if len(mesh) == 2 and mesh[0] > 1 and bwd:
        lines.append(_hsdp_words(mesh, bwd, report["passes"]))
    lines += overlap_lines(report)
    prefetch = report.get("prefetch") or {}
    peaks = [prefetch[k]["peak_bytes"] for k in KINDS if k in prefetch]
    if peaks:
        total = (report.get("params") or {}).get("gathered_bytes")
        budget = prefetch["max_bytes"]
        lines.append(
            f"  memory: at most {format_bytes(max(peaks))} of parameters gathered ahead of use"
            + (f" ({format_bytes(total)} for the whole model)" if total else "")
            + f"; prefetch depth {prefetch['depth']}, "
            + ("no budget" if budget is None else f"budget {format_bytes(budget)}")
        )
    return lines


def hidden_comm(phase: dict[str, float]) -> float:
    """Predicted seconds of communication *hidden* behind compute in one simulated graph
    (``costmodel.simulate``'s ``comm_s`` minus ``exposed_comm_s``): the link busy while
    compute runs. *Exposed* is the rest, the seconds compute waits for a collective. Both
    are time, predicted by the cost model on the recorded order; docs/report.md defines them,
    and the summary, ``explain`` and ``timeline`` all use these words for these numbers only."""
    return phase["comm_s"] - phase["exposed_comm_s"]


def report_predicted(report: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``report["predicted"]`` and ``report["cost_model"]`` as ``schedule_report`` wrote them;
    for a report written without them, the same computed now from its schedules (the
    device type's rates, or its config's hardware and compute_profile settings)."""
    pred = report.get("predicted")
    if pred is None:
        try:
            pred = predicted(report)
        except (KeyError, TypeError, ValueError):  # a hand-written report without what the cost model reads
            pred = {}
    cost = report.get("cost_model")
    if not cost:
        config = report.get("config") or {}
        try:
            cost = resolve_rates(report.get("device_type"), config.get("hardware"), config.get("compute_profile"))
        except ValueError:  # a profile file not on this machine: the rates are not known here
            cost = {}
    return pred, cost


def overlap_lines(report: dict[str, Any]) -> list[str]:
    """The predicted communication hidden behind compute per step (``hidden_comm`` over the
    training graphs, after the passes, then before them and per graph), the rates assumed
    and, when compute is shorter than communication, why little hides: the lines the
    summary and ``fsdp-overlap explain`` both print, so they say the same numbers."""
    pred, cost = report_predicted(report)
    if not pred:
        return []
    after = {k: sum(p["after"][k] for p in pred.values()) for k in ("comm_s", "exposed_comm_s", "compute_s")}
    before = sum(hidden_comm(p["before"]) for p in pred.values())
    per_kind = ", ".join(f"{k} {_ms(hidden_comm(p['after']))} of {_ms(p['after']['comm_s'])}" for k, p in pred.items())
    lines = [
        f"  communication hidden behind compute (predicted): {_ms(hidden_comm(after))} of {_ms(after['comm_s'])} ms "
        f"per step, {_ms(before)} before the passes ({per_kind})"
    ]
    if cost.get("rates") and cost.get("preset"):
        lines.append(f"    rates assumed ({_rates_origin(report, cost)}): {_rates_words(report, cost)}")
    if after["exposed_comm_s"] > 0.1 * after["comm_s"] and after["compute_s"] < after["comm_s"]:
        lines.append(
            f"    why not more: communication hides only behind compute, and this step computes for "
            f"{_ms(after['compute_s'])} ms against {_ms(after['comm_s'])} ms of communication; a larger batch or "
            "model, or a faster link, leaves more of it hidden"
        )
    return lines


def _not_run_words(report: dict[str, Any], passes_on: bool) -> str:
    """Why a compiled model has no training graph to show."""
    if not report.get("called"):
        return (
            "  not compiled yet: the plugin's compiled forward has not been called. The numbers come after the "
            "first training step; if one has run, it ran without the plugin (a module called on its own, or a "
            "compile of the user's around it; see docs/troubleshooting.md)"
        )
    if not passes_on:
        return "  compiled and run; with the passes off no graph is recorded"
    if report.get("graphs"):
        return "  no training graph compiled yet (only inference): the numbers come after the first training step"
    return "  the compiled forward ran, but no graph of it has reached the passes"


def format_report(report: dict[str, Any]) -> str:
    """A human-readable summary of ``schedule_report``: a few lines in plain words
    (``headline``), then the details, one counter per pass (each explained in docs/report.md)."""
    return "\n".join([*headline(report), "details (every term is explained in docs/report.md):", _details(report)])


def _details(report: dict[str, Any]) -> str:
    lines = []
    mesh = "x".join(str(s) for s in report["mesh"])
    on = [name for name, enabled in report["passes"].items() if enabled]
    not_run = " (not run on any graph yet)" if on and report["mode"] == "compiled" and not report.get("graphs") else ""
    lines.append(
        f"fsdp-overlap schedule: {report['mode']}, world {report['world_size']} (mesh {mesh}), "
        f"backend {report['backend']}, passes: {', '.join(on) or 'none'}{not_run}"
    )
    if report.get("fallback_reason"):
        lines.append(f"  fell back to eager: {report['fallback_reason']}")
    lines.append(f"  plan: {len(report['plan'])} buckets: " + " ".join(str(b) for b in report["plan"]))
    width = max([_GRAPH_COLUMN] + [len(r.get("label", "")) for r in report.get("graphs") or []]) + 1
    lines.append(
        f"  {'graph':<{width}} {'all-gathers':>12} {'reduce-scatters':>16} {'all-reduces':>12} {'waits':>10}  passes"
    )

    def scatters(record: dict) -> str:
        # counted as reduce-scatters (compile.pass_table.run_passes); "a2a" says they ran as all-to-all
        if not record or not record["after"].get("reduce_scatter_as_all_to_all"):
            return _arrow(record, "reduce_scatter")
        return _arrow(record, "reduce_scatter") + " a2a"

    def row(label: str, record: dict) -> str:
        notes = [
            summarize_pass(name, stats)
            for name, stats in record.get("passes", {}).items()
            if not (name == "tied" and not stats.get("merged") and not stats.get("left"))  # no tied parameter
        ]
        if record.get("from_cache"):
            notes.append("[from FX graph cache]")
        return (
            f"  {label:<{width}} {_arrow(record, 'all_gather'):>12} {scatters(record):>16} "
            f"{_arrow(record, 'all_reduce'):>12} {_arrow(record, 'wait'):>10}  {'; '.join(notes)}"
        )

    graphs = report.get("graphs") or []
    for kind in KINDS:
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
            if record.get("graphs"):  # the pieces of one forward (graph breaks): their sum
                lines.append(row(f"{kind} total", record))
        else:
            lines.append(row(kind, record))
    lines.extend(row(g["label"], g) for g in graphs if g.get("inference"))
    lines.extend(_recompile_lines(report))
    for kind, phases in (report.get("predicted") or {}).items():
        b, a = phases["before"], phases["after"]
        lines.append(
            f"  predicted {kind} (cost model, {report['device_type']} rates): exposed communication "
            f"{b['exposed_comm_s'] * 1e3:.1f} -> {a['exposed_comm_s'] * 1e3:.1f} ms of {a['comm_s'] * 1e3:.1f} ms"
        )
    rs = report.get("reduce_scatter") or {}
    if rs and report["mode"] == "compiled":
        chosen = rs["impl"] if rs["requested"] == rs["impl"] else f"{rs['requested']} -> {rs['impl']}"
        lines.append(f"  gradient reduce-scatter: {chosen} ({rs['reason']})")
        for group in rs.get("groups") or []:
            lines.append(
                f"  all-to-alls on {group}, every receive posted before any send: "
                f"{rs['exchanges']} run since this model was parallelized"
            )
    torch_passes = report.get("torch_passes") or {}
    if torch_passes and report.get("backend") == "inductor":
        lines.append(torch_passes_line(torch_passes))
    prefetch = report.get("prefetch") or {}
    shown = [k for k in KINDS if k in prefetch]
    if shown:
        budget = prefetch["max_bytes"]
        parts = [
            f"{k} depths {' '.join(map(str, prefetch[k]['depths'])) or '-'}, "
            f"peak {format_bytes(prefetch[k]['peak_bytes'])} gathered ahead"
            for k in shown
        ]
        lines.append(
            f"  prefetch ({prefetch_words(prefetch['depth'], budget, prefetch['order'])}): " + "; ".join(parts)
        )
    cache = report.get("compile_cache") or []
    if cache:
        lines.append("  compile cache: " + _cache_summary(cache))
    reshard = report.get("reshard") or {}
    if reshard:
        # the forward's resharded gathers are freed after use; the backward re-gathers only
        # those it reads (the weights of its matmuls, not the embeddings' or most biases):
        # the backward graph's all-gathers before the passes merged them
        reads = ((report.get("backward") or {}).get("before") or {}).get("all_gather")
        lines.append(
            f"  reshard after forward: {reshard.get('resharded', 0)} of the forward's all-gathers freed after use"
            + (f" (the backward re-gathers the {reads} it reads)" if reads is not None else "")
            + f", {reshard.get('kept_gathered', 0)} kept"
            + (
                f" ({'; '.join(reshard['kept_buckets'])}, for prefetch_depth {report['config']['prefetch_depth']}"
                + (
                    ", and one more: the buckets after it gather less, too short a backward to hide its re-gather"
                    if reshard.get("kept_to_cover")
                    else ""
                )
                + ")"
                if len(reshard.get("kept_buckets") or []) > 1
                else (f" ({reshard['kept_bucket']})" if reshard.get("kept_bucket") else "")
            )
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
        names = ", ".join(modules) if len(modules) <= _NAMED_MODULES else f"{modules[0]}, ..., {modules[-1]}"
        line = f"  activation checkpointing ({ac['policy']}): {len(modules)} modules ({names})"
        if ac["traced"] or ac["recompute"]:
            line += f"; {ac['recompute']} forward ops recomputed in backward, {ac['saved_by_policy']} saved"
        lines.append(line)
    if report.get("unbucketed_params"):
        lines.append(f"  parameters in no bucket (gathered one by one): {', '.join(report['unbucketed_params'])}")
    for note in report.get("adjustments") or []:
        lines.append(f"  adjusted: {note}")
    return "\n".join(lines)
