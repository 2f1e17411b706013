"""The backends given to ``torch.compile``, with our passes injected.

inductor (``inductor.py``, imported only when compiling with inductor)
    ``options={"post_grad_custom_post_pass": (..existing.., OverlapGraphPass),
               "joint_custom_post_pass": (..existing.., ReshardJointPass),
               "reorder_for_peak_memory": False}``
    Both are ``CustomGraphPass`` objects whose ``uuid()`` hashes the plan, the config,
    the model's structure, the pass source and this rank's local shard shapes, so the
    AOT autograd and FX graph caches stay on and are invalidated exactly when something
    that changes the result changes (``OverlapState.cache_key``). Passes that
    were already installed (``torch_npu`` installs a post-grad pass) run first; ours run
    last so the order we choose is the order that is executed. Inductor's peak-memory
    reordering would undo the prefetch order, so it is turned off when passes are on.
    On a torch whose slots hold one pass (2.11), one chaining pass runs them all
    (``_torch_compat.chain_graph_passes``).
aot_eager
    ``aot_autograd`` with forward/backward compilers that run the same passes on the
    ATen graphs, and a partitioner that applies the same reshard tags first.

``overlap_backend`` wraps either: per Dynamo graph it compiles, reloads the records of a
cached graph (``cache_records``), holds the compile agreement and the cross-rank check
(``rank_check``) and checks what the bucketing left (``diagnostics``). ``run_passes`` and
``run_reshard`` are looked up here when a backend is built, so they are patched here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import Any

import torch
import torch.fx as fx

from .. import _torch_compat as compat
from ..report.messages import CompileProgress
from ..runtime.state import OverlapState
from .cache_records import cache_counters, cache_use, records_from_cache
from .diagnostics import CompileFallback, PeerCompileError, check_unbucketed, recompile_reason, symbolic_sizes
from .pass_table import run_passes, run_reshard
from .rank_check import check_same_collectives, check_same_graph, collective_entries

__all__ = ["aot_eager_backend", "overlap_backend"]

# The graph id is this many hex characters of the Dynamo graph's fingerprint: a directory
# name per graph of one model (records.py), where a collision only needs to be unlikely.
_GRAPH_ID_CHARS = 16


# A peer's error is quoted up to this many characters (whole tracebacks would bury the message).
_MESSAGE_CHARS = 2000


def aot_eager_backend(state: OverlapState):
    """An ``aot_eager`` equivalent whose compilers run our passes on the ATen graphs."""
    from functorch.compile import make_boxed_func

    def compiler(kind: str, inference: bool = False):
        def compile_graph(gm: fx.GraphModule, example_inputs: list) -> Any:
            if state.passes_on:
                run_passes(gm, kind, state, inference=inference)
            return make_boxed_func(gm.forward)

        return compile_graph

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        run_reshard(joint, state)
        return compat.min_cut_partition(joint, joint_inputs, **kwargs)

    return compat.aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("forward", inference=True),
        partition_fn=partition,
        keep_inference_input_mutations=True,
    )


def _inner_backend(state: OverlapState):
    if state.passes.backend == "inductor":
        from .inductor import inductor_backend  # inductor is imported only to compile with it

        return inductor_backend(state, run_passes, run_reshard)
    return aot_eager_backend(state)


def _tensor_parallel_symbols(state: OverlapState) -> Any:
    """Under tensor parallelism, what lets AOT autograd trace symbolic sizes through DTensor
    (``compat.symbols_keep_their_first_proxy``); elsewhere nothing."""
    if state.tensor_parallel > 1:
        return compat.symbols_keep_their_first_proxy()
    return contextlib.nullcontext()


def overlap_backend(state: OverlapState, progress: CompileProgress | None = None):
    """The backend given to ``torch.compile``: rank check, compile, compile agreement.

    Dynamo calls it for every graph on every rank (also when inductor's caches hit), so
    the agreement rounds line up. The backward is compiled here too
    (``force_non_lazy_backward_lowering``), so a failure anywhere in compilation is known
    before any rank runs the graph and its collectives.
    """
    inner = _inner_backend(state)
    config = state.config

    def backend(gm: fx.GraphModule, example_inputs: list) -> Any:
        from ..runtime.ranks import RankAgreement, graph_fingerprint

        if state.after_prepare is not None:
            # a recompile may come from a change to the model since prepare (Dynamo's guards
            # saw a new dtype or module): every rank raises the same error, before any round
            state.after_prepare.check_unchanged()
        state.dynamo_graphs += 1
        index = state.dynamo_graphs
        reason = recompile_reason(state)
        if progress is not None:
            progress.graph_started(reason)  # rank 0: "compiling the model again (...)", a few times at most
        # keys unique per model and torchrun attempt (a restart may reuse the store)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        agreement = RankAgreement.default(
            f"fsdp_overlap/{state.uuid()}/{attempt}/{state.instance}/round{len(state.agreed) + 1}",
            config.rank_check_timeout,
        )
        digest, entries, local = graph_fingerprint(gm, extra=json.dumps(state.plan))
        # the records of this graph are kept under its fingerprint on this rank, so a later
        # process whose FX graph cache hits (and whose passes therefore do not run) finds
        # them (grad mode too: the same Dynamo graph compiles to a training or an
        # inference graph)
        state.graph_id = local[:_GRAPH_ID_CHARS] + ("" if torch.is_grad_enabled() else "-no-grad")
        graph_id = state.graph_id
        records_before, joints_before = len(state.records), len(state.reshard)
        sizes = symbolic_sizes(gm)
        error: BaseException | None = None
        before = cache_counters()
        try:
            with compat.eager_backward_lowering(), _tensor_parallel_symbols(state):
                compiled = inner(gm, example_inputs)
        except compat.dynamo_restart_error():
            # Dynamo traces the frame again and calls us with the graph it then gets (every
            # rank does the same): this attempt compiled nothing, and leaves nothing behind
            del state.records[records_before:], state.reshard[joints_before:]
            state.dynamo_graphs -= 1
            raise
        except Exception as exc:  # every rank must hear of it before anyone runs the graph
            error = exc
        finally:
            state.graph_id = None
        if state.passes.backend == "inductor":
            state.compile_cache.append(cache_use(index, graph_id, before, cache_counters()))
        records = state.records[records_before:]
        if error is None and state.passes_on:
            # an FX graph cache hit skips the passes: their records come from the store, for
            # every graph this compile did not run them on (all of them, or only the backward
            # when the forward missed and the backward hit)
            records += records_from_cache(state, graph_id, skip={r["graph"] for r in records})
        for record in records + state.reshard[joints_before:]:
            record["dynamo_graph"] = index  # which compile of the forward it came from (the report)
            record["dynamic_sizes"] = sizes
        collectives = collective_entries(records) if state.passes_on else None
        key = hashlib.sha256(json.dumps(collectives if collectives is not None else digest).encode()).hexdigest()
        if reason is not None:
            state.recompiles.append({"graph": index, "reason": reason, "agreed_before": key in state.agreed})
        if agreement is not None and error is None and key in state.agreed:
            # a recompile (a new sequence length, a dynamic one) that leaves collectives
            # every rank already agreed on: the ranks need not recompile at the same step
            # (each pads its own batches), so no agreement round is held for it
            check_unbucketed(state, records, index)
            return compiled
        if agreement is not None and error is not None and state.agreed:
            # a recompile on this rank alone (the others may run an agreed graph and never
            # join a round): it cannot make them switch to eager, so it stops
            raise error
        if agreement is not None:
            failures = agreement.all_succeeded("compile", None if error is None else f"{type(error).__name__}: {error}")
        else:
            failures = [f"rank 0: {type(error).__name__}: {error}"] if error is not None else []
        if failures:
            if config.on_compile_error == "eager":
                raise CompileFallback(failures[0][:_MESSAGE_CHARS])
            if error is not None:
                raise error
            raise PeerCompileError(
                f"fsdp-overlap: compilation failed on another rank ({failures[0][:_MESSAGE_CHARS]}); this rank "
                "stops too instead of waiting for it in a collective. on_compile_error: eager runs every rank "
                "uncompiled."
            )
        if agreement is not None and config.rank_check != "off":
            check_same_graph(agreement, digest, entries, index, config.rank_check)
            if collectives is not None:
                check_same_collectives(agreement, collectives, index, config.rank_check)
        state.agreed.append(key)
        check_unbucketed(state, records, index)
        return compiled

    return backend
