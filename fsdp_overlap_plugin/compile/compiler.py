"""Compile wiring: ``torch.compile`` in place, with our passes injected.

inductor (``inductor_passes.py``, imported only when compiling with inductor)
    ``options={"post_grad_custom_post_pass": (..existing.., OverlapGraphPass),
               "joint_custom_post_pass": (..existing.., ReshardJointPass),
               "reorder_for_peak_memory": False}``
    Both are ``CustomGraphPass`` objects whose ``uuid()`` hashes the plan, the config,
    the model's structure, the pass source and this rank's local shard shapes, so the
    AOT autograd and FX graph caches stay on and are invalidated exactly when something
    that changes the result changes (``OverlapState.cache_key``). Passes that
    were already installed (``torch_npu`` installs a post-grad pass) run first; ours run
    last so the order we choose is the order that is executed. Inductor's peak-memory
    reordering would undo the prefetch order, so it is turned off when passes are on.
    On a torch whose slots hold one pass (2.11), one chaining pass runs them all
    (``_torch_compat.chain_graph_passes``).
aot_eager
    ``aot_autograd`` with forward/backward compilers that run the same passes on the
    ATen graphs, and a partitioner that applies the same reshard tags first.

Which passes run, in which order, is one list per graph kind: ``POST_GRAD_PASSES`` (each
forward/backward graph, ``run_passes``) and ``JOINT_PASSES`` (each joint graph before
partitioning, ``run_reshard``); each entry says whether it applies to a graph. A pass only
returns its statistics: this module records them, recompiles the graph once and lints it
once. The per-model state lives in ``state.py`` (re-exported here), the schedule events in
``passes/events.py``; the report reads them without importing this module.

The passes never talk to a process group; the only collective work done here is the
rank-consistency check (``rank_check``), which goes through the store, not a
collective, so it cannot hang.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.fx as fx
import torch.nn as nn

from .. import _torch_compat as compat
from .. import passes
from ..config.schema import OverlapConfig, OverlapConfigError
from ..passes.events import graph_events
from ..passes.graph import C10D, collective_counts
from ..report.messages import CompileProgress
from ..runtime.records import load_graph_records, record_name, save_record, summarize_pass
from ..runtime.state import OverlapState, get_state

__all__ = [
    "JOINT_PASSES",
    "POST_GRAD_PASSES",
    "CompileFallback",
    "GraphBreakError",
    "OverlapState",  # re-exported from state.py, where it lives
    "PassEntry",
    "PeerCompileError",
    "RecompileLimitError",
    "UnbucketedError",
    "UnbucketedWarning",
    "compile_model",
    "get_state",  # re-exported from state.py
    "run_passes",
    "run_reshard",
]

log = logging.getLogger("fsdp_overlap_plugin")

# The graph id is this many hex characters of the Dynamo graph's fingerprint: a directory
# name per graph of one model (records.py), where a collision only needs to be unlikely.
_GRAPH_ID_CHARS = 16


# --------------------------------------------------------------------------- passes
class PassEntry(NamedTuple):
    """One pass as the wiring runs it: its statistics go to ``record["passes"][name]``."""

    name: str
    pass_fn: Callable[[fx.GraphModule, OverlapState], dict]  # runs the pass, returns its statistics
    applies_to: Callable[[str, OverlapState], bool]  # (graph kind, state) -> whether it runs


def _reorders(config: OverlapConfig) -> bool:
    """The passes that move collectives are on (bucketing or gradient overlap)."""
    return config.manual_bucketing or config.overlap_grad_reduce


# Each pass is looked up in ``passes`` when it runs (not bound here), so what runs is
# always what ``passes`` holds now.
POST_GRAD_PASSES: tuple[PassEntry, ...] = (
    PassEntry(
        "gather_group",
        lambda gm, state: passes.use_gather_group(gm, state.gather_group),
        lambda kind, state: state.gather_group is not None,
    ),
    # before the bucketing: the one reduction of a tied parameter is bucketed like any other
    PassEntry(
        "tied",
        lambda gm, state: passes.merge_tied_reductions(gm),
        lambda kind, state: kind == "backward" and _reorders(state.config),
    ),
    PassEntry(
        "manual_bucketing",
        lambda gm, state: passes.manual_bucketing(
            gm,
            state.plan,
            prefetch_depth=state.config.prefetch_depth,
            max_prefetch_bytes=state.config.max_prefetch_bytes,
            kept=_kept_for_backward(gm, state),
            group_ranks=_group_ranks(gm),
        ),
        lambda kind, state: state.config.manual_bucketing,
    ),
    PassEntry(
        "overlap_grad_reduce",
        lambda gm, state: passes.overlap_grad_reduce(gm, wait_before_copy_in=state.config.memory_order == "fsdp2"),
        lambda kind, state: kind == "backward" and state.config.overlap_grad_reduce,
    ),
    PassEntry(
        "all_to_all",
        lambda gm, state: passes.reduce_scatter_as_all_to_all(gm, state.exchange_groups),
        lambda kind, state: kind == "backward" and state.reduce_scatter_impl in ("all_to_all", "receive_first"),
    ),
    # after every reordering: turn the final order into dependencies inductor keeps
    PassEntry(
        "pin_order",
        lambda gm, state: passes.pin_collective_order(gm),
        lambda kind, state: state.config.backend == "inductor" and _reorders(state.config),
    ),
)


def _group_ranks(gm: fx.GraphModule) -> dict[str, int]:
    """This process's rank in each process group ``gm``'s all-gathers name: the data
    ``manual_bucketing`` needs to place a merged gather's own shard, resolved here so
    that the passes never look up a process group."""
    ranks = {}
    for node in gm.graph.find_nodes(op="call_function", target=C10D.all_gather_into_tensor.default):
        group = node.args[2] if len(node.args) > 2 else node.kwargs.get("group_name")
        rank = compat.process_group_rank(group)
        if rank is not None:
            ranks[group] = rank
    return ranks


def _kept_for_backward(gm: fx.GraphModule, state: OverlapState) -> tuple[int, int]:
    """``(buckets, bytes)`` the forward kept gathered, for a backward graph (what the
    reshard pass recorded for this model's joint graph; one graph: ``fullgraph``)."""
    if state.graph_kind != "backward" or not state.reshard or not state.config.fullgraph:
        return (0, 0)
    last = state.reshard[-1]
    return (len(last.get("kept_buckets") or []), last.get("kept_bytes", 0))


def _annotate_reshard(gm: fx.GraphModule, state: OverlapState) -> dict:
    config = state.config
    return passes.annotate_reshard(
        gm,
        state.plan,
        reshard_after_forward=config.reshard_after_forward,
        reshard_last_bucket=config.reshard_last_bucket,
        # one graph (fullgraph): its last bucket is the forward's last; with graph breaks
        # only the plan's last bucket may stay gathered (a graph cannot know it is the last)
        keepable=None if config.fullgraph else state.last_bucket,
        keep=config.prefetch_depth if config.manual_bucketing else 1,
        keep_budget=config.max_prefetch_bytes,
        keep_cover=config.manual_bucketing,
    )


# The joint-graph passes: activation-checkpointing recompute tags, then the reshard tags
# of the parameter gathers (which override the first inside a region).
JOINT_PASSES: tuple[PassEntry, ...] = (
    PassEntry(
        "checkpointing",
        lambda gm, state: passes.annotate_activation_checkpointing(gm, state.config.activation_checkpointing_policy),
        lambda kind, state: bool(state.checkpointed),
    ),
    PassEntry("reshard", _annotate_reshard, lambda kind, state: True),
)


def _apply(entries: tuple[PassEntry, ...], gm: fx.GraphModule, kind: str, state: OverlapState) -> dict[str, dict]:
    """Run the entries that apply to this graph, in order: name -> its statistics."""
    return {entry.name: entry.pass_fn(gm, state) for entry in entries if entry.applies_to(kind, state)}


def run_passes(
    gm: fx.GraphModule, kind: str, state: OverlapState, *, inference: bool = False, recompile: bool = True
) -> dict:
    """Run ``POST_GRAD_PASSES`` on one compiled graph and record what they did.

    ``kind`` is "forward" or "backward"; an inference graph (no backward, e.g. under
    ``no_grad``) is a forward with ``inference=True``. The passes only return
    statistics; recording them, recompiling (unless ``recompile=False``: the caller
    regenerates the code itself) and linting the graph happen here, once.
    """
    record: dict[str, Any] = {
        "graph": kind,
        "graph_id": state.graph_id,
        "inference": inference,
        "before": collective_counts(gm.graph),
        "passes": {},
    }
    events_before = graph_events(gm.graph, state.plan)
    state.graph_kind = "forward" if inference else kind
    try:
        record["passes"].update(_apply(POST_GRAD_PASSES, gm, kind, state))
    finally:
        state.graph_kind = None
    bucketing = record["passes"].get("manual_bucketing")
    if bucketing is not None:
        record["left_unbucketed"] = bucketing.pop("left_unbucketed", [])
    tied = record["passes"].get("tied")
    if tied is not None and tied["left"]:
        warnings.warn(
            f"fsdp-overlap: {tied['left']} sum(s) of gradient reductions in the backward graph were left as "
            "they are (their reduction chains differ): a parameter used twice, such as a tied embedding, is "
            "then reduced once per use, twice the bytes. schedule_report shows tied(left=...).",
            UnbucketedWarning,
            stacklevel=2,
        )
    if recompile:
        # once, after all passes (no pass regenerates the code itself); under inductor the
        # caller says no: inductor's post_grad_passes recompiles the graph itself after its
        # custom passes (torch 2.11 to 2.15), and half of this function's time was this
        gm.recompile()
    record["after"] = collective_counts(gm.graph)
    as_all_to_all = (record["passes"].get("all_to_all") or {}).get("rewritten", 0)
    if as_all_to_all:
        # a gradient reduce-scatter run as all-to-all plus a local sum is still counted as
        # that reduce-scatter (the report's column stays "gradient reductions"); the record
        # says how many ran that way
        record["after"]["reduce_scatter"] += as_all_to_all
        record["after"]["all_to_all"] -= as_all_to_all
        record["after"]["reduce_scatter_as_all_to_all"] = as_all_to_all
    record["nodes"] = len(gm.graph.nodes)
    gm.graph.lint()  # once, after every pass, instead of inside each
    record["schedule"] = {"before": events_before, "after": graph_events(gm.graph, state.plan)}
    state.records.append(record)
    save_record(state.cache_key(), record, rank=state.rank)
    log.info(
        "fsdp-overlap %s graph: all-gathers %d -> %d, reduce-scatters %d -> %d, %s",
        "inference" if inference else kind,
        record["before"]["all_gather"],
        record["after"]["all_gather"],
        record["before"]["reduce_scatter"],
        record["after"]["reduce_scatter"],
        ", ".join(summarize_pass(name, stats) for name, stats in record["passes"].items()) or "no passes",
    )
    return record


def run_reshard(gm: fx.GraphModule, state: OverlapState) -> None:
    """Run ``JOINT_PASSES`` on a joint graph (before partitioning) and record them: the
    reshard statistics at the top of the record, the checkpointing ones under
    ``checkpointing``. Both only tag nodes, so nothing is recompiled."""
    stats = _apply(JOINT_PASSES, gm, "joint", state)
    checkpointing = stats.get("checkpointing")
    if checkpointing is not None:
        _warn_untraced_checkpoints(state, checkpointing)
    record = {"graph": "joint", "graph_id": state.graph_id, **stats["reshard"]}
    if checkpointing is not None:
        record["checkpointing"] = checkpointing
    state.reshard.append(record)
    save_record(state.cache_key(), record, rank=state.rank)  # for the report after a cache hit


def _warn_untraced_checkpoints(state: OverlapState, stats: dict) -> None:
    """With one graph for the whole forward, every checkpointed module that ran is in it:
    one that is not was never called there, and checkpointing it does nothing."""
    if not state.config.fullgraph:
        return  # graph breaks: each graph holds some of the modules
    missing = [m for m in state.checkpointed if m not in stats["regions"]]
    if missing and "untraced-checkpoints" not in state.warned:
        state.warned.add("untraced-checkpoints")
        warnings.warn(
            f"fsdp-overlap: activation_checkpointing lists {', '.join(missing)}, which the compiled forward "
            "never ran: nothing is recomputed for them. Check the module names in activation_checkpointing.",
            stacklevel=2,
        )


def aot_eager_backend(state: OverlapState):
    """An ``aot_eager`` equivalent whose compilers run our passes on the ATen graphs."""
    from functorch.compile import make_boxed_func

    def compiler(kind: str, inference: bool = False):
        def compile_graph(gm: fx.GraphModule, example_inputs: list) -> Any:
            if state.passes_on:
                run_passes(gm, kind, state, inference=inference)
            return make_boxed_func(gm.forward)

        return compile_graph

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        run_reshard(joint, state)
        return compat.min_cut_partition(joint, joint_inputs, **kwargs)

    return compat.aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("forward", inference=True),
        partition_fn=partition,
        keep_inference_input_mutations=True,
    )


