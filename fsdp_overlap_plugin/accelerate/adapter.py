"""``prepare(accelerator, model, optimizer, ...)``: ``accelerator.prepare`` with fsdp-overlap
doing the model.

Accelerate must not touch the model: its FSDP2 path would ``fully_shard`` it again, its
DDP path (the only one it has on a CPU) would wrap it in ``DistributedDataParallel``,
and its ``dynamo_config`` would compile it a second time. So the model goes through the
core (``parallelize``: plan -> shard -> compile with the passes), is marked as prepared
(Accelerate's own "do not wrap twice" flag), and only then handed to Accelerate, which
registers it as it is. Optimizers, data loaders and schedulers go through Accelerate's
usual ``prepare_*`` methods, in the order ``accelerator.prepare`` uses.

Export (``accelerator.get_state_dict``) and checkpoints (``save_state`` / ``load_state``) of
the model prepared here: ``accelerate/checkpointing.py``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .._accelerate_compat import mark_prepared, prepared_models, prepared_objects
from ..config.schema import OverlapConfig, OverlapConfigError
from ..core import (
    build_mesh,
    devices,
    format_report,
    get_state,
    install_excepthook,
    materialize,
    parallelize,
    preflight,
    process_rank,
    say,
    schedule_report,
    take_over_compiled,
)
from .adopt import is_plugin_model
from .checkpointing import install_checkpointing, install_get_state_dict
from .config import ConfigSource, Resolved, fsdp_launch, load_config

__all__ = [
    "Resolved",
    "config_source",
    "configure",
    "load_config",
    "prepare",
    "own_store_for_restarted_attempt",
    "prepare_objects",
    "use_gloo_on_cpu_only_launch",
]

log = logging.getLogger("fsdp_overlap_plugin.accelerate")

_SOURCE_ATTR = "_fsdp_overlap_config_source"


# --------------------------------------------------------------------- CPU launches
def _launched_fsdp_worker(env: Mapping[str, str]) -> bool:
    """A worker process (``LOCAL_RANK`` set) that a launcher started for an FSDP config."""
    return fsdp_launch(env) and "LOCAL_RANK" in env


def use_gloo_on_cpu_only_launch() -> bool:
    """Let ``accelerate launch`` with an FSDP config start real gloo ranks on a CPU-only
    machine. Returns True if it changed anything.

    There, the launcher does start ``--num_processes`` workers (through torchrun), but each
    ``Accelerator`` then sees no GPU and, unless ``ACCELERATE_USE_CPU`` is set, takes itself
    for a lone process (``distributed_type: NO``, no process group): every rank would
    train alone. (``--cpu`` is no way out: it makes the launcher start one process.) So,
    in a worker of such a launch on a machine without CUDA or NPU devices, this sets
    ``ACCELERATE_USE_CPU=true`` before the ``Accelerator`` is created, which gives
    ``MULTI_CPU`` with a gloo process group. It is called when
    ``fsdp_overlap_plugin.accelerate`` is imported, and says so in one line (rank 0); an
    explicit ``ACCELERATE_USE_CPU`` in the environment is left as it is.
    """
    env = os.environ
    if not _launched_fsdp_worker(env):
        return False
    if "ACCELERATE_USE_CPU" in env:
        return False
    if devices.detect_device_type() != "cpu":
        return False
    env["ACCELERATE_USE_CPU"] = "true"
    say(
        process_rank(),
        "fsdp-overlap: set ACCELERATE_USE_CPU=true: this FSDP launch has no GPU or NPU, and without it Accelerate "
        "would run each launched process alone (set ACCELERATE_USE_CPU yourself to decide otherwise)",
    )
    return True


def own_store_for_restarted_attempt() -> bool:
    """Give a restarted worker of an FSDP launch on a CPU-only machine (``accelerate launch
    --max_restarts N``) a default process group on a store namespace of its own, before
    Accelerate creates one. Returns True if it did.

    The workers of every attempt share the launcher's store, and the default group's keys
    carry no attempt number: a restarted rank read a peer's address from the killed
    attempt and stopped with ``Gloo connectFullMesh failed ... Connection refused`` (1 of 1
    restarts here; a hang in another run). ``devices.init_process_group`` prefixes the
    store with the restart count, as it does for the Lightning strategies and
    ``fsdp_overlap_plugin.init_process_group``; Accelerate then finds the group
    initialised and uses it. Called when ``fsdp_overlap_plugin.accelerate`` is imported;
    the first attempt is left to Accelerate, and so are GPU and NPU launches (not tried)."""
    env = os.environ
    if not _launched_fsdp_worker(env):
        return False
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt in ("", "0") or dist.is_initialized() or devices.detect_device_type() != "cpu":
        return False
    devices.init_process_group("gloo")
    say(
        dist.get_rank(),
        f"fsdp-overlap: restarted attempt {attempt}: its process group uses a store namespace of its own (the "
        "launcher's store still holds the killed attempt's addresses)",
    )
    return True


def configure(
    accelerator: Any,
    model: nn.Module,
    config: OverlapConfig | dict | str | os.PathLike | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Resolved:
    """The pure first half of ``prepare``: this worker's configuration (``load_config``)
    checked against ``model`` (plan, checkpointed modules) with the key spelled as the
    user's file spells it. Every rank raises the same error here, before any collective
    (uncaught, it is printed once and short: ``messages.install_excepthook``). What the
    checks found is ``resolved.checked``, for ``parallelize(..., checked=...)``."""
    install_excepthook()  # outermost, over the hook init_process_group installed in Accelerator()
    resolved = load_config(accelerator, config, model=model, environ=environ, **overrides)
    try:
        resolved.checked = preflight(model, resolved.config)
    except OverlapConfigError as exc:
        raise resolved.rename(exc) from None
    return resolved


def config_source(model: nn.Module) -> ConfigSource | None:
    """Where the configuration of a model prepared by ``prepare`` came from."""
    return getattr(model, _SOURCE_ATTR, None)


# ------------------------------------------------------------------------- prepare
def prepare(
    accelerator: Any,
    *objects: Any,
    config: OverlapConfig | dict | str | os.PathLike | None = None,
    **overrides: Any,
) -> Any:
    """``accelerator.prepare(*objects)``, with the one model among ``objects`` sharded and
    compiled by fsdp-overlap instead of wrapped by Accelerate. Returns the objects in the
    same order (a single object if one was given), as ``accelerator.prepare`` does.

    After it: the model is the same module object, its parameters ``DTensor`` shards, its
    forward compiled with the passes; the optimizers hold the sharded parameters (create
    them from ``model.parameters()`` before or after this call); the data loaders are
    sharded by Accelerate; ``accelerator.backward``, ``accelerator.clip_grad_norm_``,
    ``save_state`` and ``load_state`` work. Configuration errors are raised on every rank
    before any collective. ``config`` / ``overrides``: see ``load_config``.
    """
    # torch.compile(model): the module inside is prepared and returned in its place (its
    # parameters are the wrapper's, so an optimizer built on either still matches)
    objects = tuple(take_over_compiled(o) if isinstance(o, nn.Module) else o for o in objects)
    models = [o for o in objects if isinstance(o, nn.Module)]
    if len(models) != 1:
        raise ValueError(
            f"fsdp_overlap_plugin.accelerate.prepare: pass exactly one model (got {len(models)}); "
            "prepare further models with further calls."
        )
    model = models[0]
    if is_plugin_model(model):
        raise ValueError("fsdp_overlap_plugin.accelerate.prepare: this model is already prepared.")
    check_accelerator(accelerator)

    resolved = configure(accelerator, model, config, **overrides)
    cfg, source = resolved.config, resolved.source

    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    for opt in optimizers:
        if opt.state:
            raise ValueError(
                "fsdp_overlap_plugin.accelerate.prepare: the optimizer already has state; call prepare() "
                "before the first optimizer step."
            )
    old_names = {id(p): name for name, p in model.named_parameters()}

    device = accelerator.device
    if device.type not in devices.BACKENDS:
        raise RuntimeError(f"fsdp-overlap runs on {', '.join(devices.BACKENDS)}; the Accelerator's device is {device}.")
    _ensure_process_group(device)
    on_meta = any(p.is_meta for p in model.parameters())
    if resolved.settings.sync_module_states and not on_meta and dist.get_world_size() > 1:
        _broadcast_from_rank0(model, device)
    try:
        # the model configure() checked (taken over from torch.compile above): not checked again
        parallelize(model, cfg, mesh=_mesh_for(accelerator, cfg, device), checked=resolved.checked)
    except OverlapConfigError as exc:
        raise resolved.rename(exc) from None
    if on_meta:
        materialize(model, device, on_uninitialized=cfg.on_uninitialized)
    _switch_optimizer_params(optimizers, old_names, model)

    mark_prepared(model)  # Accelerate's own flag: register the model, never wrap it
    setattr(model, _SOURCE_ATTR, source)
    install_get_state_dict(accelerator, model)
    if accelerator.is_main_process:
        if source.path is None and config is None:
            log.warning("fsdp-overlap: %s: using the defaults and Accelerate's settings.", source)
        log.info("fsdp-overlap: configuration from %s; plan of %d buckets", source, len(get_state(model).plan))
    return prepare_objects(accelerator, *objects)


def prepare_objects(accelerator: Any, *objects: Any) -> Any:
    """``accelerator.prepare(*objects)`` where every model among ``objects`` is already the
    plugin's (``prepare`` ran on it): the model is registered as it is, the rest goes
    through Accelerate's per-object methods. What an adopted accelerator's ``prepare``
    does with an optimizer created after the model (``accelerate/adopt.py``)."""
    prepared = _prepare_with_accelerate(accelerator, objects)
    models = [o for o in objects if isinstance(o, nn.Module)]
    if not models:
        models = [m for m in prepared_models(accelerator) if get_state(m) is not None]
    for model in models:
        install_checkpointing(accelerator, model, prepared)
        _report_after_first_step(accelerator, model, prepared)
    return prepared[0] if len(prepared) == 1 else tuple(prepared)


def check_accelerator(accelerator: Any) -> None:
    """The distributed types the plugin cannot run under, and a launch whose processes would
    each train alone, as errors that say what to change."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA):
        raise RuntimeError(
            f"fsdp-overlap replaces Accelerate's FSDP; it cannot run under distributed_type {kind.value}. "
            "Use distributed_type: FSDP (see configs/overlap.yaml)."
        )
    parallelism = getattr(accelerator, "parallelism_config", None)
    if parallelism is not None and getattr(parallelism, "cp_enabled", False):
        raise RuntimeError(
            "fsdp-overlap does not split sequences; remove cp_size from parallelism_config (valid: dp_replicate_size, "
            "dp_shard_size, tp_size)."
        )
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and accelerator.num_processes != launched:
        raise RuntimeError(
            f"the launcher started {launched} processes but Accelerate sees {accelerator.num_processes} "
            f"(distributed_type {accelerator.distributed_type.value}), so each rank would train alone. On a "
            "machine without GPUs or NPUs Accelerate sets up gloo ranks only with ACCELERATE_USE_CPU=true: import "
            "fsdp_overlap_plugin.accelerate before creating the Accelerator (it sets this for FSDP launches), or "
            "launch with `ACCELERATE_USE_CPU=true accelerate launch --config_file ...`."
        )


