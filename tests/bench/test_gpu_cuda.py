"""CUDA variants of the core and pass tests: one NCCL rank, inductor's GPU (Triton) code.

Skipped without CUDA, with the reason. `python benchmarks/gpu_check.py` runs them on a GPU
machine (`pytest -m cuda tests/**/test_*_cuda.py`). A world of one NCCL rank has no
collectives in its graphs (DTensor skips the gather on a 1-rank mesh), so the 1-rank tests
check the compile path only; what the passes do on the GPU path is checked on two ranks
of a fake process group on the GPU: the FX graphs (aot_eager) and inductor's generated code.

The fake-process-group checks need a real GPU too, not only CUDA device tensors: on a
CPU-only torch build, autograd aborts the process on any CUDA tensor that requires grad,
fake ones included (it has no CUDA device guard), and AOTAutograd traces the backward
through autograd.
"""

from __future__ import annotations

import torch
from _bucket_graphs import check_two_rank_graphs, two_rank_graphs
from _cuda import gpu_check, nccl_world_of_one, requires_cuda

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn
from fsdp_overlap_plugin.runtime import devices

pytestmark = requires_cuda

PASSES_OFF = {"manual_bucketing": False, "overlap_grad_reduce": False, "separate_gather_group": False}


def _train(model: torch.nn.Module, steps: int, batch: int = 4, seq: int = 32) -> list[float]:
    """AdamW steps on two fixed batches (the loss falls); the loss of each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = fixed_batches(2, batch, seq, model.cfg.vocab_size)
    losses = []
    for step in range(steps):
        x, y = (t.cuda() for t in data[step % 2])
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_accelerators_choose_cuda_and_nccl():
    info = devices.current()
    assert (info.device_type, info.backend, info.device) == ("cuda", "nccl", torch.device("cuda", 0))


def test_one_nccl_rank_fp32_matches_the_unsharded_model():
    torch.manual_seed(0)
    reference = gpt_small().cuda()
    expected = _train(reference, 4)
    with nccl_world_of_one():
        torch.manual_seed(0)
        model = gpt_small().cuda()
        # passes on, fp32; aot_eager runs the same ATen ops as eager, so the only difference
        # from the reference is the sharding (inductor on the GPU: the bf16 test below)
        fo.parallelize(model, backend="aot_eager")
        losses = _train(model, 4)
        report = fo.schedule_report(model)
    assert report["device_type"] == "cuda" and report["world_size"] == 1
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-6)
    assert losses[-1] < losses[0]


def test_one_nccl_rank_bf16_inductor_compile_trains_like_eager():
    """The compile path on one GPU: bf16 parameters, inductor's Triton code, trains and
    agrees with eager fully_shard. A 1-rank mesh puts no collective in the graphs, so
    the passes have nothing to act on and this says nothing about them (the 2-rank
    fake-process-group tests below do); it only checks that their switches leave a
    collective-free compile alone."""
    losses, reports = {}, {}
    for name, overrides in {"default": {}, "pass_switches_off": PASSES_OFF, "eager": {"compile": False}}.items():
        with nccl_world_of_one():
            torch.manual_seed(0)
            model = gpt_small().cuda()
            fo.parallelize(model, param_dtype="bf16", reduce_dtype="fp32", backend="inductor", **overrides)
            losses[name] = _train(model, 6)
            reports[name] = fo.schedule_report(model)
    assert losses["default"][-1] < losses["default"][0]
    torch.testing.assert_close(losses["default"], losses["pass_switches_off"], rtol=1e-2, atol=0)
    torch.testing.assert_close(losses["eager"], losses["pass_switches_off"], rtol=3e-2, atol=0)
    # what gpu_check's summary says: a 1-rank mesh puts no collective in the graphs
    for kind in ("forward", "backward"):
        assert reports["default"][kind]["before"]["all_gather"] == 0
        assert reports["default"][kind]["after"]["all_gather"] == 0
    assert reports["eager"]["mode"] == "eager fully_shard"


def test_two_fake_ranks_on_the_gpu_compile_bucketed_prefetched_collectives(monkeypatch):
    """The passes on the GPU path (a cuda mesh, the nccl defaults: a separate gather
    group), in the FX graphs. tests/bench/test_gpu_check.py runs the same check on CPU, so CI
    keeps it in step with the passes."""
    check_two_rank_graphs(two_rank_graphs(monkeypatch, "cuda"), "cuda")


def test_generated_gpu_code_keeps_the_prefetch_order():
    """The CUDA variant of tests/passes/test_passes_traced.py::test_inductor_code_keeps_prefetch_order."""
    check = gpu_check()
    cfg = {"n_layer": 4, "d_model": 64, "n_head": 4, "vocab_size": 256, "block_size": 32}
    result = check.code_order_check(cfg, world=2, device_type="cuda", batch=2)
    assert result["problems"] == []
    assert len(result["windows"]["forward"]) == len(result["plan"])
    # every block but those the forward keeps gathered (passes.prefetch.kept_buckets) is
    # re-gathered, last first: gpu_check's own expectation, from the plan and the run's config
    planned = result["expected"]["backward_buckets"]
    blocks = [i for i, bucket in enumerate(result["plan"]) if bucket[0].startswith("blocks.")]
    assert 1 <= len(planned) <= cfg["n_layer"] and set(planned) <= set(blocks)
    assert planned == sorted(planned, reverse=True)
    assert len(result["windows"]["backward"]) == len(planned) == len(result["expected"]["backward"])
    assert all(w["compute"] >= 1 for w in result["windows"]["backward"])


def test_bf16_matmul_rate_is_measured():
    """The MFU denominator gpu_check reports: a positive rate, below 10 PFLOP/s."""
    import argparse

    result = gpu_check().phase_matmul(argparse.Namespace())
    assert 1e12 < result["matmul_flops_per_s"] < 1e16
    assert result["total_memory"] > 0
