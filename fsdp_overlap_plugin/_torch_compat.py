"""Every private torch name fsdp-overlap uses, in one place, found by feature probes.

The passes lean on torch internals (inductor's custom-pass slots, its ordering
dependencies, the partitioner, FakeTensor, functorch flags, a checkpoint helper) that
move between releases. Each one is reached through this module, and each is probed for
(``hasattr``, a guarded import), never chosen by comparing version strings: a build
that backports a feature gets it, one that drops it gets the fallback or a clear error.

Nothing here imports inductor when this module is imported: ``import fsdp_overlap_plugin``
and ``fsdp-overlap inspect``/``check`` work where an inductor internal has moved; the
compile path asks for inductor when it compiles. Where a torch lacks a feature, either
the fallback below does the same job (one chaining pass for a single-pass config slot),
or the caller gets ``TorchFeatureError`` naming the config key that needs it and the torch
version, never a silent skip.

What each release has (checked on 2.11.0, 2.13.0, 2.14.1, 2.15.0):

- 2.11 has no ``CustomInferenceAwareGraphPass`` and no ``get_custom_graph_passes``; its
  ``post_grad_custom_post_pass`` and ``joint_custom_post_pass`` slots hold one pass, which
  inductor calls with the graph only. ``chain_graph_passes`` then installs one
  ``ChainedGraphPass`` that runs the passes already there, then ours, and whose
  ``uuid()`` combines theirs.
- 2.13 to 2.15 take a tuple in both slots and tell inference-aware passes whether the
  graph is an inference graph.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

# FakeTensor and its mode: torch._subclasses is imported by ``import torch`` itself.
from torch._guards import detect_fake_mode
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ._torch_compat_dynamo import (  # split off by job; re-exported: compat.<name> as before
    _attr,
    aot_autograd,
    dynamo_counters,
    dynamo_restart_error,
    dynamo_unsupported_error,
    guard_failure_counts,
    guard_failures_since,
    min_cut_partition,
    recompile_limit,
    symbolic_sizes_traceable_under_tensor_parallel,
    symbols_keep_their_first_proxy,
)

__all__ = [
    "dynamo_restart_error",
    "guard_failure_counts",
    "guard_failures_since",
    "enable_symm_mem_for_group",
    "symm_mem_test_mode",
    "FakeTensor",
    "FakeTensorMode",
    "OpOverload",
    "TORCH_VERSION",
    "TorchFeatureError",
    "aot_autograd",
    "chain_graph_passes",
    "compile_fx",
    "compile_wrapper",
    "compiler_disable",
    "control_deps_op",
    "custom_graph_pass_class",
    "default_store",
    "detect_fake_mode",
    "dynamo_counters",
    "dynamo_switched_off",
    "recompile_limit",
    "dynamo_unsupported_error",
    "eager_backward_lowering",
    "foreach_copy_",
    "fx_annotate",
    "in_compile_wrapper",
    "inductor_cache_dir",
    "inductor_config",
    "inductor_distributed_passes",
    "node_values",
    "roofline_rates",
    "inference_aware_pass_class",
    "installed_graph_passes",
    "is_impure",
    "min_cut_partition",
    "patch_optimizer_state_dict",
    "process_group_rank",
    "queue_backward_callback",
    "strided_shard",
    "symbolic_sizes_traceable_under_tensor_parallel",
    "symbols_keep_their_first_proxy",
    "register_process_group",
    "resolve_process_group",
    "preserve_node_ordering",
    "register_bucketing_ops",
    "default_process_group",
    "mesh_group_names",
    "mesh_root",
]

TORCH_VERSION: str = torch.__version__


class TorchFeatureError(RuntimeError):
    """This torch lacks something the configuration asks for."""


def _missing(what: str, key: str, alternative: str) -> TorchFeatureError:
    return TorchFeatureError(
        f"fsdp-overlap: {key} needs {what}, which torch {TORCH_VERSION} does not have. {alternative}"
    )


# --------------------------------------------------------------------------- inductor
def inductor_config() -> Any:
    """``torch._inductor.config`` (imported on first use, by the compile path)."""
    return importlib.import_module("torch._inductor.config")


def inductor_distributed_passes() -> dict[str, bool]:
    """Which of inductor's own distributed scheduling passes this torch has (by their
    config switches): ``simple_overlap`` (torch 2.14 and newer, on by default there) and
    ``overlap_scheduling`` (off by default)."""
    section = getattr(inductor_config(), "aten_distributed_optimizations", None)
    return {
        "simple_overlap": hasattr(section, "enable_simple_overlap"),
        "overlap_scheduling": hasattr(section, "enable_overlap_scheduling"),
    }


def node_values(node: Any) -> tuple[Any, Any, Any]:
    """An FX node's arguments, keyword arguments and result as their example values
    (``meta["val"]``), and a flat list of every tensor among them."""
    from torch.fx import Node
    from torch.utils._pytree import tree_leaves, tree_map

    def val(x: Any) -> Any:
        return x.meta.get("val") if isinstance(x, Node) else x

    args, kwargs, out = tree_map(val, list(node.args)), tree_map(val, dict(node.kwargs)), node.meta.get("val")
    tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
    return (args, kwargs, out), tensors


@contextlib.contextmanager
def roofline_rates(flops: float, mem: float) -> Iterator[None]:
    """While it lasts, torch's roofline estimates (``torch.utils._runtime_estimation``, which
    inductor's overlap scheduler calls) read ``flops`` FLOP/s and ``mem`` bytes/s instead of
    asking for an accelerator: without one torch 2.13 fails and 2.15 costs all compute at
    zero. The lookups are swapped in that module and put back after (2.11 - 2.14 call
    ``get_gpu_dram_gbps``, 2.15 ``get_device_dram_gbps``)."""
    module = importlib.import_module("torch.utils._runtime_estimation")
    tflops, gbps = flops / 1e12, mem / 1e9
    swaps = {
        "get_device_tflops": lambda *args, **kwargs: tflops,
        "get_gpu_dram_gbps": lambda *args, **kwargs: gbps,
        "get_device_dram_gbps": lambda *args, **kwargs: gbps,
    }
    saved = {name: getattr(module, name) for name in swaps if hasattr(module, name)}
    for name in saved:
        setattr(module, name, swaps[name])
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def compile_fx() -> Callable:
    fn = _attr("torch._inductor.compile_fx", "compile_fx")
    if fn is None:
        raise _missing("torch._inductor.compile_fx.compile_fx", "backend: inductor", "Use backend: aot_eager.")
    return fn


def register_bucketing_ops() -> bool:
    """Import torch's collective-bucketing module, which registers the ``torch.ops.bucketing``
    custom ops: code loaded from a warm FX graph cache may call them, in a process where
    nothing else imported it. False when this torch has no such module (then inductor
    cannot have emitted calls to those ops either)."""
    try:
        importlib.import_module("torch._inductor.fx_passes.bucketing")
    except ImportError:
        return False
    return True


@functools.cache
def custom_graph_pass_class() -> type:
    """``CustomGraphPass``: the base class whose ``uuid()`` inductor's caches key on."""
    cls = _attr("torch._inductor.custom_graph_pass", "CustomGraphPass")
    if cls is None:
        raise _missing(
            "torch._inductor.custom_graph_pass.CustomGraphPass", "backend: inductor", "Use backend: aot_eager."
        )
    return cls


