"""Checkpoints and export of a model prepared by ``accelerate.adapter.prepare``.

``save_state`` / ``load_state``: under ``distributed_type: FSDP`` (GPUs, NPUs) Accelerate's
FSDP2 code reads and writes DTensor models and optimizers through
``torch.distributed.checkpoint``. Elsewhere (a CPU launch, a DDP config) Accelerate writes
``get_state_dict(model)`` and ``optimizer.state_dict()`` from rank 0 only: there a save hook
gives the tied names of the full model state tensors of their own for safetensors, a load
hook reads it back and re-shards it, and the optimizer's ``state_dict`` / ``load_state_dict``
return and accept the full, FQN-keyed state (``torch.distributed.checkpoint.state_dict``),
so the files do not depend on the rank or the world size. On both, the methods run with the
parameters' gathers off (they read the shards).

On every distributed type a checkpoint is complete or absent (``shard/atomic_checkpoint.py``):
``save_state`` writes into a hidden sibling of the folder and renames it into place once
every rank has written (an existing folder of that name is replaced only by a complete
one); ``load_state`` refuses a folder that lacks a file, naming it and the newest complete
checkpoint beside it. With ``automatic_checkpoint_naming`` the folders keep Accelerate's
names (``checkpoints/checkpoint_<i>``), the oldest beyond ``total_limit`` are removed after
the new one is in place, and ``load_state()`` picks the newest folder, never a leftover.

``get_state_dict(model)`` (and so ``save_model``): ``export.full_state_dict``.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..core import (
    check_complete,
    full_state_dict,
    gather_disabled,
    refuse_tensor_parallel_checkpoint,
    retire,
    written_atomically,
)

__all__ = ["install_checkpointing", "install_get_state_dict"]

_MODELS_ATTR = "_fsdp_overlap_models"
_EXPORTED_ATTR = "_fsdp_overlap_exported_models"
_CHECKPOINTS = "checkpoints"  # the folder under project_dir that automatic_checkpoint_naming fills
_NUMBER = re.compile(r"([0-9]+)(?=[^/]*$)")  # a checkpoint folder's number, as Accelerate reads it


class _AlreadyLoaded(nn.Module):
    """Stands in, in ``load_state``'s list of models, for a model the load hook has
    already loaded: Accelerate skips it, and the models after it keep their file index."""

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False):  # noqa: ARG002
        return nn.modules.module._IncompatibleKeys([], [])


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _separate_tied(state: dict) -> dict:
    """``state`` with the names of a tied weight holding separate tensors, because
    safetensors refuses shared storage."""
    seen: set[int] = set()
    out = {}
    for key, value in state.items():
        out[key] = value.clone() if id(value) in seen else value
        seen.add(id(value))
    return out


def _weights_file(input_dir: str | os.PathLike, index: int) -> Path:
    from accelerate.utils.constants import MODEL_NAME, SAFE_MODEL_NAME

    ending = f"_{index}" if index > 0 else ""
    safe = Path(input_dir) / f"{SAFE_MODEL_NAME}{ending}.safetensors"
    return safe if safe.exists() else Path(input_dir) / f"{MODEL_NAME}{ending}.bin"


def _load_full_model_state(model: nn.Module, path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    # Every rank read the whole file, so each can take its own shard: no broadcast.
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def _add_once(models: list, model: nn.Module) -> None:
    """``models.append(model)`` unless it is there already: ``prepare_objects`` installs
    again for an optimizer prepared after the model."""
    if not any(m is model for m in models):
        models.append(model)


def install_get_state_dict(accelerator: Any, model: nn.Module) -> None:
    """``accelerator.get_state_dict(model)`` (and so ``accelerator.save_model``) of a model
    prepared here: full CPU tensors on the main process and ``{}`` elsewhere, as
    Accelerate's FSDP2 path returns (``export.full_state_dict``; tied names hold one
    tensor), on every device. Accelerate's own code would return the sharded DTensors on
    a CPU launch, which transformers' ``save_pretrained`` cannot write (an error on uneven
    shards, a hang on even ones), and on GPUs gather each parameter once more per name
    lookup. Other models keep Accelerate's method."""
    ours: list = accelerator.__dict__.setdefault(_EXPORTED_ATTR, [])
    if not ours:
        library = accelerator.get_state_dict

        def get_state_dict(model: nn.Module, unwrap: bool = True) -> dict:
            if any(model is m for m in ours):
                return full_state_dict(model)
            return library(model, unwrap=unwrap)

        get_state_dict.__doc__ = library.__doc__
        accelerator.get_state_dict = get_state_dict
    _add_once(ours, model)


