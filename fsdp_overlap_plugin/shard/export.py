"""Weights out: a model's trained weights as a ``save_pretrained`` folder, one tensor at a time.

``save_pretrained(model, directory)`` works on a model sharded by the plugin (or by
``fully_shard``, or not at all). Each state-dict entry is gathered in turn
(``DTensor.full_tensor()``) and rank 0 streams it into safetensors files, so the memory it
costs is about one full tensor per rank, never the model. For a transformers model the
folder is what transformers' own ``save_pretrained`` writes:

* tied weights once, under the name ``from_pretrained`` expects (a tied Llama's
  ``lm_head.weight`` is left out);
* the checkpoint's original names and layout (transformers' reverse weight conversions,
  entry by entry: a Mixtral's fused experts back to one tensor per expert, GPT-NeoX's
  ``lm_head`` back to ``embed_out``);
* ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus
  ``model.safetensors.index.json`` past ``max_shard_size``;
* ``config.json`` (the library class in ``architectures``, the saved dtype) and
  ``generation_config.json``.

Any other module is written under its state-dict names, a tied tensor under each of its
names, so ``load_state_dict`` takes the file back as it is.

``full_state_dict(model)``: every entry as a full CPU tensor on rank 0 and ``{}`` on the
other ranks, the contract of Accelerate's FSDP2 ``get_state_dict``; for a model the
plugin prepared, ``accelerator.get_state_dict`` returns it.

**Every rank must call both.** A gather one rank starts alone waits for the others
forever (gloo and NCCL give up after the process group's timeout, 30 minutes by default):
that was the silent hang of ``save_pretrained`` under ``if accelerator.is_main_process``.
So both first count, through the store, the ranks that called them; a rank still alone
after ``timeout`` seconds (``rank_check_timeout``) stops with an error naming the fix. An
error while writing on rank 0 does not leave the others in the next gather: rank 0 keeps
gathering, writes nothing more, and its error is raised on every rank at the end.

The writer (``write_folder``, in ``export_files.py`` with the plan) reads each group of
tensors through a ``fetch`` function, so ``fsdp-overlap export`` writes the same files from
a checkpoint on disk, in one process.
"""

from __future__ import annotations

import itertools
import os
import types
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..config.parse import parse_dtype
from ..config.schema import OverlapConfigError
from ..config.sizes import DEFAULT_MAX_SHARD_SIZE
from . import hf

# the plan and the files it writes live in export_files.py; importable from here as before
from .export_files import ExportPlan, Group, plan_export, write_folder

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "ExportPlan",
    "Group",
    "export_root",
    "full_state_dict",
    "install_save_pretrained",
    "plan_export",
    "save_pretrained",
    "tied_groups",
    "write_folder",
]

# The store-based checks of one call: every rank makes its calls in the same order.
_CALLS = itertools.count()
_DEFAULT_TIMEOUT_S = 300.0


# ---------------------------------------------------------------------- in a run
class _AllRanks:
    """One collective export call: every rank must arrive (within ``timeout`` seconds),
    and rank 0's outcome (done, or the error that stopped it) reaches every rank."""

    def __init__(self, what: str, timeout: float | None, model: nn.Module):
        from ..runtime.ranks import RankAgreement

        self.what = what
        self.timeout = _timeout(model) if timeout is None else float(timeout)
        self.agreement = RankAgreement.default(f"fsdp_overlap/export/{next(_CALLS)}", self.timeout)
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def arrive(self) -> None:
        if self.agreement is None:
            return
        self.agreement.all_arrived(
            "arrive",
            f"{self.what} call",
            f"{self.what} gathers every parameter from all ranks, so every rank must call it, and only rank 0 "
            "writes: call it outside `if accelerator.is_main_process:` / `if trainer.is_global_zero:` / "
            "`if rank == 0:`.",
        )

    def finish(self, error: BaseException | None) -> None:
        """Share rank 0's outcome: raise rank 0's error (or this rank's own) on every rank.
        The other ranks wait for rank 0 to write its last tensor, at least 10 minutes."""
        if self.agreement is not None and (self.rank == 0 or error is None):
            text = None if error is None else f"{type(error).__name__}: {error}"
            failure = self.agreement.rank0_outcome("outcome", text, max(self.timeout, 600.0))
            if self.rank != 0 and failure:
                raise RuntimeError(f"fsdp-overlap: {self.what} failed on rank 0 (the writer): {failure}")
        if error is not None:
            raise error