@functools.cache
def inference_aware_pass_class() -> tuple[type, bool]:
    """The base class of a post-grad pass that wants to know whether the graph is an
    inference graph, and whether inductor tells it (``is_inference``). Without
    ``CustomInferenceAwareGraphPass`` (torch 2.11) inductor calls the pass with the graph
    only: the base is then ``CustomGraphPass`` and the pass must find out itself."""
    cls = _attr("torch._inductor.custom_graph_pass", "CustomInferenceAwareGraphPass")
    if cls is not None:
        return cls, True
    return custom_graph_pass_class(), False


def _slot_takes_a_list() -> bool:
    # get_custom_graph_passes arrived with the loops over a tuple in both slots
    return _attr("torch._inductor.custom_graph_pass", "get_custom_graph_passes") is not None


def installed_graph_passes(slot: Any) -> tuple:
    """The passes a config slot holds (None, one pass, or a list/tuple of them)."""
    if slot is None:
        return ()
    if isinstance(slot, ChainedGraphPass):
        return slot.passes
    if isinstance(slot, (list, tuple)):
        return tuple(slot)
    return (slot,)


class ChainedGraphPass:
    """One pass that runs several in order, for a torch whose slot holds one pass.

    Its ``uuid()`` combines the members': None when any member has none (a plain
    function), so inductor bypasses its FX graph cache exactly as it would for that
    function alone. Made a ``CustomGraphPass`` subclass on first use (``chained``)."""

    passes: tuple

    def __call__(self, graph: Any) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self) -> Any:
        parts = []
        for graph_pass in self.passes:
            uuid = getattr(graph_pass, "uuid", None)
            value = uuid() if callable(uuid) else None
            if value is None:
                return None
            parts.append(value.hex() if isinstance(value, bytes) else str(value))
        return hashlib.sha256("|".join(parts).encode()).hexdigest()


