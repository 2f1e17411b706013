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
* **Its own gradient checkpointing.** ``gradient_checkpointing_enable()`` makes each layer
  call ``torch.utils.checkpoint``, which does not compile on sharded parameters:
  ``checkpointing_layers`` names the layers (they join ``activation_checkpointing``) and
  ``disable_own_checkpointing`` switches transformers' call off.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..config.schema import OverlapConfigError

__all__ = [
    "own_tp_plan",
    "checkpointing_layers",
    "disable_own_checkpointing",
    "initialize_weights",
    "is_transformers_model",
    "library_class",
    "library_classes",
    "load_config",
    "model_from_config",
    "original_format",
    "prepare_for_compile",
    "save_config",
    "tied_copies",
]

# What PreTrainedModel.loss_function falls back to for an unknown loss_type.
_FALLBACK_LOSS = "ForCausalLM"


def is_transformers_model(module: nn.Module) -> bool:
    """True for a ``transformers.PreTrainedModel`` (without importing transformers)."""
    # ``transformers`` itself is a lazy module that other libraries import in passing
    # (torchmetrics does, under Lightning); ``transformers.PreTrainedModel`` would then
    # import ``modeling_utils``, 0.4 s of CPU per rank for a model that cannot be one
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is None:
        return False
    try:
        return isinstance(module, modeling_utils.PreTrainedModel)
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


def checkpointing_layers(model: nn.Module) -> list[tuple[str, list[str]]]:
    """Per transformers model in ``model`` whose own gradient checkpointing is on: its
    FQN and the FQNs (in ``model``) of the layers it would recompute.

    ``gradient_checkpointing_enable()`` sets ``gradient_checkpointing = True`` on each
    ``GradientCheckpointingLayer`` (every ``every_n_layers``-th one) and has their forward
    call ``torch.utils.checkpoint``, which fails under ``torch.compile`` on sharded
    parameters; those layers are checkpointed the plugin's way instead. A model that
    flags other modules only (a pre-``GradientCheckpointingLayer`` model whose own forward
    calls the checkpoint) cannot be taken over: an error says which key to use."""
    found = []
    for prefix, hf_model in outermost_transformers_models(model):
        flagged = [
            (name, module)
            for name, module in hf_model.named_modules()
            if getattr(module, "gradient_checkpointing", False) is True
        ]
        if not flagged:
            continue
        layers = [
            ".".join(p for p in (prefix, name) if p) for name, module in flagged if _is_checkpointing_layer(module)
        ]
        if not layers:
            others = ", ".join(".".join(p for p in (prefix, n) if p) or "<root>" for n, _ in flagged)
            raise OverlapConfigError(
                f"{type(hf_model).__name__}: gradient_checkpointing_enable() flagged {others}, whose forward "
                "calls torch.utils.checkpoint itself, which does not compile on sharded parameters. Call "
                "gradient_checkpointing_disable() and list the blocks in activation_checkpointing instead "
                "(Accelerate: fsdp_activation_checkpointing: true)."
            )
        found.append((prefix, layers))
    return found


def disable_own_checkpointing(model: nn.Module) -> None:
    """Turn off transformers' own checkpoint call in every model ``checkpointing_layers``
    found (its layers are checkpointed by ``apply_activation_checkpointing`` instead)."""
    for _, hf_model in outermost_transformers_models(model):
        for module in hf_model.modules():
            if getattr(module, "gradient_checkpointing", False) is True:
                module.gradient_checkpointing = False
        if getattr(hf_model, "_require_grads_hook", None) is not None:
            hf_model.disable_input_require_grads()  # its hook only fed transformers' checkpoint


def _is_checkpointing_layer(module: nn.Module) -> bool:
    return any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__)


# --------------------------------------------------------------------- weights out
# What ``PreTrainedModel.save_pretrained`` does to a state dict before writing it, for
# ``export.save_pretrained`` (which writes tensor by tensor and cannot call it).


