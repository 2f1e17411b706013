"""``async_tp``: inductor's micro-pipelined tensor parallelism on the tensor-parallel group.

torch's pass (``torch/_inductor/fx_passes/micro_pipeline_tp.py``) runs among inductor's
post-grad passes, before ours, when inductor's ``_micro_pipeline_tp`` is set. It replaces
each all-gather whose result feeds a matmul, and each matmul whose result feeds a
reduce-scatter, by one fused op (``symm_mem.fused_all_gather_matmul`` /
``symm_mem.fused_matmul_reduce_scatter``) that moves the data in chunks over CUDA symmetric
memory and multiplies each chunk as it arrives; it only touches collectives on a group
with symmetric memory enabled.

What the plugin does with it:

* ``prepare`` (at compile, before the first step): the checks the config alone cannot make
  (a tensor-parallel dimension; NCCL on CUDA: gloo has no symmetric memory, torch_npu no
  kernels for these ops), then symmetric memory for the tensor-parallel group only: the
  FSDP gathers run on the data-parallel groups, stay unfused, and remain the passes' to
  bucket and move;
* ``inductor_patches``: the flag, in the plugin's own config patches for its compiles
  (never the process-wide inductor config);
* ``check_fused`` (in each compiled graph, on what our post-grad pass is handed): how many
  fused ops the pass left, for the report; a graph whose tensor-parallel collectives are
  there but none was fused is an error naming why (all-reduces: a plan without sequence
  parallelism has nothing the pass can split), so that async TP is never silently off.

torch's symmetric-memory test mode (``torch.distributed._symmetric_memory._test_mode``) makes
every group count as enabled and the fused ops run their unfused fallbacks: the tests use
it on gloo, with those fallbacks registered for CPU tensors, to train with the fused graph
on a CPU. ``prepare`` then skips the backend check: the test mode is torch's, not ours.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from .. import _torch_compat as compat
from ..config.schema import ASYNC_TP_NEEDS_TENSOR
from ..contract import OverlapConfigError

__all__ = ["FUSED_KINDS", "check_fused", "count_fused", "inductor_patches", "prepare"]

#: the fused ops of torch's micro-pipeline pass, by what they replace
FUSED_KINDS = {
    "fused_all_gather_matmul": "all_gather_matmul",
    "fused_all_gather_scaled_matmul": "all_gather_matmul",
    "fused_matmul_reduce_scatter": "matmul_reduce_scatter",
    "fused_scaled_matmul_reduce_scatter": "matmul_reduce_scatter",
}


def prepare(state: Any) -> None:
    """Before the first compile: stop where async TP cannot run, else enable symmetric
    memory for the tensor-parallel group(s) so that torch's pass fuses their collectives."""
    if not state.config.async_tp:
        return
    if state.tensor_parallel < 2 or not state.tp_groups:
        raise OverlapConfigError(ASYNC_TP_NEEDS_TENSOR)
    if compat.symm_mem_test_mode():
        return
    import torch.distributed as dist

    group = compat.resolve_process_group(state.tp_groups[0])
    backend = str(dist.get_backend(group)) if group is not None else "unknown"
    if state.device_type == "npu" or backend == "hccl":
        raise OverlapConfigError(
            "async_tp: inductor's micro-pipelined tensor parallelism runs its fused all-gather/matmul kernels over "
            "CUDA symmetric memory; torch_npu has no such kernels for hccl. Set async_tp: false (the plan's "
            "collectives then run as they are, unfused)."
        )
    if state.device_type != "cuda" or backend != "nccl":
        raise OverlapConfigError(
            "async_tp: inductor's micro-pipelined tensor parallelism needs CUDA symmetric memory (NCCL on CUDA "
            f"GPUs); this run's tensor-parallel group is {backend} on {state.device_type}. Set async_tp: false."
        )
    for name in state.tp_groups:
        compat.enable_symm_mem_for_group(name)


def inductor_patches(state: Any) -> dict[str, Any]:
    """The inductor config patch that turns torch's micro-pipeline pass on, for our compiles only."""
    return {"_micro_pipeline_tp": True} if state.config.async_tp else {}


def count_fused(graph: fx.Graph) -> dict[str, int]:
    """How many all-gather/matmul and matmul/reduce-scatter pairs the micro-pipeline pass fused."""
    counts = {"all_gather_matmul": 0, "matmul_reduce_scatter": 0}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        packet = getattr(node.target, "_overloadpacket", None)
        namespace = getattr(packet, "_qualified_op_name", "").split("::")[0]
        kind = FUSED_KINDS.get(getattr(packet, "__name__", ""))
        if namespace == "symm_mem" and kind is not None:
            counts[kind] += 1
    return counts


def check_fused(graph: fx.Graph, state: Any, kind: str, tensor_counts: dict[str, int]) -> dict[str, int] | None:
    """The fused pairs of one graph (None without async_tp). ``tensor_counts``: the
    tensor-parallel group's collectives still in the graph (``collective_counts``). A graph
    with tensor-parallel collectives and nothing fused stops the run, naming why."""
    if not state.config.async_tp:
        return None
    fused = count_fused(graph)
    if sum(fused.values()):
        return fused
    left = {k: n for k, n in tensor_counts.items() if n and k != "wait"}
    if not left:
        return fused  # no tensor-parallel collective in this graph: nothing to fuse
    found = ", ".join(f"{n} {k.replace('_', '-')}" for k, n in left.items())
    why = (
        " An all-reduce cannot be split that way: the pass fuses an all-gather with the matmul it feeds and a "
        "matmul with the reduce-scatter it feeds, the collectives of sequence parallelism. Add it to the plan "
        "(sequence_parallel on the norms, docs/tensor-parallel.md#sequence-parallelism) or set async_tp: false."
        if set(left) == {"all_reduce"}
        else " None of them sits next to a matmul the pass could pair it with. Set async_tp: false."
    )
    raise OverlapConfigError(
        f"async_tp: inductor's micro-pipelined tensor parallelism fused nothing in the {kind} graph, whose "
        f"tensor-parallel collectives are {found}.{why}"
    )
