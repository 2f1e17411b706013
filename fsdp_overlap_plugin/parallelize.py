"""``parallelize(model, config)``: plan -> shard -> compile, in that order, in place."""

from __future__ import annotations

import itertools

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from . import _torch_compat as compat
from ._torch_compat import mesh_group_names, mesh_root, resolve_process_group
from .config import inductor_overlap
from .config.schema import MeshConfig, OverlapConfig, OverlapConfigError
from .config.tp_plan import NO_TENSOR_DIMENSION
from .contract import BucketIndex
from .report.messages import install_excepthook, process_rank, say
from .runtime import accumulation, devices
from .runtime.exchange import build_receive_first_group, exchanges_run
from .runtime.state import _STATE_ATTR, OverlapState, decide_passes, local_layout, model_fingerprint
from .shard import hf
from .shard.activation_checkpointing import apply_activation_checkpointing
from .shard.export import install_save_pretrained
from .shard.preflight import Preflight, preflight
from .shard.sharding import (
    ShardSettings,
    build_gather_group,
    build_mesh,
    data_parallel_mesh,
    fully_shard_plan,
    mesh_layout,
    model_gather,
    pin_mesh_hash,
    shard_parameters,
    tensor_mesh,
)
from .shard.takeover import AfterPrepare, compile_notes_line, uncompiled
from .shard.tensor_parallel import TENSOR_DIM_NAMES, apply_tp_plan, auto_plan_notes, tensor_parallel_parameters

__all__ = ["parallelize", "pop_compile_notes", "take_over_compiled", "unbucketed_parameters"]

# What take_over_compiled undid on a module, kept on it until parallelize reports it.
_COMPILE_NOTES_ATTR = "_fsdp_overlap_compile_notes"

# A configuration error that reaches the top of a rank uncaught is printed once, short
# (report/messages.py); installed on import (errors before any process group) and again in
# parallelize (init_process_group wraps the hook it finds in its own).
install_excepthook()

# Counts the models prepared in this process. Every rank prepares the same models in the
# same order, so it tells apart the rank-agreement rounds of two models with one config.
_INSTANCES = itertools.count()
# An HSDP mesh hashed before parallelize keeps its per-process hash (shard.sharding.pin_mesh_hash):
# the compiled graphs' cache keys carry it, so a new process never finds them in the cache.
_UNPINNED_MESH = (
    "compile cache: the 2-D mesh was hashed before parallelize (its hash differs in every process, "
    "and inductor's cache keys carry it), so a new process compiles again instead of loading the "
    "compile cache; pass the mesh sizes (mesh={'replicate': R, 'shard': S}) to let the plugin build it"
)


def parameter_entries(model: nn.Module, plan: list[list[str]]) -> dict[str, int | None]:
    """Every parameter FQN (a tied parameter under each of its names) -> the plan entry
    that owns the module holding it, or None."""
    index = BucketIndex(plan)
    return {
        f"{name}.{p}" if name else p: index.bucket_of(name)
        for name, module in model.named_modules(remove_duplicate=False)
        for p, v in module._parameters.items()
        if v is not None
    }


def unbucketed_parameters(model: nn.Module, plan: list[list[str]]) -> list[str]:
    """Parameter FQNs held by modules that no plan entry covers."""
    return [fqn for fqn, entry in parameter_entries(model, plan).items() if entry is None]


def take_over_compiled(model: nn.Module) -> nn.Module:
    """``model`` with the user's own ``torch.compile`` taken off (``shard/takeover.py``):
    a ``torch.compile(model)`` wrapper gives the module inside it, a compiled child is
    replaced by the module inside it, ``model.compile()`` and a compiled ``forward`` are
    undone. Says so in one line (rank 0) and keeps the notes on the returned module for
    ``parallelize`` to put in the report. Every entry point calls it first (``parallelize``,
    Accelerate's ``prepare``, the Lightning strategies), so plans, optimizers and the
    returned model all see the module the plugin compiles."""
    module, notes = uncompiled(model)
    if notes:
        say(process_rank(), compile_notes_line(notes))
        pending = getattr(model, _COMPILE_NOTES_ATTR, None) or []
        setattr(module, _COMPILE_NOTES_ATTR, pending + notes)
    return module


def pop_compile_notes(module: nn.Module) -> list[str]:
    """The notes ``take_over_compiled`` kept on ``module`` (none left after)."""
    return vars(module).pop(_COMPILE_NOTES_ATTR, None) or []