@functools.cache
def _chained_class() -> type:
    return type("ChainedGraphPass", (ChainedGraphPass, custom_graph_pass_class()), {})


def chain_graph_passes(slot: Any, ours: Any) -> Any:
    """What to put in an inductor pass slot so that the passes already there (torch_npu
    installs one) run first and ``ours`` runs last, on every graph."""
    passes = (*installed_graph_passes(slot), ours)
    if _slot_takes_a_list():
        return passes
    chained = _chained_class()()
    chained.passes = passes
    return chained


# --------------------------------------------------------------------------- FX ordering
@functools.cache
def control_deps_op() -> Any:
    """Inductor's ``control_deps`` higher-order op (what ``preserve_node_ordering``
    wraps a node in), or None where this torch has none: no graph can then hold one."""
    return _attr("torch._inductor.fx_passes.control_dependencies", "control_deps")


def preserve_node_ordering(graph: Any, deps: dict[Any, Iterable[Any]]) -> None:
    """Make each key node of ``deps`` depend on its nodes, so inductor's scheduler keeps
    the order (``control_deps``). ``deps`` values are any ordered iterables."""
    fn = _attr("torch._inductor.fx_passes.control_dependencies", "preserve_node_ordering")
    ordered_set = _attr("torch.utils._ordered_set", "OrderedSet")
    if fn is None or ordered_set is None:
        raise _missing(
            "torch._inductor.fx_passes.control_dependencies.preserve_node_ordering (to keep the collective "
            "order it chose)",
            "backend: inductor with manual_bucketing or overlap_grad_reduce",
            "Use backend: aot_eager, or turn both passes off.",
        )
    fn(graph, {node: ordered_set(after) for node, after in deps.items()})


def is_impure(target: Any) -> bool:
    """Whether an op has side effects (random ops excluded: moving other nodes across
    them consumes no random numbers)."""
    from torch._library.utils import is_impure as impure

    try:
        return bool(impure(target, args=(), kwargs={}, impure_random=False))
    except TypeError:  # a torch whose is_impure has no impure_random: it counts random ops as pure
        return bool(impure(target, args=(), kwargs={}))


def _resolved_group(group_name: Any) -> Any | None:
    """The process group registered under ``group_name`` (what a functional collective
    names its group by), or None where no such group exists in this process (a
    hand-built graph's made-up name, or no process group at all)."""
    if not isinstance(group_name, str):
        return None
    try:
        from torch._C._distributed_c10d import _resolve_process_group

        return _resolve_process_group(group_name)
    except (ImportError, RuntimeError, ValueError):
        return None


def resolve_process_group(group_name: Any) -> Any | None:
    """The process group registered under ``group_name`` in c10d's registry
    (``torch._C._distributed_c10d._resolve_process_group``), or None where none is."""
    return _resolved_group(group_name)


def register_process_group(group_name: str, group: Any) -> None:
    """Register ``group`` under ``group_name`` in c10d's registry (where functional
    collectives look their group up by name), replacing a group registered there before
    (``torch._C._distributed_c10d._register_process_group`` / ``_unregister_process_group``)."""
    import torch._C._distributed_c10d as c10d

    if _resolved_group(group_name) is not None:
        c10d._unregister_process_group(group_name)
    c10d._register_process_group(group_name, group)