def _reading_shards(accelerator: Any, *names: str) -> None:
    """Run the accelerator's methods ``names`` with the parameters' gathers off (once)."""
    for name in names:
        method = getattr(accelerator, name)
        if getattr(method, "_reads_shards", False):
            continue

        @functools.wraps(method)
        def wrapped(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
            with gather_disabled():
                return _method(*args, **kwargs)

        wrapped._reads_shards = True  # type: ignore[attr-defined]
        setattr(accelerator, name, wrapped)


def install_checkpointing(accelerator: Any, model: nn.Module, prepared: list) -> None:
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType

    from ..core import patch_optimizer_state_dict

    # Both paths below go through torch's state-dict helpers (Accelerate's FSDP2 save/load,
    # the optimizer's full-state methods), which look each parameter up with getattr: on a
    # model sharded here that is the gathering property, a full all-gather per lookup (one
    # save_state of a 2-layer GPT: 57 on a CPU launch, 115 under FSDP2). They read the shards.
    _reading_shards(accelerator, "save_state", "load_state")
    _install_atomic_state(accelerator)
    if accelerator.distributed_type == DistributedType.FSDP:
        return  # Accelerate's FSDP2 save/load (torch.distributed.checkpoint) handles DTensor models
    ours: list = accelerator.__dict__.setdefault(_MODELS_ATTR, [])
    if not ours:

        def save_hook(models: list, weights: list, output_dir: str) -> None:
            for i, m in enumerate(models):
                if any(m is o for o in ours):
                    # save_state took weights[i] from accelerator.get_state_dict, which for
                    # these models is export.full_state_dict: full on the main process
                    weights[i] = _separate_tied(weights[i])

        def load_hook(models: list, input_dir: str) -> None:
            for i, m in enumerate(models):
                if any(m is o for o in ours):
                    _load_full_model_state(m, _weights_file(input_dir, i))
                    models[i] = _AlreadyLoaded()

        accelerator.register_save_state_pre_hook(save_hook)
        accelerator.register_load_state_pre_hook(load_hook)
    _add_once(ours, model)
    for obj in prepared:
        if isinstance(obj, (AcceleratedOptimizer, torch.optim.Optimizer)):
            inner = obj.optimizer if isinstance(obj, AcceleratedOptimizer) else obj
            # torch's own helper: state_dict() gathers the full FQN-keyed state (rank 0),
            # load_state_dict() takes it and keeps this rank's shard.
            patch_optimizer_state_dict(model, inner, _full_options())


# ------------------------------------------------------------- complete or absent
def _install_atomic_state(accelerator: Any) -> None:
    """Wrap the accelerator's ``save_state`` / ``load_state`` (once, on the instance, on
    every distributed type): see the module docstring."""
    save, load = accelerator.save_state, accelerator.load_state
    if getattr(save, "_atomic", False):
        return

    @functools.wraps(save)
    def save_state(output_dir: Any = None, *args: Any, **kwargs: Any) -> str:
        _refuse_tensor_parallel(accelerator, "accelerator.save_state")
        config = accelerator.project_configuration
        automatic = config.automatic_checkpoint_naming
        final = _save_target(accelerator, output_dir)
        writer = accelerator.is_local_main_process if config.save_on_each_node else accelerator.is_main_process
        with written_atomically(final, writer=writer) as partial:
            config.automatic_checkpoint_naming = False  # write where we say; the rotation follows
            try:
                save(str(partial), *args, **kwargs)
            finally:
                config.automatic_checkpoint_naming = automatic
        if automatic and config.total_limit is not None:
            if writer:  # after the new one is in place: a kill keeps total_limit complete ones
                _rotate(final.parent, config.total_limit)
            accelerator.wait_for_everyone()
        return str(final)

    @functools.wraps(load)
    def load_state(input_dir: Any = None, *args: Any, **kwargs: Any) -> Any:
        _refuse_tensor_parallel(accelerator, "accelerator.load_state")
        if input_dir is None and accelerator.project_configuration.automatic_checkpoint_naming:
            input_dir = _newest_numbered(Path(accelerator.project_dir) / _CHECKPOINTS)
        if input_dir is not None:
            check_complete(Path(input_dir).expanduser())
        return load(input_dir, *args, **kwargs)

    save_state._atomic = True  # type: ignore[attr-defined]
    accelerator.save_state, accelerator.load_state = save_state, load_state


def _refuse_tensor_parallel(accelerator: Any, what: str) -> None:
    """A tensor-parallel model's ``save_state`` / ``load_state`` is tested under FSDP with
    ``fsdp_state_dict_type: SHARDED_STATE_DICT`` (torch.distributed.checkpoint, what
    configs/overlap.yaml sets); the other layouts stop, on every rank, before anything is
    written or read."""
    from accelerate.utils import DistributedType

    from .._accelerate_compat import prepared_models

    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    kind = str(getattr(getattr(plugin, "state_dict_type", None), "name", getattr(plugin, "state_dict_type", "")))
    if accelerator.distributed_type == DistributedType.FSDP and kind.endswith("SHARDED_STATE_DICT"):
        return
    for model in prepared_models(accelerator):
        refuse_tensor_parallel_checkpoint(
            model, f"{what} (fsdp_state_dict_type {kind or 'none'}, distributed_type {accelerator.distributed_type})"
        )


def _save_target(accelerator: Any, output_dir: Any) -> Path:
    """Where ``save_state(output_dir)`` puts the checkpoint, by Accelerate's rules."""
    if accelerator.project_configuration.automatic_checkpoint_naming:
        final = Path(accelerator.project_dir) / _CHECKPOINTS / f"checkpoint_{accelerator.save_iteration}"
        if os.path.lexists(final):
            raise ValueError(
                f"Checkpoint directory {final} ({accelerator.save_iteration}) already exists. Please manually "
                "override `self.save_iteration` with what iteration to start with."
            )  # Accelerate's own words
        return final
    if output_dir is None:
        raise ValueError(
            "save_state() needs an output_dir, or ProjectConfiguration(automatic_checkpoint_naming=True) "
            "on the Accelerator."
        )
    return Path(output_dir).expanduser()


def _numbered(folder: Path) -> list[tuple[int, Path]]:
    """The checkpoint folders in ``folder`` by number; hidden leftovers of a killed save
    are not among them."""
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        number = _NUMBER.search(entry.name)
        if number and entry.is_dir() and not entry.name.startswith("."):
            found.append((int(number.group(1)), entry))
    return sorted(found)


def _newest_numbered(folder: Path) -> str:
    numbered = _numbered(folder)
    if not numbered:
        raise FileNotFoundError(f"load_state(): no checkpoint in {folder} (automatic_checkpoint_naming).")
    return str(numbered[-1][1])


def _rotate(folder: Path, total_limit: int) -> None:
    """Accelerate's ``total_limit``: the oldest folders beyond it are removed (renamed out
    of sight, then deleted)."""
    numbered = _numbered(folder)
    for _, old in numbered[: max(len(numbered) - total_limit, 0)]:
        retire(old)
