"""A LightningCLI YAML, read the way LightningCLI reads it: what ``fsdp-overlap check`` runs
on such a file, so that it gives the verdict the Trainer would.

    trainer:
      precision: bf16-mixed
      devices: 2
      strategy:
        class_path: fsdp_overlap_plugin.lightning.FSDPOverlapStrategy
        init_args: {bucket_plans: auto, reduce_dtype: fp32}

Nothing here re-states a rule:

1. the ``trainer`` section goes through Lightning's own parser
   (``LightningArgumentParser.add_lightning_class_args(Trainer, "trainer")``, as LightningCLI
   builds it, in the YAML's directory), which checks every trainer key and the strategy's
   ``init_args`` against their signatures and types;
2. the strategy is constructed from those ``init_args``: by its own ``__init__`` first (which
   validates the plugin keys, with our messages), then by jsonargparse, as LightningCLI does;
3. Lightning's ``_AcceleratorConnector``, what ``Trainer(...)`` builds, picks the precision
   plugin (normalising the flag, refusing what ``ModelParallelStrategy`` refuses, turning
   16-mixed into bf16-mixed on a CPU) and calls the strategy's ``_configure_launcher``;
4. ``config_for_precision``, what the strategy runs in ``setup_environment``, gives the dtypes,
   after the mesh from ``sharding_strategy`` / ``device_mesh`` and the trainer's
   ``num_nodes`` / ``devices`` (``_common.resolve_mesh``).

Unknown keys are looked up against the same signatures first, only to name the nearest
valid one. The ``model`` and ``data`` sections depend on the user's own classes and are not
checked here (LightningCLI checks them against those classes).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import os
import warnings
from pathlib import Path
from typing import Any

from .._lightning_compat import accelerator_connector, unified_precision
from ..config.keys import check_keys, suggest, unknown_key_message
from ..config.schema import OverlapConfig, OverlapConfigError, respell
from ._common import CONFIG_FIELDS, config_for_precision, precision_of
from .trainer import FSDPOverlapStrategy

__all__ = ["CLI_KEYS", "SUBCOMMANDS", "LightningYaml", "is_lightning_yaml", "read_lightning_yaml"]

#: The top-level keys of a LightningCLI config (``fit --config FILE``), and the subcommands
#: under which a config given before the subcommand nests them.
CLI_KEYS = ("seed_everything", "trainer", "model", "data", "optimizer", "lr_scheduler", "ckpt_path")
SUBCOMMANDS = ("fit", "validate", "test", "predict")
_STRATEGY_NAME = "fsdp_overlap"
#: Lines of Lightning's parser error quoted in ours (it lists every Union member it tried).
_QUOTED_LINES = 8


@dataclasses.dataclass
class LightningYaml:
    """What a LightningCLI YAML says for fsdp-overlap, resolved as the Trainer would."""

    config: OverlapConfig
    """The config in force after the precision flag was applied (``setup_environment``)."""
    section: str
    """Where the strategy's keys live: ``trainer.strategy.init_args`` (``fit.`` in front
    when the file nests under a subcommand)."""
    precision: str
    """Lightning's unified precision flag (``bf16-mixed``, ...)."""
    module: str
    """The strategy's ``module`` argument: which module of the LightningModule it parallelizes."""
    world: int | None
    """``devices`` x ``num_nodes`` when both are numbers."""
    model: Any
    """The ``model`` section (a ``class_path``/``init_args`` mapping in subclass mode), or None."""
    notes: list[str]


def is_lightning_yaml(data: dict) -> bool:
    """A LightningCLI config: it has a LightningCLI key at the top, or nests them under one
    subcommand."""
    return bool(set(data) & set(CLI_KEYS)) or (bool(data) and set(data) <= set(SUBCOMMANDS))


