"""``check``'s and ``inspect``'s analysis: the plan a config resolves to on a model (through
``preflight``, the checks ``parallelize`` runs), the bytes each bucket moves, the memory a
prefetch holds, and one function per kind of warning. Pure: the model is on meta."""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..config.plan import PlanWarning, auto_plan_info
from ..config.schema import OverlapConfig, OverlapConfigError
from ..contract import BucketIndex
from ..parallelize import unbucketed_parameters
from ..passes.prefetch import kept_buckets, prefetch_plan
from ..shard.preflight import preflight
from .options import SMALL_BUCKET_BYTES
from .text import format_bytes, format_count

__all__ = [
    "LARGE_BUCKET_FACTOR",
    "SMALL_BUCKET_BYTES",
    "analyze",
    "bucket_rows",
    "kept_for_backward",
    "module_tree",
    "parameter_buckets",
    "tied_parameters",
]

#: A bucket this many times the median bucket sets the prefetch memory peak on its own.
LARGE_BUCKET_FACTOR = 4
#: Unbucketed parameters named in the warning before "...".
_LISTED_PARAMS = 6


def _registrations(model: nn.Module) -> dict[int, list[str]]:
    """Every parameter (by ``id``) -> its FQNs, in registration order (a tied parameter,
    ``lm_head.weight is model.embed_tokens.weight``, has several)."""
    names: dict[int, list[str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is not None:
                names.setdefault(id(p), []).append(f"{prefix}.{name}" if prefix else name)
    return names


def _module_of(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _counted(
    params: list[tuple[str, torch.Tensor]], home: Callable[[str], bool], names: dict[int, list[str]]
) -> tuple[dict[str, int], list[dict[str, Any]], list[int]]:
    """``params`` (name, parameter: every registration inside one bucket or subtree) counted
    once each, and only where the parameter is first registered (``home(first FQN)``): a tied
    parameter is gathered once, by its first use (AOT autograd merges its reads' identical
    gathers into the first, and ``passes/tied.py`` reduces its summed gradient in that
    read's bucket). Returns the totals, the tied parameters held here but counted elsewhere,
    and the ids counted."""
    totals = {"params": 0, "storage_bytes": 0, "gather_bytes": 0, "reduce_bytes": 0}
    tied: list[dict[str, Any]] = []
    ids: list[int] = []
    seen: set[int] = set()
    for name, p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        first = names.get(id(p), [name])[0]
        if not home(first):
            tied.append({"param": name, "same_as": first, "params": p.numel()})
            continue
        ids.append(id(p))
        totals["params"] += p.numel()
        totals["storage_bytes"] += p.numel() * p.element_size()
    return totals, tied, ids


def _add_bytes(totals: dict[str, int], ids: list[int], by_id: dict[int, torch.Tensor], config: OverlapConfig) -> None:
    for key, dtype in (("gather_bytes", config.torch_param_dtype), ("reduce_bytes", config.torch_reduce_dtype)):
        totals[key] = sum(by_id[i].numel() * (dtype or by_id[i].dtype).itemsize for i in ids)


def _held(module: nn.Module, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """Every parameter registration under ``module`` as (FQN from the root, parameter)."""
    return [(f"{prefix}.{name}" if prefix else name, p) for name, p in module.named_parameters(remove_duplicate=False)]


def tied_parameters(model: nn.Module, plan: list[list[str]]) -> list[dict[str, Any]]:
    """Parameters registered under more than one name: ``{"param": first FQN, "names": the
    others, "params": elements, "bucket": the plan entry that gathers and reduces it}``. The
    entry is the one holding its first registration (the forward's first read for a model
    that registers modules in the order it runs them: the embedding, not the head); None
    when no entry holds that one."""
    index = BucketIndex(plan)
    params = {id(p): p for p in model.parameters()}
    return [
        {
            "param": names[0],
            "names": names[1:],
            "params": params[pid].numel(),
            "bucket": index.bucket_of(_module_of(names[0])),
        }
        for pid, names in _registrations(model).items()
        if len(names) > 1 and pid in params
    ]


def parameter_buckets(model: nn.Module, plan: list[list[str]]) -> dict[int, int | None]:
    """Each parameter (by ``id``, once) -> the plan entry that gathers and reduces it: the
    entry holding its first registration, as ``bucket_rows`` counts it; None where no entry
    holds that registration (the parameter is gathered on its own, unbucketed)."""
    index = BucketIndex(plan)
    params = {id(p) for p in model.parameters()}
    return {pid: index.bucket_of(_module_of(names[0])) for pid, names in _registrations(model).items() if pid in params}


def _param_rows(module: nn.Module, prefix: str, config: OverlapConfig, names: dict[int, list[str]]) -> dict[str, Any]:
    """Counts and bytes of ``module``'s subtree (storage in each parameter's own dtype,
    all-gather in param_dtype, reduce-scatter in reduce_dtype), each parameter once and a
    tied one only in the subtree of its first registration; ``tied``: the ones held here
    but counted there."""
    inside = lambda fqn: not prefix or fqn.startswith(prefix + ".")  # noqa: E731
    totals, tied, ids = _counted(_held(module, prefix), inside, names)
    _add_bytes(totals, ids, {id(p): p for p in module.parameters()}, config)
    return {**totals, "tied": tied}


def bucket_rows(model: nn.Module, config: OverlapConfig, plan: list[list[str]]) -> list[dict[str, Any]]:
    """One row per bucket: its modules, parameter count and bytes. Each parameter counts
    once, in the bucket that gathers and reduces it at runtime: a tied parameter
    (``lm_head.weight is model.embed_tokens.weight``) in the bucket of its first
    registration, and in any other bucket holding it only under ``tied``. So the rows
    never sum to more than the model."""
    names = _registrations(model)
    index = BucketIndex(plan)
    by_id = {id(p): p for p in model.parameters()}
    rows = []
    for i, bucket in enumerate(plan):
        held = [pair for fqn in bucket for pair in _held(model.get_submodule(fqn), fqn)]
        totals, tied, ids = _counted(held, lambda fqn, i=i: index.bucket_of(_module_of(fqn)) == i, names)
        _add_bytes(totals, ids, by_id, config)
        for t in tied:
            t["counted_in"] = index.bucket_of(_module_of(t["same_as"]))
        rows.append({"index": i, "modules": list(bucket), **totals, "tied": tied})
    return rows


# ------------------------------------------------------------------------ the warnings
def _warning(kind: str, message: str, buckets: list[int] | None = None, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "buckets": buckets or [], "message": message, **extra}


def warn_no_params(caught: list[warnings.WarningMessage], rename: Callable[[str], str]) -> list[dict]:
    """Plan entries that own no parameters (``resolve_plan`` warns; the run would too)."""
    return [_warning("no_params", rename(str(w.message))) for w in caught if issubclass(w.category, PlanWarning)]


def warn_ignored(config: OverlapConfig, key: Callable[[str], str]) -> list[dict]:
    """``bucket_bytes`` set where it is not read."""
    if config.bucket_plans == "auto" or config.bucket_bytes is None:
        return []
    return [
        _warning("ignored", f"{key('bucket_bytes')} is set but only read when bucket_plans is auto; it is ignored.")
    ]


def warn_large(rows: list[dict[str, Any]]) -> list[dict]:
    """A bucket far above the median: it alone sets the prefetch memory peak."""
    median = statistics.median(r["gather_bytes"] for r in rows) if rows else 0
    return [
        _warning(
            "large",
            f"bucket {r['index']} {r['modules']} gathers {format_bytes(r['gather_bytes'])}, "
            f"{r['gather_bytes'] / median:.1f}x the median bucket ({format_bytes(median)}): it alone sets "
            "the prefetch memory peak and its all-gather is the hardest to hide; split it.",
            [r["index"]],
        )
        for r in rows
        if median and r["gather_bytes"] > LARGE_BUCKET_FACTOR * median
    ]


def warn_small(rows: list[dict[str, Any]], small_bytes: int) -> list[dict]:
    """Buckets so small that a collective's fixed latency outweighs its transfer."""
    small = [r for r in rows if r["gather_bytes"] < small_bytes]
    if not small:
        return []
    listed = ", ".join(f"{r['index']} ({format_bytes(r['gather_bytes'])})" for r in small)
    return [
        _warning(
            "small",
            f"{len(small)} of {len(rows)} buckets gather less than {format_bytes(small_bytes)}, where a "
            f"collective's fixed latency outweighs its transfer time: {listed}. Merge neighbours "
            "(a list entry, or bucket_bytes for auto) unless the model is a toy.",
            [r["index"] for r in small],
        )
    ]


def warn_unbucketed(model: nn.Module, unbucketed: list[str]) -> list[dict]:
    """Parameters no bucket covers: gathered one by one, never prefetched."""
    if not unbucketed:
        return []
    params = dict(model.named_parameters(remove_duplicate=False))
    n = sum(params[name].numel() for name in unbucketed if name in params)
    shown = ", ".join(unbucketed[:_LISTED_PARAMS]) + (", ..." if len(unbucketed) > _LISTED_PARAMS else "")
    return [
        _warning(
            "unbucketed",
            f"{len(unbucketed)} parameters ({format_count(n)} elements) belong to no bucket and are gathered "
            f"one by one, unprefetched: {shown}.",
            params=unbucketed,
        )
    ]


# ------------------------------------------------------------------------------ memory
def kept_for_backward(sizes: list[int], config: OverlapConfig) -> int:
    """How many of the last buckets (gathered ``sizes``, plan order) the forward keeps
    gathered for backward, so the backward does not gather them again: the reshard pass's
    rule (``passes.prefetch.kept_buckets``) when the forward reshards and the last bucket
    is not resharded by request; 0 otherwise (``reshard_after_forward: false`` keeps every
    bucket, which the callers read from the config)."""
    if not config.reshard_after_forward or config.reshard_last_bucket:
        return 0
    return kept_buckets(sizes, config.prefetch_depth, config.max_prefetch_bytes, cover=config.manual_bucketing)


def _memory(
    model: nn.Module, sizes: list[int], mesh: tuple[int, int] | None, world: int | None, config: OverlapConfig
) -> dict[str, Any]:
    # the pass's own rule (passes/prefetch.py) on the plan's gathered sizes, forward (plan
    # order) and backward (reverse); the first window wins a tie, so the answer does not
    # move when identical blocks follow
    depth, budget = config.prefetch_depth, config.max_prefetch_bytes
    forward = prefetch_plan(sizes, depth, budget)
    # backward: the buckets the forward kept gathered are computed first, the others are
    # re-gathered in reverse (the reshard pass keeps the last prefetch_depth that fit)
    kept = kept_for_backward(sizes, config)
    regathered = sizes[: len(sizes) - kept][::-1]
    backward = prefetch_plan(regathered, depth, budget, (kept, sum(sizes[len(sizes) - kept :])))
    peak, window = forward.peak_bytes, forward.peak_buckets
    if backward.peak_bytes > peak:
        top = backward.peak_at_top
        window = sorted(len(regathered) - 1 - i for i in backward.peak_buckets)
        peak, window = backward.peak_bytes, window + (list(range(len(sizes) - kept, len(sizes))) if top else [])
    total_storage = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    replicate, shard = mesh if mesh is not None else (None, None)
    return {
        "prefetch_peak_bytes": peak,
        "prefetch_peak_buckets": window,
        "prefetch_depths": {"forward": forward.depths, "backward": backward.depths},
        "kept_for_backward": list(range(len(sizes) - kept, len(sizes))),
        "all_gathered_bytes": sum(sizes),
        "sharded_storage_bytes_per_rank": -(-total_storage // shard) if shard else None,
        "shard_size": shard,
        "replicate": replicate,
        "world": world,
    }


def analyze(
    model: nn.Module,
    config: OverlapConfig,
    *,
    world: int | None = None,
    small_bytes: int = SMALL_BUCKET_BYTES,
    key: Callable[[str], str] = str,
    rename: Callable[[OverlapConfigError], OverlapConfigError] = lambda exc: exc,
) -> dict[str, Any]:
    """Resolve the plan of ``config`` against ``model`` and say what it will move.

    ``key`` spells a config key as the user's file does; ``rename`` rewrites a core error
    that way. Returns a JSON-serialisable dict: ``plan`` (source, buckets with modules,
    parameter count, storage / all-gather / reduce-scatter bytes), ``auto`` (the auto plan
    and its target), ``activation_checkpointing``, ``memory``, ``unbucketed`` parameters,
    ``tied`` parameters (each counted once, in the bucket that gathers it) and ``warnings`` (each with a ``kind``: unbucketed, large, small, no_params, ignored).
    Raises ``OverlapConfigError`` where ``parallelize`` would (plan, checkpointing, mesh).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PlanWarning)
        try:
            checked = preflight(model, config, world)  # what parallelize runs first
        except OverlapConfigError as exc:
            raise rename(exc) from None
    rows = bucket_rows(model, config, checked.plan)
    unbucketed = unbucketed_parameters(model, checked.plan)
    found = (
        warn_no_params(caught, lambda m: str(rename(OverlapConfigError(m))))
        + warn_ignored(config, key)
        + warn_large(rows)
        + warn_small(rows, small_bytes)
        + warn_unbucketed(model, unbucketed)
    )
    auto = auto_plan_info(model, config)
    return {
        "plan": {"source": "auto" if config.bucket_plans == "auto" else "config", "buckets": rows},
        "auto": {
            "buckets": auto.buckets,
            "bucket_bytes": auto.bucket_bytes,
            "target_bytes": auto.target_bytes,
            "target_source": auto.target_source,
            "container": auto.container,
            "blocks": auto.blocks,
        },
        "activation_checkpointing": checked.checkpointed,
        "unbucketed": unbucketed,
        "tied": tied_parameters(model, checked.plan),
        "memory": _memory(model, [r["gather_bytes"] for r in rows], checked.mesh, world, config),
        "warnings": found,
    }


# --------------------------------------------------------------------------- the tree
def module_tree(model: nn.Module, config: OverlapConfig, plan: list[list[str]], depth: int = 0) -> list[dict[str, Any]]:
    """Rows of the module tree down to the bucket level (and ``depth`` levels inside each
    bucket): modules containing buckets are expanded, bucketed modules are leaves.

    Each row: ``fqn``, ``type``, ``depth``, ``role`` ("container": holds buckets; "bucket":
    a plan entry; "inside": below a plan entry; "unbucketed"; "own": parameters held
    directly by a container, which no FQN can name), ``bucket`` and the byte counts.
    """
    owner = {fqn: i for i, bucket in enumerate(plan) for fqn in bucket}
    names = _registrations(model)
    ancestors = {".".join(f.split(".")[:k]) for f in owner for k in range(1, f.count(".") + 1)} | {""}
    rows: list[dict[str, Any]] = []

    def visit(prefix: str, module: nn.Module, level: int, inherited: int | None, below: int) -> None:
        own = [(n, p) for n, p in module._parameters.items() if p is not None]
        if own and prefix in ancestors:
            listed = ", ".join(n for n, _ in own)
            held = [(f"{prefix}.{n}" if prefix else n, p) for n, p in own]
            totals, tied, ids = _counted(held, lambda fqn: _module_of(fqn) == prefix, names)
            _add_bytes(totals, ids, {id(p): p for _, p in own}, config)
            rows.append(
                {
                    "fqn": f"{prefix}.({listed})" if prefix else f"({listed})",
                    "type": "own parameters",
                    "depth": level,
                    "role": "own",
                    "bucket": None,
                    **totals,
                    "tied": tied,
                }
            )
        for name, child in module.named_children():
            if next(child.parameters(), None) is None:
                continue
            fqn = f"{prefix}.{name}" if prefix else name
            if fqn in ancestors:
                role, bucket = "container", None
            elif fqn in owner:
                role, bucket = "bucket", owner[fqn]
            elif inherited is not None:
                role, bucket = "inside", inherited
            else:
                role, bucket = "unbucketed", None
            rows.append(
                {"fqn": fqn, "type": type(child).__name__, "depth": level, "role": role, "bucket": bucket}
                | _param_rows(child, fqn, config, names)
            )
            if role == "container":
                visit(fqn, child, level + 1, None, 0)
            elif role in ("bucket", "inside") and below < depth:
                visit(fqn, child, level + 1, bucket, below + 1)

    visit("", model, 0, None, 0)
    return rows
