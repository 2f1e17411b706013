"""``OverlapState``: what ``parallelize`` decided for one model, and what the passes did.

Attached to the model (``get_state``), read by the compile wiring, the report and the
adapters. Also the identity of everything that changes what the passes do
(``OverlapState.uuid`` / ``cache_key``): inductor's caches and the rank-agreement keys
are built from it. Imports no compile code, so reading a model's state or its report
never loads the compile wiring.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.nn as nn

from .. import _torch_compat as compat
from ..config.schema import PREDICTION_ONLY, OverlapConfig

__all__ = ["OverlapState", "PassSwitches", "decide_passes", "get_state", "local_layout", "model_fingerprint"]

_PACKAGE_DIR = Path(__file__).resolve().parents[1]
_STATE_ATTR = "_fsdp_overlap_state"
# Hex characters kept of a sha256 digest (128 bits): collision-free in practice, and
# short enough for cache directory names and log lines.
_DIGEST_CHARS = 32
# The source files whose code decides what the passes do to a graph, what they record and
# how the uuid is made: a change to any of them invalidates inductor's caches (every file
# of passes/, events.py included).
_SOURCE_DIRS = ("passes", "compile")
_SOURCE_FILES = ("contract.py", "_torch_compat.py", "runtime/state.py")


@dataclass(frozen=True)
class PassSwitches:
    """Which of our passes are on and how the graphs compile, decided once per model by
    ``decide_passes``: the pass table (``compile/``), the report and the CLI read these
    instead of deriving them from the config again."""

    backend: str | None  # the torch.compile backend; None with compile: false
    manual_bucketing: bool
    overlap_grad_reduce: bool
    pin_order: bool  # under inductor, the final collective order pinned as dependencies
    fullgraph: bool
    inductor_overlap: str  # inductor's own distributed passes (config/inductor_overlap.py)

    @property
    def reorders(self) -> bool:
        """A pass that moves collectives is on (bucketing or gradient overlap)."""
        return self.manual_bucketing or self.overlap_grad_reduce

    @property
    def names(self) -> list[str]:
        """The passes the config turns on, as the report and ``fsdp-overlap check`` name them."""
        return [name for name in ("manual_bucketing", "overlap_grad_reduce") if getattr(self, name)]


def decide_passes(config: OverlapConfig) -> PassSwitches:
    """The one place that decides from the config which passes run (``parallelize`` calls
    it once per model; a hand-built ``OverlapState`` gets it on construction)."""
    compiled = bool(config.compile)
    bucketing = compiled and config.manual_bucketing
    grad_overlap = compiled and config.overlap_grad_reduce
    return PassSwitches(
        backend=config.backend if compiled else None,
        manual_bucketing=bucketing,
        overlap_grad_reduce=grad_overlap,
        pin_order=config.backend == "inductor" and (bucketing or grad_overlap),
        fullgraph=config.fullgraph,
        inductor_overlap=config.inductor_overlap,
    )


@dataclass
class OverlapState:
    """What ``parallelize`` decided for one model, and what the passes reported."""

    config: OverlapConfig
    plan: list[list[str]]
    device_type: str
    world_size: int
    mesh_shape: tuple[int, ...]
    mesh: Any = None
    # tensor parallelism (shard/tensor_parallel.py): the group size (1: none), this rank's
    # tensor-parallel mesh, and the config's tp_plan resolved to module FQNs (empty when the
    # user's own code split the model)
    tensor_parallel: int = 1
    tp_mesh: Any = None
    tp_plan: dict[str, str] = field(default_factory=dict)
    tp_groups: tuple[str, ...] = ()  # the tensor-parallel group's name (its collectives are the plan's)
    # torch.compile's dynamic for this model: the config's, except under tensor parallelism
    # (parallelize: "auto" compiles every length static there)
    compile_dynamic: bool | None = None
    gather_group: Any = None
    model_fingerprint: str = ""
    records: list[dict] = field(default_factory=list)
    reshard: list[dict] = field(default_factory=list)  # per joint graph: what annotate_reshard did
    last_bucket: int | None = None  # the plan's last entry that owns parameters
    unbucketed_params: list[str] = field(default_factory=list)
    fallback: str | None = None
    instance: int = 0  # the n-th model prepared in this process: the same on every rank
    dynamo_graphs: int = 0  # graphs Dynamo handed to our backend so far
    # digests of the collective sequences every rank agreed on (compile.backends.overlap_backend):
    # a recompile that leaves one of them (a new sequence length) needs no agreement round
    agreed: list[str] = field(default_factory=list)
    recompiles: list[dict] = field(default_factory=list)  # per recompile: Dynamo's reason, whether it was agreed
    guard_counts: dict = field(default_factory=dict)  # Dynamo's guard failures before this call (_torch_compat)
    called: bool = False  # the compiled forward has run once
    graph_id: str | None = None  # the Dynamo graph being compiled now (its fingerprint)
    graph_kind: str | None = None  # the kind of graph the post-grad passes run on now
    rank: int = 0
    adjustments: list[str] = field(default_factory=list)  # what parallelize changed on the model, and why
    warned: set[str] = field(default_factory=set)  # modules already named in an unbucketed warning
    param_entries: dict[str, int | None] = field(default_factory=dict)  # parameter FQN -> its plan entry
    compile_cache: list[dict] = field(default_factory=list)  # per Dynamo graph: what inductor's caches did
    local_layout: str = ""  # digest of this rank's shard shapes (they differ across ranks when uneven)
    checkpointed: list[str] = field(default_factory=list)  # modules whose forward is recomputed in backward
    reduce_scatter_impl: str = "native"  # what reduce_scatter_impl resolved to (auto -> native / all_to_all)
    # receive_first: shard group name -> the receive-first group over it (runtime/exchange.py)
    exchange_groups: dict[str, str] = field(default_factory=dict)
    exchanges_before: int = 0  # all-to-alls those groups had run when this model was parallelized
    reduce_scatter_reason: str = ""  # why (devices.reduce_scatter_choice)
    replica_sync: Any = None  # accumulation.ReplicaSync of the compiled model
    summary_hooked: bool = False  # Accelerate: the summary prints after the first optimizer step
    # shard/takeover.AfterPrepare: what prepare fixed, checked by the compiled forward and the backend
    after_prepare: Any = None
    # which passes run, the backend, fullgraph, inductor_overlap: decided once (decide_passes)
    passes: PassSwitches = None  # type: ignore[assignment]  # filled in __post_init__ when not given

    def __post_init__(self) -> None:
        if self.passes is None:
            self.passes = decide_passes(self.config)

    def uuid(self) -> str:
        """Identifies everything that changes what the passes do to a graph; the same on
        every rank (the rank-agreement keys are built from it)."""
        return _pass_uuid(self)

    def cache_key(self) -> str:
        """``uuid()`` plus this rank's local shard shapes, and its rank where the
        bucketing pass runs: what our passes report to inductor as their ``uuid()``, and
        so part of the AOT autograd and FX graph cache keys. AOT autograd keys its cache
        on the graph Dynamo traced, whose DTensor inputs carry global shapes only; with
        uneven shards (97 rows on 2 ranks: 49 and 48) every rank traces the same graph
        but compiles different code, and without this a warm cache hands one rank
        another rank's code. A merged all-gather writes the rank's shards at the rank's
        offset of its output (``passes/merge.py``), so with bucketing on the compiled
        code is the rank's own even when shards are even."""
        rank = self.rank if self.passes.manual_bucketing else ""
        # the process groups this rank's graphs name (the gather group, the receive-first
        # groups): on an HSDP mesh each shard group has its own, so they belong here, not
        # in uuid(), which must be the same on every rank
        groups = f"{self.gather_group}:{sorted(self.exchange_groups.items())}"
        key = f"{self.uuid()}:{self.local_layout}:{rank}:{groups}"
        return hashlib.sha256(key.encode()).hexdigest()[:_DIGEST_CHARS]

    @property
    def passes_on(self) -> bool:
        """Whether any post-grad pass has work to do."""
        return self.passes.reorders or self.reduce_scatter_impl != "native" or self.gather_group is not None