# A compile failure is quoted in the fallback warning up to this many characters.
_WARNING_CHARS = 500


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


def _inner_backend(state: OverlapState):
    if state.config.backend == "inductor":
        from .inductor import inductor_backend  # inductor is imported only to compile with it

        return inductor_backend(state, run_passes, run_reshard)
    return aot_eager_backend(state)


def overlap_backend(state: OverlapState, progress: CompileProgress | None = None):
    """The backend given to ``torch.compile``: rank check, compile, compile agreement.

    Dynamo calls it for every graph on every rank (also when inductor's caches hit), so
    the agreement rounds line up. The backward is compiled here too
    (``force_non_lazy_backward_lowering``), so a failure anywhere in compilation is known
    before any rank runs the graph and its collectives.
    """
    inner = _inner_backend(state)
    config = state.config

    def backend(gm: fx.GraphModule, example_inputs: list) -> Any:
        from ..runtime.ranks import RankAgreement, graph_fingerprint

        state.dynamo_graphs += 1
        index = state.dynamo_graphs
        reason = _recompile_reason(state)
        if progress is not None:
            progress.graph_started(reason)  # rank 0: "compiling the model again (...)", a few times at most
        # keys unique per model and torchrun attempt (a restart may reuse the store)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        agreement = RankAgreement.default(
            f"fsdp_overlap/{state.uuid()}/{attempt}/{state.instance}/round{len(state.agreed) + 1}",
            config.rank_check_timeout,
        )
        digest, entries, local = graph_fingerprint(gm, extra=json.dumps(state.plan))
        # the records of this graph are kept under its fingerprint on this rank, so a later
        # process whose FX graph cache hits (and whose passes therefore do not run) finds
        # them (grad mode too: the same Dynamo graph compiles to a training or an
        # inference graph)
        state.graph_id = local[:_GRAPH_ID_CHARS] + ("" if torch.is_grad_enabled() else "-no-grad")
        graph_id = state.graph_id
        records_before, joints_before = len(state.records), len(state.reshard)
        sizes = _symbolic_sizes(gm)
        error: BaseException | None = None
        before = _cache_counters()
        try:
            with compat.eager_backward_lowering():
                compiled = inner(gm, example_inputs)
        except compat.dynamo_restart_error():
            # Dynamo traces the frame again and calls us with the graph it then gets (every
            # rank does the same): this attempt compiled nothing, and leaves nothing behind
            del state.records[records_before:], state.reshard[joints_before:]
            state.dynamo_graphs -= 1
            raise
        except Exception as exc:  # every rank must hear of it before anyone runs the graph
            error = exc
        finally:
            state.graph_id = None
        if config.backend == "inductor":
            state.compile_cache.append(_cache_use(index, graph_id, before, _cache_counters()))
        records = state.records[records_before:]
        if error is None and not records and state.passes_on:
            records = _records_from_cache(state, graph_id)
        for record in records + state.reshard[joints_before:]:
            record["dynamo_graph"] = index  # which compile of the forward it came from (the report)
            record["dynamic_sizes"] = sizes
        collectives = _collective_entries(records) if state.passes_on else None
        key = hashlib.sha256(json.dumps(collectives if collectives is not None else digest).encode()).hexdigest()
        if reason is not None:
            state.recompiles.append({"graph": index, "reason": reason, "agreed_before": key in state.agreed})
        if agreement is not None and error is None and key in state.agreed:
            # a recompile (a new sequence length, a dynamic one) that leaves collectives
            # every rank already agreed on: the ranks need not recompile at the same step
            # (each pads its own batches), so no agreement round is held for it
            _check_unbucketed(state, records, index)
            return compiled
        if agreement is not None and error is not None and state.agreed:
            # a recompile on this rank alone (the others may run an agreed graph and never
            # join a round): it cannot make them switch to eager, so it stops
            raise error
        if agreement is not None:
            failures = agreement.all_succeeded("compile", None if error is None else f"{type(error).__name__}: {error}")
        else:
            failures = [f"rank 0: {type(error).__name__}: {error}"] if error is not None else []
        if failures:
            if config.on_compile_error == "eager":
                raise CompileFallback(failures[0][:_MESSAGE_CHARS])
            if error is not None:
                raise error
            raise PeerCompileError(
                f"fsdp-overlap: compilation failed on another rank ({failures[0][:_MESSAGE_CHARS]}); this rank "
                "stops too instead of waiting for it in a collective. on_compile_error: eager runs every rank "
                "uncompiled."
            )
        if agreement is not None and config.rank_check != "off":
            _check_same_graph(agreement, digest, entries, index, config.rank_check)
            if collectives is not None:
                _check_same_collectives(agreement, collectives, index, config.rank_check)
        state.agreed.append(key)
        _check_unbucketed(state, records, index)
        return compiled

    return backend


