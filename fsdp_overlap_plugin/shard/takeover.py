"""A model that reaches the plugin already compiled, and changes made to it after prepare.

The plugin compiles the model once, itself, with its passes. Whatever way a user arrives,
the run gets that or stops with a clear error, never a silently different run
(ARCHITECTURE.md). Two ways to arrive otherwise are handled here.

**Compiled by the user first** (``uncompiled``, run by every entry point before anything
else looks at the model):

* ``torch.compile(model)``: a wrapper (``OptimizedModule``, the model inside it as
  ``_orig_mod``), at the root or anywhere in the tree (``self.model = torch.compile(model)``
  in a LightningModule, one compiled block). Left in place, the wrapper's Dynamo compiles
  the model with the user's backend: per-parameter gathers, no passes, plan names
  ``_orig_mod.*``. Each wrapper is replaced by the module inside it (at the root, that
  module is what ``parallelize`` prepares and returns).
* ``model.compile()`` (in place, ``_compiled_call_impl``): the plugin's compile replaces
  the root's, and inside the plugin's compiled forward Dynamo ignores a submodule's; each is
  undone all the same, so no module keeps a second compiled call.
* ``module.forward = torch.compile(module.forward)``: inside the plugin's trace that
  forward runs as a compiled region of its own, with the user's backend (the plugin's gets
  no graph); the module's own forward is put back.

A ``torch.compiler.disable`` wrapper, or a compiled ``forward`` that is not the module's
own, cannot be taken over: ``CompiledModelError`` says what to remove.

**Changed after prepare** (``AfterPrepare``, run by the plugin's compiled forward, which
``compile/compiler.py`` guards): before the first step, transformers' own gradient
checkpointing switched on (or off) and a compile wrapper added are taken over as above;
after it, a change the compiled graph cannot follow is an error naming the call. A
parameter cast (``model.to(torch.bfloat16)``, ``.half()``) or a module replaced after
prepare is an error whenever it is seen: before the first step, and at any recompile
(Dynamo's guards notice the new dtype or module, so the backend checks again).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch.nn as nn
from torch.distributed.tensor import DTensor

from .. import _torch_compat as compat
from ..config.schema import OverlapConfigError
from . import hf
from .activation_checkpointing import _summarize, apply_activation_checkpointing, remove_activation_checkpointing

__all__ = ["AfterPrepare", "ChangedAfterPrepareError", "CompiledModelError", "uncompiled"]

# Marks the plugin's own compiled call (compile/compiler.py), which ``uncompiled`` leaves alone.
PLUGIN_CALL_ATTR = "_fsdp_overlap_call"


class CompiledModelError(OverlapConfigError):
    """The model was compiled (or excluded from compiling) in a way the plugin cannot undo."""


class ChangedAfterPrepareError(OverlapConfigError):
    """The model was changed after prepare in a way its compiled graph cannot follow."""


# ----------------------------------------------------------------- compiled by the user
def uncompiled(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """``model`` with every ``torch.compile`` of the user's taken off (see the module doc):
    the module to prepare (the one inside a root wrapper, else ``model`` itself) and what
    was undone, in words. Raises ``CompiledModelError`` where it cannot be undone."""
    notes: list[str] = []
    root, wrappers = _inside(model, "the model")
    if wrappers:
        notes.append(f"{_spelled('torch.compile(model)', wrappers)} given: the module inside it is prepared")
    replaced = []
    for name, module in list(root.named_modules()):
        for child_name, child in list(module._modules.items()):
            if child is None:
                continue
            fqn = f"{name}.{child_name}" if name else child_name
            inner, count = _inside(child, fqn)
            if count:
                module._modules[child_name] = inner
                replaced.append(fqn)
    if replaced:
        notes.append(f"torch.compile(...) around {_names(replaced)}: replaced by the module inside")
    in_place = [name or "the model" for name, module in root.named_modules() if _clear_compiled_call(module)]
    if in_place:
        notes.append(f".compile() on {_names(in_place)}: undone")
    forwards = [name or "the model" for name, module in root.named_modules() if _restore_forward(module, name)]
    if forwards:
        notes.append(f"forward = torch.compile(forward) on {_names(forwards)}: undone")
    return root, notes


def _inside(module: nn.Module, where: str) -> tuple[nn.Module, int]:
    """The module inside any number of ``torch.compile`` wrappers, and how many there were."""
    count = 0
    while (found := compat.compile_wrapper(module)) is not None and isinstance(found[0], nn.Module):
        inner, disabled = found
        if disabled:
            raise CompiledModelError(
                f"fsdp-overlap: {where} is wrapped in torch.compiler.disable(...), which keeps Dynamo, and so the "
                "plugin's compile and passes, out of it. Remove the torch.compiler.disable call, or set compile: "
                "false to train it uncompiled (plain FSDP2)."
            )
        module, count = inner, count + 1
    return module, count


def _clear_compiled_call(module: nn.Module) -> bool:
    call = vars(module).get("_compiled_call_impl")
    if call is None or getattr(call, PLUGIN_CALL_ATTR, False):
        return False
    module._compiled_call_impl = None
    return True


def _restore_forward(module: nn.Module, name: str) -> bool:
    """Put back the forward that ``module.forward = torch.compile(module.forward)`` replaced."""
    forward = vars(module).get("forward")
    found = compat.compile_wrapper(forward) if forward is not None else None
    if found is None:
        return False
    original, disabled = found
    where = f"{name or 'the model'}.forward"
    own = type(module).forward
    if disabled:
        raise CompiledModelError(
            f"fsdp-overlap: {where} is wrapped in torch.compiler.disable(...), which keeps Dynamo, and so the "
            f"plugin's compile and passes, out of it. Remove that assignment to {where}, or set compile: false "
            "to train it uncompiled (plain FSDP2)."
        )
    while (inner := compat.compile_wrapper(original)) is not None and not isinstance(inner[0], nn.Module):
        original = inner[0]  # torch.compile(torch.compile(module.forward))
    # Dynamo wraps a torch.nn module's forward once more (functools.wraps: __wrapped__)
    while getattr(original, "__self__", None) is not module and hasattr(original, "__wrapped__"):
        original = original.__wrapped__
    if getattr(original, "__self__", None) is module and getattr(original, "__func__", None) is own:
        del module.forward  # the class's forward again
    elif getattr(original, "__self__", None) is module:
        module.forward = original  # a bound method of its own, other than forward
    else:
        raise CompiledModelError(
            f"fsdp-overlap: {where} was replaced by torch.compile({getattr(original, '__qualname__', original)!r}), "
            f"which is not a method of the module, so the plugin cannot put its forward back. Remove the "
            f"torch.compile around it (the plugin compiles the whole model, with its passes)."
        )
    return True


def _spelled(what: str, count: int) -> str:
    return what if count == 1 else f"{what} ({count} wrappers deep)"


def _names(fqns: list[str], suffix: str = "") -> str:
    shown = [f + suffix for f in fqns[:3]]
    return ", ".join(shown) + (f" and {len(fqns) - 3} more" if len(fqns) > 3 else "")


def compile_notes_line(notes: list[str]) -> str:
    """The one line a rank says when it took a user's compile off the model."""
    return (
        "fsdp-overlap: the model was already compiled (" + "; ".join(notes) + "). The plugin compiles it once "
        "itself, with its passes; the torch.compile arguments are not used (set backend, fullgraph or dynamic "
        "in the plugin's config instead)."
    )


