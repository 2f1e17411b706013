"""The checks every entry point runs on a model and its config before any process group
exists: ``parallelize``, Accelerate's ``prepare`` and ``fsdp-overlap check`` call this one
function, so a plan, checkpointing or mesh problem gets the same verdict from all three.
Pure (module tree, shapes and config only), so every rank raises the same error."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from ..config.plan import plan_buckets
from ..config.schema import ASYNC_TP_NEEDS_TENSOR, OverlapConfig, OverlapConfigError
from ..config.tp_plan import NO_TENSOR_DIMENSION
from .activation_checkpointing import checkpointed_modules
from .tensor_parallel import resolve_tp_plan, tensor_parallel_parameters

__all__ = ["Preflight", "preflight"]


@dataclass
class Preflight:
    """What the checks resolved."""

    plan: list[list[str]]
    """The bucket plan as explicit module FQNs (``resolve_plan``)."""
    checkpointed: list[str] = field(default_factory=list)
    """Modules whose forward is recomputed in backward (``checkpointed_modules``)."""
    notes: list[str] = field(default_factory=list)
    """What will be adjusted on the model (transformers' own checkpointing taken over)."""
    mesh: tuple[int, int] | None = None
    """``(replicate, shard)`` for the world size, when one was given."""


def preflight(model: nn.Module, config: OverlapConfig, world: int | None = None) -> Preflight:
    """Resolve the plan and the checkpointed modules of ``config`` against ``model``, and the
    mesh for ``world`` ranks; raise ``OverlapConfigError`` naming the key at fault."""
    _refuse_fully_shard(model)
    plan = plan_buckets(model, config)
    if config.tp_plan:
        resolve_tp_plan(model, config.tp_plan)
    checkpointed, notes = checkpointed_modules(model, config)
    mesh = config.mesh.sizes(world) if world is not None else None
    if world is not None and config.tp_plan and config.mesh.tensor == 1:
        # the mesh is the config's (fsdp-overlap check); parallelize checks the mesh it runs on
        raise OverlapConfigError(NO_TENSOR_DIMENSION)
    if world is not None and config.async_tp and config.mesh.tensor == 1 and not tensor_parallel_parameters(model):
        raise OverlapConfigError(ASYNC_TP_NEEDS_TENSOR)
    return Preflight(plan, checkpointed, notes, mesh)


def _refuse_fully_shard(model: nn.Module) -> None:
    """A module torch's ``fully_shard`` already wrapped (a ModelParallelStrategy or
    torchtitan recipe's ``configure_model`` does both ``parallelize_module`` and
    ``fully_shard``): the plugin shards the data-parallel dimension itself."""
    from torch.distributed.fsdp import FSDPModule

    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            where = f"module {name!r}" if name else "the model"
            raise OverlapConfigError(
                f"{where} was sharded by torch's fully_shard; fsdp-overlap shards the data-parallel dimension "
                "itself (compile-visible, with the passes): remove the fully_shard calls (in configure_model, or "
                "before prepare / parallelize) and keep the rest, a tensor-parallel plan included."
            )