def _section(data: dict, source: str) -> tuple[dict, str]:
    """The mapping holding the LightningCLI keys, and its path prefix ("" or "fit.")."""
    prefix = ""
    if set(data) <= set(SUBCOMMANDS):
        if len(data) != 1:
            raise OverlapConfigError(
                f"{source}: the file holds the settings of {', '.join(map(str, data))}; check one subcommand's "
                "file at a time."
            )
        ((name, data),) = data.items()
        prefix = f"{name}."
        if not isinstance(data, dict):
            raise OverlapConfigError(f"{source}: {name}: expected a mapping, got {type(data).__name__}.")
    unknown = [k for k in data if k not in CLI_KEYS]
    if unknown:
        key = str(unknown[0])
        raise OverlapConfigError(
            unknown_key_message(
                key,
                CLI_KEYS,
                source=source,
                shown=repr(prefix + key),
                what="top-level key",
                reason=" (LightningCLI rejects it)",
                tail=f"LightningCLI's keys: {', '.join(CLI_KEYS)}.",
            )
        )
    return data, prefix


def _check_keys(mapping: dict, allowed: list[str], where: str, source: str, note: str = "") -> None:
    """Unknown keys, named with the nearest valid one (the parser below would reject them
    too, with the key but no suggestion)."""
    check_keys(
        mapping,
        allowed,
        source=source,
        shown=lambda key: repr(f"{where}.{key}"),
        note=note,
        tail=f"Valid keys under {where}: {', '.join(allowed)}.",
    )


def _parameters(fn: Any) -> list[str]:
    return [n for n, p in inspect.signature(fn).parameters.items() if n != "self" and p.kind is not p.VAR_KEYWORD]


class _LightningParser:
    """Lightning's own parser over the ``trainer`` section, as LightningCLI builds it
    (``add_lightning_class_args(Trainer, "trainer")``): the same checks LightningCLI runs
    on keys and types of the Trainer's and the strategy's arguments. It runs in the YAML's
    directory, so a relative ``init_args.config`` path resolves as with ``--config FILE``."""

    def __init__(self, source: str, where: str):
        try:
            from lightning.pytorch import Trainer
            from lightning.pytorch.cli import LightningArgumentParser
        except ImportError as exc:  # jsonargparse is what LightningCLI needs too
            raise OverlapConfigError(
                f"{source}: reading a LightningCLI YAML needs LightningCLI's parser ({exc}); "
                "pip install 'jsonargparse[signatures]'."
            ) from None
        self.parser = LightningArgumentParser(exit_on_error=False)
        self.parser.add_lightning_class_args(Trainer, "trainer")
        self.source, self.where = source, where
        self.directory = Path(source).resolve().parent

    def _run(self, fn: Any, *args: Any) -> Any:
        previous = os.getcwd()
        os.chdir(self.directory)
        try:
            return fn(*args)
        except Exception as exc:  # jsonargparse's ArgumentError / ValueError: which key, and why
            key, reason = _parser_complaint(str(exc))
            raise OverlapConfigError(f"{self.source}: {self.where}{key}: LightningCLI rejects it: {reason}") from None
        finally:
            os.chdir(previous)

    def parse(self, trainer: dict) -> Any:
        return self._run(self.parser.parse_object, {"trainer": trainer})

    def instantiate(self, parsed: Any) -> Any:
        """What LightningCLI does next: construct the strategy from its ``init_args``."""
        instantiate = getattr(self.parser, "instantiate", None) or self.parser.instantiate_classes
        return self._run(instantiate, parsed).trainer.strategy


def _parser_complaint(text: str) -> tuple[str, str]:
    """The key and the reason in a jsonargparse error. Its message nests one
    ``Parser key "..."`` per level (a strategy's ``init_args`` under its ``class_path``)
    and lists what each member of a Union expected; the innermost level says what is wrong."""
    lines = [line.strip() for line in text.strip().splitlines()]
    path: list[str] = []
    last = 0
    for i, line in enumerate(lines):
        if line.startswith('Parser key "'):
            name = line.split('"')[1]
            if path and any("class_path" in lines[j] for j in range(last, i)):
                name = f"init_args.{name}"
            path.append(name)
            last = i
    reasons = [
        line[2:]
        for line in lines[last:]
        if line.startswith("- ") and "NoneType" not in line and not line.startswith("- Expected a <class 'str'>")
    ]
    reason = reasons[0] if reasons else " ".join(lines[last : last + _QUOTED_LINES])
    return ".".join(path) or "trainer", reason