def _ensure_process_group(device: torch.device) -> None:
    """A single process (``python train.py``) has no process group; sharding over one rank
    still needs one."""
    if dist.is_initialized():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError("fsdp-overlap: several processes were launched but no process group is initialised.")
    dist.init_process_group(devices.backend_for(device.type), store=dist.HashStore(), rank=0, world_size=1)


def _mesh_for(accelerator: Any, cfg: OverlapConfig, device: torch.device) -> Any:
    """The mesh the model is sharded on. With a tensor dimension it is Accelerate's own
    ``torch_device_mesh`` (its data-parallel dimensions and ``tp``, innermost), the mesh a
    user's ``parallelize_module(..., accelerator.torch_device_mesh["tp"], ...)`` splits over
    and every model of the job shares: a second mesh of the same ranks would compare equal
    to it with process groups of its own, and two ranks of a tensor-parallel group could
    then run one all-reduce on different groups, which hangs (found at dp 2 x tp 2: about
    one launch in two hung in its first backward)."""
    mesh = getattr(accelerator, "torch_device_mesh", None) if cfg.mesh.tensor > 1 else None
    if mesh is None:
        return build_mesh(cfg, device.type)
    dims = tuple(n for n in mesh.mesh_dim_names or () if n in ("dp_replicate", "dp_shard", "tp"))
    if dims != tuple(mesh.mesh_dim_names or ()) or dims[-1:] != ("tp",):
        raise RuntimeError(
            f"fsdp-overlap: Accelerate's device mesh has dimensions {mesh.mesh_dim_names}; with tensor parallelism "
            "the plugin shards over its dp_replicate / dp_shard dimensions with tp innermost (no cp or sp)."
        )
    return mesh


