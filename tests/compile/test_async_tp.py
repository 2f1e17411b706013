"""``async_tp``: inductor's micro-pipelined tensor parallelism on the tensor-parallel group.

In one process (a fake process group of 4 ranks, dp 2 x tp 2): the errors where it cannot
run (no tensor dimension, aot_eager, gloo or the fake backend, a plan of all-reduces with
nothing to fuse), and, in torch's symmetric-memory test mode (its fused ops run their
unfused fallbacks, registered here for CPU tensors), the compiled graphs: the all-gather ->
matmul and matmul -> reduce-scatter pairs of a sequence-parallel plan fused on the
tensor-parallel group, the FSDP gathers and reduce-scatters on the data-parallel group left
unfused and still bucketed by the passes, the report counting both. The numerics (4 gloo
ranks in the same test mode against one process) are in
``integration/test_async_tp_training.py``.

Not covered here, and not run anywhere yet: the CUDA kernels over symmetric memory
(``prepare``'s NCCL path), which need GPUs.
"""

from __future__ import annotations

import pytest
import torch
from _async_tp import LAYERS, batch, seq_loss, seq_net, sp_plan, symm_mem_test_mode
from _fake import GraphCapture, fake_world

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.compile import async_tp
from fsdp_overlap_plugin.config.schema import OverlapConfig, OverlapConfigError
from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn
from fsdp_overlap_plugin.passes.graph import group_name, is_all_gather, is_reduce_scatter
from fsdp_overlap_plugin.runtime.state import get_state

pytestmark = pytest.mark.torch_sensitive  # inductor's micro-pipeline pass and symm_mem ops move between torches

#: torch's micro-pipeline pass returns at once in a torch built without NCCL (the CPU wheels, such
#: as the 2.13.0 of CI's main lane), GPU or not; the CUDA builds of the matrix fuse on a CPU
fuses_here = [
    pytest.mark.middle_torch,  # CI's 2.14 leg, a CUDA build
    pytest.mark.skipif(
        not torch.distributed.is_nccl_available(),
        reason=f"torch {torch.__version__} is built without NCCL: its micro-pipeline pass fuses nothing; "
        "`.ci/test-torch 2.14.1` (part of .ci/run) runs this on a CUDA build",
    ),
]

GPT_PLAN = {"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}
# ---------------------------------------------------------------- where it cannot run


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"async_tp": "yes"}, r"async_tp: expected true or false, got 'yes'"),
        (
            {"async_tp": True, "backend": "aot_eager"},
            r"async_tp: .* an inductor pass; this config has backend: aot_eager",
        ),
        ({"async_tp": True, "compile": False}, r"async_tp: .* this config has compile: false"),
    ],
)
def test_the_config_refuses_async_tp_without_inductor(config, message):
    with pytest.raises(OverlapConfigError, match=message):
        OverlapConfig(**config)


@pytest.fixture
def world4():
    with fake_world(4):
        yield


def test_async_tp_without_a_tensor_dimension_stops_at_parallelize(world4):
    with pytest.raises(OverlapConfigError, match=r"async_tp: needs a tensor-parallel dimension .* mesh.tensor > 1"):
        fo.parallelize(gpt_small(n_layer=1), async_tp=True)


def test_check_refuses_async_tp_without_a_tensor_dimension(tmp_path):
    from fsdp_overlap_plugin.shard.preflight import preflight

    with pytest.raises(OverlapConfigError, match=r"async_tp: needs a tensor-parallel dimension"):
        preflight(gpt_small(n_layer=1), OverlapConfig(async_tp=True), world=4)


def test_a_backend_without_symmetric_memory_stops_at_parallelize_naming_it(world4):
    """gloo (here the fake backend: the same answer) has no symmetric memory: an error
    before any step, naming the group's backend and the way out."""
    with pytest.raises(
        OverlapConfigError,
        match=r"async_tp: .* needs CUDA symmetric memory \(NCCL on CUDA GPUs\); this run's tensor-parallel group is "
        r"fake on cpu\. Set async_tp: false",
    ):
        fo.parallelize(gpt_small(n_layer=1), mesh={"tensor": 2}, tp_plan=GPT_PLAN, async_tp=True)


