"""The pass table: which passes run on which graph, in which order, and what is recorded.

Which passes run is one list per graph kind: ``POST_GRAD_PASSES`` (each forward/backward
graph, ``run_passes``) and ``JOINT_PASSES`` (each joint graph before partitioning,
``run_reshard``); each entry says whether it applies to a graph. A pass only returns its
statistics: this module records them, recompiles the graph once and lints it once. The
per-model state lives in ``runtime/state.py``, the schedule events in
``passes/events.py``; the report reads them without importing this module. The passes
never talk to a process group.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch.fx as fx

from .. import _torch_compat as compat
from .. import passes
from ..passes.events import graph_events
from ..passes.graph import C10D, collective_counts, group_name, is_collective, mark_tensor_parallel
from ..runtime.records import save_record, summarize_pass
from ..runtime.state import OverlapState
from . import async_tp
from .diagnostics import UnbucketedWarning

__all__ = ["JOINT_PASSES", "POST_GRAD_PASSES", "PassEntry", "run_passes", "run_reshard"]

log = logging.getLogger("fsdp_overlap_plugin")


class PassEntry(NamedTuple):
    """One pass as the wiring runs it: its statistics go to ``record["passes"][name]``."""

    name: str
    pass_fn: Callable[[fx.GraphModule, OverlapState], dict]  # runs the pass, returns its statistics
    applies_to: Callable[[str, OverlapState], bool]  # (graph kind, state) -> whether it runs


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
        lambda kind, state: kind == "backward" and state.passes.reorders,
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
        lambda kind, state: state.passes.manual_bucketing,
    ),
    PassEntry(
        "overlap_grad_reduce",
        lambda gm, state: passes.overlap_grad_reduce(gm, wait_before_copy_in=state.config.memory_order == "fsdp2"),
        lambda kind, state: kind == "backward" and state.passes.overlap_grad_reduce,
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
        lambda kind, state: state.passes.pin_order,
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
    if state.graph_kind != "backward" or not state.reshard or not state.passes.fullgraph:
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
        keepable=None if state.passes.fullgraph else state.last_bucket,
        keep=config.prefetch_depth if state.passes.manual_bucketing else 1,
        keep_budget=config.max_prefetch_bytes,
        keep_cover=state.passes.manual_bucketing,
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
    }
    tensor = tensor_groups(gm.graph, state)
    record["before"] = collective_counts(gm.graph, tensor, exclude=True)
    record["passes"] = {}
    if tensor:
        # the tensor-parallel plan's own collectives, counted apart: the passes leave them as they are
        mark_tensor_parallel(gm.graph, tensor)
        record["tensor_parallel"] = {"before": collective_counts(gm.graph, tensor)}
        # async_tp: torch's micro-pipeline pass ran before ours; what it fused (an error if nothing)
        fused = async_tp.check_fused(gm.graph, state, kind, record["tensor_parallel"]["before"])
        if fused is not None:
            record["tensor_parallel"]["fused"] = fused
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
    record["after"] = collective_counts(gm.graph, tensor, exclude=True)
    if tensor:
        record["tensor_parallel"]["after"] = collective_counts(gm.graph, tensor)
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
    record["schedule"] = {
        "before": _on_lanes(events_before, tensor, state.tensor_parallel),
        "after": _on_lanes(graph_events(gm.graph, state.plan), tensor, state.tensor_parallel),
    }
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
    if not state.passes.fullgraph:
        return  # graph breaks: each graph holds some of the modules
    missing = [m for m in state.checkpointed if m not in stats["regions"]]
    if missing and "untraced-checkpoints" not in state.warned:
        state.warned.add("untraced-checkpoints")
        warnings.warn(
            f"fsdp-overlap: activation_checkpointing lists {', '.join(missing)}, which the compiled forward "
            "never ran: nothing is recomputed for them. Check the module names in activation_checkpointing.",
            stacklevel=2,
        )


def tensor_groups(graph: fx.Graph, state: OverlapState) -> tuple[str, ...]:
    """The names, in this graph, of the tensor-parallel group: the model's own
    (``state.tp_groups``) and any other group of the same ranks. Two meshes over the same
    ranks are equal to DTensor, so a model prepared after another one in the same process
    may run its plan's collectives on the first model's groups of those ranks."""
    if not state.tp_groups:
        return ()
    names = set(state.tp_groups)
    ranks = {_ranks_of_group(name) for name in names} - {None}
    for node in graph.nodes:
        if is_collective(node):
            name = group_name(node)
            if name not in names and _ranks_of_group(name) in ranks:
                names.add(name)
    return tuple(sorted(names, key=str))


def _ranks_of_group(name: Any) -> tuple[int, ...] | None:
    group = compat.resolve_process_group(name) if isinstance(name, str) else None
    if group is None:
        return None
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group))


def _on_lanes(events: list[dict], tensor: tuple[str, ...], size: int) -> list[dict]:
    """The tensor-parallel plan's collectives on their own lane (the link inside a node,
    over the tensor-parallel group) for the cost model; the others as recorded."""
    if not tensor:
        return events
    return [dict(ev, lane="tensor", ranks=size) if ev.get("group") in tensor else ev for ev in events]