def _timeout(model: nn.Module) -> float:
    from ..runtime.state import get_state

    for module in model.modules():
        state = get_state(module)
        if state is not None:
            return float(state.config.rank_check_timeout)
    return _DEFAULT_TIMEOUT_S


def export_root(model: nn.Module) -> tuple[nn.Module, str]:
    """The module whose weights are exported, and its FQN in ``model``: a LightningModule
    (or any wrapper) holding one transformers model and nothing else is exported as that
    model, with its names and its config."""
    if hf.is_transformers_model(model):
        return model, ""
    found = hf.outermost_transformers_models(model)
    if len(found) == 1:
        fqn, inner = found[0]
        if {id(p) for p in model.parameters()} <= {id(p) for p in inner.parameters()}:
            return inner, fqn
    return model, ""


def _local_entries(model: nn.Module, state_dict: Mapping[str, Any] | None) -> dict[str, torch.Tensor]:
    """The tensors to export by name: ``state_dict``'s, or ``model``'s own (the sharded
    parameters themselves, so tied names hold one object; never gathered here)."""
    from .sharding import gather_disabled

    if state_dict is None:
        with gather_disabled():
            state_dict = model.state_dict(keep_vars=True)
    return {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}


def _identity(tensor: torch.Tensor) -> tuple:
    """Equal for two entries that hold the same data (a tied weight read twice)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if local.device.type == "meta" or local.numel() == 0:
        return ("object", id(tensor))
    return (local.device.type, local.data_ptr(), tuple(tensor.shape), local.stride(), tensor.dtype)


def tied_groups(tensors: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Names (in state-dict order) of entries that hold one tensor, groups of two or more."""
    groups: dict[tuple, list[str]] = {}
    for name, tensor in tensors.items():
        groups.setdefault(_identity(tensor), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _gather(tensor: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """``tensor`` whole, on the CPU where ``keep`` (every rank joins a DTensor's gather)."""
    with torch.no_grad():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        return full.detach().to("cpu") if keep else None


def save_pretrained(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    state_dict: Mapping[str, Any] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | str | None = None,
    original_format: bool = True,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Write ``model``'s weights to ``directory`` as a ``save_pretrained`` folder that plain
    ``from_pretrained`` loads (module doc). **Collective**: every rank calls it; only rank
    0 writes; memory is about one full tensor per rank.

    Args:
        model: a model sharded by the plugin (or ``fully_shard``, or unsharded). A module
            holding one transformers model and nothing else (a LightningModule's
            ``self.model``) saves that model.
        state_dict: the entries to write instead of the model's own (sharded or full).
        max_shard_size: a file holds at most this much ("5GB", "500MiB", bytes); past it
            the weights are split into several files with an index.
        dtype: cast floating-point tensors (``"bf16"``, ``torch.bfloat16``); default: as
            trained (the master weights' dtype).
        original_format: a transformers model's tensors in its original checkpoint
            format, as transformers' ``save_original_format`` (default True).
        timeout: seconds to wait for every rank to call it (default: the model's
            ``rank_check_timeout``, else 300).

    Returns (on every rank) the files, tensor count and bytes written, the names left out
    (tied copies) and notes.
    """
    together = _AllRanks("save_pretrained", timeout, model)
    together.arrive()
    root, prefix = export_root(model) if state_dict is None else (model, "")
    tensors = _local_entries(root, state_dict)
    cast = parse_dtype(dtype, "dtype") if dtype is not None else None
    entries = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    error: BaseException | None = None
    summary: dict[str, Any] = {}
    try:
        plan = plan_export(root, entries, tied_groups(tensors), dtype=cast, original_format=original_format)
        if prefix:
            plan.notes.insert(
                0, f"saved {prefix} ({type(root).__name__}), the transformers model {type(model).__name__} holds"
            )
        writer = together.rank == 0

        def fetch(group: Group) -> dict[str, torch.Tensor]:
            return {name: _gather(tensors[name], writer) for name in group.sources}

        summary = write_folder(directory, plan, fetch, writer=writer, max_shard_size=max_shard_size)
    except BaseException as exc:  # noqa: BLE001 - shared with every rank by finish()
        error = exc
    together.finish(error)
    return summary


def full_state_dict(model: nn.Module, *, timeout: float | None = None) -> dict[str, torch.Tensor]:
    """Every state-dict entry of ``model`` as a full CPU tensor on rank 0 (tied names hold
    one tensor, as in the model), ``{}`` on the other ranks. **Collective**, like
    ``save_pretrained``; Accelerate's FSDP2 ``get_state_dict`` returns the same."""
    together = _AllRanks("get_state_dict", timeout, model)
    together.arrive()
    keep = together.rank == 0
    tensors = _local_entries(model, None)
    out: dict[str, torch.Tensor] = {}
    error: BaseException | None = None
    try:
        gathered: dict[tuple, torch.Tensor | None] = {}
        for name, tensor in tensors.items():
            key = _identity(tensor)
            if key not in gathered:
                gathered[key] = _gather(tensor, keep)
            if keep:
                out[name] = gathered[key]
    except BaseException as exc:  # noqa: BLE001
        error = exc
    together.finish(error)
    return out


# ------------------------------------------- transformers' save_pretrained, in a run
_NOT_SHARDED_ARGS = {
    "push_to_hub": (False, "save, then upload the folder (huggingface_hub.upload_folder)"),
    "variant": (None, "rename the files after saving"),
    "distributed_checkpoint": (False, "use fsdp_overlap_plugin.shard.checkpoint.save for sharded checkpoints"),
}


def _transformers_save_pretrained(
    self: nn.Module,
    save_directory: str | os.PathLike,
    is_main_process: bool = True,
    state_dict: dict | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    save_original_format: bool = True,
    **kwargs: Any,
) -> None:
    """``model.save_pretrained(...)`` of a transformers model the plugin sharded.

    With full tensors in ``state_dict`` (``accelerator.get_state_dict(model)`` on rank 0,
    ``{}`` elsewhere) it is transformers' own. Otherwise (no ``state_dict``, or a sharded
    one) it is ``export.save_pretrained``: collective, so every rank calls it, and rank 0
    writes (``is_main_process`` is not needed; transformers' ``save_function`` and
    ``token`` have nothing to do)."""
    if state_dict is not None and not any(isinstance(v, DTensor) for v in state_dict.values()):
        with hf.library_classes(self):
            return type(self).save_pretrained(
                self,
                save_directory,
                is_main_process=is_main_process,
                state_dict=state_dict,
                max_shard_size=max_shard_size,
                save_original_format=save_original_format,
                **kwargs,
            )
    for key, (default, instead) in _NOT_SHARDED_ARGS.items():
        if kwargs.get(key, default) != default:
            raise OverlapConfigError(
                f"save_pretrained({key}={kwargs[key]!r}) is not supported on a model sharded by fsdp-overlap: {instead}."
            )
    if getattr(self, "_hf_peft_config_loaded", False):
        raise OverlapConfigError(
            "save_pretrained of a PEFT model sharded by fsdp-overlap is not supported: merge the adapters first."
        )
    save_pretrained(
        self, save_directory, state_dict=state_dict, max_shard_size=max_shard_size, original_format=save_original_format
    )
    return None


def install_save_pretrained(model: nn.Module) -> None:
    """Give every transformers model in ``model`` the ``save_pretrained`` above (an
    instance attribute: the class and its other methods are unchanged)."""
    for _, module in hf.outermost_transformers_models(model):
        module.save_pretrained = types.MethodType(_transformers_save_pretrained, module)
