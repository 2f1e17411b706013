"""Compile wiring: ``torch.compile`` in place, with our passes injected.

inductor
    ``options={"post_grad_custom_post_pass": (..existing.., OverlapGraphPass),
               "joint_custom_post_pass": (..existing.., ReshardJointPass),
               "reorder_for_peak_memory": False}``
    Both are ``CustomGraphPass`` objects whose ``uuid()`` hashes the plan, the config,
    the model's structure and the pass source, so the FX graph cache stays on and is
    invalidated exactly when something that changes the result changes. Passes that
    were already installed (``torch_npu`` installs a post-grad pass) run first; ours run
    last so the order we choose is the order that is executed. Inductor's peak-memory
    reordering would undo the prefetch order, so it is turned off when passes are on.
aot_eager
    ``aot_autograd`` with forward/backward compilers that run the same passes on the
    ATen graphs, and a partitioner that applies the same reshard tags first.

The passes never talk to a process group; the only collective work done here is the
rank-consistency check (``rank_check``), which goes through the store, not a
collective, so it cannot hang.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# Torch's bucketing custom ops (torch.ops.bucketing.*) must be registered before an FX
# graph cache hit loads code that may call them, even in a fresh process.
import torch._inductor.fx_passes.bucketing  # noqa: F401
import torch.fx as fx
import torch.nn as nn
from torch._inductor.custom_graph_pass import (
    CustomGraphPass,
    CustomInferenceAwareGraphPass,
    get_custom_graph_passes,
)

from . import passes
from .config import OverlapConfig
from .passes.graph import collective_counts, graph_kind

__all__ = [
    "CompileFallback",
    "GraphBreakError",
    "PeerCompileError",
    "OverlapState",
    "compile_model",
    "get_state",
    "run_passes",
]

log = logging.getLogger("fsdp_overlap_plugin")

_PACKAGE_DIR = Path(__file__).resolve().parent
_STATE_ATTR = "_fsdp_overlap_state"


@dataclass
class OverlapState:
    """What ``parallelize`` decided for one model, and what the passes reported."""

    config: OverlapConfig
    plan: list[list[str]]
    device_type: str
    world_size: int
    mesh_shape: tuple[int, ...]
    mesh: Any = None
    gather_group: Any = None
    model_fingerprint: str = ""
    records: list[dict] = field(default_factory=list)
    reshard: dict = field(default_factory=dict)
    unbucketed_params: list[str] = field(default_factory=list)
    fallback: str | None = None
    instance: int = 0  # the n-th model prepared in this process: the same on every rank
    dynamo_graphs: int = 0  # graphs Dynamo handed to our backend so far
    called: bool = False  # the compiled forward has run once

    def uuid(self) -> str:
        """Identifies everything that changes what the passes do to a graph."""
        return _pass_uuid(self)

    @property
    def passes_on(self) -> bool:
        """Whether any post-grad pass has work to do."""
        config = self.config
        return (
            config.manual_bucketing
            or config.overlap_grad_reduce
            or config.reduce_scatter_impl != "native"
            or self.gather_group is not None
        )


def get_state(model: nn.Module) -> OverlapState | None:
    """The ``OverlapState`` that ``parallelize`` attached to ``model``, if any."""
    return getattr(model, _STATE_ATTR, None)


def _source_digest() -> str:
    files = sorted((_PACKAGE_DIR / "passes").glob("*.py")) + [_PACKAGE_DIR / "compile.py"]
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


_SOURCE_DIGEST = _source_digest()


def _pass_uuid(state: OverlapState) -> str:
    payload = {
        "config": state.config.to_dict(),
        "plan": state.plan,
        "model": state.model_fingerprint,
        "world": state.world_size,
        "mesh": list(state.mesh_shape),
        "gather_group": state.gather_group,
        "source": _SOURCE_DIGEST,
        "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]


def model_fingerprint(model: nn.Module) -> str:
    """A digest of the module tree and parameter shapes (no values)."""
    digest = hashlib.sha256()
    for name, module in model.named_modules():
        digest.update(f"{name}:{type(module).__qualname__};".encode())
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
    return digest.hexdigest()[:32]


# --------------------------------------------------------------------------- passes
def run_passes(gm: fx.GraphModule, kind: str, state: OverlapState) -> dict:
    """Run the configured passes on one compiled graph and record what they did."""
    from .report import graph_events, save_record, summarize_pass

    config = state.config
    record: dict[str, Any] = {"graph": kind, "before": collective_counts(gm.graph), "passes": {}}
    events_before = graph_events(gm.graph, state.plan)
    if state.gather_group is not None:
        record["passes"]["gather_group"] = {"moved": passes.use_gather_group(gm, state.gather_group)}
    if config.manual_bucketing:
        passes.manual_bucketing(gm, state.plan, recompile=False)
        record["passes"]["manual_bucketing"] = gm.meta.get("fsdp_overlap", {}).get("manual_bucketing", {})
    if config.overlap_grad_reduce and kind == "backward":
        passes.overlap_grad_reduce(gm, recompile=False)
        record["passes"]["overlap_grad_reduce"] = gm.meta.get("fsdp_overlap", {}).get("overlap_grad_reduce", {})
    if config.reduce_scatter_impl == "all_to_all" and kind == "backward":
        record["passes"]["all_to_all"] = passes.reduce_scatter_as_all_to_all(gm, recompile=False)
    if config.backend == "inductor" and (config.manual_bucketing or config.overlap_grad_reduce):
        # after every reordering: turn the final order into dependencies inductor keeps
        record["passes"]["pin_order"] = passes.pin_collective_order(gm, recompile=False)
    gm.recompile()  # once, after all passes (the passes were told not to)
    record["after"] = collective_counts(gm.graph)
    record["nodes"] = len(gm.graph.nodes)
    gm.graph.lint()  # once, after every pass, instead of inside each
    record["schedule"] = {"before": events_before, "after": graph_events(gm.graph, state.plan)}
    state.records.append(record)
    save_record(state.uuid(), record)
    log.info(
        "fsdp-overlap %s graph: all-gathers %d -> %d, reduce-scatters %d -> %d, %s",
        kind,
        record["before"]["all_gather"],
        record["after"]["all_gather"],
        record["before"]["reduce_scatter"],
        record["after"]["reduce_scatter"],
        ", ".join(summarize_pass(name, stats) for name, stats in record["passes"].items()) or "no passes",
    )
    return record


def run_reshard(gm: fx.GraphModule, state: OverlapState) -> None:
    config = state.config
    stats = passes.annotate_reshard(
        gm,
        state.plan,
        reshard_after_forward=config.reshard_after_forward,
        reshard_last_bucket=config.reshard_last_bucket,
    )
    state.reshard = stats
    from .report import save_record

    save_record(state.uuid(), {"graph": "joint", **stats})  # for the report after a cache hit


class OverlapGraphPass(CustomInferenceAwareGraphPass):
    """Inductor post-grad pass: bucketing and gradient overlap on each compiled graph."""

    def __init__(self, state: OverlapState):
        self.state = state

    def __call__(self, graph: fx.Graph, is_inference: bool = False) -> None:
        gm = graph.owning_module
        kind = "inference" if is_inference else graph_kind(graph)
        run_passes(gm, "forward" if kind == "inference" else kind, self.state)
        self.state.records[-1]["inference"] = is_inference

    def uuid(self) -> str:
        return "fsdp-overlap-post-grad-" + self.state.uuid()


class ReshardJointPass(CustomGraphPass):
    """Inductor joint-graph pass: reshard-after-forward recompute tags per bucket."""

    def __init__(self, state: OverlapState):
        self.state = state

    def __call__(self, graph: fx.Graph) -> None:
        run_reshard(graph.owning_module, self.state)

    def uuid(self) -> str:
        return "fsdp-overlap-joint-" + self.state.uuid()


def _chain(existing: Any, ours: Any) -> tuple:
    return (*get_custom_graph_passes(existing), ours)


def inductor_options(state: OverlapState) -> dict[str, Any]:
    """The ``torch.compile(options=...)`` that install our passes after any existing ones."""
    from torch._inductor import config as inductor_config

    options: dict[str, Any] = {
        "joint_custom_post_pass": _chain(inductor_config.joint_custom_post_pass, ReshardJointPass(state)),
    }
    if state.passes_on:
        options["post_grad_custom_post_pass"] = _chain(
            inductor_config.post_grad_custom_post_pass, OverlapGraphPass(state)
        )
        options["reorder_for_peak_memory"] = False
    return options


def aot_eager_backend(state: OverlapState):
    """An ``aot_eager`` equivalent whose compilers run our passes on the ATen graphs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def compiler(kind: str):
        def compile_graph(gm: fx.GraphModule, example_inputs: list) -> Any:
            if state.passes_on:
                run_passes(gm, kind, state)
            return make_boxed_func(gm.forward)

        return compile_graph

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        run_reshard(joint, state)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    return aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("forward"),
        partition_fn=partition,
        keep_inference_input_mutations=True,
    )