@torch.no_grad()
def _broadcast_from_rank0(model: nn.Module, device: torch.device) -> None:
    """Accelerate's ``fsdp_sync_module_states``: every rank starts from rank 0's weights
    (each rank keeps only its shard of them, so they must agree). A parameter the user
    already split over tensor-parallel ranks (a ``DTensor``) is broadcast whole and each
    rank keeps its own part of rank 0's tensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if device.type != "cpu":
        model.to(device)
    for tensor in [*model.parameters(), *model.buffers()]:
        if isinstance(tensor, DTensor):
            full = tensor.full_tensor()
            dist.broadcast(full, src=0)
            mine = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None)
            tensor.to_local().copy_(mine.to_local())
        else:
            dist.broadcast(tensor.data, src=0)


def _switch_optimizer_params(optimizers: list, old_names: dict[int, str], model: nn.Module) -> None:
    """Point optimizers created before sharding at the sharded parameters (same FQN)."""
    new = dict(model.named_parameters())
    for opt in optimizers:
        for group in opt.param_groups:
            group["params"] = [new[old_names[id(p)]] if id(p) in old_names else p for p in group["params"]]


def _prepare_with_accelerate(accelerator: Any, objects: tuple) -> list:
    """What ``accelerator.prepare`` does for each object (first data loaders, the models and
    optimizers, then schedulers, which need the prepared optimizers), without its FSDP2
    branch, which would shard the model again: the models are the plugin's, marked
    prepared, so ``prepare_model`` only registers them."""
    from torch.optim.lr_scheduler import LRScheduler
    from torch.utils.data import DataLoader

    result: list = []
    for obj in objects:
        if isinstance(obj, nn.Module):
            result.append(accelerator.prepare_model(obj))
        elif isinstance(obj, DataLoader):
            result.append(accelerator.prepare_data_loader(obj))
        elif isinstance(obj, torch.optim.Optimizer):
            result.append(accelerator.prepare_optimizer(obj))
        else:
            result.append(obj)
    result = [accelerator.prepare_scheduler(o) if isinstance(o, LRScheduler) else o for o in result]
    for item in result:
        if any(item is x for x in prepared_objects(accelerator)):
            mark_prepared(item)
    return result


def _report_after_first_step(accelerator: Any, model: nn.Module, prepared: list) -> None:
    """The schedule summary, printed once by the main process after the model's first
    optimizer step (as the Lightning strategy does): a script that only calls
    ``accelerator.prepare`` (transformers' ``Trainer``) shows what the passes did too."""
    from accelerate.optimizer import AcceleratedOptimizer

    state = get_state(model)
    if state is None or state.summary_hooked:
        return
    optimizers = [o.optimizer if isinstance(o, AcceleratedOptimizer) else o for o in prepared]
    optimizers = [o for o in optimizers if isinstance(o, torch.optim.Optimizer)]
    if not optimizers:
        return  # an optimizer prepared later (an adopted accelerator) installs it then
    state.summary_hooked = True
    handles: list = []

    def after_step(*_: Any) -> None:
        for handle in handles:
            handle.remove()
        if accelerator.is_main_process:
            print(format_report(schedule_report(model)), flush=True)

    handles.extend(o.register_step_post_hook(after_step) for o in optimizers)
