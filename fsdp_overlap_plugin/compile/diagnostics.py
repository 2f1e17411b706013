"""Diagnostics of compiling: the errors and warnings a compile problem raises, their
messages (a graph break, the recompile limit, collectives the bucketing missed), and what
the report is told about a graph (why Dynamo compiled it again, which sizes are symbolic).

The lowest of the compile modules: it imports none of them (the order is ``diagnostics``,
``rank_check``, ``cache_records``, ``pass_table``, ``backends``, ``compiler``, each
importing only modules before it).
"""

from __future__ import annotations

import warnings

import torch
import torch.fx as fx
import torch.nn as nn

from .. import _torch_compat as compat
from ..runtime.state import OverlapState

__all__ = [
    "CompileFallback",
    "GraphBreakError",
    "PeerCompileError",
    "RecompileLimitError",
    "UnbucketedError",
    "UnbucketedWarning",
    "check_unbucketed",
    "graph_break_message",
    "is_recompile_limit",
    "recompile_limit_message",
    "recompile_reason",
    "symbolic_sizes",
    "warn_graph_breaks",
]


class CompileFallback(RuntimeError):
    """Every rank agreed to run the model without compiling it (``on_compile_error: eager``)."""


class GraphBreakError(RuntimeError):
    """The forward has a graph break while ``fullgraph`` is true."""


class RecompileLimitError(RuntimeError):
    """Dynamo compiled the model's forward as often as ``torch._dynamo.config.recompile_limit``
    allows and was asked for yet another graph."""


class PeerCompileError(RuntimeError):
    """Compilation failed on another rank, so this one stops too (``on_compile_error: raise``)."""


class UnbucketedError(RuntimeError):
    """A compiled graph holds collectives of a plan entry that the bucketing missed
    (``on_unbucketed: error``); raised on every rank at the first step."""


class UnbucketedWarning(UserWarning):
    """Collectives that run unbucketed (outside the plan, or missed with ``on_unbucketed: warn``)."""


def check_unbucketed(state: OverlapState, records: list[dict], index: int) -> None:
    """Stop (``on_unbucketed: error``) or warn when a graph holds FSDP collectives that
    the bucketing left alone although they belong to a plan entry, or that could not be
    attributed to any parameter; warn for parameters no plan entry covers.

    Whether a collective belongs to an entry is decided here from the model itself (the
    parameter FQN the collective carries, looked up in ``state.param_entries``), not from
    the pass's own lookup, so a pass that misattributes is caught, not trusted. Graphs
    without parameter annotations (a torch that does not record them) fall back to the
    pass's module-path attribution.
    """
    by_entry: dict[tuple, dict] = {}  # (entry, graph, kind) -> one group: the pass may split them by module
    uncovered = []
    for record in records:
        for group in record.get("left_unbucketed") or []:
            param = group.get("param")
            entry = state.param_entries.get(param) if param is not None else group["entry"]
            if entry is not None or (param is None and group["owner"] is None):  # None: unattributable
                key = (entry, record["graph"], group["kind"])
                if key in by_entry:
                    by_entry[key]["count"] += group["count"]
                else:
                    modules = state.plan[entry] if entry is not None else None
                    by_entry[key] = dict(group, entry=entry, modules=modules, graph=record["graph"])
            else:
                uncovered.append(group)
    missed = sorted(
        by_entry.values(), key=lambda g: (g["entry"] is None, g["entry"] or 0, g["graph"] != "forward", g["kind"])
    )
    # each uncovered module is named once per model, in the first graph that holds it
    uncovered = [g for g in uncovered if g["owner"] not in state.warned]
    if uncovered:
        owners = sorted({g["owner"] or "<root>" for g in uncovered})
        state.warned.update(g["owner"] for g in uncovered)
        count = sum(g["count"] for g in uncovered)
        warnings.warn(
            f"fsdp-overlap: graph {index} holds {count} collectives of parameters that no bucket_plans entry "
            f"covers (modules {', '.join(owners[:_LISTED])}{', ...' if len(owners) > _LISTED else ''}); they run "
            "one by one, unprefetched. Add the modules to a plan entry to bucket them.",
            UnbucketedWarning,
            stacklevel=3,
        )
    if not missed:
        return
    lines = []
    for g in missed[:_LISTED]:
        if g["entry"] is not None:
            what = f"bucket_plans entry {g['entry']} {g['modules']}"
        else:
            what = "no parameter (the collective could not be attributed to one)"
        lines.append(
            f"{what}: {g['count']} {g['kind'].replace('_', '-')}(s) left unbucketed in the {g['graph']} graph; one "
            f"{'reads ' + repr(g['param']) if g['param'] else 'carries no parameter annotation'}, traced in the "
            f"module Dynamo calls {g['dynamo_path']!r}"
        )
    if len(missed) > _LISTED:
        lines.append(f"... and {len(missed) - _LISTED} more")
    message = (
        f"fsdp-overlap: the bucketing pass missed collectives in graph {index}:\n  "
        + "\n  ".join(lines)
        + "\nThe model trains correctly, but these collectives are neither merged nor prefetched: the "
        "overlap the plan asks for is lost. This is a bug in fsdp-overlap; please report it with this message. "
        "on_unbucketed: warn trains anyway."
    )
    if state.config.on_unbucketed == "error":
        raise UnbucketedError(message)
    warnings.warn(message, UnbucketedWarning, stacklevel=3)