class CompileFallback(RuntimeError):
    """Every rank agreed to run the model without compiling it (``on_compile_error: eager``)."""


class GraphBreakError(RuntimeError):
    """The forward has a graph break while ``fullgraph`` is true."""


class PeerCompileError(RuntimeError):
    """Compilation failed on another rank, so this one stops too (``on_compile_error: raise``)."""


def _inner_backend(state: OverlapState):
    if state.config.backend == "inductor":
        from torch._inductor.compile_fx import compile_fx

        options = inductor_options(state)

        def inductor(gm: fx.GraphModule, example_inputs: list) -> Any:
            return compile_fx(gm, example_inputs, config_patches=options)

        return inductor
    return aot_eager_backend(state)


def overlap_backend(state: OverlapState):
    """The backend given to ``torch.compile``: rank check, compile, compile agreement.

    Dynamo calls it for every graph on every rank (also when inductor's caches hit), so
    the agreement rounds line up. The backward is compiled here too
    (``force_non_lazy_backward_lowering``), so a failure anywhere in compilation is known
    before any rank runs the graph and its collectives.
    """
    inner = _inner_backend(state)
    config = state.config

    def backend(gm: fx.GraphModule, example_inputs: list) -> Any:
        from .ranks import RankAgreement, RankMismatchError, graph_fingerprint

        state.dynamo_graphs += 1
        index = state.dynamo_graphs
        # keys unique per model, graph and torchrun attempt (a restart may reuse the store)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        agreement = RankAgreement.default(
            f"fsdp_overlap/{state.uuid()}/{attempt}/{state.instance}/graph{index}", config.rank_check_timeout
        )
        if agreement is not None and config.rank_check != "off":
            digest, entries = graph_fingerprint(gm, extra=json.dumps(state.plan))
            difference = agreement.same_graph("fingerprint", digest, entries)
            if difference is not None:
                message = (
                    f"fsdp-overlap: the ranks compiled different graphs (graph {index}): {difference}. Every "
                    "rank must run the same model code, shapes and config; ranks running different graphs "
                    "would issue collectives that never match. (rank_check: warn only warns; off skips this.)"
                )
                if config.rank_check == "error":
                    raise RankMismatchError(message)
                warnings.warn(message, stacklevel=2)
        error: BaseException | None = None
        try:
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                compiled = inner(gm, example_inputs)
        except Exception as exc:  # every rank must hear of it before anyone runs the graph
            error = exc
        if agreement is not None:
            failures = agreement.all_succeeded("compile", None if error is None else f"{type(error).__name__}: {error}")
        else:
            failures = [f"rank 0: {type(error).__name__}: {error}"] if error is not None else []
        if failures:
            if config.on_compile_error == "eager":
                raise CompileFallback(failures[0][:2000])
            if error is not None:
                raise error
            raise PeerCompileError(
                f"fsdp-overlap: compilation failed on another rank ({failures[0][:2000]}); this rank stops too "
                "instead of waiting for it in a collective. on_compile_error: eager runs every rank uncompiled."
            )
        return compiled

    return backend


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


