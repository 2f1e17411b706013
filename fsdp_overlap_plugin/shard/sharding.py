"""Compile-visible FSDP2 sharding, and the eager ``fully_shard`` fallback.

Compile-visible layout (the SimpleFSDP approach, arXiv 2411.00284):

* every parameter becomes ``nn.Parameter(DTensor)`` with ``Shard(0)`` on the data-parallel
  mesh (``(Replicate(), Shard(0))`` on an HSDP mesh), exactly FSDP2's layout, so
  ``state_dict()`` and distributed checkpoints interoperate with ``fully_shard``;
* the module's class is swapped for a subclass whose parameter names are properties;
  reading ``self.weight`` inside ``forward`` redistributes the shard to ``Replicate()``
  (an all-gather that Dynamo *traces*) and returns a plain tensor whose gradient is
  ``Partial("avg")``, which autograd turns into a reduce-scatter (plus an all-reduce
  across replicas on HSDP) in the backward graph;
* ``state_dict()``/``named_parameters()`` read ``module._parameters`` directly, so they
  see the sharded DTensors and never trigger a gather.

Tied parameters stay one parameter: the shared ``nn.Parameter`` is sharded once and the
same object is re-registered in every module that used it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from .._torch_compat import (
    compiler_disable,
    default_process_group,
    fx_annotate,
    local_shape_and_offset,
    mesh_cached_hash,
    set_mesh_cached_hash,
    strided_shard,
)
from ..config.schema import MeshConfig, OverlapConfig, OverlapConfigError
from ..contract import PARAM_KEY
from .tensor_parallel import TENSOR_DIM_NAME, TENSOR_DIM_NAMES, TensorLayout, check_tensor_mesh, tensor_layout

# torch >= 2.9: Dynamo records the annotation in node.meta["custom"]; None on an older
# torch, where module paths are the only attribution
_annotate = fx_annotate()

__all__ = [
    "local_box",
    "build_gather_group",
    "build_mesh",
    "data_parallel_mesh",
    "mesh_layout",
    "tensor_mesh",
    "pin_mesh_hash",
    "fully_shard_plan",
    "gather_disabled",
    "is_sharded",
    "model_gather",
    "plugin_call",
    "shard_parameters",
    "ShardSettings",
    "SHARD_DIM_NAME",
    "REPLICATE_DIM_NAME",
]

SHARD_DIM_NAME = "shard"
REPLICATE_DIM_NAME = "replicate"
_CLASS_PREFIX = "FSDPOverlap"

# A plain module global (not thread-local): Dynamo guards on it like any global.
_GATHER_ENABLED = True


@contextlib.contextmanager
def gather_disabled() -> Iterator[None]:
    """Inside this block, ``module.weight`` returns the sharded DTensor itself (no
    collective). Use it to initialise or inspect parameters after sharding."""
    global _GATHER_ENABLED
    previous = _GATHER_ENABLED
    _GATHER_ENABLED = False
    try:
        yield
    finally:
        _GATHER_ENABLED = previous


# True while the plugin's compiled forward runs (compile/compiler.py). Dynamo reads it
# while tracing a gather, and guards on it like any global: a gather traced while it is
# False is being compiled by another torch.compile than the plugin's.
_PLUGIN_CALL = False


@contextlib.contextmanager
def plugin_call() -> Iterator[None]:
    """The plugin's compiled forward runs inside this block (see ``_PLUGIN_CALL``)."""
    global _PLUGIN_CALL
    previous = _PLUGIN_CALL
    _PLUGIN_CALL = True
    try:
        yield
    finally:
        _PLUGIN_CALL = previous


_COMPILED_ELSEWHERE = (
    "fsdp-overlap: the sharded model is being compiled by a torch.compile other than the plugin's "
    "(model.compile() or torch.compile(...) of the model or one of its modules, called after prepare / "
    "parallelize): that compile would gather each parameter on its own, with no passes. The plugin already "
    "compiles the model: remove that call (to change how the plugin compiles, set its backend, fullgraph or "
    "dynamic keys)."
)


