"""What the Lightning adapters share, without a Lightning base class: the precision mapping,
the config a strategy is built from, which module is parallelized (and parallelizing it
once), the members both strategies have, and the schedule report as metrics.

Both the Trainer strategy and the Fabric strategy exist twice (for the ``lightning``
package and for the standalone ``pytorch_lightning`` / ``lightning_fabric`` packages,
whose class hierarchies and registries are separate), so everything that does not need
a Lightning base class lives here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

from .. import accelerators
from ..config import OverlapConfig, OverlapConfigError, suggest
from ..initialize import materialize
from ..messages import install_excepthook
from ..parallelize import parallelize
from ..sharding import is_sharded
from ..state import get_state

__all__ = [
    "CONFIG_FIELDS",
    "PRECISION_DTYPES",
    "StrategyBase",
    "build_config",
    "config_for_precision",
    "distributed_checkpoint",
    "log_once",
    "no_gathers",
    "on_meta",
    "parallelize_once",
    "parallelized_module",
    "precision_of",
    "report_metrics",
    "select_target",
]

# The OverlapConfig keys. The strategies spell each out as a keyword argument (LightningCLI
# accepts only named parameters as init_args); tests/test_lightning.py checks that their
# signatures cover every key, so a key added to OverlapConfig cannot be forgotten there.
CONFIG_FIELDS = tuple(OverlapConfig.field_docs())

# Lightning precision flag -> (default param_dtype, default reduce_dtype,
#                              allowed param_dtype, allowed reduce_dtype).
# None means "the parameter's own dtype" (fp32 under 32-true). "-mixed" keeps Lightning's
# autocast around the step and gathers parameters in the low dtype, so matmuls read half
# the bytes and autocast still runs norms, softmax and the loss in fp32; gradients are
# reduced in fp32 unless the config asks for less. "-true" casts the module (so the
# shards, i.e. the master weights, are in that dtype) before it is sharded.
# The flags are those Lightning's ModelParallelStrategy supports: "16-mixed" needs a
# GradScaler over sharded gradients, which neither Lightning nor we support there (on a
# CPU Lightning turns it into "bf16-mixed" itself).
PRECISION_DTYPES: dict[str, tuple[str | None, str | None, tuple, tuple]] = {
    "32-true": (None, None, (None, "fp32"), (None, "fp32", "bf16", "fp16")),
    "bf16-mixed": ("bf16", "fp32", ("bf16", "fp32"), ("fp32", "bf16")),
    "bf16-true": ("bf16", "bf16", ("bf16",), ("bf16", "fp32")),
    "16-true": ("fp16", "fp16", ("fp16",), ("fp16", "fp32")),
}

_SUGGESTED_PRECISION = {"bf16": "bf16-mixed", "fp16": "16-true", "fp32": "32-true"}


def precision_of(plugin: Any) -> str:
    """The precision flag a Lightning/Fabric precision plugin was built for."""
    return str(getattr(plugin, "precision", "32-true"))


def build_config(config: OverlapConfig | dict | str | None, overrides: dict[str, Any]) -> OverlapConfig:
    """The user's config: a file/dict/object plus keyword arguments that are not None.

    Validated here, at construction, so a wrong key fails before any process starts
    (and, uncaught, is printed once and short: ``messages.install_excepthook``).
    """
    install_excepthook()
    unknown = [k for k in overrides if k not in CONFIG_FIELDS]
    if unknown:
        key = unknown[0]
        raise OverlapConfigError(
            f"fsdp_overlap strategy: unknown argument {key!r}.{suggest(key, CONFIG_FIELDS)} "
            f"Config keys: {', '.join(CONFIG_FIELDS)}."
        )
    try:
        base = OverlapConfig.coerce(config)
    except OverlapConfigError as exc:
        raise OverlapConfigError(f"config: {exc}") from None  # the strategy's `config` argument
    return OverlapConfig.coerce(base, **{k: v for k, v in overrides.items() if v is not None})


STATE_DICT_TYPES = ("full", "sharded")


def distributed_checkpoint(save_distributed_checkpoint: bool | None, state_dict_type: str | None) -> bool:
    """Whether checkpoints are sharded, from ``ModelParallelStrategy``'s
    ``save_distributed_checkpoint`` or the ``state_dict_type`` of Lightning's FSDP
    strategies (``"full"``: one file with the gathered state on rank 0; ``"sharded"``: a
    distributed-checkpoint directory, the default). Both given must agree."""
    if state_dict_type is not None and state_dict_type not in STATE_DICT_TYPES:
        raise OverlapConfigError(
            f"state_dict_type: {state_dict_type!r} is not one of {', '.join(STATE_DICT_TYPES)}."
            f"{suggest(str(state_dict_type), STATE_DICT_TYPES)}"
        )
    if state_dict_type is None:
        return True if save_distributed_checkpoint is None else bool(save_distributed_checkpoint)
    sharded = state_dict_type == "sharded"
    if save_distributed_checkpoint is not None and bool(save_distributed_checkpoint) != sharded:
        raise OverlapConfigError(
            f"state_dict_type={state_dict_type!r} contradicts save_distributed_checkpoint="
            f"{save_distributed_checkpoint!r}: they say the same thing, pass one of them."
        )
    return sharded


def config_for_precision(config: OverlapConfig, precision: str) -> OverlapConfig:
    """Fill ``param_dtype`` / ``reduce_dtype`` from Lightning's precision flag.

    A dtype the user set explicitly wins when it is compatible with the precision (e.g.
    ``reduce_dtype: bf16`` under ``bf16-mixed``); one that contradicts it (``param_dtype:
    bf16`` under ``32-true``) is an error naming both, never silently overridden.
    """
    if precision not in PRECISION_DTYPES:
        raise OverlapConfigError(
            f"precision={precision!r} is not supported by the fsdp_overlap strategy; "
            f"valid: {', '.join(PRECISION_DTYPES)}.{suggest(precision, list(PRECISION_DTYPES))}"
        )
    default_param, default_reduce, allowed_param, allowed_reduce = PRECISION_DTYPES[precision]
    changes: dict[str, Any] = {}
    for key, default, allowed in (
        ("param_dtype", default_param, allowed_param),
        ("reduce_dtype", default_reduce, allowed_reduce),
    ):
        value = getattr(config, key)
        if value is None:
            changes[key] = default
        elif value not in allowed:
            hint = _SUGGESTED_PRECISION.get(value) if key == "param_dtype" else None
            fix = f"set precision={hint!r} on the Trainer/Fabric, or " if hint and hint != precision else ""
            valid = ", ".join("null" if a is None else a for a in allowed)
            raise OverlapConfigError(
                f"{key}: {value!r} conflicts with precision={precision!r} (valid there: {valid}). "
                f"Either {fix}remove {key} from the fsdp_overlap config."
            )
    if all(getattr(config, k) == v for k, v in changes.items()):
        return config
    return config.replace(**changes)


def select_target(root: nn.Module, spec: str) -> tuple[str, nn.Module]:
    """The module to parallelize inside a LightningModule: ``(fqn, module)``.

    ``"auto"``: the one child that holds all the parameters (``self.model = GPT()``), so
    both ``self(x)`` and ``self.model(x)`` run the compiled forward and plans are written
    relative to the model, as for ``parallelize(model)``; otherwise the LightningModule
    itself (its ``forward`` is compiled: call ``self(x)`` in ``training_step``).
    ``""`` always means the LightningModule; any other string is a submodule FQN.
    """
    if spec == "auto":
        if any(p is not None for p in root._parameters.values()):
            return "", root
        holders = [(name, child) for name, child in root.named_children() if any(True for _ in child.parameters())]
        return holders[0] if len(holders) == 1 else ("", root)
    if spec == "":
        return "", root
    names = [name for name, _ in root.named_modules() if name]
    if spec not in names:
        raise OverlapConfigError(
            f"module: {type(root).__name__} has no submodule {spec!r}.{suggest(spec, names)} "
            'Use "auto", "" (the LightningModule itself) or a submodule name.'
        )
    return spec, root.get_submodule(spec)


def on_meta(module: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in (*module.parameters(), *module.buffers()))


def parallelized_module(root: nn.Module) -> nn.Module | None:
    """The module ``parallelize`` already ran on inside ``root`` (by a strategy on an
    earlier ``fit``/``validate``, or by the user inside ``configure_model``), or None."""
    for module in root.modules():
        if get_state(module) is not None:
            return module
    return root if is_sharded(root) else None


def parallelize_once(
    root: nn.Module,
    choose_target: Callable[[], nn.Module],
    config: OverlapConfig,
    mesh: Any,
    device: torch.device,
) -> nn.Module:
    """Parallelize the module ``choose_target()`` names inside ``root``, unless one
    already was, then materialize ``root`` if it was built on the meta device (initialised
    as its library does; a tensor nothing initialises is an error or a warning, per
    ``on_uninitialized``). Returns the parallelized module."""
    done = parallelized_module(root)
    if done is None:
        target = choose_target()
        if not on_meta(root):
            root.to(device)
        parallelize(target, config, mesh=mesh)
        done = target
    if on_meta(root):
        materialize(root, device, on_uninitialized=config.on_uninitialized)
    return done


class StrategyBase:
    """The members the Trainer and Fabric strategy mixins have in common. A subclass sets
    ``_user_config`` / ``_config`` and ``_lightning_package``; the Lightning base class
    provides ``root_device``, ``world_size``, ``global_rank`` and ``_process_group_backend``."""

    _lightning_package: str
    _user_config: OverlapConfig
    _config: OverlapConfig | None

    @property
    def overlap_config(self) -> OverlapConfig:
        """The config in force: the user's, completed from the precision once set up."""
        return self._config or self._user_config

    @property
    def _log(self) -> logging.Logger:
        # A child of Lightning's logger, so messages reach the console like Lightning's own.
        return logging.getLogger(f"{self._lightning_package}.strategies.fsdp_overlap")

    def _get_process_group_backend(self) -> str:
        return self._process_group_backend or accelerators.backend_for(self.root_device.type)  # type: ignore[attr-defined]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank is a data-parallel rank (also on an HSDP mesh): each reads its own data.
        return {"num_replicas": self.world_size, "rank": self.global_rank}  # type: ignore[attr-defined]


def report_metrics(report: dict[str, Any]) -> dict[str, float]:
    """The schedule report as flat numbers, for ``self.log_dict`` and loggers."""
    metrics: dict[str, float] = {
        "fsdp_overlap/buckets": float(len(report["plan"])),
        "fsdp_overlap/world_size": float(report["world_size"]),
        "fsdp_overlap/unbucketed_params": float(len(report.get("unbucketed_params") or [])),
    }
    for kind in ("forward", "backward"):
        record = report.get(kind)
        if not record:
            continue
        for key in ("all_gather", "reduce_scatter", "all_reduce"):
            for when in ("before", "after"):
                metrics[f"fsdp_overlap/{kind}_{key}s_{when}"] = float(record[when].get(key, 0))
    return metrics


_LOGGED: set[str] = set()


def log_once(logger: logging.Logger, key: str, message: str) -> None:
    """Log ``message`` at INFO the first time ``key`` is seen in this process."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info(message)


@contextmanager
def no_gathers() -> Iterator[None]:
    """State-dict and checkpoint code reads parameters through ``getattr`` (torch's DCP
    ``_get_fqns`` does); inside this block that returns the shard instead of running an
    all-gather per parameter."""
    from ..sharding import gather_disabled

    with gather_disabled():
        yield
