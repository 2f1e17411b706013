"""The schedule report in words: ``format_report`` (a few lines in plain words from
``headline``, then the details, one counter per pass) and the lines ``fsdp-overlap explain``
shares with it (``overlap_lines``, ``hidden_comm``, ``report_predicted``).

Reads only the dict ``schedule_report`` (``report/schedule.py``) returns, or one loaded from
JSON; the words are explained in docs/report.md.
"""

from __future__ import annotations

from typing import Any

from ..config.inductor_overlap import summary_line as torch_passes_line
from ..config.parse import format_bytes
from ..config.schema import prefetch_words
from ..runtime.records import KINDS, cache_hits, summarize_pass
from .costmodel import predicted, resolve_rates

__all__ = ["format_report", "headline", "hidden_comm", "overlap_lines", "report_predicted"]

# The graph column is at least this wide: "inference" fits without widening the table.
_GRAPH_COLUMN = len("inference")
# Checkpointed modules named in full in the summary line; more show as "first, ..., last".
_NAMED_MODULES = 3


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


def tensor_parallel_words(report: dict[str, Any], size: int) -> str:
    """The tensor-parallel plan's collectives in one line: how many per step and per
    bucket of the plan, on their own group, left where the plan put them."""
    parts = []
    for kind in KINDS:
        record = report.get(kind) or {}
        counts = (record.get("tensor_parallel") or {}).get("after") or {}
        found = [f"{counts[k]} {word}" for k, word in _TP_KINDS if counts.get(k)]
        fused = (record.get("tensor_parallel") or {}).get("fused") or {}
        found += [f"{fused[k]} {word} (async TP)" for k, word in _FUSED_KINDS if fused.get(k)]
        if found:
            parts.append(f"{kind} {', '.join(found)}")
    per_bucket = sorted(
        {
            n
            for kind in KINDS
            for n in _tensor_per_bucket((report.get(kind) or {}).get("schedule", {}).get("after") or []).values()
        }
    )
    where = f" ({'/'.join(map(str, per_bucket))} per bucket that has any)" if per_bucket else ""
    return (
        f"  tensor parallel: groups of {size} ranks; the plan's collectives: "
        + ("; ".join(parts) if parts else "none in the graphs")
        + f"{where}, on the tensor-parallel group, not bucketed and not moved by the passes"
    )


_TP_KINDS = (
    ("all_reduce", "all-reduces"),
    ("all_gather", "all-gathers"),
    ("reduce_scatter", "reduce-scatters"),
    ("all_to_all", "all-to-alls"),
    ("other", "other collectives"),
)


# async_tp: the pairs torch's micro-pipeline pass fused (compile/async_tp.py)
_FUSED_KINDS = (
    ("all_gather_matmul", "all-gathers fused with their matmul"),
    ("matmul_reduce_scatter", "reduce-scatters fused with their matmul"),
)


def _tensor_per_bucket(events: list[dict]) -> dict:
    counts: dict = {}
    for ev in events:
        if ev.get("lane") == "tensor":
            counts[ev.get("bucket")] = counts.get(ev.get("bucket"), 0) + 1
    return counts


def headline(report: dict[str, Any]) -> list[str]:
    """The first lines a practitioner reads, in plain words: how the model runs, its
    buckets, the collectives per step before -> after the passes, how much communication
    the cost model predicts hidden (with the rates it assumed, and why little can be hidden
    when compute is short), and the memory prefetching keeps gathered."""
    mode = report["mode"]
    mesh = report.get("mesh") or []
    tp = (report.get("tensor_parallel") or {}).get("size", 1)
    ranks = f"{report['world_size']} ranks" + (f" ({mesh[0]} replicas of {mesh[1]} shards)" if len(mesh) == 2 else "")
    if tp > 1:
        dp = f"{mesh[0]} replicas of {mesh[1]} shards" if len(mesh) == 2 else f"{mesh[-1]} data-parallel"
        ranks = f"{report['world_size']} ranks ({dp} x {tp} tensor-parallel)"
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
    if tp > 1:
        lines.append(tensor_parallel_words(report, tp))
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