def parallelize(
    model: nn.Module,
    config: OverlapConfig | dict | str | None = None,
    *,
    mesh: DeviceMesh | None = None,
    checked: Preflight | None = None,
    **overrides,
) -> nn.Module:
    """Shard ``model`` the FSDP2 way and compile it with the overlap passes, in place.

    Args:
        model: the model, on CPU, on its device, or on the meta device (then call
            ``fsdp_overlap_plugin.materialize`` afterwards).
        config: an ``OverlapConfig``, a dict of its fields, a YAML path, or None for
            the defaults; keyword ``overrides`` are applied on top.
        mesh: the data-parallel ``DeviceMesh`` (1-D, or 2-D ``(replicate, shard)`` for
            HSDP), with a tensor dimension innermost for tensor parallelism. Defaults to all
            ranks of the default process group, shaped by ``config.mesh`` (one mesh per
            layout in the process, ``build_mesh``); a dict such as ``{"replicate": 2}`` sets
            ``config.mesh``. A model the user split over a mesh of theirs with that layout
            is sharded on that mesh; split over other process groups of the same ranks, it
            is an error saying to pass the mesh (``_check_one_tensor_mesh``).
        checked: what ``preflight(model, config)`` returned, when the caller (an adapter
            that checks before its framework builds anything) ran it already on this model
            and this config: the checks then run once, not twice.

    Returns the module it prepared: the same module object, whose parameters are now
    ``DTensor`` ``Shard(0)`` shards and, with ``compile: true``, whose forward is compiled
    with the passes installed. With ``compile: false`` it is wrapped the eager FSDP2 way
    (``fully_shard`` per bucket). A model the user compiled first is taken over
    (``take_over_compiled``): for ``torch.compile(model)`` the module inside the wrapper is
    prepared and returned (use it in the wrapper's place: the wrapper would run the
    user's Dynamo around the plugin's compiled forward, for nothing).
    """
    install_excepthook()  # outermost again, over init_process_group's
    model = take_over_compiled(model)
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        overrides["mesh"] = mesh  # the config field (a dict / MeshConfig), not a DeviceMesh
        mesh = None
    # the config is read, checked and resolved here, once; the stages below get plain values
    config = OverlapConfig.coerce(config, **overrides)
    # pure: every rank raises the same error here, and fsdp-overlap check runs the same
    if checked is None:
        checked = preflight(model, config)
    plan, checkpointed = checked.plan, checked.checkpointed
    sharding = ShardSettings(
        param_dtype=config.torch_param_dtype,
        reduce_dtype=config.torch_reduce_dtype,
        reshard_after_forward=config.reshard_after_forward,
    )
    given = mesh is not None
    if mesh is None:
        # a model the user split over a mesh of theirs with the layout of config.mesh: shard on that
        # mesh, so that there is one set of process groups (a second mesh of the same ranks would
        # be equal to DTensor with groups of its own: a hang, docs/tensor-parallel.md)
        mesh = _mesh_of_split_parameters(model, config.mesh)
    if mesh is None:
        device_type = devices.detect_device_type()
        # one mesh per layout in the process (shard.sharding.build_mesh); a model the user split:
        # the tensor dimension named as the user's mesh names it, so that the plugin's tensor mesh
        # equals theirs (shard/tensor_parallel.tensor_layout), where _check_one_tensor_mesh finds the
        # very same groups
        mesh = build_mesh(config.mesh, device_type, names=_users_tensor_name(model))
    # with a tensor dimension (innermost), parameters are sharded over the others
    full_mesh, tp_mesh = mesh, tensor_mesh(mesh)
    mesh = data_parallel_mesh(full_mesh)
    if mesh.ndim not in (1, 2):
        raise OverlapConfigError(
            f"mesh: expected a 1-D (shard) or 2-D (replicate, shard) data-parallel mesh, and optionally a tensor "
            f"dimension innermost; got {full_mesh.ndim}-D {full_mesh.mesh_dim_names}."
        )
    _check_tensor_size(config, tp_mesh)
    # the user's split over other process groups of the same ranks: an error now, not a hang later
    _check_one_tensor_mesh(model, tp_mesh, given=given, sizes=config.mesh)
    device_type = mesh.device_type
    hash_pinned = pin_mesh_hash(mesh)  # a mesh of ours is pinned already; one given may not be
    if full_mesh is not mesh:
        # split parameters are stored on the whole mesh: a graph input too
        hash_pinned = pin_mesh_hash(full_mesh) and hash_pinned
    if devices.backend_for(device_type) == "gloo":
        devices.settle_gloo_workers_at_exit()  # a torch bug at exit (its docstring)
    if device_type != "cpu" and not _on_meta(model):
        model.to(devices.device_for_rank(device_type))
    tp_plan = apply_tp_plan(model, config.tp_plan, tp_mesh) if config.tp_plan else {}
    if tp_mesh is not None and not tensor_parallel_parameters(model):
        raise OverlapConfigError(
            f"mesh.tensor={tp_mesh.size()}, but no parameter is split over the tensor-parallel ranks: give a "
            "tp_plan (module names -> colwise / rowwise / replicate), or split the model "
            "with torch's parallelize_module before parallelize (docs/tensor-parallel.md)."
        )
    entries = parameter_entries(model, plan)
    state = OverlapState(
        config=config,
        plan=plan,
        device_type=device_type,
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        mesh_shape=tuple(mesh.shape),
        mesh=mesh,
        tensor_parallel=tp_mesh.size() if tp_mesh is not None else 1,
        tp_mesh=tp_mesh,
        tp_plan=tp_plan,
        tp_groups=(tp_mesh.get_group().group_name,) if tp_mesh is not None else (),
        instance=next(_INSTANCES),
        model_fingerprint=model_fingerprint(model),
        unbucketed_params=[fqn for fqn, entry in entries.items() if entry is None],
        last_bucket=max((e for e in entries.values() if e is not None), default=None),
        param_entries=entries,
        passes=decide_passes(config),
    )
    state.adjustments.extend(pop_compile_notes(model) + checked.notes)
    if config.tp_plan == "auto":
        state.adjustments.extend(auto_plan_notes(model))
    state.compile_dynamic = _compile_dynamic(config, state)
    if not hash_pinned and mesh.ndim == 2 and config.compile:
        state.adjustments.append(_UNPINNED_MESH)
    state.reduce_scatter_impl, state.reduce_scatter_reason = devices.reduce_scatter_choice(
        config.reduce_scatter_impl,
        devices.backend_for(device_type),
        mesh.shape[-1],
        compiled=config.compile,
    )
    if config.compile and (problem := inductor_overlap.device_error(config.inductor_overlap, device_type)):
        raise OverlapConfigError(problem)
    hf_layers = [fqn for _, layers in hf.checkpointing_layers(model) for fqn in layers]
    hf.disable_own_checkpointing(model)
    if checkpointed:
        state.checkpointed = apply_activation_checkpointing(
            model, checkpointed, config.activation_checkpointing_policy, compiled=config.compile
        )
    if config.compile:
        state.adjustments.extend(hf.prepare_for_compile(model))
        shard_parameters(model, mesh, sharding, full_mesh=full_mesh)
        state.local_layout = local_layout(model)
        if _separate_gather_group(config, device_type):
            state.gather_group = build_gather_group(mesh)
        if state.reduce_scatter_impl == "receive_first":
            shard_group = mesh.get_group(mesh.ndim - 1)
            state.exchange_groups = {shard_group.group_name: build_receive_first_group(shard_group)}
            state.exchanges_before = exchanges_run(*state.exchange_groups.values())
        # imported only to compile (as compile/inductor.py is only to compile with inductor):
        # `import fsdp_overlap_plugin`, the report, the adapters and compile: false never
        # load the compile wiring
        from .compile.compiler import compile_model

        compile_model(model, state)
        gather = model_gather(model)
        gather.compiled = True
        state.replica_sync = accumulation.install(model, gather, mesh)
        from_config = [fqn for fqn in checkpointed if fqn not in hf_layers]
        state.after_prepare = AfterPrepare(model, state, hf_layers, from_config)
    else:
        fully_shard_plan(model, mesh, plan, sharding, notes=state.adjustments)
    # transformers' own save_pretrained would gather each sharded tensor on the writing
    # rank alone (a hang); this one is collective and streams (shard/export.py)
    install_save_pretrained(model)
    setattr(model, _STATE_ATTR, state)
    return model