_LISTED = 8  # modules named in a warning before "..."


def graph_break_message(exc: BaseException) -> str:
    """The user's line a graph break happened at, and what to do about it."""
    text = str(exc)
    where = ""
    if "from user code:" in text:
        frames = [
            line.strip()
            for line in text.split("from user code:", 1)[1].splitlines()
            if line.strip().startswith("File ")
        ]
        if frames:
            where = frames[-1]
    reason = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return (
        f"fsdp-overlap: fullgraph: true, but the model's forward has a graph break"
        f"{' at ' + where if where else ''}: {reason}. Collectives outside a graph cannot be bucketed or "
        "overlapped. Remove the break, or set fullgraph: false to compile the pieces separately (their "
        "collectives in between then run eagerly)."
    )


def is_recompile_limit(exc: BaseException) -> bool:
    # Dynamo words it "Dynamo recompile limit exceeded" (2.11 to 2.15; "cache size limit"
    # before the rename)
    text = str(exc)
    return "recompile limit" in text or "cache_size_limit" in text or "recompile_limit" in text


def recompile_limit_message(state: OverlapState) -> str:
    """What the recompile limit is, why this model reached it (the guards that failed) and
    what to do: no graph break is involved."""
    limit = compat.recompile_limit()
    last = _latest_guard_failure(state)
    dynamic = state.config.dynamic
    fix = (
        "under tensor parallelism every sequence length compiles on its own (docs/tensor-parallel.md): pad "
        "batches to fewer lengths"
        if state.tensor_parallel > 1
        else "dynamic: true compiles one graph for every size from the first step"
        if dynamic != True  # noqa: E712 - the config value, "auto" or a bool
        else "sizes 0 and 1 are always compiled separately, and a guard in the model's code can still fix a size"
    )
    return (
        f"fsdp-overlap: the model's forward was compiled {state.dynamo_graphs} times, Dynamo's recompile limit "
        f"({limit}, torch._dynamo.config.recompile_limit), and a new call needs another graph: {last or 'Dynamo did not say why'}. "
        + "This is no graph break: each compile is one whole graph, but a guard on the inputs failed. "
        f"Fixes: {fix}; or pad batches to a few lengths (pad_to_multiple_of in transformers' collators); or raise "
        "torch._dynamo.config.recompile_limit if the graphs are expected (training and eval modes, grad and no_grad "
        "each count). Run with TORCH_LOGS=recompiles to see every reason."
    )


def warn_graph_breaks(model: nn.Module, state: OverlapState, graphs: int, records: list[dict]) -> None:
    forward = [r for r in records if r["graph"] == "forward"]
    gathered = sum(r["before"]["all_gather"] for r in forward)
    bucketed = sum(r["after"]["all_gather"] for r in forward)
    total = sum(1 for m in model.modules() for p in m._parameters.values() if p is not None)
    counted = (
        f"{gathered} of the model's {total} parameter reads were traced into them and bucketed per graph "
        f"({bucketed} all-gathers after the passes; schedule_report lists every graph); the other "
        f"{max(total - gathered, 0)} gather eagerly between the graphs, not overlapped. A bucket cannot "
        "prefetch across a break"
        if forward
        else "the passes are off, so no all-gather was bucketed"
    )
    warnings.warn(
        f"fsdp-overlap: graph breaks split the forward into {graphs} compiled graphs (fullgraph: false); "
        f"{counted}. Remove the breaks for full overlap (fullgraph: true reports where they are).",
        stacklevel=3,
    )


def recompile_reason(state: OverlapState) -> str | None:
    """Why Dynamo is compiling this model's forward again (the guard that failed, as
    Dynamo words it), or None for its first graph."""
    if state.dynamo_graphs <= 1:
        return None
    return _latest_guard_failure(state) or "Dynamo did not say why"


def _latest_guard_failure(state: OverlapState) -> str | None:
    """The guard that failed in this call, in Dynamo's words, or None."""
    reasons = compat.guard_failures_since(state.guard_counts)
    # one line per cached graph, the most recent first: why the latest one did not fit
    return _reason_words(reasons[0]) if reasons else None


def _reason_words(reason: str) -> str:
    """Dynamo's guard-failure line without its compile id prefix and user stack."""
    first = reason.split("\nUser stack trace:", 1)[0].strip()
    head, _, rest = first.partition(": ")
    return rest if rest and head.replace("/", "").replace("_", "").isalnum() else first


def symbolic_sizes(gm: fx.GraphModule) -> list[dict]:
    """The input sizes Dynamo compiled this graph for symbolically (a dynamic sequence
    length): each as ``{"input", "dim", "size", "traced_at"}``, ``size`` the expression
    and ``traced_at`` its value in the call that compiled it (what estimates count with)."""
    from ..passes.graph import size_hint

    out = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("example_value")
        if not isinstance(val, torch.Tensor) or isinstance(val, nn.Parameter):
            continue
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = getattr(source, "name", None) or node.name  # a property on newer torch, a method before
        name = name() if callable(name) else name
        for dim, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt) and size.node.expr.free_symbols:
                out.append({"input": str(name), "dim": dim, "size": str(size), "traced_at": size_hint(size)})
    return out