_BYPASS = (
    "fsdp-overlap: parameter {fqn} was gathered outside the plugin's compiled forward: that code runs uncompiled, "
    "gathering each parameter on its own, with no passes (a module of the model called on its own, or the model's "
    "compiled call replaced, e.g. by model.compile() after prepare). Call the model the plugin prepared; see "
    "docs/troubleshooting.md. (Said once per model.)"
)


def _refuse_foreign_compile() -> None:
    from .takeover import ChangedAfterPrepareError

    raise ChangedAfterPrepareError(_COMPILED_ELSEWHERE)


# Dynamo does not trace a disabled function: with fullgraph: false the other compile breaks
# its graph here and this raises when the call runs; with fullgraph: true Dynamo's own error
# quotes the reason.
_compiled_elsewhere = compiler_disable(_refuse_foreign_compile, reason=_COMPILED_ELSEWHERE)


@dataclass(frozen=True)
class ShardSettings:
    """What sharding reads of the config, resolved once by ``parallelize``: shard/ gets
    plain typed values, not the whole ``OverlapConfig``."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    reshard_after_forward: bool = True


# build_mesh's meshes by layout, for the default process group they were made under (a new one starts a new set)
_MESHES: tuple[object, dict[tuple, DeviceMesh]] | None = None


def build_mesh(
    config: OverlapConfig | MeshConfig | dict, device_type: str | None = None, *, names: dict[str, str] | None = None
) -> DeviceMesh:
    """The mesh over all ranks of the default group: 1-D ``(shard,)``, or 2-D
    ``(replicate, shard)`` for HSDP, with a ``tensor`` dimension innermost when
    ``mesh.tensor`` > 1 (the ranks of one tensor-parallel group consecutive). Takes the
    config, its ``MeshConfig`` or the mesh sizes as a dict (``{"tensor": 2}``); the device
    type defaults to this machine's. ``build_mesh({"tensor": 2})["tensor"]`` is the mesh to
    give torch's ``parallelize_module`` before ``parallelize(model, mesh=that_mesh)``;
    ``data_parallel_mesh`` / ``tensor_mesh`` split it. ``names`` renames dimensions for a
    framework that indexes the mesh its own way (Lightning's ``{"shard": "data_parallel",
    "tensor": "tensor_parallel"}``); the tensor dimension's name must stay one of
    ``TENSOR_DIM_NAMES``.

    One mesh per layout (device type, sizes, names) per default process group: a second call
    returns the first one's mesh and groups. Two meshes over the same ranks compare equal and
    DTensor takes one for the other, but each has process groups of its own: two ranks of a
    tensor-parallel group could then run one collective on different groups, a hang
    (docs/tensor-parallel.md). So every path (``parallelize`` with sizes, the Lightning
    strategies, a second model) shares one set of groups."""
    global _MESHES
    if isinstance(config, dict):
        from ..config.mesh import mesh_from_value

        config = mesh_from_value(config, "build_mesh")
    if device_type is None:
        from ..runtime.devices import detect_device_type

        device_type = detect_device_type()
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fsdp-overlap needs an initialised default process group "
            "(torch.distributed.init_process_group, torchrun, Lightning or Accelerate do this)."
        )
    world = dist.get_world_size()
    sizes = config if isinstance(config, MeshConfig) else config.mesh
    dim_names, shape = zip(*mesh_layout(sizes, world))
    if names:
        dim_names = tuple(names.get(n, n) for n in dim_names)
    default = default_process_group()
    if _MESHES is None or _MESHES[0] is not default:
        _MESHES = (default, {})
    key = (device_type, tuple(shape), tuple(dim_names))
    mesh = _MESHES[1].get(key)
    if mesh is None:
        mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(dim_names))
        pin_mesh_hash(mesh)  # before anything hashes it
        _MESHES[1][key] = mesh
    return mesh


def mesh_layout(sizes: MeshConfig, world: int) -> list[tuple[str, int]]:
    """The dimensions ``build_mesh`` gives ``world`` ranks, outermost first, as (name, size)."""
    replicate, shard = sizes.sizes(world)
    dims = [(REPLICATE_DIM_NAME, replicate)] if replicate > 1 else []
    dims.append((SHARD_DIM_NAME, shard))
    if sizes.tensor > 1:
        dims.append((TENSOR_DIM_NAME, sizes.tensor))
    return dims


def _tensor_dim(mesh: DeviceMesh) -> str | None:
    names = [n for n in mesh.mesh_dim_names or () if n in TENSOR_DIM_NAMES]
    if not names:
        return None
    if len(names) > 1 or (mesh.mesh_dim_names or ())[-1] != names[0]:
        raise OverlapConfigError(
            f"mesh: expected one tensor-parallel dimension ({' or '.join(TENSOR_DIM_NAMES)}), the innermost; got "
            f"dimensions {mesh.mesh_dim_names}. Build it as (replicate, shard, tensor), or let the plugin build it "
            "from the config's mesh sizes."
        )
    return names[0]


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` without its tensor dimension (named as in ``TENSOR_DIM_NAMES``, the
    innermost): the mesh parameters are sharded over (the same object when it has none)."""
    tensor = _tensor_dim(mesh)
    if tensor is None:
        return mesh
    dp = tuple(n for n in mesh.mesh_dim_names if n != tensor)
    if not dp:
        raise OverlapConfigError(
            f"mesh: only a tensor dimension ({tensor}); add the data-parallel dimension (e.g. "
            f"init_device_mesh(device, (dp, tp), mesh_dim_names=('shard', '{tensor}')), size 1 for tensor "
            "parallelism alone)."
        )
    sub = mesh[dp[0]] if len(dp) == 1 else mesh[dp]
    pin_mesh_hash(sub)
    return sub