def _separate_gather_group(config: OverlapConfig, device_type: str) -> bool:
    """On by default where one communicator runs its collectives in issue order on one
    stream (nccl, hccl); off for gloo, whose groups already run collectives on worker
    threads and where a second connection only splits the link."""
    if config.separate_gather_group is not None:
        return config.separate_gather_group
    return devices.backend_for(device_type) in ("nccl", "hccl")


# torch 2.13, 2.14 and 2.15 cannot trace the backward of a tensor-parallel Linear whose input has a
# symbolic size without ``compat.symbols_keep_their_first_proxy``, which the backend installs while it
# compiles a tensor-parallel graph: AOT autograd recursed without end on a size (``sym_max(s, 1)``) in
# DTensor's view (docs/tensor-parallel.md has the 15-line reproduction without the plugin). Where that
# cannot be installed (a torch whose tracer has moved), each sequence length compiles static.
_TP_STATIC = (
    "dynamic: auto -> false under tensor parallelism: this torch's tracer lacks what the plugin needs to "
    "trace DTensor with symbolic sizes (AOT autograd recurses without end in a tensor-parallel Linear's "
    "backward), so each new sequence length compiles once on its own, up to Dynamo's recompile limit: pad "
    "batches to a few lengths (docs/tensor-parallel.md)"
)


