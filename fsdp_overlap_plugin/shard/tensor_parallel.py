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
gathers and reduce-scatters of sequence parallelism) stay in the module's forward, outside
the parameter's gather, where no pass touches them.

A plan with a ``sequence_parallel`` entry is a sequence-parallel plan (Megatron's, as
torchtitan's ``apply_tp`` writes it): the residual stream is a ``DTensor`` split by
sequence (``Shard(1)``) from the token embedding to the head, so that every module reads
the global shapes (a transformers model computes its positions and mask from them). The
styles then become:

* ``rowwise`` Embedding: vocabulary rows split; its output reduce-scattered to sequence shards;
* ``sequence_parallel`` (a norm): runs on the sequence shards, its weight whole;
* ``colwise`` Linear: its input all-gathered from the sequence shards, once per parent
  module (torchtitan's ``PrepareModuleInput`` on the attention and the MLP);
* ``rowwise`` Linear: its output reduce-scattered to sequence shards instead of all-reduced;
* ``colwise`` head (``_head_of``): its input gathered, its logits gathered for the loss.

``resolve_tp_plan`` refuses at startup what that cannot make right (a second embedding
added whole to the stream, a norm with split children, a head left whole, tied weights
split two ways, a split dimension the group does not divide). A sequence length the group
does not divide is split unevenly (15 tokens: 8 and 7), as DTensor pads its collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from ..config.plan import resolve_module_names
from ..contract import OverlapConfigError

__all__ = [
    "TENSOR_DIM_NAME",
    "TENSOR_DIM_NAMES",
    "SEQUENCE_PARALLEL",
    "TensorLayout",
    "apply_tp_plan",
    "auto_plan_notes",
    "auto_plan_of",
    "check_tensor_mesh",
    "is_sequence_parallel",
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


#: the style that makes a plan sequence-parallel, and the dimension its activations are split on
SEQUENCE_PARALLEL = "sequence_parallel"
SEQUENCE_DIM = 1


def is_sequence_parallel(resolved: dict[str, str]) -> bool:
    """A plan with one ``sequence_parallel`` entry is a sequence-parallel plan."""
    return SEQUENCE_PARALLEL in resolved.values()


def _split_of(style: str | None, module: nn.Module) -> str:
    """How ``style`` places ``module``'s weight over the tensor group, in words: two
    modules sharing a weight (tied) must agree."""
    if style == "colwise":
        return "rows split" if isinstance(module, nn.Linear) else "columns split"
    if style == "rowwise":
        return "columns split" if isinstance(module, nn.Linear) else "rows split"
    return "whole"


def _styles(resolved: dict[str, str], model: nn.Module, head: str | None) -> dict[str, Any]:
    """torch's ``ParallelStyle`` for each entry of a resolved plan (see the module doc);
    a sequence-parallel plan adds one input gather per parent of colwise Linear layers."""
    sequence = is_sequence_parallel(resolved)
    out: dict[str, Any] = {}
    for fqn, style in resolved.items():
        module = model.get_submodule(fqn)
        embedding = isinstance(module, nn.Embedding)
        if style == SEQUENCE_PARALLEL:
            out[fqn] = _SequenceShardedNorm()
        elif style == "rowwise" and embedding:
            # token ids are whole on every rank (torch's default, Shard(-1), would gather them)
            # under sequence parallelism its output is reduce-scattered to sequence shards and
            # stays a DTensor: the model reads the global sequence length (positions, mask)
            out[fqn] = (
                RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(SEQUENCE_DIM), use_local_output=False)
                if sequence
                else RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
            )
        elif style == "rowwise":
            out[fqn] = (
                RowwiseParallel(output_layouts=Shard(SEQUENCE_DIM), use_local_output=False)
                if sequence
                else RowwiseParallel()
            )
        elif style == "colwise" and not embedding:
            # the head's logits are gathered for the loss (transformers' colwise_gather_output)
            output = Replicate() if fqn == head else Shard(-1)
            out[fqn] = _ColwiseGathered(output_layouts=output) if sequence else ColwiseParallel(output_layouts=output)
        elif style == "colwise":
            out[fqn] = ColwiseParallel()
    if sequence:
        for parent in _colwise_parents(resolved, model, head):
            out[parent] = _GatherSequenceInputs()
    return out


def _colwise_parents(resolved: dict[str, str], model: nn.Module, head: str | None) -> list[str]:
    """The parents (not the root, not in the plan) of the colwise Linear layers other than
    the head: each all-gathers its sequence-sharded inputs once for all its colwise
    children (q, k and v read one gathered input; its gradient is reduce-scattered once)."""
    parents: list[str] = []
    for fqn, style in resolved.items():
        if style != "colwise" or fqn == head or "." not in fqn:
            continue
        parent = fqn.rsplit(".", 1)[0]
        if parent not in resolved and parent not in parents:
            parents.append(parent)
    return parents


def _gathered(value: Any, mesh: DeviceMesh) -> Any:
    if isinstance(value, DTensor) and value.device_mesh == mesh and value.placements == (Shard(SEQUENCE_DIM),):
        return value.redistribute(placements=(Replicate(),))
    return value


class _GatherSequenceInputs(ParallelStyle):
    """torchtitan's ``PrepareModuleInput(Shard(1) -> Replicate())`` on an attention or MLP
    module, for whatever its inputs are called: every input that is a sequence-sharded
    ``DTensor`` of the group is all-gathered, once, before its colwise children read it."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return (
                tuple(_gathered(a, device_mesh) for a in args),
                {k: _gathered(v, device_mesh) for k, v in kwargs.items()},
            )

        module.register_forward_pre_hook(gather, with_kwargs=True)
        return module


class _SequenceShardedNorm(SequenceParallel):
    """torch's ``SequenceParallel`` (the norm on the sequence shards, its weight whole on
    every rank), except for a plain-tensor input: in our plans the stream is a ``DTensor``
    from the embedding on, so a plain tensor is whole (``Replicate``) and is split here,
    never taken for this rank's shard as torch's style takes it."""

    @staticmethod
    def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)
        if x.placements != sequence_sharding:
            x = x.redistribute(placements=sequence_sharding)
        return x


class _ColwiseGathered(ColwiseParallel):
    """``ColwiseParallel`` whose input is made whole whatever it is: a sequence-sharded
    ``DTensor`` is all-gathered (a no-op where the parent gathered it already), a plain
    tensor is taken as whole."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):
            return DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False)
        if x.placements != (Replicate(),):
            x = x.redistribute(placements=(Replicate(),))
        return x


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
    ``nn.Linear`` nor an ``nn.Embedding``, a weight shared by two modules (tied) that the
    plan splits two ways, and what a sequence-parallel plan cannot make right
    (``_check_sequence_parallel``)."""
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
    _check_tied(model, resolved, claimed_by)
    if is_sequence_parallel(resolved):
        _check_sequence_parallel(model, resolved, claimed_by)
    return resolved


def _tied_owners(model: nn.Module) -> list[list[tuple[str, str]]]:
    """``[(module FQN, parameter name), ...]`` per parameter held by more than one module."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for prefix, module in model.named_modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((prefix, name))
    return [group for group in owners.values() if len(group) > 1]


