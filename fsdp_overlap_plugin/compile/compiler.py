"""The entry point: ``compile_model`` compiles a sharded model in place with our backend,
and guards its compiled forward (a graph break under fullgraph becomes a clear error, an
agreed compile failure switches to the eager forward, graph breaks under fullgraph: false
are reported once).

The compile wiring is split by job, each module importing only those before it:
``diagnostics`` (errors, warnings, messages), ``rank_check`` (the cross-rank check),
``cache_records`` (FX-cache record replay), ``pass_table`` (which passes run, and their
records), ``backends`` (the backends given to ``torch.compile``; ``inductor.py`` holds
inductor's) and this module. The passes never talk to a process group; the only
collective work done while compiling is the rank-consistency check, which goes through
the store, not a collective, so it cannot hang.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.nn as nn

from .. import _torch_compat as compat
from ..config.schema import OverlapConfigError
from ..report.messages import CompileProgress, say
from ..runtime.state import OverlapState
from ..shard.sharding import model_gather, plugin_call
from ..shard.takeover import PLUGIN_CALL_ATTR, ChangedAfterPrepareError
from . import async_tp
from .backends import overlap_backend
from .diagnostics import (
    CompileFallback,
    GraphBreakError,
    PeerCompileError,
    RecompileLimitError,
    UnbucketedError,
    graph_break_message,
    is_recompile_limit,
    recompile_limit_message,
    warn_graph_breaks,
)

__all__ = ["compile_model"]

# A compile failure is quoted in the fallback warning up to this many characters.
_WARNING_CHARS = 500


def _find(exc: BaseException, kind: type) -> BaseException | None:
    """``exc`` or an exception it wraps (cause, context, Dynamo's inner_exception) of type ``kind``."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        cur = stack.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, kind):
            return cur
        stack.extend([cur.__cause__, cur.__context__, getattr(cur, "inner_exception", None)])
    return None


# Why the compiled forward is kept out of another torch.compile around the model (Dynamo
# quotes it where that compile has fullgraph=True and would otherwise trace into it).
_OUTER_COMPILE = (
    "fsdp-overlap: the plugin's compiled forward runs on its own, inside any torch.compile around the model; "
    "that outer compile adds nothing (pass the model uncompiled)"
)


def _install_call_guard(model: nn.Module, state: OverlapState, progress: CompileProgress | None = None) -> None:
    """Wrap the compiled forward: graph breaks under fullgraph become a clear error; an
    agreed compile failure switches to the eager forward; graph breaks under
    fullgraph: false are reported once. ``progress``: rank 0's lines about compiling.

    The wrapper is ``torch.compiler.disable``d: another ``torch.compile`` around the model
    (``torch.compile(model)`` after prepare, Fabric compiling again what it unwrapped)
    breaks its graph here and runs this call as it is, so the plugin's compiled forward
    runs with its passes, never a second trace of the model by the other compile. Before
    each call, ``state.after_prepare`` takes over or refuses changes made to the model
    since prepare (``shard/takeover.py``)."""
    compiled = model._compiled_call_impl
    progress = progress or CompileProgress(state)

    def call(*args: Any, **kwargs: Any) -> Any:
        first = not state.called
        if state.after_prepare is not None:
            state.after_prepare.before_call()
        if first and compat.in_compile_wrapper() and "outer-compile" not in state.warned:
            state.warned.add("outer-compile")
            note = (
                "the model is called through a torch.compile(...) wrapper (a torch.compile after prepare, or "
                "Fabric compiling again a model it was given compiled): that compile stops at the model, whose "
                "own compiled forward runs inside it with the passes"
            )
            state.adjustments.append(note)
            say(state.rank, f"fsdp-overlap: {note}.")
        graphs_before, records_before = state.dynamo_graphs, len(state.records)
        state.guard_counts = compat.guard_failure_counts()
        progress.call_started(first)
        try:
            with plugin_call():
                out = compiled(*args, **kwargs)
        except Exception as exc:
            fallback = _find(exc, CompileFallback)
            if fallback is not None:
                state.fallback = str(fallback)
                model._compiled_call_impl = None  # from now on nn.Module runs the eager forward
                model_gather(model).compiled = False  # its gathers now run eagerly by design
                progress.call_finished(fallback=True)
                warnings.warn(
                    f"fsdp-overlap: compilation failed ({state.fallback[:_WARNING_CHARS]}); on_compile_error: eager, so "
                    "every rank now runs the sharded model uncompiled: same numerics, collectives gathered "
                    "per parameter as FSDP2 does, no passes.",
                    stacklevel=2,
                )
                return model._call_impl(*args, **kwargs)
            from ..runtime.ranks import RankMismatchError, RankTimeoutError

            progress.announced = False  # no "compiled in" line after a failure
            ours = _find(
                exc,
                (
                    RankMismatchError,
                    RankTimeoutError,
                    PeerCompileError,
                    UnbucketedError,
                    RecompileLimitError,
                    OverlapConfigError,  # a configuration error found while compiling
                    compat.TorchFeatureError,  # a feature this torch lacks, found while compiling
                ),
            )
            if ours is not None:
                raise ours from None  # our message, not Dynamo's wrapper around it
            unsupported = _find(exc, compat.dynamo_unsupported_error())
            if unsupported is not None and is_recompile_limit(unsupported):
                raise RecompileLimitError(recompile_limit_message(state)) from exc
            if unsupported is not None and state.passes.fullgraph:
                raise GraphBreakError(graph_break_message(unsupported)) from exc
            raise
        if (
            not state.passes.fullgraph
            and state.dynamo_graphs == graphs_before
            and "recompile-limit" not in state.warned
        ):
            # a guard failed but nothing was compiled: past the recompile limit Dynamo runs
            # the frame uncompiled (fullgraph: false), our passes and buckets gone with it
            if compat.guard_failures_since(state.guard_counts):
                state.warned.add("recompile-limit")
                warnings.warn(
                    recompile_limit_message(state) + " With fullgraph: false Dynamo now runs it uncompiled.",
                    stacklevel=2,
                )
        progress.call_finished()
        if first and state.dynamo_graphs == 0:
            raise ChangedAfterPrepareError(_no_graph_message())
        if first:
            state.called = True
            graphs = state.dynamo_graphs - graphs_before
            if graphs > 1:
                warn_graph_breaks(model, state, graphs, state.records[records_before:])
        return out

    setattr(call, PLUGIN_CALL_ATTR, True)
    guarded = compat.compiler_disable(call, reason=_OUTER_COMPILE)
    setattr(guarded, PLUGIN_CALL_ATTR, True)
    model._compiled_call_impl = guarded


def _no_graph_message() -> str:
    off = " (Dynamo is switched off: TORCHDYNAMO_DISABLE=1)" if compat.dynamo_switched_off() else ""
    return (
        f"fsdp-overlap: the model's first compiled call ran, but Dynamo gave the plugin's compiler no graph{off}: "
        "the forward ran outside the plugin's compile, with no passes. Something in the model is compiled or "
        "excluded on its own (a torch.compile or torch.compiler.disable around its forward or a module, set after "
        "prepare / parallelize): remove it, or set compile: false to train it uncompiled (plain FSDP2)."
    )


def compile_model(model: nn.Module, state: OverlapState) -> nn.Module:
    """Compile ``model`` in place (``module.compile``: hooks, names and state-dict keys
    stay as they are; no ``_orig_mod`` wrapper)."""
    async_tp.prepare(state)  # async_tp: where it cannot run, an error now, before any step
    dynamic = state.compile_dynamic  # torch.compile's meaning (parallelize decided it)
    progress = CompileProgress(state)
    model.compile(backend=overlap_backend(state, progress), fullgraph=state.passes.fullgraph, dynamic=dynamic)
    _install_call_guard(model, state, progress)
    return model
