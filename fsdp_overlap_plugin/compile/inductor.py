"""Our passes as inductor custom passes, and the inductor backend that installs them.

Imported only when a model is compiled with ``backend: inductor``, so that
``import fsdp_overlap_plugin`` never needs inductor's internals (see ``_torch_compat``).
The pass functions come in as arguments (``pass_table.run_passes`` / ``run_reshard``, handed
over by ``backends._inner_backend``): this module does not import ``backends``, which imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx as fx

from .. import _torch_compat as compat
from ..passes.graph import graph_kind
from . import async_tp, torch_passes

__all__ = ["inductor_backend", "inductor_options"]

_InferenceAware, _TOLD_INFERENCE = compat.inference_aware_pass_class()


class OverlapGraphPass(_InferenceAware):
    """Inductor post-grad pass: bucketing and gradient overlap on each compiled graph."""

    def __init__(self, state: Any, run_passes: Callable):
        self.state = state
        self.run_passes = run_passes

    def __call__(self, graph: fx.Graph, is_inference: bool | None = None) -> None:
        gm = graph.owning_module
        if is_inference is None:
            # a torch that does not tell (2.11): a forward compiled with grad disabled is the
            # inference graph (our backend marks such graphs "-no-grad"); a forward of a
            # model with nothing requiring grad is then recorded as a training forward
            is_inference = not _TOLD_INFERENCE and _compiled_without_grad(self.state, graph)
        kind = "forward" if is_inference else graph_kind(graph)
        # inductor's post_grad_passes recompiles and lints the graph after its custom passes
        self.run_passes(gm, kind, self.state, inference=is_inference, recompile=False)

    def uuid(self) -> str:
        return "fsdp-overlap-post-grad-" + self.state.cache_key()


def _compiled_without_grad(state: Any, graph: fx.Graph) -> bool:
    return graph_kind(graph) == "forward" and (state.graph_id or "").endswith("-no-grad")


class ReshardJointPass(compat.custom_graph_pass_class()):
    """Inductor joint-graph pass: reshard-after-forward recompute tags per bucket."""

    def __init__(self, state: Any, run_reshard: Callable):
        self.state = state
        self.run_reshard = run_reshard

    def __call__(self, graph: fx.Graph) -> None:
        self.run_reshard(graph.owning_module, self.state)

    def uuid(self) -> str:
        return "fsdp-overlap-joint-" + self.state.cache_key()


def inductor_options(state: Any, run_passes: Callable, run_reshard: Callable) -> dict[str, Any]:
    """The inductor config patches that install our passes after any existing ones."""
    config = compat.inductor_config()
    options: dict[str, Any] = {
        "joint_custom_post_pass": compat.chain_graph_passes(
            config.joint_custom_post_pass, ReshardJointPass(state, run_reshard)
        ),
        # what inductor's own distributed passes may do after ours (inductor_overlap)
        **torch_passes.config_patches(state.passes.inductor_overlap),
    }
    if state.passes.inductor_overlap == "auto":
        options.update(torch_passes.auto_patches(state.device_type, _rates(state)))
    options.update(async_tp.inductor_patches(state))  # torch's micro-pipelined TP (async_tp)
    if state.passes_on:
        options["post_grad_custom_post_pass"] = compat.chain_graph_passes(
            config.post_grad_custom_post_pass, OverlapGraphPass(state, run_passes)
        )
        options["reorder_for_peak_memory"] = False
        # Inductor's buffer reuse keeps a dead buffer for the next allocation of its size
        # instead of freeing it. Under the passes' schedule (a bucket prefetched while
        # the one before computes, a reduce-scatter in flight while the next bucket's
        # gradients are computed) a bucket's dead gradients then lived on across the next
        # bucket's copy-out: 10 MiB per rank at the step's peak on a 15M GPT at batch 1
        # (benchmarks/RESULTS.md). Freed at their last use, as in eager; step time at
        # 300 Mbit unchanged within noise.
        options["allow_buffer_reuse"] = False
    return options


def inductor_backend(state: Any, run_passes: Callable, run_reshard: Callable) -> Callable:
    """``compile_fx`` with our passes installed through its config patches."""
    # torch's bucketing ops must be registered before a warm FX graph cache loads code
    # that may call them, even in a fresh process
    compat.register_bucketing_ops()
    compile_fx = compat.compile_fx()
    options = inductor_options(state, run_passes, run_reshard)

    def inductor(gm: fx.GraphModule, example_inputs: list) -> Any:
        if state.passes.inductor_overlap == "auto" and state.device_type != "cuda":
            with torch_passes.estimates(_rates(state)):
                return compile_fx(gm, example_inputs, config_patches=options)
        return compile_fx(gm, example_inputs, config_patches=options)

    return inductor


def _rates(state: Any) -> dict:
    """The rates torch's scheduler is given off CUDA (``inductor_overlap: auto``): the
    ``hardware`` setting's, the device type's preset without one."""
    from ..config.hardware import resolve_rates

    return resolve_rates(state.device_type, state.config.hardware, state.config.compute_profile)["rates"]