def _check_tied(model: nn.Module, resolved: dict[str, str], claimed_by: dict[str, str]) -> None:
    """Modules sharing a weight (a tied embedding and head) must split it the same way
    (``apply_tp_plan`` ties the split weights back together): a rowwise embedding and a
    colwise head both split the vocabulary rows."""
    for group in _tied_owners(model):
        splits = {fqn: _split_of(resolved.get(fqn), model.get_submodule(fqn)) for fqn, _ in group}
        if len(set(splits.values())) > 1:
            (a, sa), (b, sb) = list(splits.items())[:2]
            said = lambda fqn: f"{claimed_by[fqn]!r} ({resolved[fqn]})" if fqn in resolved else "no entry (whole)"  # noqa: E731
            raise OverlapConfigError(
                f"tp_plan: {a!r} and {b!r} share one weight (tied), but the plan gives {a!r} {said(a)}: {sa}, and "
                f"{b!r} {said(b)}: {sb}. Split both the same way (a rowwise embedding and a colwise head both split "
                "the vocabulary rows) or leave both whole."
            )


def _head_of(model: nn.Module) -> str | None:
    """The FQN of the model's output layer, whose colwise split gathers its logits: a
    transformers model's ``get_output_embeddings()``, else the last ``nn.Linear`` with as
    many outputs as the largest ``nn.Embedding`` has rows (the repo GPT's ``head``); None
    if neither."""
    from .hf import outermost_transformers_models

    fqn_of = {id(m): fqn for fqn, m in model.named_modules()}
    for _, hf_model in outermost_transformers_models(model):
        head = hf_model.get_output_embeddings()
        if isinstance(head, nn.Linear) and id(head) in fqn_of:
            return fqn_of[id(head)]
    vocab = max((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), default=None)
    heads = [fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and m.out_features == vocab]
    return heads[-1] if heads else None