def tensor_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """``mesh``'s tensor-parallel dimension (this rank's group), or None without one."""
    tensor = _tensor_dim(mesh)
    if tensor is None:
        return None
    sub = mesh[tensor]
    pin_mesh_hash(sub)
    return sub


def pin_mesh_hash(mesh: DeviceMesh) -> bool:
    """Give ``mesh`` a hash that is the same in every process (a digest of its device
    type, dimension names and ranks); False where it was hashed already, and is left so.

    Why: on an HSDP mesh the compiled graphs take the 2-D mesh and its shard submesh as
    inputs (``_Gather._gather_hsdp``), and inductor's FX graph and AOT autograd cache keys
    pickle each such mesh whole (torch 2.13: ``FxGraphCachePickler``
    ``_reduce_fake_script_object``), ``_hash`` included: the ``hash()`` DeviceMesh caches
    the first time it is hashed (a ``DTensorSpec`` hashes it), over a tuple of strings,
    so salted per process (PYTHONHASHSEED). Every new process then got new cache keys and
    an HSDP job never loaded its graphs from the cache (a flat mesh is no graph input).
    The pinned value keeps ``hash``'s contract: equal meshes have equal device types,
    names and rank tensors, so equal pinned hashes. A mesh already hashed may key a dict
    or a cached spec hash somewhere: changing it then could break a lookup, so it is left
    as it is (its graphs then miss a warm cache)."""
    pinned = _stable_mesh_hash(mesh)
    current = mesh_cached_hash(mesh)
    if current is not None and current != pinned:
        return False
    set_mesh_cached_hash(mesh, pinned)
    return True


def _stable_mesh_hash(mesh: DeviceMesh) -> int:
    key = repr((mesh.device_type, mesh.mesh_dim_names, mesh.mesh.tolist()))
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 1) or 1  # non-zero: DeviceMesh recomputes a falsy cache