def graph_break_message(exc: BaseException) -> str:
    """The user's line a graph break happened at, and what to do about it."""
    text = str(exc)
    where = ""
    if "from user code:" in text:
        frames = [
            line.strip()
            for line in text.split("from user code:", 1)[1].splitlines()
            if line.strip().startswith("File ")
        ]
        if frames:
            where = frames[-1]
    reason = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return (
        f"fsdp-overlap: fullgraph: true, but the model's forward has a graph break"
        f"{' at ' + where if where else ''}: {reason}. Collectives outside a graph cannot be bucketed or "
        "overlapped. Remove the break, or set fullgraph: false to compile the pieces separately (their "
        "collectives in between then run eagerly)."
    )


def _warn_graph_breaks(model: nn.Module, state: OverlapState, graphs: int, records: list[dict]) -> None:
    forward = [r for r in records if r["graph"] == "forward"]
    gathered = sum(r["before"]["all_gather"] for r in forward)
    bucketed = sum(r["after"]["all_gather"] for r in forward)
    total = sum(1 for m in model.modules() for p in m._parameters.values() if p is not None)
    counted = (
        f"{gathered} of the model's {total} parameter reads were traced into them ({bucketed} all-gathers "
        f"after bucketing; modules compiled in a graph of their own are seen relative to it, so plan "
        f"entries may not match them); the other {max(total - gathered, 0)} gather eagerly between the "
        "graphs, not overlapped"
        if forward
        else "the passes are off, so no all-gather was bucketed"
    )
    warnings.warn(
        f"fsdp-overlap: graph breaks split the forward into {graphs} compiled graphs (fullgraph: false); "
        f"{counted}. Remove the breaks for full overlap (fullgraph: true reports where they are).",
        stacklevel=3,
    )