def get_state(model: nn.Module) -> OverlapState | None:
    """The ``OverlapState`` that ``parallelize`` attached to ``model``, if any."""
    return getattr(model, _STATE_ATTR, None)


def _source_digest() -> str:
    files = [p for d in _SOURCE_DIRS for p in sorted((_PACKAGE_DIR / d).glob("*.py"))]
    files += [_PACKAGE_DIR / name for name in _SOURCE_FILES]
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(_PACKAGE_DIR).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


_SOURCE_DIGEST = _source_digest()


def _pass_uuid(state: OverlapState) -> str:
    # the keys only predictions read (a per-rank compute_profile path, say) change nothing
    # the passes do: kept out, so they neither split the ranks' agreement keys nor the caches
    config = {k: v for k, v in state.config.to_dict().items() if k not in PREDICTION_ONLY}
    payload = {
        "config": config,
        "plan": state.plan,
        "model": state.model_fingerprint,
        "world": state.world_size,
        "mesh": list(state.mesh_shape),
        # whether they exist, not their names: a group's name depends on which shard group
        # of an HSDP mesh this rank is in (the names are in cache_key())
        "gather_group": state.gather_group is not None,
        "checkpointed": state.checkpointed,
        "reduce_scatter_impl": state.reduce_scatter_impl,
        "exchange_groups": len(state.exchange_groups),
        "source": _SOURCE_DIGEST,
        "torch": compat.TORCH_VERSION,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:_DIGEST_CHARS]


def model_fingerprint(model: nn.Module) -> str:
    """A digest of the module tree and parameter shapes (no values)."""
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        digest.update(f"{name}:{type(module).__qualname__};".encode())
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
    return digest.hexdigest()[:_DIGEST_CHARS]


def local_layout(model: nn.Module) -> str:
    """A digest of this rank's local shard shapes and strides (``to_local()`` of every
    sharded parameter): equal on ranks whose compiled code is interchangeable."""
    from torch.distributed.tensor import DTensor

    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            local = param.to_local()
            digest.update(f"{name}:{tuple(local.shape)}:{local.stride()};".encode())
    return digest.hexdigest()[:_DIGEST_CHARS]