def _compile_dynamic(config: OverlapConfig, state: OverlapState) -> bool | None:
    """torch.compile's ``dynamic`` for this model: the config's ("auto" is None); under tensor
    parallelism static where this torch cannot trace symbolic sizes through DTensor
    (``_TP_STATIC``)."""
    dynamic = {"auto": None}.get(config.dynamic, config.dynamic)
    if state.tensor_parallel == 1 or not config.compile or compat.symbolic_sizes_traceable_under_tensor_parallel():
        return dynamic
    if config.dynamic is True:
        raise OverlapConfigError(
            "dynamic: true compiles every size symbolic, which this torch cannot trace through DTensor under "
            "tensor parallelism (mesh.tensor > 1): AOT autograd recurses without end in a tensor-parallel "
            "Linear's backward. Use dynamic: auto or false (each sequence length compiles once; pad batches to "
            "a few lengths), docs/tensor-parallel.md."
        )
    if config.dynamic == "auto":
        state.adjustments.append(_TP_STATIC)
    return False


def _users_tensor_name(model: nn.Module) -> dict[str, str] | None:
    for _, param in tensor_parallel_parameters(model)[:1]:
        names = param.device_mesh.mesh_dim_names or ()
        if len(names) == 1 and names[0] in TENSOR_DIM_NAMES:
            return {"tensor": names[0]}
    return None


def _check_tensor_size(config: OverlapConfig, tp_mesh: DeviceMesh | None) -> None:
    """A mesh given with a tensor dimension must agree with ``mesh.tensor`` where the
    config sets it."""
    size = tp_mesh.size() if tp_mesh is not None else 1
    if config.mesh.tensor not in (1, size):
        raise OverlapConfigError(
            f"mesh.tensor={config.mesh.tensor} contradicts the mesh passed to parallelize, whose tensor dimension "
            f"has {size} ranks; they say the same thing, give one of them."
        )
    if config.tp_plan and tp_mesh is None:
        raise OverlapConfigError(NO_TENSOR_DIMENSION)


