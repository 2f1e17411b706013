"""``prepare(accelerator, model, optimizer, ...)``: ``accelerator.prepare`` with fsdp-overlap
doing the model.

Accelerate must not touch the model: its FSDP2 path would ``fully_shard`` it again, its
DDP path (the only one it has on a CPU) would wrap it in ``DistributedDataParallel``,
and its ``dynamo_config`` would compile it a second time. So the model goes through the
core (``parallelize``: plan -> shard -> compile with the passes), is marked as prepared
(Accelerate's own "do not wrap twice" flag), and only then handed to Accelerate, which
registers it as it is. Optimizers, data loaders and schedulers go through Accelerate's
usual ``prepare_*`` methods, in the order ``accelerator.prepare`` uses.

Export: ``accelerator.get_state_dict(model)`` of a model prepared here is the plugin's
``export.full_state_dict`` (full CPU tensors on the main process, ``{}`` elsewhere, as
Accelerate's FSDP2 path returns), so Accelerate's recipes (``save_pretrained(state_dict=
...)``, ``save_model``) work on every distributed type.

Checkpoints: under ``distributed_type: FSDP`` (GPUs, NPUs) ``save_state`` /
``load_state`` use Accelerate's FSDP2 code, which reads and writes DTensor models and
optimizers through ``torch.distributed.checkpoint``. Elsewhere (a CPU launch, a DDP
config) Accelerate writes ``get_state_dict(model)`` and ``optimizer.state_dict()`` from
rank 0 only: there a save hook gives the tied names of the full model state (the
plugin's ``get_state_dict``) tensors of their own for safetensors, a load hook reads it back
and re-shards it, and the optimizer's ``state_dict`` / ``load_state_dict`` return and
accept the full, FQN-keyed state (``torch.distributed.checkpoint.state_dict``), so the
files do not depend on the rank or the world size.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .._accelerate_compat import mark_prepared, prepared_models, prepared_objects
from ..config.schema import OverlapConfig, OverlapConfigError
from ..parallelize import parallelize, take_over_compiled
from ..report.messages import install_excepthook, say
from ..report.schedule import format_report, schedule_report
from ..runtime import devices
from ..runtime.state import get_state
from ..shard.export import full_state_dict
from ..shard.initialize import materialize
from ..shard.preflight import preflight
from ..shard.sharding import build_mesh, gather_disabled, is_sharded
from .config import ConfigSource, Resolved, load_config

__all__ = [
    "Resolved",
    "config_source",
    "configure",
    "load_config",
    "prepare",
    "prepare_objects",
    "use_gloo_on_cpu_only_launch",
]

log = logging.getLogger("fsdp_overlap_plugin.accelerate")

_SOURCE_ATTR = "_fsdp_overlap_config_source"
_MODELS_ATTR = "_fsdp_overlap_models"
_EXPORTED_ATTR = "_fsdp_overlap_exported_models"


# --------------------------------------------------------------------- CPU launches
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
    if env.get("ACCELERATE_USE_FSDP", "").lower() != "true" or "LOCAL_RANK" not in env:
        return False
    if "ACCELERATE_USE_CPU" in env:
        return False
    if devices.detect_device_type() != "cpu":
        return False
    env["ACCELERATE_USE_CPU"] = "true"
    say(
        int(env.get("RANK", "0")),
        "fsdp-overlap: set ACCELERATE_USE_CPU=true: this FSDP launch has no GPU or NPU, and without it Accelerate "
        "would run each launched process alone (set ACCELERATE_USE_CPU yourself to decide otherwise)",
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
    (uncaught, it is printed once and short: ``messages.install_excepthook``)."""
    install_excepthook()  # outermost, over the hook init_process_group installed in Accelerator()
    resolved = load_config(accelerator, config, model=model, environ=environ, **overrides)
    try:
        preflight(model, resolved.config)
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
    if is_sharded(model) or get_state(model) is not None:
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
        parallelize(model, cfg, mesh=build_mesh(cfg, device.type))
    except OverlapConfigError as exc:
        raise resolved.rename(exc) from None
    if on_meta:
        materialize(model, device, on_uninitialized=cfg.on_uninitialized)
    _switch_optimizer_params(optimizers, old_names, model)

    mark_prepared(model)  # Accelerate's own flag: register the model, never wrap it
    setattr(model, _SOURCE_ATTR, source)
    _install_get_state_dict(accelerator, model)
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
        _install_checkpointing(accelerator, model, prepared)
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
    if parallelism is not None and (
        getattr(parallelism, "tp_enabled", False) or getattr(parallelism, "cp_enabled", False)
    ):
        raise RuntimeError("fsdp-overlap shards over data-parallel ranks only; remove tp/cp from parallelism_config.")
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


@torch.no_grad()
def _broadcast_from_rank0(model: nn.Module, device: torch.device) -> None:
    """Accelerate's ``fsdp_sync_module_states``: every rank starts from rank 0's weights
    (each rank keeps only its shard of them, so they must agree)."""
    if device.type != "cpu":
        model.to(device)
    for tensor in [*model.parameters(), *model.buffers()]:
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


# ------------------------------------------------------------------- checkpoints
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


def _install_get_state_dict(accelerator: Any, model: nn.Module) -> None:
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
    ours.append(model)


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


def _install_checkpointing(accelerator: Any, model: nn.Module, prepared: list) -> None:
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType

    from .._torch_compat import patch_optimizer_state_dict

    # Both paths below go through torch's state-dict helpers (Accelerate's FSDP2 save/load,
    # the optimizer's full-state methods), which look each parameter up with getattr: on a
    # model sharded here that is the gathering property, a full all-gather per lookup (one
    # save_state of a 2-layer GPT: 57 on a CPU launch, 115 under FSDP2). They read the shards.
    _reading_shards(accelerator, "save_state", "load_state")
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
    ours.append(model)
    for obj in prepared:
        if isinstance(obj, (AcceleratedOptimizer, torch.optim.Optimizer)):
            inner = obj.optimizer if isinstance(obj, AcceleratedOptimizer) else obj
            # torch's own helper: state_dict() gathers the full FQN-keyed state (rank 0),
            # load_state_dict() takes it and keeps this rank's shard.
            patch_optimizer_state_dict(model, inner, _full_options())
