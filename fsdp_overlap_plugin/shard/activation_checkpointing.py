"""Activation checkpointing: which modules, and how their forward is recomputed.

The module tree is left as it is (no wrapper module), so FQNs, plans and state-dict keys
do not change: each checkpointed module's ``forward`` is replaced on the instance.

* Compiled (``compile: true``): the forward runs inside
  ``torch.fx.traceback.annotate({AC_KEY: fqn})``; the joint-graph pass
  ``passes.checkpointing`` turns the marks into recompute tags. Under ``torch.compile``,
  ``torch.utils.checkpoint`` around a module whose parameters are gathered DTensors fails
  in AOT autograd (it saves the ``DeviceMesh`` for backward); the tags give the same
  recompute with the gathers as ordinary nodes, which the reshard pass and the bucketing
  then treat like any other.
* Eager (``compile: false``, and any call that is not being compiled):
  ``torch.utils.checkpoint`` (non-reentrant), with a selective-checkpoint context for
  ``matmuls_saved``.

``checkpointed_modules`` takes over a transformers model's own switch
(``gradient_checkpointing_enable()`` / ``activation_checkpointing_enable()``): the layers it
flagged join the list, and transformers' own checkpoint call is turned off, so there is
one mechanism.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from .._torch_compat import TORCH_VERSION, fx_annotate
from ..config.keys import suggest
from ..config.plan import expand_pattern
from ..config.schema import OverlapConfigError
from ..contract import AC_KEY, SAVED_OPS
from . import hf

_annotate = fx_annotate()  # torch >= 2.9 (None on an older torch)

__all__ = [
    "apply_activation_checkpointing",
    "checkpointed_modules",
    "remove_activation_checkpointing",
    "resolve_activation_checkpointing",
]


def resolve_activation_checkpointing(model: nn.Module, patterns: list[str]) -> list[str]:
    """The module FQNs that ``patterns`` name, in module order; an error names a pattern
    that matches nothing. Pure: every rank raises the same error before any collective."""
    names = [n for n, _ in model.named_modules() if n]
    known = set(names)
    chosen: list[str] = []
    for i, pattern in enumerate(patterns):
        found = expand_pattern(pattern, names) if any(c in pattern for c in "*?[") else [pattern]
        if not found or found[0] not in known:
            raise OverlapConfigError(
                f"activation_checkpointing[{i}]: no module matches {pattern!r}.{suggest(pattern, names)}"
            )
        chosen.extend(f for f in found if f not in chosen)
    return chosen


def _selective_context(policy: str):
    if policy == "full":
        return None
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def decide(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, decide)


def apply_activation_checkpointing(
    model: nn.Module, fqns: list[str], policy: str = "full", *, compiled: bool = True
) -> list[str]:
    """Recompute the forward of the modules ``fqns`` in backward (see the module doc).
    A module nested in another listed one is checkpointed with its outer module only."""
    if compiled and _annotate is None:  # pragma: no cover - torch < 2.9
        raise OverlapConfigError(
            f"activation_checkpointing with compile: true needs torch.fx.traceback.annotate "
            f"(torch >= 2.9); this is torch {TORCH_VERSION}. Set compile: false or upgrade torch."
        )
    outer = [f for f in fqns if not any(f.startswith(o + ".") for o in fqns if o != f)]
    context_fn = _selective_context(policy)
    for fqn in outer:
        module = model.get_submodule(fqn)
        original = module.forward

        def checkpointed(*args, _original=original, _fqn=fqn, **kwargs):
            if compiled and torch.compiler.is_compiling():
                with _annotate({AC_KEY: _fqn}):
                    return _original(*args, **kwargs)
            extra = {"context_fn": context_fn} if context_fn is not None else {}
            return torch.utils.checkpoint.checkpoint(_original, *args, use_reentrant=False, **extra, **kwargs)

        checkpointed._fsdp_overlap_original = original  # what remove_activation_checkpointing puts back
        module.forward = checkpointed
    return outer


def remove_activation_checkpointing(model: nn.Module, fqns: list[str]) -> None:
    """Undo ``apply_activation_checkpointing`` on the modules ``fqns``: each gets back the
    forward it had (the class's own, where it had no other)."""
    for fqn in fqns:
        module = model.get_submodule(fqn)
        original = getattr(vars(module).get("forward"), "_fsdp_overlap_original", None)
        if original is None:
            continue  # not checkpointed by the plugin
        if (
            getattr(original, "__self__", None) is module
            and getattr(original, "__func__", None) is type(module).forward
        ):
            del module.forward
        else:
            module.forward = original


def checkpointed_modules(model: nn.Module, config) -> tuple[list[str], list[str]]:
    """Every module to checkpoint: ``config.activation_checkpointing`` resolved, then the
    layers a transformers model's own switch flagged; and notes for the report. Pure (the
    model is not changed; ``parallelize`` then calls ``hf.disable_own_checkpointing``):
    ``parallelize`` and ``fsdp-overlap check`` both call it, so they raise the same errors."""
    chosen = resolve_activation_checkpointing(model, config.activation_checkpointing)
    notes = []
    for prefix, layers in hf.checkpointing_layers(model):
        chosen.extend(f for f in layers if f not in chosen)
        where = f"{prefix}: " if prefix else ""
        notes.append(
            f"{where}transformers gradient checkpointing ({len(layers)} layers) runs as activation_checkpointing "
            f"{_summarize(layers)}: transformers' own checkpoint call is off"
        )
    if config.activation_checkpointing_policy != "full" and not chosen:
        raise OverlapConfigError(
            f"activation_checkpointing_policy: {config.activation_checkpointing_policy!r} applies to the "
            "checkpointed modules, and activation_checkpointing lists none. List them (for example "
            '["layers.*"]) or remove the policy.'
        )
    return chosen, notes


def _summarize(fqns: list[str]) -> str:
    return f"[{fqns[0]}, ..., {fqns[-1]}]" if len(fqns) > 2 else str(fqns)
