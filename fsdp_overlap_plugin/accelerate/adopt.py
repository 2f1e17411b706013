"""Accelerators of an FSDP launch, adopted: ``accelerator.prepare`` shards and compiles the
model with fsdp-overlap, so code that only knows Accelerate (transformers' ``Trainer``,
Accelerate's own examples) trains through the plugin.

Importing ``fsdp_overlap_plugin.accelerate`` calls ``install()``, which wraps four methods
of ``accelerate.Accelerator`` (the class, once; other code keeps calling them as before):

``__init__``
    An ``Accelerator`` created in an FSDP launch (``ACCELERATE_USE_FSDP=true``: what
    ``accelerate launch`` exports for ``distributed_type: FSDP``, and what
    ``Accelerator(fsdp_plugin=...)`` sets) is *adopted*. It must be FSDP2
    (``fsdp_version: 2``; else an error here, at ``Accelerator()``). On a machine without
    GPUs or NPUs Accelerate never enables FSDP (its state says ``MULTI_CPU``, its FSDP plugin
    is dropped, and transformers' ``Trainer`` would wrap the model in
    ``DistributedDataParallel``); adoption sets ``distributed_type`` to ``FSDP`` with the FSDP
    plugin Accelerate builds from the launch, as it does on a GPU. Code that branches on FSDP
    (the ``Trainer``'s checkpoints, ``no_sync``, ``clip_grad_norm_``, ``save_state``) then
    takes one path on every device, the one it takes for FSDP2 models, which the plugin's
    models are (``DTensor`` ``Shard(0)`` parameters). The main process prints one line.
``prepare`` / ``prepare_model``
    On an adopted accelerator, a model the plugin has not prepared yet goes through
    ``fsdp_overlap_plugin.accelerate.prepare`` (plan, shard, compile with the passes; the
    schedule summary after the first optimizer step); objects prepared with a model that
    already is the plugin's (an optimizer created after it, data loaders) go through
    Accelerate's own per-object methods.
``clip_grad_norm_``
    What Accelerate's FSDP2 branch does, without its lookup of the model among those it
    prepared (which fails once a second model is prepared).

Accelerators that are not adopted are untouched.

Why wrap the class: the ``Trainer`` creates its ``Accelerator`` itself and calls
``accelerator.prepare(model, optimizer)``; no argument or config of either library lets a
plugin take the model (Accelerate drops unknown ``fsdp_config`` keys and refuses custom
dynamo backends). What the plugin changes in the state is only what a GPU launch of the
same config already has.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.nn as nn

from .._accelerate_compat import clip_grad_norm, deferred_parallelism_check, set_fsdp_distributed_type
from ..config.schema import OverlapConfigError
from ..core import get_state, is_sharded, say
from .config import fsdp_launch

__all__ = ["ADOPTED_ATTR", "install", "is_adopted", "is_plugin_model"]

#: Set on an adopted ``Accelerator`` instance.
ADOPTED_ATTR = "_fsdp_overlap_adopted"


def is_adopted(accelerator: Any) -> bool:
    """Whether ``accelerator`` was created in an FSDP launch after ``install()``."""
    return bool(getattr(accelerator, ADOPTED_ATTR, False))


def is_plugin_model(model: Any) -> bool:
    """A model fsdp-overlap has sharded (``parallelize`` or ``prepare`` ran on it)."""
    return isinstance(model, nn.Module) and (get_state(model) is not None or is_sharded(model))


def install() -> None:
    """Put ``Accelerator``'s methods below on ``accelerate.Accelerator`` (once per process)."""
    import accelerate

    if _ORIGINALS:
        return
    for name in ("__init__", "prepare", "prepare_model", "clip_grad_norm_"):
        original = getattr(accelerate.Accelerator, name)
        _ORIGINALS[name] = original
        method = getattr(Accelerator, name)
        functools.update_wrapper(method, original)
        setattr(accelerate.Accelerator, name, method)


