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

__all__ = ["OverlapState", "compile_model", "run_passes", "get_state"]

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


def compile_model(model: nn.Module, state: OverlapState) -> nn.Module:
    """Compile ``model`` in place (``module.compile``: hooks, names and state-dict keys
    stay as they are; no ``_orig_mod`` wrapper)."""
    config = state.config
    if config.backend == "inductor":
        model.compile(backend="inductor", fullgraph=config.fullgraph, options=inductor_options(state))
    else:
        model.compile(backend=aot_eager_backend(state), fullgraph=config.fullgraph)
    return model
