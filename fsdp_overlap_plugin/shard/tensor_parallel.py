"""Tensor parallelism under the data-parallel sharding (2-D: TP inside a node, FSDP across).

The tensor-parallel part is torch's own: ``parallelize_module`` with a plan, run by the
user's code before ``parallelize`` or by ``apply_tp_plan`` from the config's ``tp_plan``.
It leaves a parameter of a split module a ``DTensor`` on the 1-D tensor-parallel mesh
(``Shard(0)`` for colwise, ``Shard(1)`` for rowwise; ``Replicate()`` where a user's own
plan says so) and wraps the module's forward so that its activations enter and leave as it needs.

``shard.sharding`` then shards the tensor-parallel rank's *local* part over the
data-parallel ranks (FSDP2's layout for TP parameters: ``_StridedShard(0)`` where both
split dim 0), and its gather rebuilds that local part only (a gather over the data-parallel
group, which the passes bucket) before re-entering the tensor-parallel mesh with the
plan's placement. The plan's own collectives (an all-reduce after a rowwise layer, the
gathers of sequence parallelism) stay in the module's forward, outside the parameter's
gather, where no pass touches them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..config.plan import resolve_module_names
from ..contract import OverlapConfigError

__all__ = [
    "TENSOR_DIM_NAME",
    "TENSOR_DIM_NAMES",
    "TensorLayout",
    "apply_tp_plan",
    "auto_plan_notes",
    "auto_plan_of",
    "check_tensor_mesh",
    "refuse_tensor_parallel_checkpoint",
    "resolve_tp_plan",
    "tensor_layout",
    "tensor_parallel_parameters",
]

TENSOR_DIM_NAME = "tensor"
#: what a mesh given to ``parallelize`` may call its tensor-parallel dimension: ours, torchtitan's
#: and Accelerate's ("tp"), Lightning's ModelParallelStrategy's ("tensor_parallel")
TENSOR_DIM_NAMES = (TENSOR_DIM_NAME, "tp", "tensor_parallel")

# the module types each style splits (torch's ParallelStyles refuse others with a bare
# NotImplementedError; ours names the module and the plan entry)
_SPLITTABLE = {
    "colwise": (nn.Linear, nn.Embedding),
    "rowwise": (nn.Linear, nn.Embedding),
}


@dataclass(frozen=True)
class TensorLayout:
    """How a parameter of a tensor-parallel model enters the module's computation: the
    data-parallel gather rebuilds ``local_shape`` (this tensor-parallel rank's part), which
    then becomes a ``DTensor`` on ``mesh`` with ``placements`` (the plan's); with no mesh
    (a parameter the plan left whole) it stays the plain tensor gathered."""

    mesh: DeviceMesh | None
    placements: tuple
    local_shape: torch.Size
    local_stride: tuple[int, ...]


def _style(style: str):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}[style]()


def auto_plan_of(model: nn.Module) -> dict[str, str]:
    """``tp_plan: auto``: the colwise / rowwise entries of a transformers model's own plan
    (``shard/hf.own_tp_plan``); an error naming the model when it has none."""
    from .hf import own_tp_plan

    applied, _ = own_tp_plan(model)
    if not applied:
        raise OverlapConfigError(
            f"tp_plan: auto reads a transformers model's own tensor-parallel plan (its _tp_plan, from the config's "
            f"base_model_tp_plan); {type(model).__name__} has no colwise or rowwise entry there: write the plan "
            "(tp_plan: {module pattern: colwise | rowwise | replicate})."
        )
    return applied


def auto_plan_notes(model: nn.Module) -> list[str]:
    """What ``tp_plan: auto`` left whole of the model's own plan, one line for the report."""
    from .hf import own_tp_plan

    _, left = own_tp_plan(model)
    if not left:
        return []
    entries = ", ".join(f"{k} ({v})" for k, v in left.items())
    return [f"tp_plan: auto applied the model's colwise and rowwise entries; left whole (not split yet): {entries}"]


def resolve_tp_plan(model: nn.Module, plan: dict[str, str] | str) -> dict[str, str]:
    """``plan`` (the config's ``tp_plan``) resolved to module FQNs, patterns expanded, in
    plan order; pure, so ``preflight`` (and with it ``fsdp-overlap check``) gives the same
    verdict as ``apply_tp_plan``. Errors name the entry: a pattern matching no module (with
    the nearest names), a module given two styles, a split of a module that is neither an
    ``nn.Linear`` nor an ``nn.Embedding``."""
    if plan == "auto":
        plan = auto_plan_of(model)
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, str] = {}
    claimed_by: dict[str, str] = {}
    for pattern, style in plan.items():
        for fqn in resolve_module_names(pattern, names, where=f"tp_plan[{pattern!r}]"):
            if fqn in resolved and resolved[fqn] != style:
                raise OverlapConfigError(
                    f"tp_plan: module {fqn!r} is matched by {claimed_by[fqn]!r} ({resolved[fqn]}) and by "
                    f"{pattern!r} ({style}); give each module one style."
                )
            resolved[fqn], claimed_by[fqn] = style, pattern
            module = model.get_submodule(fqn)
            types = _SPLITTABLE.get(style)
            if types is not None and not isinstance(module, types):
                raise OverlapConfigError(
                    f"tp_plan[{pattern!r}]: {style} splits nn.Linear and nn.Embedding modules; {fqn!r} is a "
                    f"{type(module).__name__}. Name its Linear children instead (fsdp-overlap inspect lists them)."
                )
    return resolved


def apply_tp_plan(model: nn.Module, plan: dict[str, str] | str, tp_mesh: DeviceMesh) -> dict[str, str]:
    """Split ``model``'s modules over ``tp_mesh`` as ``plan`` (the config's ``tp_plan``)
    says; returns the plan resolved to module FQNs (``resolve_tp_plan``). "replicate"
    entries only claim their modules: they stay whole on every rank."""
    resolved = resolve_tp_plan(model, plan)
    torch_plan = {fqn: _style(style) for fqn, style in resolved.items() if style != "replicate"}
    if torch_plan:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, tp_mesh, torch_plan)
    return resolved