def test_npu_is_refused_naming_torch_npu(world4, monkeypatch):
    state = type("S", (), {})()
    state.config = OverlapConfig(async_tp=True)
    state.tensor_parallel, state.tp_groups, state.device_type = 2, ("0",), "npu"
    with pytest.raises(OverlapConfigError, match=r"torch_npu has no such kernels for hccl"):
        async_tp.prepare(state)


def test_a_plan_of_all_reduces_has_nothing_to_fuse_and_says_so(world4):
    """The repo GPT's MLPs split colwise / rowwise without sequence parallelism: the plan's
    collectives are all-reduces, which the micro-pipeline pass cannot split; the first
    compile stops, naming the graph, what it holds and the fix."""
    x, y = fixed_batches(1, 2, 16, 256)[0]
    with symm_mem_test_mode():
        model = fo.parallelize(
            gpt_small(n_layer=1), mesh={"tensor": 2}, tp_plan=GPT_PLAN, async_tp=True, rank_check="off"
        )
        with pytest.raises(
            OverlapConfigError,
            match=r"async_tp: inductor's micro-pipelined tensor parallelism fused nothing in the forward graph, whose "
            r"tensor-parallel collectives are 1 all-reduce\. An all-reduce cannot be split .*\(sequence_parallel on the norms",
        ):
            loss_fn(model(x), y).backward()


# ---------------------------------------------------------------- what it fuses


def _fused_groups(gm) -> list[str]:
    return [
        str(node.args[-1]) for node in gm.graph.nodes if node.op == "call_function" and "symm_mem" in str(node.target)
    ]


@pytest.mark.slow
@fuses_here[0]
@fuses_here[1]
def test_a_sequence_parallel_plan_is_fused_on_the_tensor_group_only(world4, monkeypatch):
    """dp 2 x tp 2, the user's own sequence-parallel plan, inductor, torch's test mode: in the
    forward each block's gather -> up and down -> reduce-scatter are fused (and the head's
    gather), in the backward their mirror images; every fused op is on the tensor-parallel
    group; the FSDP collectives stay on the data-parallel group, one per bucket; the report
    counts the fused pairs."""
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = fo.build_mesh({"tensor": 2})
    model = seq_net()
    parallelize_module(model, mesh["tensor"], sp_plan())
    capture = GraphCapture(monkeypatch)
    tp, dp = mesh["tensor"].get_group().group_name, mesh["shard"].get_group().group_name
    x, y = batch()
    with symm_mem_test_mode({tp}):
        fo.parallelize(model, mesh=mesh, async_tp=True, rank_check="off", reduce_scatter_impl="native")
        seq_loss(model, x, y).backward()
    state = get_state(model)
    report = fo.schedule_report(model)
    buckets = len(state.plan)

    forward = capture.get("forward", "after")
    fused = async_tp.count_fused(forward.graph)
    assert fused == {"all_gather_matmul": LAYERS + 1, "matmul_reduce_scatter": LAYERS}, fused
    assert set(_fused_groups(forward)) == {tp}
    dp_gathers = [n for n in forward.graph.nodes if is_all_gather(n) and group_name(n) == dp]
    assert len(dp_gathers) == buckets  # the passes' buckets, untouched by the fusion
    backward = capture.get("backward", "after")
    fused_back = async_tp.count_fused(backward.graph)
    assert fused_back["all_gather_matmul"] >= LAYERS and fused_back["matmul_reduce_scatter"] >= LAYERS, fused_back
    assert set(_fused_groups(backward)) == {tp}
    dp_scatters = [n for n in backward.graph.nodes if is_reduce_scatter(n) and group_name(n) == dp]
    assert len(dp_scatters) == buckets

    assert report["forward"]["tensor_parallel"]["fused"] == fused
    assert report["backward"]["tensor_parallel"]["fused"] == fused_back
    text = fo.format_report(report)
    assert (
        f"{LAYERS + 1} all-gathers fused with their matmul (async TP), {LAYERS} reduce-scatters fused with their "
        "matmul (async TP)"
    ) in text
