"""Hugging Face ``transformers`` models: what the plugin does differently for them.

Nothing here imports ``transformers`` unless the user already has: a model can only be a
``PreTrainedModel`` if its module is loaded, so ``sys.modules`` answers "is this a
transformers model" for free.

What a new user of a transformers model would otherwise hit:

* **The loss graph break.** ``PreTrainedModel.loss_function`` calls
  ``logger.warning_once`` when the model's ``loss_type`` is unset (GPT-2 and every class
  whose name does not end in a known head such as ``ForCausalLM``), then uses
  ``ForCausalLMLoss``. Dynamo cannot trace a logger call, so under ``fullgraph: true``
  the first training step stops with a graph break inside transformers. ``prepare``
  sets ``loss_type = "ForCausalLM"`` on such models, which is the loss transformers
  falls back to anyway: the same function, without the warning and its graph break.
  The schedule report lists the change under ``adjustments``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

__all__ = ["initialize_weights", "is_transformers_model", "load_config", "model_from_config", "prepare_for_compile"]

# What PreTrainedModel.loss_function falls back to for an unknown loss_type.
_FALLBACK_LOSS = "ForCausalLM"


def is_transformers_model(module: nn.Module) -> bool:
    """True for a ``transformers.PreTrainedModel`` (without importing transformers)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return False
    try:
        return isinstance(module, transformers.PreTrainedModel)
    except AttributeError:  # pragma: no cover - a partially imported transformers
        return False


def outermost_transformers_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(fqn, module)`` of each transformers model in ``model``'s tree that is not inside
    another one (the model itself, or ``self.model`` of a LightningModule)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(outer == "" or name.startswith(outer + ".") for outer, _ in found):
            continue
        if is_transformers_model(module):
            found.append((name, module))
    return found


def prepare_for_compile(model: nn.Module) -> list[str]:
    """Make the transformers models in ``model`` traceable in one graph without changing
    what they compute (see the module doc). Returns what was changed, in words."""
    notes = []
    for name, module in outermost_transformers_models(model):
        if "_loss_function" in vars(module):
            continue  # the user set loss_function explicitly: it is used as it is
        try:
            from transformers.loss.loss_utils import LOSS_MAPPING
        except ImportError:  # pragma: no cover - a transformers without the loss registry
            return notes
        loss_type = getattr(module, "loss_type", None)
        if loss_type in LOSS_MAPPING:
            continue
        module.loss_type = _FALLBACK_LOSS
        where = f"{name} ({type(module).__name__})" if name else type(module).__name__
        notes.append(
            f"{where}.loss_type {loss_type!r} -> {_FALLBACK_LOSS!r}: the loss transformers "
            "falls back to, set explicitly so that its logger.warning_once (a graph break) is not traced"
        )
    return notes


def initialize_weights(model: nn.Module) -> None:
    """Run a transformers model's own initialisation, as ``post_init()`` does outside a meta
    device context: ``initialize_weights()`` (``_init_weights`` on every module, each by the
    nearest enclosing sub-model; rotary ``inv_freq`` buffers recomputed from the config).

    It skips every module and tensor marked ``_is_hf_initialized`` (what ``from_pretrained``
    marks as loaded); on freshly allocated memory nothing is initialised yet, so the marks
    are cleared first."""
    for module in model.modules():
        if "_is_hf_initialized" in vars(module):
            del module._is_hf_initialized
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if tensor is not None and "_is_hf_initialized" in vars(tensor):
                del tensor._is_hf_initialized
    run = getattr(model, "initialize_weights", None)
    if callable(run):
        run()
    else:  # pragma: no cover - transformers 4.x
        model.apply(model._initialize_weights)


def load_config(path: str | Path) -> Any:
    """A ``transformers`` config from a local ``config.json`` (or a folder holding one),
    without hub access: its ``model_type`` picks the config class."""
    from transformers import AutoConfig

    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no transformers config at {str(file)!r} (expected a config.json or its folder)")
    data = json.loads(file.read_text())
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{file}: not a transformers config.json (it has no 'model_type' key)")
    return AutoConfig.for_model(**data)


def model_from_config(config: Any, *, device: torch.device | str | None = None) -> nn.Module:
    """The model a transformers config describes, randomly initialised: the class its
    ``architectures`` names (as ``from_pretrained`` would pick), else the causal-LM class
    of its ``model_type``. ``config`` may be a path (see ``load_config``); ``device="meta"``
    builds it without allocating weights."""
    import transformers

    if isinstance(config, (str, Path)):
        config = load_config(config)
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    with torch.device(device) if device is not None else contextlib.nullcontext():
        if cls is not None:
            # as from_config does: in the config's dtype (a bf16 checkpoint's config says bf16)
            return cls._from_config(config) if hasattr(cls, "_from_config") else cls(config)
        return transformers.AutoModelForCausalLM.from_config(config)
