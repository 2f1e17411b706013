"""``async_tp: true`` trains like one process: 4 gloo ranks at dp 2 x tp 2, inductor, the
sequence-parallel plan of ``tests/_async_tp.py`` fused by torch's micro-pipeline
pass, in torch's symmetric-memory test mode (the fused ops run their unfused fallbacks, the
same all-gather and matmul, registered for CPU tensors): losses and final weights within
1e-5 of one process, every rank's weights equal, and the forward and backward graphs of
every rank hold the fused pairs.

What this does not show: the CUDA kernels over symmetric memory, nor any time saved (the
fallbacks run the collective then the matmul, as without async TP).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _async_tp import LAYERS, batch, seq_loss, seq_net, sp_plan, symm_mem_test_mode
from _dist import run_ranks
from _train import full_params, local_slice

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.runtime.state import get_state

pytestmark = [
    pytest.mark.slow,
    pytest.mark.middle_torch,  # CI's 2.14 leg: a CUDA build, whose micro-pipeline pass fuses on a CPU
    pytest.mark.skipif(
        not torch.distributed.is_nccl_available(),
        reason=f"torch {torch.__version__} is built without NCCL: its micro-pipeline pass fuses nothing; "
        "`.ci/test-torch 2.14.1` (part of .ci/run) runs this on a CUDA build",
    ),
]

WORLD, TP = 4, 2
DP = WORLD // TP
STEPS, LR, TOL = 3, 0.5, 1e-5
ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}


def _train(model, dp_rank: int | None = None) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        if dp_rank is not None:
            x, y = local_slice(x, dp_rank, DP), local_slice(y, dp_rank, DP)
        value = seq_loss(model, x, y)
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = value.detach().clone()
        if dp_rank is not None:
            dist.all_reduce(value)
            value /= WORLD  # each data-parallel rank's loss counted once per tensor-parallel rank
        losses.append(value.item())
    return losses


def _rank(rank: int, world: int) -> dict:
    from torch.distributed.tensor.parallel import parallelize_module

    torch.set_num_threads(1)
    mesh = fo.build_mesh({"tensor": TP})
    model = seq_net()
    parallelize_module(model, mesh["tensor"], sp_plan())
    with symm_mem_test_mode({mesh["tensor"].get_group().group_name}):
        fo.parallelize(model, mesh=mesh, async_tp=True)
        losses = _train(model, dp_rank=rank // TP)
    report = fo.schedule_report(model)
    out = {
        "losses": losses,
        "params": full_params(model),
        "fused": {
            kind: (report.get(kind) or {}).get("tensor_parallel", {}).get("fused") for kind in ("forward", "backward")
        },
        "dynamo_graphs": get_state(model).dynamo_graphs,
    }
    if rank == 0:
        reference = seq_net()
        out["ref_losses"] = _train(reference)
        out["ref_params"] = full_params(reference)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_rank, world=WORLD, env=ENV, timeout=900)


def test_async_tp_trains_like_one_process(results):
    ours = results[0]
    for got, want in zip(ours["losses"], ours["ref_losses"], strict=True):
        assert abs(got - want) <= TOL, (ours["losses"], ours["ref_losses"])
    assert ours["losses"][-1] < ours["losses"][0]
    assert ours["params"].keys() == ours["ref_params"].keys()
    worst = max((ours["params"][k] - ours["ref_params"][k]).abs().max().item() for k in ours["params"])
    assert worst <= TOL, worst
    print(
        f"async TP: max |loss - ref| = {max(abs(a - b) for a, b in zip(ours['losses'], ours['ref_losses'])):.3g}, "
        f"max |param - ref| = {worst:.3g}"
    )
    for other in results[1:]:
        for k, v in other["params"].items():
            assert torch.equal(v, ours["params"][k]), k


def test_every_rank_ran_the_fused_graphs(results):
    for result in results:
        assert result["dynamo_graphs"] == 1
        assert result["fused"]["forward"] == {"all_gather_matmul": LAYERS + 1, "matmul_reduce_scatter": LAYERS}
        backward = result["fused"]["backward"]
        assert backward["all_gather_matmul"] >= LAYERS and backward["matmul_reduce_scatter"] >= LAYERS, backward