def _check_sequence_parallel(model: nn.Module, resolved: dict[str, str], claimed_by: dict[str, str]) -> None:
    """What a sequence-parallel plan needs, refused at startup naming the module and the
    entry: the stream starts split at the one token embedding (rowwise), a second
    embedding would be added whole to it (the repo GPT's learned positions); a
    ``sequence_parallel`` module is a norm, whose weight stays whole; the head is colwise,
    gathering the stream and its logits for the loss."""
    key = next(claimed_by[fqn] for fqn, style in resolved.items() if style == SEQUENCE_PARALLEL)
    where = f"tp_plan[{key!r}] makes the plan sequence-parallel: the residual stream is split by sequence over the tensor-parallel ranks from the token embedding to the head"
    for fqn, style in resolved.items():
        if style != SEQUENCE_PARALLEL:
            continue
        module = model.get_submodule(fqn)
        inner = next((f"{fqn}.{n}" for n, c in module.named_children() if any(True for _ in c.parameters())), None)
        if inner is not None:
            raise OverlapConfigError(
                f"tp_plan[{claimed_by[fqn]!r}]: sequence_parallel runs a norm on the sequence shards, its weights "
                f"whole; {fqn!r} is a {type(module).__name__} whose child {inner!r} holds parameters. Name the norms "
                "themselves (e.g. model.layers.*.input_layernorm) and split the Linear layers colwise / rowwise."
            )
    embeddings = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.Embedding)]
    token = [fqn for fqn, _ in embeddings if resolved.get(fqn) == "rowwise"]
    if not token:
        named = f" ({', '.join(repr(f) for f, _ in embeddings)})" if embeddings else " (the model has no nn.Embedding)"
        raise OverlapConfigError(
            f"{where}; it starts at the token embedding, which the plan must split rowwise{named}: add e.g. "
            "'model.embed_tokens': rowwise (its output is then reduce-scattered to sequence shards)."
        )
    for fqn, _ in embeddings:
        if fqn != token[0]:
            style = resolved.get(fqn)
            now = f"{claimed_by[fqn]!r} ({style})" if style else "no entry: whole"
            raise OverlapConfigError(
                f"{where}; {fqn!r} is a second nn.Embedding ({now}) beside the token embedding {token[0]!r}: its "
                "output (learned positions, token types) would be added whole to the sequence shards, which "
                "sequence parallelism cannot split yet. Remove the sequence_parallel entries: colwise / rowwise "
                "alone keep the stream whole on every rank."
            )
    head = _head_of(model)
    if head is not None and resolved.get(head) != "colwise":
        style = resolved.get(head)
        now = f"{claimed_by[head]!r} ({style})" if style else "no entry: whole"
        raise OverlapConfigError(
            f"{where}; the head {head!r} ({now}) reads the last norm's sequence shards: split it colwise "
            f"('{head}': colwise), which gathers the stream before it and its logits after it for the loss."
        )


def _check_divisible(model: nn.Module, resolved: dict[str, str], size: int) -> None:
    """Each split dimension must be a multiple of the group size: uneven parts give the
    tensor-parallel ranks graphs of different shapes (the rank check stops them), and a
    vocabulary is padded for that in Megatron and torchtitan alike."""
    for fqn, style in resolved.items():
        module = model.get_submodule(fqn)
        if style not in _SPLITTABLE or not isinstance(module, _SPLITTABLE[style]):
            continue
        rows = style == "colwise" if isinstance(module, nn.Linear) else style == "rowwise"
        dim, what = (0, "rows") if rows else (1, "columns")
        n = module.weight.shape[dim]
        if n % size:
            pad = (
                f" (model.resize_token_embeddings(n, pad_to_multiple_of={size}) for a transformers vocabulary)"
                if isinstance(module, nn.Embedding)
                or n in {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
                else ""
            )
            raise OverlapConfigError(
                f"tp_plan: {style} splits the {n} {what} of {fqn}.weight over the {size} tensor-parallel ranks, "
                f"which is not a multiple of mesh.tensor={size}: the ranks would hold parts of different sizes. "
                f"Pad that dimension to a multiple of {size}{pad}, or leave {fqn!r} whole."
            )


def apply_tp_plan(model: nn.Module, plan: dict[str, str] | str, tp_mesh: DeviceMesh) -> dict[str, str]:
    """Split ``model``'s modules over ``tp_mesh`` as ``plan`` (the config's ``tp_plan``)
    says; returns the plan resolved to module FQNs (``resolve_tp_plan``). "replicate"
    entries only claim their modules: they stay whole on every rank. A weight two modules
    share (tied) stays one parameter: torch splits it once per module, the later copies are
    replaced by the first."""
    resolved = resolve_tp_plan(model, plan)
    _check_divisible(model, resolved, tp_mesh.size())
    tied = _tied_owners(model)
    torch_plan = _styles(resolved, model, _head_of(model))
    if torch_plan:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, tp_mesh, torch_plan)
    for group in tied:
        (first, name), *others = group
        param = model.get_submodule(first)._parameters[name]
        for fqn, other in others:
            model.get_submodule(fqn)._parameters[other] = param
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