def _symbolic_sizes(gm: fx.GraphModule) -> list[dict]:
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


def _recompile_reason(state: OverlapState) -> str | None:
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


def _check_same_graph(agreement: Any, digest: str, entries: list, index: int, mode: str) -> None:
    _must_agree(
        agreement,
        "fingerprint",
        digest,
        entries,
        mode,
        f"fsdp-overlap: the ranks compiled different graphs (graph {index}): {{}}. Every rank must run the same "
        "model code and config; ranks running different graphs would issue collectives that never match. "
        "(rank_check: warn only warns; off skips this.)",
    )


def _must_agree(agreement: Any, name: str, digest: str, entries: list, mode: str, message: str) -> None:
    """One store round comparing ``digest`` with rank 0's; on a difference raise
    ``RankMismatchError`` (``rank_check: error``) or warn, with ``message`` naming it."""
    from ..runtime.ranks import RankMismatchError

    difference = agreement.same_graph(name, digest, entries)
    if difference is None:
        return
    if mode == "error":
        raise RankMismatchError(message.format(difference))
    warnings.warn(message.format(difference), stacklevel=4)


def _cache_counters() -> dict[str, int]:
    counters = compat.dynamo_counters()
    return {
        f"{group}.{key}": counters[group][key]
        for group, keys in (
            ("aot_autograd", ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")),
            ("inductor", ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")),
        )
        for key in keys
    }


def _cache_use(index: int, graph_id: str, before: dict[str, int], after: dict[str, int]) -> dict:
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


# shard-group collectives, whose sizes must agree (a reduce-scatter run as all-to-all too)
_SIZED = ("all_gather", "reduce_scatter", "all_to_all")


def _collective_entries(records: list[dict]) -> list[list[str]]:
    """What every rank's compiled graphs must share, in graph order: each collective's kind,
    group size and bytes (shard-group collectives: all-gathers, reduce-scatters and their
    all-to-all form move padded, equal sizes on every rank; a replica all-reduce moves
    this rank's shard, whose size legitimately differs between shard positions), and each
    pass's decisions in a few numbers. Entries as ``ranks.first_difference`` reads them."""
    entries = []
    for r in records:
        for e in (r.get("schedule") or {}).get("after", []):
            if e["op"] in ("compute", "wait"):
                continue
            words = f"{record_name(r)} graph: {e['op']}" + (f" of {e['bytes']} bytes" if e["op"] in _SIZED else "")
            size = compat.process_group_size(e.get("group"))
            if size is not None:  # a group's name differs between its instances (HSDP's shard groups)
                words += f" on a group of {size} ranks"
            entries.append([words, "", words])
        for name, stats in r.get("passes", {}).items():
            words = f"{record_name(r)} graph: {summarize_pass(name, stats)}"
            entries.append([words, "", words])
    return entries


def _check_same_collectives(agreement: Any, entries: list[list[str]], index: int, mode: str) -> None:
    """Every rank's passes must leave the same collectives, in kind, order and size, or the
    ranks would issue collectives that never match (a hang, or gloo's "Received data
    size doesn't match"). The Dynamo graphs agree (checked just before), but the graphs
    the passes see carry each rank's local shard shapes, so a pass that decides on shapes
    could decide differently per rank: that is a bug in fsdp-overlap, stopped here at
    the first step instead of in a collective."""
    _must_agree(
        agreement,
        "collectives",
        hashlib.sha256(json.dumps(entries).encode()).hexdigest(),
        entries,
        mode,
        f"fsdp-overlap: the passes left different collectives on different ranks (graph {index}): {{}}. This is a "
        "bug in fsdp-overlap; please report it with this message. (rank_check: warn only warns.)",
    )


# A peer's error is quoted up to this many characters (whole tracebacks would bury the message).
_MESSAGE_CHARS = 2000


def _records_from_cache(state: OverlapState, graph_id: str) -> list[dict]:
    """The records the passes left for this graph when it was compiled before: on an FX
    graph cache hit inductor loads compiled code without running them."""
    records = [dict(r, from_cache=True) for r in load_graph_records(state.cache_key(), graph_id, rank=state.rank)]
    joints = {r.get("graph_id") for r in state.reshard}
    for record in records:
        if record["graph"] != "joint":
            state.records.append(record)
        elif graph_id not in joints:  # the joint pass ran (AOT autograd's cache missed): already there
            state.reshard.append(record)
    return [r for r in records if r["graph"] != "joint"]


def _check_unbucketed(state: OverlapState, records: list[dict], index: int) -> None:
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


class UnbucketedWarning(UserWarning):
    """Collectives that run unbucketed (outside the plan, or missed with ``on_unbucketed: warn``)."""


def _find(exc: BaseException, kind: type) -> BaseException | None:
    """``exc`` or an exception it wraps (cause, context, Dynamo's inner_exception) of type ``kind``."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        cur = stack.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, kind):
            return cur
        stack.extend([cur.__cause__, cur.__context__, getattr(cur, "inner_exception", None)])
    return None


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


def _is_recompile_limit(exc: BaseException) -> bool:
    # Dynamo words it "Dynamo recompile limit exceeded" (2.11 to 2.15; "cache size limit"
    # before the rename)
    text = str(exc)
    return "recompile limit" in text or "cache_size_limit" in text or "recompile_limit" in text


def recompile_limit_message(state: OverlapState) -> str:
    """What the recompile limit is, why this model reached it (the guards that failed) and
    what to do: no graph break is involved."""
    import torch._dynamo

    limit = getattr(torch._dynamo.config, "recompile_limit", None) or getattr(
        torch._dynamo.config, "cache_size_limit", "?"
    )
    last = _latest_guard_failure(state)
    dynamic = state.config.dynamic
    fix = (
        "dynamic: true compiles one graph for every size from the first step"
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


def _warn_graph_breaks(model: nn.Module, state: OverlapState, graphs: int, records: list[dict]) -> None:
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


def _install_call_guard(model: nn.Module, state: OverlapState, progress: CompileProgress | None = None) -> None:
    """Wrap the compiled forward: graph breaks under fullgraph become a clear error; an
    agreed compile failure switches to the eager forward; graph breaks under
    fullgraph: false are reported once. ``progress``: rank 0's lines about compiling."""
    compiled = model._compiled_call_impl
    progress = progress or CompileProgress(state)

    def call(*args: Any, **kwargs: Any) -> Any:
        first = not state.called
        graphs_before, records_before = state.dynamo_graphs, len(state.records)
        state.guard_counts = compat.guard_failure_counts()
        progress.call_started(first)
        try:
            out = compiled(*args, **kwargs)
        except Exception as exc:
            fallback = _find(exc, CompileFallback)
            if fallback is not None:
                state.fallback = str(fallback)
                model._compiled_call_impl = None  # from now on nn.Module runs the eager forward
                progress.call_finished(fallback=True)
                warnings.warn(
                    f"fsdp-overlap: compilation failed ({state.fallback[:_WARNING_CHARS]}); on_compile_error: eager, so "
                    "every rank now runs the sharded model uncompiled: same numerics, collectives gathered "
                    "per parameter as FSDP2 does, no passes.",
                    stacklevel=2,
                )
                return model._call_impl(*args, **kwargs)
            from ..runtime.ranks import RankMismatchError, RankTimeoutError

            progress.announced = False  # no "compiled in" line after a failure
            ours = _find(
                exc,
                (
                    RankMismatchError,
                    RankTimeoutError,
                    PeerCompileError,
                    UnbucketedError,
                    RecompileLimitError,
                    OverlapConfigError,  # a configuration error found while compiling
                    compat.TorchFeatureError,  # a feature this torch lacks, found while compiling
                ),
            )
            if ours is not None:
                raise ours from None  # our message, not Dynamo's wrapper around it
            unsupported = _find(exc, compat.dynamo_unsupported_error())
            if unsupported is not None and _is_recompile_limit(unsupported):
                raise RecompileLimitError(recompile_limit_message(state)) from exc
            if unsupported is not None and state.config.fullgraph:
                raise GraphBreakError(graph_break_message(unsupported)) from exc
            raise
        if (
            not state.config.fullgraph
            and state.dynamo_graphs == graphs_before
            and "recompile-limit" not in state.warned
        ):
            # a guard failed but nothing was compiled: past the recompile limit Dynamo runs
            # the frame uncompiled (fullgraph: false), our passes and buckets gone with it
            if compat.guard_failures_since(state.guard_counts):
                state.warned.add("recompile-limit")
                warnings.warn(
                    recompile_limit_message(state) + " With fullgraph: false Dynamo now runs it uncompiled.",
                    stacklevel=2,
                )
        progress.call_finished()
        if first:
            state.called = True
            graphs = state.dynamo_graphs - graphs_before
            if graphs > 1:
                _warn_graph_breaks(model, state, graphs, state.records[records_before:])
        return out

    model._compiled_call_impl = call


def compile_model(model: nn.Module, state: OverlapState) -> nn.Module:
    """Compile ``model`` in place (``module.compile``: hooks, names and state-dict keys
    stay as they are; no ``_orig_mod`` wrapper)."""
    dynamic = {"auto": None}.get(state.config.dynamic, state.config.dynamic)  # torch.compile's meaning
    progress = CompileProgress(state)
    model.compile(backend=overlap_backend(state, progress), fullgraph=state.config.fullgraph, dynamic=dynamic)
    _install_call_guard(model, state, progress)
    return model
