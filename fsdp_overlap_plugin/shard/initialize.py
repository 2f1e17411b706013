"""Materialising a meta-device model on its shards, initialised the way its library does.

A model built under ``torch.device("meta")`` has shapes and no values. ``materialize``
allocates every meta tensor on the device (each rank only its shards), then runs the
initialisers a normal build would have run, in the order it would have run them:

1. ``reset_parameters()`` of every module that has one, innermost first (PyTorch's
   convention: what ``nn.Linear.__init__`` calls; a parent's own scheme has the last word);
2. for every ``transformers.PreTrainedModel`` in the tree, its own initialisation
   (``initialize_weights()``, what ``post_init()`` runs: ``_init_weights`` per module,
   dispatched to the nearest sub-model). It sets the norms to 1, draws the embeddings and
   linears with ``initializer_range`` and recomputes the rotary ``inv_freq`` buffers. (A
   meta build skips it: ``init_weights`` does nothing under a meta device context.)

Nothing is silent. Every meta tensor is filled with NaN (floating) before the
initialisers run, and its version counter is read before and after: a tensor that no
initialiser wrote (nor replaced) is *uninitialised* and, per ``on_uninitialized``, an
error naming it ("error", the default) or a warning with the tensor set to zero ("warn":
for tensors a checkpoint loaded afterwards will fill). Then every parameter and buffer is
checked for NaN and inf (an initialiser that wrote only part of a tensor leaves NaN
behind); any is an error naming it, raised on every rank.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..config.schema import ON_UNINITIALIZED, OverlapConfigError
from . import hf
from .sharding import gather_disabled, local_box

__all__ = ["UninitializedWarning", "check_finite", "materialize", "slots"]

# Names listed in one error message; the rest are counted.
_MAX_NAMES = 12


class UninitializedWarning(UserWarning):
    """A meta-device tensor that no initialiser wrote was set to zero (``on_uninitialized: warn``)."""


@dataclass
class _Slot:
    """Where a tensor lives: ``module._parameters[name]`` or ``module._buffers[name]``."""

    module: nn.Module
    kind: str  # "_parameters" or "_buffers"
    name: str
    fqn: str

    def get(self) -> torch.Tensor | None:
        return getattr(self.module, self.kind)[self.name]

    def set(self, value: torch.Tensor) -> None:
        getattr(self.module, self.kind)[self.name] = value


def slots(model: nn.Module) -> list[_Slot]:
    """Every parameter and buffer slot of ``model``, tied tensors once per module holding them."""
    out = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for name, value in getattr(module, kind).items():
                if value is not None:
                    out.append(_Slot(module, kind, name, f"{prefix}.{name}" if prefix else name))
    return out


def _default_policy(model: nn.Module) -> str:
    from ..runtime.state import get_state

    for module in model.modules():
        state = get_state(module)
        if state is not None:
            return state.config.on_uninitialized
    return "error"


def materialize(
    model: nn.Module,
    device: torch.device | str,
    *,
    init: bool = True,
    full_init: bool | None = None,
    on_uninitialized: str | None = None,
) -> nn.Module:
    """Allocate ``model``'s meta-device parameters and buffers on ``device`` (sharded ones
    as this rank's shards) and initialise them as the model's library does (module doc).
    Tensors already on a real device keep their values (moved to ``device``).

    ``full_init`` (default: on for CPU meshes) initialises full-size parameters once and
    keeps each rank's shard, so the result equals an unsharded model initialised the same
    way with the same seed; it needs the unsharded model's memory once. Without it the
    shards are initialised directly: right on CUDA/NPU meshes, where DTensor's random ops
    give each shard its own part of one random stream, but on CPU meshes DTensor draws
    every shard from the same generator state, so all ranks would get the same values.

    ``on_uninitialized`` ("error" or "warn"; default: the ``parallelize`` config's, else
    "error") decides what a meta tensor that no initialiser wrote does. ``init=False``
    only allocates (the memory is uninitialised: load a checkpoint into it next).
    """
    policy = on_uninitialized if on_uninitialized is not None else _default_policy(model)
    if policy not in ON_UNINITIALIZED:
        raise OverlapConfigError(f"on_uninitialized: unknown value {policy!r}; valid: {', '.join(ON_UNINITIALIZED)}.")
    every = slots(model)
    pending = [slot for slot in every if slot.get().is_meta]
    # _apply replaces plain parameters module by module, which unties tied weights;
    # remember who shared what and share it again afterwards
    shared: dict[int, list[_Slot]] = {}
    for slot in every:
        shared.setdefault(id(slot.get()), []).append(slot)
    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))
    for group in shared.values():
        first, *rest = group
        for slot in rest:
            slot.set(first.get())
    if not init or not pending:
        return model
    sharded = [s.get() for s in pending if isinstance(s.get(), DTensor)]
    if full_init is None:
        full_init = bool(sharded) and sharded[0].device_mesh.device_type == "cpu"
    with gather_disabled(), torch.no_grad():
        untouched = _initialise(model, pending, full_init)
    _report_untouched(untouched, policy)
    check_finite(model)
    return model


def _initialise(model: nn.Module, pending: list[_Slot], full_init: bool) -> list[_Slot]:
    """Run the initialisers on ``pending`` (with full-size stand-ins for the shards when
    ``full_init``); returns the slots no initialiser wrote."""
    stand_in: dict[int, torch.Tensor] = {}  # id(DTensor) -> its full-size stand-in
    swapped: list[tuple[_Slot, DTensor]] = []
    if full_init:
        for slot in pending:
            value = slot.get()
            if isinstance(value, DTensor):
                full = stand_in.get(id(value))
                if full is None:  # tied parameters share one stand-in
                    local = value.to_local()
                    full = nn.Parameter(
                        torch.empty(value.shape, dtype=value.dtype, device=local.device),
                        requires_grad=value.requires_grad,
                    )
                    stand_in[id(value)] = full
                swapped.append((slot, value))
                slot.set(full)
    seen: dict[int, tuple[torch.Tensor, int]] = {}
    for slot in pending:
        value = slot.get()
        if id(value) not in seen:
            if value.is_floating_point() or value.is_complex():
                value.fill_(float("nan"))
            seen[id(value)] = (value, _version(value))
    before = {slot.fqn: seen[id(slot.get())] for slot in pending}
    # id(DTensor) -> (it, what its stand-in slot holds after the initialisers)
    sources: dict[int, tuple[DTensor, torch.Tensor]] = {}
    try:
        _run_initialisers(model)
        if not full_init:
            _zero_padding_rows(model)
    finally:
        for slot, param in swapped:
            sources.setdefault(id(param), (param, slot.get()))  # an initialiser may have replaced it
            slot.set(param)
    untouched = []
    for slot in pending:
        value, version = before[slot.fqn]
        now = sources.get(id(slot.get()), (None, slot.get()))[1]
        if now is value and _version(now) == version:
            untouched.append(slot)
    for param, full in sources.values():
        shard = distribute_tensor(full.detach(), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    return untouched


def _version(t: torch.Tensor) -> int:
    # an in-place write to a DTensor bumps the local tensor's counter (and the wrapper's)
    return t._version + (t.to_local()._version if isinstance(t, DTensor) else 0)


def _run_initialisers(model: nn.Module) -> None:
    with _untied(model):
        for module in reversed(list(model.modules())):
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
        for _, pretrained in hf.outermost_transformers_models(model):
            hf.initialize_weights(pretrained)


def _zero_padding_rows(model: nn.Module) -> None:
    """``weight[padding_idx].zero_()`` (``nn.Embedding.reset_parameters``, transformers'
    ``_init_weights``) selects a row of a ``Shard(0)`` DTensor, which DTensor answers with a
    gathered copy: the write never reaches the shard. Write it on the rank that holds it."""
    for module in model.modules():
        if not isinstance(module, nn.Embedding) or module.padding_idx is None:
            continue
        weight = module._parameters.get("weight")
        if not isinstance(weight, DTensor):
            continue
        rows = local_box(weight)[0]
        row = module.padding_idx % weight.shape[0]
        if rows.start <= row < rows.stop:
            weight.to_local()[row - rows.start].zero_()


@contextlib.contextmanager
def _untied(model: nn.Module):
    """transformers ties weights *after* initialising them (``post_init``: initialise, then
    ``tie_weights``), so the tie source's initialisation is what a normal build keeps (an
    embedding's zero ``padding_idx`` row; ``lm_head``'s own draw is thrown away). Give each
    tied slot transformers declares (``all_tied_weights_keys``: tied name -> source) a
    throwaway tensor while the initialisers run, and share the source again afterwards."""
    swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
    for _, pretrained in hf.outermost_transformers_models(model):
        for tied, source in (getattr(pretrained, "all_tied_weights_keys", None) or {}).items():
            holder, name = _owner(pretrained, tied)
            origin, origin_name = _owner(pretrained, source)
            if holder is None or origin is None:
                continue
            value = holder._parameters.get(name)
            if value is not None and value is origin._parameters.get(origin_name):
                swapped.append((holder, name, value))
                holder._parameters[name] = nn.Parameter(torch.empty_like(value), requires_grad=False)
    try:
        yield
    finally:
        for holder, name, value in swapped:
            holder._parameters[name] = value


def _owner(root: nn.Module, fqn: str) -> tuple[nn.Module | None, str]:
    parent, _, name = fqn.rpartition(".")
    try:
        module = root.get_submodule(parent) if parent else root
    except AttributeError:
        return None, name
    return (module, name) if name in module._parameters else (None, name)


def _report_untouched(untouched: list[_Slot], policy: str) -> None:
    if not untouched:
        return
    names = [
        f"{s.fqn} ({type(s.module).__name__}, {'parameter' if s.kind == '_parameters' else 'buffer'})"
        for s in untouched
    ]
    listed = ", ".join(names[:_MAX_NAMES]) + (f" and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else "")
    if policy == "error":
        raise OverlapConfigError(
            f"materialize: no initialiser wrote these meta-device tensors, so they would hold "
            f"uninitialised memory: {listed}. Give their module a reset_parameters() (or, for a "
            "transformers model, handle them in its _init_weights), build them outside the meta "
            "device, or, if a checkpoint loaded next fills them, set on_uninitialized: warn."
        )
    with torch.no_grad():
        for slot in untouched:
            value = slot.get()
            (value.to_local() if isinstance(value, DTensor) else value).zero_()
    warnings.warn(
        f"materialize: no initialiser wrote {listed}; set to zero (on_uninitialized: warn). "
        "Load a checkpoint that holds them before training.",
        UninitializedWarning,
        stacklevel=3,
    )


def check_finite(model: nn.Module) -> None:
    """NaN or inf in any parameter or buffer (this rank's shard) is an error on every rank
    of the parameters' mesh (the count is all-reduced, so no rank goes on alone)."""
    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    bad = []
    for name, value in (*model.named_parameters(), *model.named_buffers()):
        local = value.to_local() if isinstance(value, DTensor) else value
        if (local.is_floating_point() or local.is_complex()) and local.numel() and not torch.isfinite(local).all():
            bad.append(name)
    count = torch.tensor([len(bad)], dtype=torch.int64, device=_flag_device(mesh))
    if mesh is not None and dist.is_initialized():
        for dim in range(mesh.ndim):
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    if not count.item():
        return
    where = (
        ", ".join(bad[:_MAX_NAMES]) + (f" and {len(bad) - _MAX_NAMES} more" if len(bad) > _MAX_NAMES else "")
        if bad
        else "tensors of another rank's shards (see that rank's error)"
    )
    raise OverlapConfigError(
        f"materialize: NaN or inf after initialisation in {where}. An initialiser wrote only part "
        "of the tensor, or computed non-finite values; training would start from them."
    )


def _flag_device(mesh) -> torch.device:
    if mesh is None or mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type, None)
    index = module.current_device() if module is not None and hasattr(module, "current_device") else 0
    return torch.device(mesh.device_type, index)
