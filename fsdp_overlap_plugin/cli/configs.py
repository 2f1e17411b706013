"""A config file, read by the reader the runtime uses for its format, so that ``check``
says what the run would do with it. Nothing here decides a rule:

* plugin YAML (the ``OverlapConfig`` keys at the top): ``OverlapConfig.from_yaml``'s reader,
  what ``parallelize(model, "file.yaml")`` and ``FSDPOverlapStrategy(config=...)`` run;
* Accelerate YAML (plugin keys under ``fsdp_config``): ``accelerate.config.load_config``,
  what ``prepare`` runs in each worker, with Accelerate's own loader's verdict on the file
  and no environment (the launcher exports what the file says);
* LightningCLI YAML (the strategy under ``trainer.strategy``): ``lightning.config``, which
  runs Lightning's own parser and constructs the strategy as ``Trainer(...)`` does.

This module only records where the keys live, so that messages and analysis spell them
as the file does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.nn as nn

from ..accelerate import config as accelerate_config
from ..config.parse import read_yaml
from ..config.schema import OverlapConfig, OverlapConfigError, respell
from ..lightning import config as lightning_config

__all__ = ["LoadedConfig", "SHAPES", "load_config"]

#: What each shape is called in ``check``'s first line.
SHAPES = {"plugin": "plugin YAML", "lightning": "LightningCLI YAML", "accelerate": "Accelerate YAML"}


@dataclass
class LoadedConfig:
    """A config read from one of the three YAML shapes, and where its keys live."""

    config: OverlapConfig
    path: str | None = None
    shape: str = "default"
    """"plugin", "lightning", "accelerate", or "default" (no file)."""
    section: str = ""
    """Where the plugin keys live in the file ("", "trainer.strategy.init_args", "fsdp_config")."""
    prefix: str = ""
    """What each key is prefixed with there ("fsdp_overlap_" for Accelerate)."""
    world: int | None = None
    """World size the file implies (Accelerate num_processes, Lightning devices x num_nodes)."""
    notes: list[str] = field(default_factory=list)
    model_spec: str | None = None
    """A model the file names (LightningCLI ``model.class_path``), used when --model is absent."""
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    model_init_args: dict[str, Any] | None = None
    """LightningCLI ``model:`` without a ``class_path``: its init args, for the class the
    script gives ``LightningCLI(model_class)`` (which the file cannot name: ``--model`` does)."""
    module: str | None = None
    """LightningCLI: the strategy's ``module`` argument (which part of a LightningModule it
    parallelizes, and so what the plan is relative to)."""
    for_model: Callable[[nn.Module], OverlapConfig] | None = None
    """The config once the model is known, where it depends on it (Accelerate's
    ``fsdp_activation_checkpointing: true`` checkpoints the model's repeated blocks)."""

    def key(self, name: str) -> str:
        """How the file spells the key ``name``, with its section (``fsdp_config.fsdp_overlap_grad_reduce``)."""
        spelled = accelerate_config.key_for(name) if self.shape == "accelerate" else name
        return f"{self.section}.{spelled}" if self.section else spelled

    def rename(self, exc: OverlapConfigError) -> OverlapConfigError:
        """A core error (``bucket_plans[1]: ...``) with the key as the file spells it, and the file."""
        message = respell(str(exc), self.key)
        if self.path and not message.startswith(self.path):
            message = f"{self.path}: {message}"
        return OverlapConfigError(message)

    def resolve(self, model: nn.Module) -> OverlapConfig:
        """The config the run would use with ``model``."""
        return self.for_model(model) if self.for_model is not None else self.config


def load_config(path: str | Path | None, *, environ: Mapping[str, str] | None = None) -> LoadedConfig:
    """Read ``path`` with the runtime's reader for its shape: LightningCLI if it has a
    LightningCLI key at the top (``trainer``, ``model``, ...), Accelerate if it has
    ``distributed_type`` / ``fsdp_config`` / ``compute_environment``, a plugin YAML otherwise.
    Every problem raises ``OverlapConfigError`` naming the key as the file spells it.

    ``environ``: for an Accelerate YAML, the variables ``accelerate launch`` would export
    beside the file's values (its command-line overrides, e.g. ``ACCELERATE_MIXED_PRECISION``);
    none by default, so the file alone decides, as it does for ``accelerate launch
    --config_file`` with no overrides."""
    if path is None:
        return LoadedConfig(OverlapConfig())
    source = str(path)
    data = read_yaml(path)
    if lightning_config.is_lightning_yaml(data):
        return _lightning(data, source)
    if accelerate_config.is_accelerate_yaml(data):
        return _accelerate(source, dict(environ or {}))
    return LoadedConfig(OverlapConfig.from_dict(data, source=source), path=source, shape="plugin")


def _accelerate(source: str, environ: dict[str, str]) -> LoadedConfig:
    def read(model: nn.Module | None) -> accelerate_config.Resolved:
        # what prepare() runs in a worker, whose environment holds what the launcher exported
        return accelerate_config.load_config(None, source, model=model, environ=environ, model_later=model is None)

    resolved = read(None)
    settings, config = resolved.settings, resolved.config
    notes = []
    if settings.mixed_precision not in (None, "no"):
        notes.append(f"param_dtype = {config.param_dtype} from mixed_precision: {settings.mixed_precision}")
    if settings.reshard_after_forward is not None:
        notes.append(
            f"reshard_after_forward = {str(config.reshard_after_forward).lower()} from fsdp_reshard_after_forward"
        )
    if settings.activation_checkpointing and not config.activation_checkpointing:
        notes.append("fsdp_activation_checkpointing: true checkpoints the model's repeated blocks")
    loaded = LoadedConfig(
        resolved.config,
        path=source,
        shape="accelerate",
        section="fsdp_config",
        prefix=accelerate_config.PREFIX,
        world=resolved.world,
        notes=notes,
    )

    def for_model(model: nn.Module) -> OverlapConfig:
        try:
            return read(model).config
        except OverlapConfigError as exc:
            raise loaded.rename(exc) from None

    loaded.for_model = for_model
    return loaded


def _lightning(data: dict, source: str) -> LoadedConfig:
    found = lightning_config.read_lightning_yaml(data, source)
    loaded = LoadedConfig(
        found.config,
        path=source,
        shape="lightning",
        section=found.section,
        world=found.world,
        notes=found.notes,
        module=found.module,
    )
    model = found.model
    if isinstance(model, dict) and isinstance(model.get("class_path"), str):
        module, _, attr = model["class_path"].rpartition(".")
        loaded.model_spec = f"{module}:{attr}"
        loaded.model_kwargs = dict(model.get("init_args") or {})
    elif isinstance(model, dict):
        # LightningCLI(model_class) in the script: ``model:`` holds that class's init args
        # (directly, or under ``init_args:``)
        init = model.get("init_args") if set(model) == {"init_args"} else model
        loaded.model_init_args = dict(init) if isinstance(init, dict) else {}
    return loaded
