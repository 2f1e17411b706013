"""Reshard-after-forward, decided per bucket, as recompute tags on the joint graph.

Without tags the partitioner saves every gathered parameter for backward: memory of an
unsharded model, and no all-gathers in the backward graph. This pass runs on the joint
(forward + backward) graph before partitioning and tags, for each FSDP all-gather, the
chain that produces the gathered parameter::

    shard --cast--> all_gather --> wait --view/slice...--> weight used by compute

``MUST_RECOMPUTE`` (reshard: the backward re-gathers) or ``MUST_SAVE`` (keep the gathered
parameter until its backward). Tagging only the all-gather and its wait is not enough:
the partitioner would then save the view after the wait, so the whole single-user
chain is tagged.

Policy: with ``reshard_after_forward`` every bucket reshards, except the bucket that
the forward gathers last (unless ``reshard_last_bucket``): backward starts with exactly
those parameters, and re-gathering them at the graph boundary cannot be hidden behind
anything. FSDP2 keeps its root unsharded for the same reason. With ``prefetch_depth`` d
the last d buckets stay (within ``max_prefetch_bytes``), so the backward's first
re-gathers run while it computes d buckets instead of one. With the bucketing pass, one
more stays where the kept ones gather fewer bytes than the bucket before them (a final
norm and a small head before a block): their backward is too short to hide that
block's re-gather (``passes.prefetch.kept_buckets``, measured in benchmarks/RESULTS.md).
When graph breaks split the forward, each graph is annotated on its own and cannot know
whether it is the last one: ``keepable`` then names the one bucket that may stay gathered (the plan's last bucket),
so every other graph reshards all its buckets.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..contract import BucketIndex
from .graph import is_fsdp_all_gather, is_preparation_op, is_view, numel_hint, owner_module, param_fqn, wait_of
from .prefetch import kept_buckets

__all__ = ["annotate_reshard"]

# Far from any activation-checkpoint region id, so the partitioner never merges our
# tags with a user's checkpoint region (nodes on the border of two regions are saved).
_AC_GRAPH_ID = 100_000
_CASTS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)


def _gather_chain(ag: fx.Node) -> list[fx.Node]:
    chain = [ag]
    source = ag.args[0]
    if (
        isinstance(source, fx.Node)
        and source.op == "call_function"
        and source.target in _CASTS
        and len(source.users) == 1
    ):
        chain.insert(0, source)
    wait = wait_of(ag)
    if wait is None:
        return chain
    chain.append(wait)
    cur = wait
    while len(cur.users) == 1:
        user = next(iter(cur.users))
        if not is_view(user):
            break
        chain.append(user)
        cur = user
    return chain


def _shard_of(ag: fx.Node) -> fx.Node:
    """What an all-gather gathers, before its dtype cast and padding (a rank whose
    shard is shorter pads it to the longest): the same node for every read of one
    parameter, on every rank."""
    source = ag.args[0]
    while (
        isinstance(source, fx.Node)
        and source.op == "call_function"
        and (source.target in _CASTS or is_preparation_op(source) or is_view(source))
        and len(source.all_input_nodes) == 1
    ):
        source = source.all_input_nodes[0]
    return source if isinstance(source, fx.Node) else ag


def annotate_reshard(
    gm: fx.GraphModule,
    buckets: list[list[str]],
    *,
    reshard_after_forward: bool = True,
    reshard_last_bucket: bool = False,
    keepable: int | None = None,
    keep: int = 1,
    keep_budget: int | None = None,
    keep_cover: bool = False,
) -> dict:
    """Tag each FSDP all-gather chain of the joint graph to be recomputed or saved.

    ``keepable``: if given, the last-gathered bucket stays gathered only if it is this
    plan index (see the module doc); None keeps whichever bucket is gathered last.
    ``keep``: with one graph (``keepable`` None), how many of the last-gathered buckets
    stay gathered into backward (``prefetch_depth``), as long as their gathered bytes fit
    ``keep_budget`` (``max_prefetch_bytes``); the last one always stays. Backward then
    starts with that many buckets to compute while its first re-gathers run, instead of
    one. ``keep_cover``: one more where the kept buckets gather fewer bytes than the one
    before them (the backward prefetches: the bucketing pass runs). Returns statistics:
    how many all-gathers reshard, how many stay gathered, and which buckets were kept
    (plan index, or the module path of an unbucketed gather).
    """
    index = BucketIndex(buckets)
    gathers = [n for n in gm.graph.nodes if is_fsdp_all_gather(n)]
    keys = [index.key(owner_module(n)) for n in gathers]
    kept_keys: list = []
    kept_bytes = 0
    if reshard_after_forward and not reshard_last_bucket and gathers and keepable in (None, keys[-1]):
        one_graph = keepable is None
        kept_keys, kept_bytes = _last_buckets(
            gathers, keys, keep if one_graph else 1, keep_budget, keep_cover and one_graph
        )
    kept_key = kept_keys[0] if kept_keys else None
    # A tied parameter is gathered once per read here; the partitioner's CSE later merges
    # the gathers into one, which keeps the first one's tag. So one decision per
    # parameter (per shard it gathers): kept if any read is in the kept bucket (the
    # gathered weight is alive at the end of the forward anyway), and counted once.
    reads: dict[fx.Node, list[tuple[fx.Node, object]]] = {}
    for node, key in zip(gathers, keys):
        reads.setdefault(_shard_of(node), []).append((node, key))
    resharded = kept = 0
    tied = []
    for shard, group in reads.items():
        reshard = reshard_after_forward and all(key not in kept_keys for _, key in group)
        policy = CheckpointPolicy.MUST_RECOMPUTE if reshard else CheckpointPolicy.MUST_SAVE
        for node, _ in group:
            for member in _gather_chain(node):
                member.meta["recompute"] = policy
                member.meta["ac_graph_id"] = _AC_GRAPH_ID
        if reshard:
            resharded += 1
        else:
            kept += 1
        if len(group) > 1:
            tied.append({"param": param_fqn(group[0][0]) or shard.name, "reads": len(group), "kept": not reshard})
    stats = {
        "all_gathers": len(reads),
        "resharded": resharded,
        "kept_gathered": kept,
        "kept_bucket": index.describe(kept_key) if kept_key is not None else None,
        "kept_buckets": [index.describe(k) for k in kept_keys],
        "kept_bytes": kept_bytes,
        # kept one bucket more than prefetch_depth: the ones after it gather fewer bytes
        "kept_to_cover": len(kept_keys) > max(keep, 1),
        "tied": tied,
    }
    return stats


def _last_buckets(gathers: list[fx.Node], keys: list, keep: int, budget: int | None, cover: bool) -> tuple[list, int]:
    """The keys of the buckets kept gathered (last first) and their bytes:
    ``passes.prefetch.kept_buckets``, the rule ``check`` applies to plan sizes, on the
    gathered bytes of this graph's buckets."""
    held: dict = {}
    for node, key in zip(gathers, keys):
        wait = wait_of(node)
        val = wait.meta.get("val") if wait is not None else None
        held[key] = held.get(key, 0) + (numel_hint(val) * val.element_size() if val is not None else 0)
    order = list(dict.fromkeys(reversed(keys)))  # last gathered first
    kept = order[: kept_buckets([held[key] for key in reversed(order)], keep, budget, cover)]
    return kept, sum(held[key] for key in kept)