def build_gather_group(mesh: DeviceMesh) -> str:
    """A second communicator over the same ranks as this rank's shard group, for the
    parameter all-gathers; returns its group name. Every rank creates every such group
    in the same order (``new_subgroups_by_enumeration``), as process groups require."""
    shard_groups = mesh.mesh.reshape(-1, mesh.mesh.shape[-1]).tolist()
    backend = dist.get_backend(mesh.get_group(mesh.ndim - 1))
    mine, _ = dist.new_subgroups_by_enumeration(shard_groups, backend=backend)
    return mine.group_name


class _Gather:
    """Turns a sharded parameter into the full tensor the module computes with.

    Forward: cast to ``param_dtype`` then all-gather (so the collective moves the
    smaller dtype). Backward: cast the gradient to ``reduce_dtype``, then reduce-scatter
    with averaging over the shard group (and all-reduce over replicas on HSDP).
    """

    def __init__(self, mesh: DeviceMesh, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None):
        self.mesh = mesh
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.compute = tuple(Replicate() for _ in range(mesh.ndim))
        self.grad = tuple(Partial("avg") for _ in range(mesh.ndim))
        self.shard_mesh = mesh[mesh.mesh_dim_names[-1]] if mesh.ndim == 2 else mesh
        pin_mesh_hash(self.shard_mesh)  # a new object: a graph input on HSDP (pin_mesh_hash)
        # HSDP: False while accumulating (runtime/accumulation.py): the traced backward leaves the
        # replica all-reduce out. Dynamo guards on it, so each value has its own graph.
        self.all_reduce = True
        # True while the model runs compiled by the plugin (parallelize; False again after a
        # compile failure): a gather run eagerly outside the plugin's compiled forward is
        # then code that bypasses it, said once
        self.compiled = False
        self.warned = False

    def __call__(self, param: torch.Tensor, fqn: str | None = None, tp: TensorLayout | None = None) -> torch.Tensor:
        if not _GATHER_ENABLED or not isinstance(param, DTensor):
            return param
        if tp is not None:
            return self._gather_tensor_parallel(param, fqn, tp)
        compiling = torch.compiler.is_compiling()
        if compiling:
            if not _PLUGIN_CALL:
                _compiled_elsewhere()
        elif self.compiled and not _PLUGIN_CALL and not self.warned:
            self.warned = True
            warnings.warn(_BYPASS.format(fqn=fqn), stacklevel=3)
        if compiling and fqn is not None and _annotate is not None:
            # every node this gather traces (the cast, the all-gather and its wait, and
            # through autograd the gradient's reduce-scatter) carries the parameter's FQN,
            # so the passes attribute it exactly, whatever Dynamo calls the module
            with _annotate({PARAM_KEY: fqn}):
                return self._gather(param)
        return self._gather(param)

    def _gather_tensor_parallel(self, param: DTensor, fqn: str | None, tp: TensorLayout) -> DTensor:
        """A tensor-parallel parameter: its local part (this rank's data-parallel shard of
        its tensor-parallel part) is gathered over the data-parallel mesh alone, like any
        parameter (annotated, so the passes own that gather and its reduce-scatter), then
        enters the tensor-parallel mesh with the plan's placement. That last step is outside
        the annotation: its backward (an all-reduce over the tensor-parallel group where a
        replicated parameter's gradient is partial there) is the plan's, not the passes'."""
        dp_part = DTensor.from_local(
            param.to_local(),
            self.mesh,
            _placements(self.mesh, param),
            run_check=False,
            shape=tp.local_shape,
            stride=tp.local_stride,
        )
        local = self(dp_part, fqn)
        if tp.mesh is None:  # left whole by the plan: the module computes with a plain tensor
            return local
        return DTensor.from_local(
            local, tp.mesh, tp.placements, run_check=False, shape=param.shape, stride=param.stride()
        )

    def _gather(self, param: DTensor) -> torch.Tensor:
        if self.mesh.ndim == 2 and param.dim() > 0:
            return self._gather_hsdp(param)
        full = param.redistribute(
            placements=self.compute,
            forward_dtype=self.param_dtype,
            backward_dtype=self.reduce_dtype,
        )
        if self.mesh.ndim == 2 and not self.all_reduce:
            # a replicated 0-dim parameter while accumulating: reduced over the shard group only
            return full.to_local(grad_placements=(Replicate(), Partial("avg")))
        return full.to_local(grad_placements=self.grad)

    def _gather_hsdp(self, param: DTensor) -> torch.Tensor:
        """HSDP, FSDP2's order: the backward reduce-scatters over the shard group first,
        then all-reduces the reduced *shard* over the replicas. (One redistribute from
        ``(Partial, Partial)`` to ``(Replicate, Shard(0))`` all-reduces the full gradient
        first: the whole parameter's bytes over the replica link, once per parameter.)

        Forward: the local shard, as a 1-D DTensor on the shard group, all-gathered there.
        Backward, in reverse: reduce-scatter (avg) on the shard group; the shard's gradient
        enters the 2-D mesh as ``(Partial("avg"), Shard(0))``, and ``from_local``'s
        backward brings it to the parameter's ``(Replicate(), Shard(0))``: an all-reduce
        of the shard across replicas."""
        replicated = DTensor.from_local(
            param.to_local(), self.mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
        # while accumulating (``all_reduce`` False) the shard's gradient stays this
        # replica's own: no all-reduce in the graph (runtime/accumulation.py reduces the sum later)
        replica = Partial("avg") if self.all_reduce else Replicate()
        local = replicated.to_local(grad_placements=(replica, Shard(0)))
        shard = DTensor.from_local(
            local, self.shard_mesh, (Shard(0),), run_check=False, shape=param.shape, stride=param.stride()
        )
        full = shard.redistribute(
            placements=(Replicate(),), forward_dtype=self.param_dtype, backward_dtype=self.reduce_dtype
        )
        return full.to_local(grad_placements=(Partial("avg"),))


@functools.cache
def _sharded_class(cls: type, names: tuple[str, ...]) -> type:
    """A subclass of ``cls`` whose parameters ``names`` are gathering properties."""

    def getter(name: str):
        def get(self: nn.Module) -> torch.Tensor:
            return self._fsdp_overlap_gather(
                self._parameters[name], self._fsdp_overlap_fqns[name], self._fsdp_overlap_tp.get(name)
            )

        return property(get)

    attrs = {name: getter(name) for name in names}
    attrs["__module__"] = cls.__module__
    return type(f"{_CLASS_PREFIX}{cls.__name__}", (cls,), attrs)


def is_sharded(model: nn.Module) -> bool:
    """True if ``parallelize`` (compile path) already sharded this module tree."""
    return any(type(m).__name__.startswith(_CLASS_PREFIX) for m in model.modules())


def model_gather(model: nn.Module) -> _Gather:
    """The one gather ``shard_parameters`` installed on every module of ``model`` that
    holds parameters (its flags are the model's: ``compiled``, ``all_reduce``)."""
    return next(m._fsdp_overlap_gather for m in model.modules() if hasattr(m, "_fsdp_overlap_gather"))


def _placements(mesh: DeviceMesh, param: torch.Tensor) -> tuple:
    # 0-dim parameters cannot be split; they stay replicated and their gradient is
    # all-reduced (Partial -> Replicate), as FSDP2 does not shard them either.
    if param.dim() == 0:
        return tuple(Replicate() for _ in range(mesh.ndim))
    if mesh.ndim == 1:
        return (Shard(0),)
    return (Replicate(), Shard(0))


def shard_parameters(
    model: nn.Module, mesh: DeviceMesh, settings: ShardSettings, *, full_mesh: DeviceMesh | None = None
) -> nn.Module:
    """Shard every parameter of ``model`` in place and install the traced gathers.

    Each rank keeps only its ``Shard(0)`` chunk (``torch.chunk`` semantics, padded
    on the last ranks as FSDP2 does); no data is exchanged, so every rank must start
    from the same values (same seed, or meta-device init followed by
    ``initialize.materialize``).

    ``mesh`` is the data-parallel mesh. With tensor parallelism, ``full_mesh`` is the mesh
    with the tensor dimension innermost: a parameter a plan already split (a ``DTensor``
    on the tensor-parallel mesh) keeps its tensor-parallel part, sharded over ``mesh``,
    and is stored on ``full_mesh`` as FSDP2 stores it (``shard/tensor_parallel.py``).
    Parameters the plan left whole are sharded over ``mesh`` alone.
    """
    if is_sharded(model):
        raise RuntimeError("this model is already sharded by fsdp-overlap; call parallelize() once.")
    tp_mesh = tensor_mesh(full_mesh) if full_mesh is not None else None
    check_tensor_mesh(model, tp_mesh)
    gather = _Gather(mesh, settings.param_dtype, settings.reduce_dtype)
    replaced: dict[int, tuple[nn.Parameter, TensorLayout | None]] = {}
    for prefix, module in list(model.named_modules()):
        names = tuple(name for name, p in module._parameters.items() if p is not None)
        if not names:
            continue
        layouts: dict[str, TensorLayout] = {}
        for name in names:
            param = module._parameters[name]
            entry = replaced.get(id(param))
            if entry is None:
                if isinstance(param, DTensor) or tp_mesh is not None:
                    entry = (_shard_tensor_parallel(param, mesh, full_mesh), tensor_layout(param, tp_mesh))
                else:
                    data = distribute_tensor(param.detach(), mesh, _placements(mesh, param), src_data_rank=None)
                    entry = (nn.Parameter(data, requires_grad=param.requires_grad), None)
                replaced[id(param)] = entry
            module._parameters[name] = entry[0]
            if entry[1] is not None:
                layouts[name] = entry[1]
        module.__class__ = _sharded_class(type(module), names)
        module._fsdp_overlap_gather = gather
        module._fsdp_overlap_tp = layouts
        # FQNs relative to the sharded root: the names plans use. A tied parameter has one
        # per module that holds it; each read is attributed to the module that read it.
        module._fsdp_overlap_fqns = {name: f"{prefix}.{name}" if prefix else name for name in names}
    return model


def _shard_tensor_parallel(param: torch.Tensor, mesh: DeviceMesh, full_mesh: DeviceMesh) -> nn.Parameter:
    """A parameter of a tensor-parallel model, sharded over the data-parallel ``mesh`` and
    stored on ``full_mesh`` with FSDP2's placements: a split parameter's data-parallel
    ``Shard(0)`` of its tensor-parallel part, written ``_StridedShard(0, split_factor=tp)``
    where the plan splits dim 0 as well (so that ``full_tensor()``, state dicts and DCP read
    it as FSDP2's); a parameter the plan left whole is ``Replicate()`` on the tensor
    dimension. Every parameter and gradient then lives on one mesh, as gradient clipping's
    norm over all of them needs."""
    split = isinstance(param, DTensor)
    local = param.to_local().detach() if split else param.detach()
    dp_local = distribute_tensor(local, mesh, _placements(mesh, local), src_data_rank=None).to_local()
    (tp_placement,) = param.placements if split else (Replicate(),)
    dp_placement = Shard(0)
    if isinstance(tp_placement, Shard) and tp_placement.dim == 0:
        dp_placement = strided_shard(0, param.device_mesh.size())
    placements = ((Replicate(),) if mesh.ndim == 2 else ()) + (dp_placement, tp_placement)
    if local.dim() == 0:
        placements = tuple(Replicate() for _ in range(mesh.ndim)) + (tp_placement,)
    data = DTensor.from_local(
        dp_local, full_mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
    )
    return nn.Parameter(data, requires_grad=param.requires_grad)


def fully_shard_plan(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: list[list[str]],
    settings: ShardSettings,
    notes: list[str] | None = None,
) -> nn.Module:
    """The eager fallback (``compile: false``): FSDP2 ``fully_shard`` per plan entry, then
    the root. Same parameter layout as the compiled path, no passes.

    FSDP2 manages each parameter in exactly one group, so plan entries whose modules
    share a parameter (tied embeddings: ``lm_head.weight is embed_tokens.weight``) become
    one ``fully_shard`` group over all their modules; ``notes`` gets one line per such
    merge (the report shows it under "adjusted")."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=settings.param_dtype, reduce_dtype=settings.reduce_dtype)
    for entries, shared in _groups_sharing_parameters(model, plan):
        modules = [model.get_submodule(fqn) for i in entries for fqn in plan[i]]
        if not any(True for m in modules for _ in m.parameters()):
            continue
        if len(entries) > 1 and notes is not None:
            notes.append(
                f"compile: false: bucket_plans entries {', '.join(f'{i} {plan[i]}' for i in entries)} share "
                f"{', '.join(shared)}; FSDP2 manages a parameter in one group only, so they are one fully_shard group"
            )
        fully_shard(
            modules if len(modules) > 1 else modules[0],
            mesh=mesh,
            reshard_after_forward=settings.reshard_after_forward,
            mp_policy=mp,
        )
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _groups_sharing_parameters(model: nn.Module, plan: list[list[str]]) -> list[tuple[list[int], list[str]]]:
    """The plan entries as ``fully_shard`` groups, in plan order: entries whose modules'
    subtrees hold one parameter object are joined (with the parameter names that join
    them); every other entry is a group of its own."""
    holders: dict[int, set[int]] = {}  # id(parameter) -> plan entries holding it
    names: dict[int, list[str]] = {}
    for i, entry in enumerate(plan):
        for fqn in entry:
            for name, param in model.get_submodule(fqn).named_parameters(prefix=fqn, remove_duplicate=False):
                holders.setdefault(id(param), set()).add(i)
                names.setdefault(id(param), []).append(name)
    parent = list(range(len(plan)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for entries in holders.values():
        first, *rest = sorted(entries)
        for other in rest:
            parent[root(other)] = root(first)
    groups: dict[int, list[int]] = {}
    for i in range(len(plan)):
        groups.setdefault(root(i), []).append(i)
    out = []
    for entries in groups.values():
        shared = [
            " = ".join(dict.fromkeys(names[key]))
            for key, held in holders.items()
            if len(held) > 1 and held <= set(entries)
        ]
        out.append((entries, shared))
    return out


def local_box(tensor: DTensor) -> tuple[slice, ...]:
    """The part of the global tensor this rank holds, one slice per dimension: ``Shard(0)``
    rows of a 1-D or HSDP mesh, and on a mesh with a tensor dimension the rows of a
    tensor-parallel part (``_StridedShard``) or a block of rows and columns (``Shard(0)``
    over the data-parallel ranks, ``Shard(1)`` over the tensor-parallel ones), as
    torch.distributed.checkpoint describes them. Raises where the local part is not one
    such block."""
    shape, offset = local_shape_and_offset(tensor)
    if tuple(shape) != tuple(tensor.to_local().shape):
        raise OverlapConfigError(
            f"a parameter placed as {tensor.placements} holds a local part of shape {list(tensor.to_local().shape)}, "
            f"not one block of the global tensor ({list(shape)} at {list(offset)}); supported: Shard(0) over the "
            "data-parallel ranks, with Shard(d) or Replicate() over the tensor-parallel ones."
        )
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))