def read_lightning_yaml(data: dict, source: str) -> LightningYaml:
    """Resolve a LightningCLI config mapping (read from ``source``) to the ``OverlapConfig``
    the Trainer's fsdp_overlap strategy would run with. Every problem is an
    ``OverlapConfigError`` naming the key as the file spells it."""
    data, prefix = _section(data, source)
    trainer = data.get("trainer")
    if not isinstance(trainer, dict):
        raise OverlapConfigError(
            f"{source}: {prefix}trainer: expected a mapping with strategy: fsdp_overlap, got "
            f"{type(trainer).__name__ if trainer is not None else 'nothing'}."
        )
    cls = FSDPOverlapStrategy
    where = f"{prefix}trainer.strategy"
    init_where = f"{where}.init_args"
    strategy = trainer.get("strategy")
    raw_init: dict = {}
    if isinstance(strategy, dict):
        _check_keys(strategy, ["class_path", "init_args", "dict_kwargs"], where, source)
        raw_init = strategy.get("init_args") or {}
        if isinstance(raw_init, dict):
            allowed = _parameters(cls.__init__)
            own = [name for name in allowed if name not in CONFIG_FIELDS]
            _check_keys(
                raw_init,
                allowed,
                init_where,
                source,
                f" (fsdp-overlap's keys are docs/config.md's, plus {', '.join(own[:-1])} and {own[-1]}.)",
            )
    _check_keys(trainer, _parameters(_trainer_init()), f"{prefix}trainer", source)
    parser = _LightningParser(source, prefix)
    parsed = parser.parse(trainer)
    notes: list[str] = []
    chosen = parsed.trainer.strategy
    if isinstance(chosen, str):
        if chosen != _STRATEGY_NAME:
            raise OverlapConfigError(
                f"{source}: {where}: {chosen!r} is not fsdp-overlap's strategy; use {_STRATEGY_NAME!r} or "
                f"class_path: fsdp_overlap_plugin.lightning.FSDPOverlapStrategy.{suggest(chosen, [_STRATEGY_NAME])}"
            )
        notes.append(f"{where}: {chosen}, every key at its default")
        flag: Any = chosen  # Lightning's registry builds the strategy for the name
    else:
        class_path = str(chosen.class_path)
        module_name, _, name = class_path.rpartition(".")
        strategy_cls = getattr(importlib.import_module(module_name), name)
        if not (isinstance(strategy_cls, type) and issubclass(strategy_cls, cls)):
            raise OverlapConfigError(
                f"{source}: {where}.class_path: {class_path!r} is not fsdp-overlap's strategy; use "
                "fsdp_overlap_plugin.lightning.FSDPOverlapStrategy."
            )
        # The strategy's own __init__ first, for its messages (the plugin YAML of `config`
        # read by the plugin's reader, relative to this file as jsonargparse resolves it);
        # then LightningCLI's own construction, which must succeed as well.
        init = chosen.init_args.as_dict()
        config_path = raw_init.get("config") if isinstance(raw_init, dict) else None
        if isinstance(config_path, str) and not Path(config_path).is_absolute():
            config_path = str(parser.directory / config_path)
        init["config"] = config_path
        try:
            strategy_cls(**init)
        except OverlapConfigError as exc:
            message = str(exc)
            if message.startswith("config: "):  # the strategy's own `config` argument (a plugin YAML)
                raise OverlapConfigError(f"{source}: {init_where}.{message}") from None
            raise OverlapConfigError(f"{source}: {respell(message, lambda n: f'{init_where}.{n}')}") from None
        flag = parser.instantiate(parsed)
    try:
        built, precision = _trainer_precision(parsed.trainer, flag, notes)
        # what setup_environment does: the mesh from sharding_strategy / device_mesh and the
        # trainer's num_nodes / devices, then the dtypes from the precision flag
        config = config_for_precision(built._config_with_mesh(), precision)
    except OverlapConfigError as exc:
        message = str(exc)
        if message.startswith(("precision=", "accelerator=", "devices=")):  # a Trainer argument itself
            raise OverlapConfigError(f"{source}: {prefix}trainer.{message}") from None
        if message.startswith("trainer:"):
            raise OverlapConfigError(f"{source}: {prefix}{message}") from None
        raise OverlapConfigError(f"{source}: {respell(message, lambda n: f'{init_where}.{n}')}") from None
    user = built.overlap_config
    if (config.param_dtype, config.reduce_dtype) != (user.param_dtype, user.reduce_dtype):
        notes.append(
            f"param_dtype {config.param_dtype or 'null'}, reduce_dtype {config.reduce_dtype or 'null'} "
            f"from {prefix}trainer.precision={precision}"
        )
    devices, nodes = parsed.trainer.devices, parsed.trainer.num_nodes
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    world = devices * nodes if isinstance(devices, int) and isinstance(nodes, int) and devices > 0 else None
    return LightningYaml(
        config=config,
        section=init_where,
        precision=precision,
        module=built._module_spec,
        world=world,
        model=data.get("model"),
        notes=notes,
    )