def _install_call_guard(model: nn.Module, state: OverlapState) -> None:
    """Wrap the compiled forward: graph breaks under fullgraph become a clear error; an
    agreed compile failure switches to the eager forward; graph breaks under
    fullgraph: false are reported once."""
    compiled = model._compiled_call_impl

    def call(*args: Any, **kwargs: Any) -> Any:
        first = not state.called
        graphs_before, records_before = state.dynamo_graphs, len(state.records)
        try:
            out = compiled(*args, **kwargs)
        except Exception as exc:
            fallback = _find(exc, CompileFallback)
            if fallback is not None:
                state.fallback = str(fallback)
                model._compiled_call_impl = None  # from now on nn.Module runs the eager forward
                warnings.warn(
                    f"fsdp-overlap: compilation failed ({state.fallback[:500]}); on_compile_error: eager, so "
                    "every rank now runs the sharded model uncompiled: same numerics, collectives gathered "
                    "per parameter as FSDP2 does, no passes.",
                    stacklevel=2,
                )
                return model._call_impl(*args, **kwargs)
            from .ranks import RankMismatchError, RankTimeoutError

            ours = _find(exc, (RankMismatchError, RankTimeoutError, PeerCompileError))
            if ours is not None:
                raise ours from None  # our message, not Dynamo's wrapper around it
            unsupported = _find(exc, torch._dynamo.exc.Unsupported)
            if unsupported is not None and state.config.fullgraph:
                raise GraphBreakError(graph_break_message(unsupported)) from exc
            raise
        if first:
            state.called = True
            graphs = state.dynamo_graphs - graphs_before
            if graphs > 1:
                _warn_graph_breaks(model, state, graphs, state.records[records_before:])
        return out

    model._compiled_call_impl = call


def compile_model(model: nn.Module, state: OverlapState) -> nn.Module:
    """Compile ``model`` in place (``module.compile``: hooks, names and state-dict keys
    stay as they are; no ``_orig_mod`` wrapper)."""
    model.compile(backend=overlap_backend(state), fullgraph=state.config.fullgraph)
    _install_call_guard(model, state)
    return model