#: Accelerate's own methods, replaced by ``install``.
_ORIGINALS: dict[str, Any] = {}


class Accelerator:
    """The methods ``install`` puts on ``accelerate.Accelerator``, each calling Accelerate's
    own (this class is never instantiated; its name is what an error raised through them
    reports: "raised in Accelerator.prepare")."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not fsdp_launch():
            _ORIGINALS["__init__"](self, *args, **kwargs)
            return
        # Accelerate checks its ParallelismConfig against the distributed type last; on a
        # CPU-only launch that is MULTI_CPU until adoption makes it FSDP, as on a GPU
        with deferred_parallelism_check() as checks:
            _ORIGINALS["__init__"](self, *args, **kwargs)
        _adopt(self)
        for config, accelerator in checks:
            config._validate_accelerator(accelerator)

    def prepare(self, *args: Any, device_placement: Any = None) -> Any:
        if not is_adopted(self):
            return _ORIGINALS["prepare"](self, *args, device_placement=device_placement)
        from .adapter import prepare, prepare_objects

        if any(isinstance(a, nn.Module) and not is_plugin_model(a) for a in args):
            return prepare(self, *args)
        return prepare_objects(self, *args)

    def prepare_model(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        if is_adopted(self) and isinstance(model, nn.Module) and not is_plugin_model(model):
            from .adapter import prepare

            return prepare(self, model)
        return _ORIGINALS["prepare_model"](self, model, *args, **kwargs)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        # Accelerate's FSDP branch looks the model up with `parameters == list(m.parameters())`
        # for each model it prepared: with a second model that compares DTensors elementwise
        # and fails (its FSDP2 takes one model per Accelerator; the plugin takes several).
        # What that branch then does for FSDP2 models is this, on the parameters given.
        if not is_adopted(self):
            return _ORIGINALS["clip_grad_norm_"](self, parameters, max_norm, norm_type=norm_type)
        self.unscale_gradients()
        return clip_grad_norm(self, list(parameters), max_norm, norm_type)


# -------------------------------------------------------------------------- adoption
def _adopt(accelerator: Any) -> None:
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    kind = accelerator.distributed_type
    if kind == DistributedType.MULTI_CPU:
        # Accelerate's FSDP needs a GPU; its state dropped the plugin. Build it from the
        # launch's FSDP_* variables, as Accelerator() does on a GPU.
        plugin = FullyShardedDataParallelPlugin()
        _check_version(plugin)
        set_fsdp_distributed_type(accelerator, plugin)
    elif kind == DistributedType.FSDP:
        _check_version(accelerator.state.fsdp_plugin)
    elif kind == DistributedType.NO:
        return  # one process, no launcher: prepare() (explicit) still shards over one rank
    else:
        from .adapter import check_accelerator

        check_accelerator(accelerator)  # DeepSpeed, Megatron-LM, XLA: an error naming them
        return
    setattr(accelerator, ADOPTED_ATTR, True)
    from . import trainer  # transformers' Trainer creates its accelerator itself: its FSDP paths

    trainer.install()
    how = (
        " (Accelerate alone would run it as MULTI_CPU, DistributedDataParallel)"
        if kind != accelerator.distributed_type
        else ""
    )
    say(
        accelerator.process_index,
        f"fsdp-overlap: this FSDP launch runs through fsdp-overlap on {accelerator.num_processes} "
        f"{accelerator.device.type} process(es): distributed_type FSDP{how}; accelerator.prepare shards and "
        "compiles the model with the passes",
    )


def _check_version(plugin: Any) -> None:
    version = getattr(plugin, "fsdp_version", None)
    if version != 2:
        raise OverlapConfigError(
            f"fsdp_version: {version!r}: fsdp-overlap keeps FSDP2's parameter layout and runs only with "
            "fsdp_version: 2 (fsdp_config in the accelerate launch config, or FullyShardedDataParallelPlugin"
            "(fsdp_version=2)); it was imported in this FSDP launch, so it prepares the model instead of "
            "Accelerate's FSDP."
        )