def _trainer_precision(trainer: Any, strategy: Any, notes: list[str]) -> tuple[Any, str]:
    """What ``Trainer(...)`` makes of these arguments: Lightning's own connector chooses the
    accelerator and the strategy (the registry's for a name), builds the precision plugin
    (normalising the flag, refusing what ``ModelParallelStrategy`` refuses, turning
    16-mixed into bf16-mixed on a CPU) and calls the strategy's ``_configure_launcher``,
    where fsdp-overlap applies the precision to its config. Returns the strategy and its
    precision flag. Where the accelerator is not available on this machine (a GPU config
    checked on a laptop) the flag is only normalised, and a note says so."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
    from lightning_utilities.core import rank_zero

    # Lightning's "Using bfloat16 Automatic Mixed Precision" line (rank_zero_info, whose
    # logger the last imported Lightning package chose) is not check's output
    logger = rank_zero.log
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            connector = accelerator_connector(
                devices=trainer.devices,
                num_nodes=trainer.num_nodes,
                accelerator=trainer.accelerator,
                strategy=strategy,
                precision=trainer.precision,
            )
    except OverlapConfigError:
        raise  # the strategy's own _configure_launcher: the precision applied to its config
    except MisconfigurationException as exc:
        # Lightning refuses hardware this machine lacks (a GPU config checked on a laptop)
        if trainer.accelerator in ("auto", "cpu"):
            raise OverlapConfigError(f"trainer: Lightning refuses it: {exc}") from None
        notes.append(f"accelerator {trainer.accelerator!r} cannot be built here ({exc}); its precision checks not run")
        built = strategy if not isinstance(strategy, str) else FSDPOverlapStrategy()
        return built, str(unified_precision(trainer.precision) or "32-true")
    except ValueError as exc:  # Lightning's own refusal of a precision or an accelerator name
        key = next((k for k in ("precision", "accelerator", "devices") if k in str(exc)), "")
        raise OverlapConfigError(
            f"{key + '=' + repr(getattr(trainer, key)) if key else 'trainer'}: Lightning refuses it: {exc}"
        ) from None
    finally:
        logger.setLevel(level)
    notes.extend(f"Lightning: {w.message}" for w in caught if "precision" in str(w.message))
    if trainer.accelerator == "auto":
        chosen = type(connector.accelerator).__name__
        notes.append(
            f"accelerator: auto is {chosen} on this machine; the run's machine decides (set trainer.accelerator)"
        )
    return connector.strategy, precision_of(connector.precision_plugin)


def _trainer_init() -> Any:
    from lightning.pytorch import Trainer

    return Trainer.__init__