@contextlib.contextmanager
def library_classes(model: nn.Module):
    """Give the transformers models in ``model`` their library class back for a moment:
    transformers looks weight conversions up by class name, and sharding renamed the class
    (``FSDP<name>`` for FSDP2's ``fully_shard``, ``FSDPOverlap<name>`` for ours)."""
    swapped = []
    for module in model.modules():
        if not is_transformers_model(module):
            continue
        original = library_class(module)
        if original is not type(module):
            swapped.append((module, type(module)))
            module.__class__ = original
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def library_class(module: nn.Module) -> type:
    """The class ``module`` had before sharding renamed it (its own class if it did not)."""
    cls = type(module)
    prefix = next((p for p in ("FSDPOverlap", "FSDP") if cls.__name__.startswith(p)), None)
    if prefix is None:
        return cls
    return next((c for c in cls.__mro__ if c.__name__ == cls.__name__[len(prefix) :]), cls)


def tied_copies(model: nn.Module, groups: list[list[str]]) -> set[str]:
    """The state-dict names a transformers checkpoint leaves out: in each group of names
    that hold one tensor (``groups``), those the model declares tied to another
    (``_tied_weights_keys``: ``lm_head.weight`` of a tied Llama), as transformers'
    ``save_pretrained`` drops them; at least one name of each group stays."""
    patterns = []
    for prefix, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or {}
        patterns += [f"{prefix}.{key}" if prefix else key for key in tied]
    dropped: set[str] = set()
    for names in groups:
        tied = [n for n in sorted(names) if any(re.search(p, n) for p in patterns)]
        dropped.update(tied[: len(names) - 1] if len(tied) == len(names) else tied)
    return dropped


def original_format(model: nn.Module) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None:
    """The function turning tensors of ``model``'s state dict into the checkpoint format
    its ``from_pretrained`` reads (transformers' reverse weight conversions: a Mixtral's
    fused experts back to one tensor per expert, GPT-NeoX's ``lm_head`` to ``embed_out``),
    or None where the model has none. It works on one state-dict entry at a time, or on
    meta tensors to plan the names and shapes."""
    if not is_transformers_model(model):
        return None
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # pragma: no cover - a transformers without the v5 conversions
        return None

    def revert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with library_classes(model):
            return revert_weight_conversion(model, dict(tensors))

    return revert


def save_config(model: nn.Module, directory: Path, dtype: torch.dtype) -> list[str]:
    """Write ``config.json`` (the library class in ``architectures``, ``dtype`` the saved
    weights') and, for a model that generates, ``generation_config.json``, as
    ``save_pretrained`` does. Returns the file names written."""
    import copy

    config = copy.deepcopy(model.config)
    config.architectures = [library_class(model).__name__]
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(directory)
    written = ["config.json"]
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(directory)
        written.append("generation_config.json")
    return written


# transformers' style names that are ours as they are; the others (embedding_rowwise,
# colwise_gather_output, ...) are left whole by ``tp_plan: auto``. Its "sequence_parallel"
# is not ours either: transformers' takes a plain input for this rank's sequence shard and
# keeps its rowwise all-reduce, while a sequence-parallel plan of ours needs the embedding,
# every norm and the head named (docs/tensor-parallel.md#sequence-parallelism): written
# out in a tp_plan, not read from a model's own plan
_OWN_STYLES = ("colwise", "rowwise")


def own_tp_plan(model: nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """A transformers model's own tensor-parallel plan (``_tp_plan``: its config's
    ``base_model_tp_plan`` under the base model's prefix, plus the head's entry):
    ``(applied, left)``, the colwise / rowwise entries and the others, which stay whole.
    Empty for a model without a plan."""
    plan = getattr(model, "_tp_plan", None) or {}
    applied = {k: v for k, v in plan.items() if v in _OWN_STYLES}
    return applied, {k: v for k, v in plan.items() if v not in _OWN_STYLES}