def tensor_parallel_parameters(model: nn.Module) -> list[tuple[str, DTensor]]:
    """The parameters that are already ``DTensor``s (a tensor-parallel plan placed them)."""
    return [(name, p) for name, p in model.named_parameters() if isinstance(p, DTensor)]


def check_tensor_mesh(model: nn.Module, tp_mesh: DeviceMesh | None) -> None:
    """Every ``DTensor`` parameter must live on a 1-D mesh of the same ranks as this
    rank's tensor-parallel group, with a placement the data-parallel sharding composes
    with (``Shard(d)`` or ``Replicate()``); raises naming the first that does not."""
    for name, param in tensor_parallel_parameters(model):
        mesh = param.device_mesh
        if tp_mesh is None:
            raise OverlapConfigError(
                f"parameter {name} is already a DTensor on a mesh of {mesh.size()} ranks (a tensor-parallel "
                f"plan placed it), but the config has no tensor dimension: set mesh: {{tensor: {mesh.size()}}} "
                "(the tensor-parallel group size) so that the plugin shards over the other ranks only."
            )
        if mesh.ndim != 1:
            raise OverlapConfigError(
                f"parameter {name} is a DTensor on a {mesh.ndim}-D mesh {mesh.mesh_dim_names}; the plugin composes "
                "with tensor parallelism on a 1-D mesh (its tensor dimension) and shards the other dimensions itself: "
                "pass the tensor-parallel submesh to parallelize_module, and leave data parallelism to the plugin."
            )
        if mesh.mesh.tolist() != tp_mesh.mesh.tolist():
            raise OverlapConfigError(
                f"parameter {name} is split over ranks {mesh.mesh.tolist()}, but this rank's tensor-parallel group "
                f"(the mesh's innermost dimension, mesh.tensor={tp_mesh.size()}) is ranks {tp_mesh.mesh.tolist()}; "
                "build the plan's mesh from the plugin's (fsdp_overlap_plugin.build_mesh(config)['tensor']) or with "
                "the tensor-parallel dimension innermost, as init_device_mesh(..., (dp, tp)) does."
            )
        for placement in param.placements:
            if not isinstance(placement, (Shard, Replicate)):
                raise OverlapConfigError(
                    f"parameter {name} is placed as {placement} on the tensor-parallel mesh; the plugin shards "
                    "parameters placed Shard(d) or Replicate() there."
                )


def tensor_layout(param: torch.Tensor, tp_mesh: DeviceMesh | None = None) -> TensorLayout:
    """``param``'s tensor-parallel layout, read before the data-parallel sharding; for a
    parameter the plan left whole (a plain tensor), no mesh: the module computes with it
    as a plain tensor, the same on every rank of the tensor-parallel group.

    The layout's mesh is ``tp_mesh`` (the plugin's, its hash pinned) wherever it equals the
    parameter's: the mesh is a graph input, and a mesh the user sliced
    (``device_mesh["tensor_parallel"]``) hashes differently in every process, which can
    order the graph's inputs differently on different ranks (the rank check stops that)."""
    if not isinstance(param, DTensor):
        return TensorLayout(mesh=None, placements=(), local_shape=param.shape, local_stride=tuple(param.stride()))
    local = param.to_local()
    mesh = tp_mesh if tp_mesh is not None and tp_mesh == param.device_mesh else param.device_mesh
    return TensorLayout(
        mesh=mesh,
        placements=tuple(param.placements),
        local_shape=local.shape,
        local_stride=tuple(local.stride()),
    )


def refuse_tensor_parallel_checkpoint(model: nn.Module, what: str) -> None:
    """A checkpoint path not yet tested with a tensor-parallel model: ``what`` (a save or a
    load) stops with that said, instead of writing or reading state nobody has checked.
    ``shard/checkpoint.py``'s ``save`` / ``load_latest`` and ``save_pretrained`` /
    ``load_pretrained`` are tested at 2-D and do not call it."""
    on_tensor = [
        (name, param)
        for name, param in model.named_parameters()
        if isinstance(param, DTensor) and set(param.device_mesh.mesh_dim_names or ()) & set(TENSOR_DIM_NAMES)
    ]
    if not on_tensor:
        return
    split = [name for name, param in on_tensor if isinstance(param.placements[-1], Shard)]
    which = (
        f"{split[0]} is split over the mesh's tensor dimension" if split else f"{on_tensor[0][0]} is on a tensor mesh"
    )
    raise OverlapConfigError(
        f"{what}: the model is tensor-parallel ({which}); this way of saving or loading is not supported for "
        "it yet. Tested at 2-D: fsdp_overlap_plugin.shard.checkpoint.save / load_latest (sharded, resumable, "
        "loads at other layouts) and fsdp_overlap_plugin.save_pretrained / load_pretrained "
        "(docs/tensor-parallel.md#checkpoints)."
    )