def _on_meta(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def _live(mesh: DeviceMesh) -> bool:
    """Whether ``mesh``'s process groups are this process's current ones (DTensor may hand a
    parameter an equal mesh made under a default group destroyed since: a test's)."""
    try:
        return all(
            resolve_process_group(name) is mesh.get_group(dim) for dim, name in enumerate(mesh_group_names(mesh))
        )
    except (RuntimeError, ValueError, KeyError):
        return False


def _compatible_root(root: DeviceMesh, tensor_name: str, sizes: MeshConfig) -> str | None:
    """Why ``root`` (the mesh a user's split parameters were sliced from) is not the mesh
    the config's sizes describe, or None where it is: data-parallel dimensions then the
    tensor dimension (named ``tensor_name``) innermost, the sizes ``build_mesh`` would give,
    the ranks in order (each tensor-parallel group consecutive)."""
    world = dist.get_world_size()
    want = mesh_layout(sizes, world)
    names = tuple(root.mesh_dim_names or ())
    shape = tuple(root.mesh.shape)
    described = " x ".join(f"{n} {s}" for n, s in zip(names, shape)) if names else str(shape)
    expected = " x ".join(f"{n} {s}" for n, s in want)
    if len(names) != root.ndim or len(set(names)) != len(names):
        return f"a mesh {described} without a name for each dimension"
    if tensor_name not in TENSOR_DIM_NAMES:
        return f"a mesh {described} whose tensor dimension {tensor_name!r} is not named {' or '.join(TENSOR_DIM_NAMES)}"
    if names[-1] != tensor_name or sum(n in TENSOR_DIM_NAMES for n in names) != 1:
        return f"a mesh {described} whose tensor dimension {tensor_name!r} is not the one innermost"
    if shape != tuple(s for _, s in want):
        return f"a mesh {described}, not the layout the config's mesh sizes ask for ({expected})"
    if root.mesh.flatten().tolist() != list(range(world)):
        return f"a mesh {described} whose ranks are not in order ({root.mesh.tolist()})"
    return None


def _mesh_of_split_parameters(model: nn.Module, sizes: MeshConfig) -> DeviceMesh | None:
    """The mesh a model the user split before ``parallelize`` should be sharded on, when
    ``parallelize`` got mesh sizes (``mesh={"tensor": 2}``) rather than a mesh: the mesh the
    split parameters' tensor-parallel mesh was sliced from (``init_device_mesh(dev, (dp,
    tp), mesh_dim_names=("dp", "tp"))["tp"]``: that whole mesh), where it has the layout the
    sizes describe (``_compatible_root``). Sharding there, the plugin's data-parallel and
    tensor-parallel groups are the very groups the user's mesh holds, not a second set over
    the same ranks. None where nothing is split (or split on a mesh of a process group since
    destroyed), or the split parameters' mesh has no such root: then the plugin builds its
    own, and ``_check_one_tensor_mesh`` stops a split over other groups of the same ranks."""
    if sizes.tensor <= 1:
        return None
    split = [p.device_mesh for _, p in tensor_parallel_parameters(model)]
    mesh = next((m for m in split if m.ndim == 1 and m.mesh_dim_names and _live(m)), None)
    if mesh is None:
        return None
    root = mesh_root(mesh)
    if root is mesh or _compatible_root(root, mesh.mesh_dim_names[0], sizes) is not None:
        return None
    return root


def _check_one_tensor_mesh(model: nn.Module, tp_mesh: DeviceMesh | None, *, given: bool, sizes: MeshConfig) -> None:
    """Before ``parallelize`` splits or shards anything: every parameter the user split
    over this rank's tensor-parallel ranks must be split over the very process group of the
    plugin's tensor mesh ``tp_mesh`` (the mesh passed to ``parallelize`` when ``given``, else
    the one built from the mesh sizes ``sizes``). A split over another mesh of the same
    ranks (equal to DTensor, other groups) is an error saying which mesh to pass, never a
    second set of groups in one model (the hang of docs/tensor-parallel.md). Other
    mismatches (no tensor dimension, a 2-D mesh, other ranks) are ``check_tensor_mesh``'s."""
    if tp_mesh is None:
        return
    ours = mesh_group_names(tp_mesh)
    for name, param in tensor_parallel_parameters(model):
        mesh = param.device_mesh
        if mesh.ndim != 1 or mesh.mesh.tolist() != tp_mesh.mesh.tolist() or not _live(mesh):
            continue
        theirs = mesh_group_names(mesh)
        if theirs == ours:
            continue
        raise OverlapConfigError(_two_meshes(name, theirs[0], ours[0], mesh, given, sizes))


_EQUAL_MESHES = (
    "DeviceMesh equality is ranks, layout and names, so DTensor takes one equal mesh for the other, and two ranks "
    "of a tensor-parallel group can then run one collective on different groups and wait for each other forever"
)


def _two_meshes(name: str, theirs: str, ours: str, mesh: DeviceMesh, given: bool, sizes: MeshConfig) -> str:
    if given:
        return (
            f"parameter {name} is split over a tensor-parallel mesh whose process group is {theirs}, but the tensor "
            f"dimension of the mesh passed to parallelize has process group {ours}: two meshes over the same ranks, "
            f"each with process groups of its own ({_EQUAL_MESHES}). Split the model over the tensor dimension of the mesh you pass (my_mesh['tp']; "
            "under Lightning self.device_mesh['tensor_parallel'], under Accelerate "
            "accelerator.torch_device_mesh['tp']), or pass the mesh you split over; build one mesh for every model "
            "of the process (fsdp_overlap_plugin.build_mesh returns the same mesh for the same sizes). See "
            "docs/tensor-parallel.md."
        )
    root = mesh_root(mesh)
    tensor_name = mesh.mesh_dim_names[0] if mesh.mesh_dim_names else ""
    why = (
        f"a 1-D mesh of {mesh.size()} ranks"
        if root is mesh
        else _compatible_root(root, tensor_name, sizes) or "a mesh of its own"
    )
    layout = " x ".join(f"{n} {s}" for n, s in mesh_layout(sizes, dist.get_world_size()))
    return (
        f"parameter {name} is split over {why}, and parallelize got mesh sizes ({layout}), not that mesh: a mesh "
        f"of the plugin's over the same ranks would carry process groups of its own (tensor group {ours}; the "
        f"split's is {theirs}; {_EQUAL_MESHES}). Pass the mesh you split over: parallelize(model, "
        "mesh=my_mesh), my_mesh with its data-parallel dimension(s) first and the tensor dimension innermost, "
        f"named one of {', '.join(TENSOR_DIM_NAMES)} (init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', "
        "'tp')), the model split over my_mesh['tp']). See docs/tensor-parallel.md."
    )