def default_store() -> Any:
    """The default process group's store (``torch.distributed.distributed_c10d._get_default_store``)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def mesh_cached_hash(mesh: Any) -> int | None:
    """The hash ``DeviceMesh`` cached the first time it was hashed (its private ``_hash``),
    or None before that (or on a torch that caches no hash)."""
    return getattr(mesh, "_hash", None)


def set_mesh_cached_hash(mesh: Any, value: int) -> None:
    """Set the hash ``DeviceMesh.__hash__`` returns (it returns its cached ``_hash`` as it
    is): shard.sharding.pin_mesh_hash gives it a value that is the same in every process."""
    mesh._hash = value


def mesh_root(mesh: Any) -> Any:
    """The mesh ``mesh`` was sliced from (``mesh[...]``), itself for a mesh built whole:
    ``DeviceMesh._get_root_mesh()`` (2.11 to 2.15); before it, ``_mesh_resources.get_root_mesh``."""
    get = getattr(mesh, "_get_root_mesh", None)
    if get is not None:
        return get()
    from torch.distributed.device_mesh import _mesh_resources

    return _mesh_resources.get_root_mesh(mesh)


def mesh_group_names(mesh: Any) -> tuple[str, ...]:
    """The names of ``mesh``'s process groups, one per dimension (what a functional
    collective in a compiled graph names its group by): ``DeviceMesh._dim_group_names``
    (2.11 to 2.15), else each dimension's ``get_group().group_name``."""
    names = getattr(mesh, "_dim_group_names", None)
    if names is not None:
        return tuple(names)
    return tuple(mesh.get_group(dim).group_name for dim in range(mesh.ndim))