# ---------------------------------------------------------------- changed after prepare
def _layout(model: nn.Module) -> dict[str, str]:
    """What prepare fixed: every module's class, every parameter's shape, dtype and sharding."""
    out = {f"module {name or '<root>'}": type(module).__qualname__ for name, module in model.named_modules()}
    for name, param in model.named_parameters():
        kind = "shard" if isinstance(param, DTensor) else "plain tensor"
        out[f"parameter {name}"] = f"{tuple(param.shape)} {str(param.dtype).removeprefix('torch.')} {kind}"
    return out


def _checkpoint_func(module: nn.Module) -> Any:
    return vars(module).get("_gradient_checkpointing_func")


class AfterPrepare:
    """What prepare fixed about one model, checked by its compiled forward
    (``before_call``, every call) and by the backend (``check_unchanged``, every compile).

    ``hf_layers``: the layers checkpointed because transformers' own switch was on at
    prepare; ``from_config``: those the ``activation_checkpointing`` key lists."""

    def __init__(self, model: nn.Module, state: Any, hf_layers: list[str], from_config: list[str]):
        self._model = weakref.ref(model)
        self.state = state
        self.from_config = list(from_config)
        self.layout = _layout(model)
        # every module transformers' switch sets a flag on, read each call (a few attribute reads)
        self.switches = [
            (f"{prefix}.{name}".strip("."), module)
            for prefix, hf_model in hf.outermost_transformers_models(model)
            for name, module in hf_model.named_modules()
            if hasattr(module, "gradient_checkpointing")
        ]
        modules = dict(self.switches)
        # each taken-over layer and the checkpoint function transformers gave it: a
        # gradient_checkpointing_disable() replaces that function (and leaves the flag off)
        self.taken = {fqn: _checkpoint_func(modules[fqn]) for fqn in hf_layers if fqn in modules}

    @property
    def model(self) -> nn.Module:
        model = self._model()
        assert model is not None, "the model this check belongs to is gone"
        return model

    # ------------------------------------------------------------------ every call
    def before_call(self) -> None:
        """Run by the compiled forward before each call: take over what changed since
        prepare while nothing is compiled yet, refuse it afterwards."""
        fresh = not self.state.called and self.state.dynamo_graphs == 0
        if self.switches and self._checkpointing_switched():
            self._take_over_checkpointing(fresh)
        forward = vars(self.model).get("forward")
        if fresh or (forward is not None and compat.compile_wrapper(forward) is not None):
            self._take_over_compiled(fresh)
        if fresh:
            self.check_unchanged()

    def _checkpointing_switched(self) -> bool:
        return any(getattr(m, "gradient_checkpointing", False) is True for _, m in self.switches) or any(
            _checkpoint_func(m) is not self.taken[fqn] for fqn, m in self.switches if fqn in self.taken
        )

    def _take_over_checkpointing(self, fresh: bool) -> None:
        """transformers' gradient checkpointing switched on or off after prepare: before
        the first step, its layers are (un)checkpointed the plugin's way, exactly as at
        prepare; after it, an error."""
        model, state = self.model, self.state
        flagged = [fqn for _, layers in hf.checkpointing_layers(model) for fqn in layers]
        modules = dict(self.switches)
        dropped = [f for f, func in self.taken.items() if _checkpoint_func(modules[f]) is not func and f not in flagged]
        added = [f for f in flagged if f not in self.taken]
        removed = [f for f in dropped if f not in self.from_config]
        if (added or removed) and not fresh:
            call = "gradient_checkpointing_enable()" if added else "gradient_checkpointing_disable()"
            layers = added or removed
            raise ChangedAfterPrepareError(
                f"fsdp-overlap: {call} was called after the model's first compiled step (it switches "
                f"{_names(layers)}): the compiled graph cannot follow, and transformers' own checkpoint call does "
                "not compile on sharded parameters. Call it before prepare / parallelize (the plugin then "
                "checkpoints those layers itself), or list the layers in the activation_checkpointing key "
                "(Accelerate: fsdp_activation_checkpointing: true)."
            )
        if added:
            nested = [c for c in state.checkpointed for f in added if c.startswith(f + ".")]
            if nested:
                raise ChangedAfterPrepareError(
                    f"fsdp-overlap: gradient_checkpointing_enable() after prepare switches {_names(added)}, which "
                    f"holds {_names(nested)}, already checkpointed by activation_checkpointing. Call it before "
                    "prepare / parallelize, where the plugin resolves the two together."
                )
            covered = [f for f in added if any(f.startswith(c + ".") for c in state.checkpointed)]
            new = [f for f in added if f not in covered]
            state.checkpointed.extend(
                apply_activation_checkpointing(
                    model, new, state.config.activation_checkpointing_policy, compiled=state.config.compile
                )
            )
            state.adjustments.append(
                f"transformers gradient checkpointing ({len(added)} layers, switched on after prepare, before the "
                f"first step) runs as activation_checkpointing {_summarize(added)}: transformers' own checkpoint "
                "call is off"
            )
        if removed:
            remove_activation_checkpointing(model, removed)
            state.checkpointed[:] = [f for f in state.checkpointed if f not in removed]
            state.adjustments.append(
                f"transformers gradient checkpointing switched off after prepare, before the first step: "
                f"{_summarize(removed)} no longer recomputed"
            )
        hf.disable_own_checkpointing(model)
        kept = {f: func for f, func in self.taken.items() if f not in dropped}
        self.taken = {**kept, **{f: _checkpoint_func(modules[f]) for f in flagged}}

    def _take_over_compiled(self, fresh: bool) -> None:
        """A ``torch.compile`` put on the prepared model: undone before the first step
        (``uncompiled``), an error after it (the compiled graph already runs)."""
        if not fresh:
            raise ChangedAfterPrepareError(
                "fsdp-overlap: the model's forward was replaced by torch.compile(...) after its first compiled "
                "step. The plugin already compiles the model, with its passes: remove that torch.compile (to "
                "change how the plugin compiles, set its backend, fullgraph or dynamic keys)."
            )
        _, notes = uncompiled(self.model)
        if notes:
            self.state.adjustments.append("compiled after prepare, before the first step: " + "; ".join(notes))

    # ---------------------------------------------------------------- every compile
    def check_unchanged(self) -> None:
        """Raise ``ChangedAfterPrepareError`` naming the first difference between the model
        now and the model prepare left (a cast, a replaced or added module or parameter)."""
        now = _layout(self.model)
        if now == self.layout:
            return
        for key, was in self.layout.items():
            if now.get(key) != was:
                raise ChangedAfterPrepareError(_changed_message(key, was, now.get(key)))
        added = next(key for key in now if key not in self.layout)
        raise ChangedAfterPrepareError(_changed_message(added, None, now[added]))


def _changed_message(key: str, was: str | None, now: str | None) -> str:
    kind, _, name = key.partition(" ")
    if kind == "parameter" and was is not None and now is not None and was.split()[:-2] == now.split()[:-2]:
        old_dtype, new_dtype = was.split()[-2], now.split()[-2]
        if old_dtype != new_dtype:
            return (
                f"fsdp-overlap: parameter {name} changed dtype after prepare ({old_dtype} -> {new_dtype}): "
                "model.to(dtype), .half() or .bfloat16() was called on the prepared model. The shards keep the "
                "dtype they were prepared in; to compute in another, set param_dtype (and reduce_dtype) in the "
                "plugin's config, or cast the model before prepare / parallelize."
            )
    if now is None:
        what = f"{kind} {name} was removed"
    elif was is None:
        what = f"{kind} {name} was added ({now})"
    else:
        what = f"{kind} {name} was replaced ({was} -> {now})"
    return (
        f"fsdp-overlap: {what} after prepare. Its parameters are sharded and its compiled graph traced as prepare "
        "left them; change the model before prepare / parallelize, then prepare it."
    )
