"""The schedule report: what the passes did to each compiled graph.

``schedule_report(model)`` returns a JSON-serialisable dict of every compiled graph and
the totals per kind; ``format_report`` (``schedule_text.py``) turns it into the summary the examples print. A
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
from ..runtime.exchange import exchanges_run
from ..runtime.records import KINDS, SUMMARY_STATS, current, record_name, summarize_pass
from ..runtime.state import get_state
from .costmodel import predicted, resolve_rates

# the report in words lives in schedule_text.py; importable from here as before
from .schedule_text import format_report, headline, hidden_comm, overlap_lines, report_predicted

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
        # tensor parallelism: the group size (1: none) and the config's plan as applied
        "tensor_parallel": {"size": state.tensor_parallel, "plan": dict(state.tp_plan)},
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