def default_process_group() -> Any | None:
    """The default process group object (``torch.distributed.group.WORLD``), or None without one."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.group.WORLD


def symm_mem_test_mode() -> bool:
    """Whether torch's symmetric-memory test mode is on (``_symmetric_memory._test_mode``:
    every group counts as enabled, the fused ops run their unfused fallbacks)."""
    try:
        module = importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError:  # a torch built without distributed
        return False
    return bool(getattr(module, "_is_test_mode", False))


def enable_symm_mem_for_group(group_name: str) -> None:
    """Symmetric memory for one process group, which inductor's micro-pipeline pass asks for
    (``is_symm_mem_enabled_for_group``). torch 2.11-2.15 mark the call deprecated ("no need to
    call this function anymore"), yet their pass still skips a group it was not made for."""
    import warnings

    from torch.distributed._symmetric_memory import enable_symm_mem_for_group as enable

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable(group_name)


def local_shape_and_offset(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape of a ``DTensor``'s local part and its offset in the global tensor, for any
    placements (``_StridedShard`` and a ``Shard`` per mesh dimension included):
    ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, the function
    torch.distributed.checkpoint describes shards with (the same signature on 2.11-2.15)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)


def strided_shard(dim: int, split_factor: int) -> Any:
    """FSDP2's data-parallel placement of a parameter that tensor parallelism splits on the
    same dim (``torch.distributed.tensor.placement_types._StridedShard``): the data-parallel
    ``Shard(dim)`` of each tensor-parallel part, ``split_factor`` parts."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward pass ends
    (``torch.autograd.Variable._execution_engine.queue_callback``)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """Copy each of ``src`` into the matching ``dst`` in one call (``torch._foreach_copy_``)."""
    torch._foreach_copy_(dst, src)


def fx_annotate() -> Callable | None:
    """``torch.fx.traceback.annotate`` (torch >= 2.9: Dynamo records the annotation in
    ``node.meta["custom"]``), or None on an older torch."""
    return _attr("torch.fx.traceback", "annotate")


def process_group_rank(group_name: Any) -> int | None:
    """This process's rank in the process group named ``group_name``, or None (``_resolved_group``)."""
    group = _resolved_group(group_name)
    return None if group is None else int(group.rank())


def process_group_size(group_name: Any) -> int | None:
    """How many ranks the process group named ``group_name`` has, or None (``_resolved_group``)."""
    group = _resolved_group(group_name)
    return None if group is None else int(group.size())


# --------------------------------------------------------------------------- AOT / functorch / dynamo
@contextlib.contextmanager
def eager_backward_lowering() -> Iterator[None]:
    """Compile the backward together with the forward (not lazily at the first backward),
    so a failure anywhere in compilation is known before any rank runs a collective."""
    config = importlib.import_module("torch._functorch.config")
    if not hasattr(config, "force_non_lazy_backward_lowering"):
        raise _missing(
            "torch._functorch.config.force_non_lazy_backward_lowering (to compile the backward before the first "
            "step, when every rank can still agree on a failure)",
            "compile: true",
            "Use compile: false.",
        )
    with config.patch(force_non_lazy_backward_lowering=True):
        yield


def inductor_cache_dir() -> str:
    """Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR`` or its default)."""
    cache_dir = _attr("torch._inductor.runtime.cache_dir_utils", "cache_dir")
    if cache_dir is not None:
        return cache_dir()
    user = "".join(c if c.isalnum() else "_" for c in os.environ.get("USER", "user"))
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


# --------------------------------------------------------------------------- a user's own torch.compile
def compile_wrapper(obj: Any) -> tuple[Any, bool] | None:
    """What ``torch.compile`` or ``torch.compiler.disable`` wrapped in ``obj``, and whether it
    is a ``disable``: ``(module, disabled)`` for ``torch.compile(module)``'s wrapper
    (``torch._dynamo.eval_frame.OptimizedModule``: ``_orig_mod``, its ``dynamo_ctx`` a
    ``DisableContext`` for a disable), ``(callable, disabled)`` for a wrapped function
    (``_torchdynamo_orig_callable``, ``_torchdynamo_disable``); None for anything else."""
    wrapper_class = _attr("torch._dynamo.eval_frame", "OptimizedModule")
    if wrapper_class is not None and isinstance(obj, wrapper_class):
        disable_class = _attr("torch._dynamo.eval_frame", "DisableContext")
        disabled = disable_class is not None and isinstance(getattr(obj, "dynamo_ctx", None), disable_class)
        return obj._orig_mod, disabled
    original = getattr(obj, "_torchdynamo_orig_callable", None)
    if original is None or isinstance(obj, type) or not callable(obj):
        return None
    return original, bool(getattr(obj, "_torchdynamo_disable", False))


def in_compile_wrapper() -> bool:
    """Whether a ``torch.compile(module)`` wrapper's call is running now (it sets a flag in
    Dynamo's ``eval_frame`` for its duration); False where this torch has no such flag."""
    flag = _attr("torch._dynamo.eval_frame", "_is_in_optimized_module")
    return bool(flag()) if flag is not None else False


def dynamo_switched_off() -> bool:
    """Whether Dynamo is switched off in this process (``TORCHDYNAMO_DISABLE=1``, or
    ``torch._dynamo.config.disable``): every ``torch.compile`` then runs eagerly."""
    import torch._dynamo

    return bool(getattr(torch._dynamo.config, "disable", False))


def compiler_disable(fn: Callable, reason: str) -> Callable:
    """``torch.compiler.disable(fn, reason=...)`` (public; ``reason`` is newer than the
    function: where it is missing, Dynamo's graph-break message just lacks it)."""
    try:
        return torch.compiler.disable(fn, reason=reason)
    except TypeError:  # pragma: no cover - a torch whose disable takes no reason
        return torch.compiler.disable(fn)


# --------------------------------------------------------------------------- checkpoint
def patch_optimizer_state_dict(model: Any, optimizer: Any, options: Any) -> None:
    """Make ``optimizer.state_dict()``/``load_state_dict()`` gather and scatter the full,
    FQN-keyed state (torch's own helper, which also keeps ``get_state_dict`` from
    recursing into the patched methods)."""
    patch = _attr("torch.distributed.checkpoint.state_dict", "_patch_optimizer_state_dict")
    if patch is None:
        raise _missing(
            "torch.distributed.checkpoint.state_dict._patch_optimizer_state_dict",
            "Accelerate's save_state/load_state of an fsdp-overlap model",
            "Save with fsdp_overlap_plugin.shard.checkpoint instead.",
        )
    patch(model, optimizers=(optimizer,), options=options)
