"""Gradient accumulation on HSDP (issue 43) on 2 gloo ranks, mesh replicate=2 x shard=1:
the micro-batches that accumulate skip the all-reduce across replicas, the last one
all-reduces the sum, and the numbers equal one large batch (1e-6).

Two ``run_ranks`` jobs (start-up and imports paid once per framework), each test reads
its part:

* core and Lightning: ``model.no_sync()`` on a ``parallelize``d model; the Trainer with
  ``accumulate_grad_batches=2`` and ``sharding_strategy="HYBRID_SHARD"`` on 2 simulated
  nodes of 1 device (``NODE_RANK`` per rank) against the Trainer on the large batch with
  ``device_mesh=(2, 1)``; Fabric's ``no_backward_sync`` with ``mesh={"replicate": 2}``.
* Accelerate: ``Accelerator(gradient_accumulation_steps=2)`` + ``accumulate(model)``,
  with the mesh from its ``parallelism_config`` (dp_replicate_size=2) and from
  ``fsdp_sharding_strategy: HYBRID_SHARD`` on 2 simulated machines (both on a simulated
  FSDP2 state, as a GPU launch gives: ``accumulate`` calls
  ``model.set_requires_gradient_sync``), and from the plugin's own ``mesh`` key
  (MULTI_CPU, what a CPU launch gives: ``accumulate`` calls ``model.no_sync``).

Each run uses ``backend="aot_eager"`` and a 2-block GPT.
"""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
from _dist import run_ranks

pytestmark = pytest.mark.slow

MODEL = {"n_layer": 2, "d_model": 32, "n_head": 4, "vocab_size": 97, "block_size": 32}
STEPS = 2
PER_RANK = 4  # sequences per rank and optimizer step (2 micro-batches of 2)
SEQ = 16
LR = 0.5
TOL = 1e-6
ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}


def _data(world: int) -> list:
    from fsdp_overlap_plugin.models import fixed_batches

    return fixed_batches(STEPS, PER_RANK * world, SEQ, MODEL["vocab_size"])


def _backward_all_reduces(model) -> list[int]:
    """The all-reduces of each compiled backward graph of ``model`` (after the passes)."""
    import fsdp_overlap_plugin as fo

    return sorted(e["after"]["all_reduce"] for e in fo.schedule_report(model)["graphs"] if e["graph"] == "backward")


def _deferred(model) -> int:
    from fsdp_overlap_plugin.runtime.accumulation import replica_sync_of

    return replica_sync_of(model).deferred_all_reduces


@contextlib.contextmanager
def _environ(**values):
    """Set (a string) or remove (None) environment variables inside the block."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --------------------------------------------------------------- core + Lightning job
def _core(rank: int, world: int) -> dict:
    """2 micro-batches per step, the first under ``model.no_sync()``."""
    import torch.distributed as dist
    from _train import full_params, local_slice, make_model, train_reference

    import fsdp_overlap_plugin as fo
    from fsdp_overlap_plugin.models import loss_fn

    torch._dynamo.reset()
    data = _data(world)
    model = make_model(**MODEL)
    ref = train_reference(model, lr=LR, data=data) if rank == 0 else (None, None)
    fo.parallelize(model, backend="aot_eager", mesh={"replicate": 2, "shard": 1})
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in data:
        mx, my = local_slice(x, rank, world), local_slice(y, rank, world)
        total = torch.zeros(())
        for k, sync in enumerate((model.no_sync(), contextlib.nullcontext())):
            with sync:
                part = slice(2 * k, 2 * k + 2)
                loss = loss_fn(model(mx[part]), my[part]) / 2
                loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return {
        "losses": losses,
        "params": full_params(model),
        "ref": ref,
        "all_reduces": _backward_all_reduces(model),
        "deferred": _deferred(model),
        "mesh": fo.schedule_report(model)["mesh"],
    }


def _trainer_fit(root: str, strategy, batch: int, accumulate: int, **trainer_kwargs) -> tuple:
    from _lightning import LitGPT, loader, trainer
    from torch.utils.data import TensorDataset

    from fsdp_overlap_plugin.models import fixed_batches

    torch._dynamo.reset()
    lit = LitGPT(seed=0, **MODEL)
    tr = trainer(root, max_epochs=1, strategy=strategy, accumulate_grad_batches=accumulate, **trainer_kwargs)
    # 2 sequences per rank and step: 2 micro-batches of 1, or one batch of 2
    x, y = fixed_batches(1, 2 * STEPS * 2, SEQ, MODEL["vocab_size"], seed=7)[0]
    tr.fit(lit, loader(TensorDataset(x, y), batch=batch))
    return tr, lit


def _lightning(rank: int, world: int, root: str) -> dict:
    """The Trainer: accumulate 2 micro-batches of 1 sequence on HYBRID_SHARD over 2
    simulated nodes vs. the same data in batches of 2 on device_mesh=(2, 1)."""
    from _train import full_params

    from fsdp_overlap_plugin.lightning import FSDPOverlapStrategy

    out: dict = {}
    # 2 nodes of 1 device: rank r is node r's only local process (Lightning's
    # LightningEnvironment reads NODE_RANK and LOCAL_RANK; the process group exists).
    with _environ(NODE_RANK=str(rank), LOCAL_RANK="0"):
        strategy = FSDPOverlapStrategy(backend="aot_eager", sharding_strategy="HYBRID_SHARD")
        tr, lit = _trainer_fit(root, strategy, batch=1, accumulate=2, num_nodes=2, devices=1)
    out["accumulated"] = {
        "step_losses": [(a + b) / 2 for a, b in zip(lit.losses[::2], lit.losses[1::2])],
        "micro": len(lit.losses),
        "global_step": tr.global_step,
        "params": full_params(lit.model),
        "device_mesh": list(tr.strategy.device_mesh.shape),
        "all_reduces": _backward_all_reduces(lit.model),
        "deferred": _deferred(lit.model),
    }
    strategy = FSDPOverlapStrategy(backend="aot_eager", device_mesh=(2, 1))
    tr, lit = _trainer_fit(root, strategy, batch=2, accumulate=1)
    out["large"] = {
        "losses": list(lit.losses),
        "params": full_params(lit.model),
        "device_mesh": list(tr.strategy.device_mesh.shape),
        "all_reduces": _backward_all_reduces(lit.model),
        "deferred": _deferred(lit.model),
    }
    return out


def _fabric(rank: int, world: int) -> dict:
    """Fabric: the first micro-batch of each step under no_backward_sync, mesh={"replicate": 2}."""
    from _train import full_params, local_slice, make_model
    from lightning.fabric import Fabric

    from fsdp_overlap_plugin.lightning import FSDPOverlapFabricStrategy
    from fsdp_overlap_plugin.models import loss_fn

    torch._dynamo.reset()
    fabric = Fabric(
        strategy=FSDPOverlapFabricStrategy(backend="aot_eager", mesh={"replicate": 2}), accelerator="cpu", devices=2
    )
    fabric.launch()
    model = make_model(**MODEL)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = fabric.setup(model, opt)
    losses = []
    for x, y in _data(world):
        mx, my = local_slice(x, rank, world), local_slice(y, rank, world)
        total = 0.0
        for k in range(2):
            with fabric.no_backward_sync(model, enabled=k == 0):
                loss = loss_fn(model(mx[2 * k : 2 * k + 2]), my[2 * k : 2 * k + 2]) / 2
                fabric.backward(loss)
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(fabric.all_reduce(torch.tensor(total), reduce_op="mean").item())
    inner = model.module
    return {
        "losses": losses,
        "params": full_params(inner),
        "all_reduces": _backward_all_reduces(inner),
        "deferred": _deferred(inner),
        "mesh": list(fabric.strategy.device_mesh.shape),
    }


def _lightning_job(rank: int, world: int, root: str) -> dict:
    return {"core": _core(rank, world), "lightning": _lightning(rank, world, root), "fabric": _fabric(rank, world)}


@pytest.fixture(scope="module")
def lightning_results(tmp_path_factory) -> list[dict]:
    return run_ranks(_lightning_job, str(tmp_path_factory.mktemp("hsdp_acc")), world=2, timeout=600, env=ENV)


# ------------------------------------------------------------------- Accelerate job
def _fresh_accelerator(fsdp_plugin=None, **kwargs):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType

    torch._dynamo.reset()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = Accelerator(**kwargs)
    if fsdp_plugin is not None:  # what a GPU/NPU FSDP2 launch gives (never on a CPU)
        accelerator.state.fsdp_plugin = fsdp_plugin
        accelerator.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        assert accelerator.is_fsdp2
    return accelerator


def _accelerate_run(rank: int, world: int, accelerator, calls: list | None = None, **config) -> dict:
    """2 steps of 2 micro-batches with ``accelerator.accumulate(model)``."""
    from _train import full_params, local_slice, make_model

    import fsdp_overlap_plugin as fo
    from fsdp_overlap_plugin.accelerate import prepare
    from fsdp_overlap_plugin.models import loss_fn

    model = make_model(**MODEL)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = prepare(accelerator, model, opt, config={"backend": "aot_eager", **config})
    if calls is not None:  # which FSDP2 method Accelerate called
        library = model.set_requires_gradient_sync

        def recorded(flag, **kw):
            calls.append(flag)
            return library(flag, **kw)

        model.set_requires_gradient_sync = recorded
    losses = []
    for x, y in _data(world):
        mx, my = local_slice(x, rank, world), local_slice(y, rank, world)
        total = 0.0
        for k in range(2):
            with accelerator.accumulate(model):
                loss = loss_fn(model(mx[2 * k : 2 * k + 2]), my[2 * k : 2 * k + 2])
                accelerator.backward(loss)  # divides by gradient_accumulation_steps
                opt.step()
                opt.zero_grad()
            total += loss.item() / 2
        losses.append(accelerator.reduce(torch.tensor(total), "mean").item())
    return {
        "losses": losses,
        "params": full_params(model),
        "all_reduces": _backward_all_reduces(model),
        "deferred": _deferred(model),
        "report_mesh": fo.schedule_report(model)["mesh"],
    }


def _accelerate_job(rank: int, world: int) -> dict:
    from _train import make_model, train_reference
    from accelerate.utils import FullyShardedDataParallelPlugin

    out: dict = {}
    if rank == 0:
        out["ref"] = train_reference(make_model(**MODEL), lr=LR, data=_data(world))
    # Accelerate refuses a parallelism_config on MULTI_CPU, and under FSDP2 wants
    # dp_shard_size > 1 (2 ranks cannot be 2 x 2): the Accelerator holds the sizes as a
    # GPU launch's would, on the simulated FSDP2 state
    from accelerate.parallelism_config import ParallelismConfig

    accelerator = _fresh_accelerator(FullyShardedDataParallelPlugin(fsdp_version=2), gradient_accumulation_steps=2)
    accelerator.state.parallelism_config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=1)
    out["parallelism_config"] = _accelerate_run(rank, world, accelerator)
    # 2 machines of 1 process, as torchrun describes them to each worker
    with _environ(LOCAL_WORLD_SIZE="1"):
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, sharding_strategy="HYBRID_SHARD", reshard_after_forward=True
        )
        accelerator = _fresh_accelerator(plugin, gradient_accumulation_steps=2)
        calls: list = []
        out["hybrid_shard"] = _accelerate_run(rank, world, accelerator, calls)
        out["hybrid_shard"]["calls"] = calls
    accelerator = _fresh_accelerator(gradient_accumulation_steps=2)
    out["plugin_mesh"] = _accelerate_run(rank, world, accelerator, mesh={"replicate": 2, "shard": 1})
    return out


@pytest.fixture(scope="module")
def accelerate_results() -> list[dict]:
    # MULTI_CPU with a gloo group, as on a CPU launch (tests/accelerate/integration/test_accelerate_ranks.py)
    return run_ranks(_accelerate_job, world=2, timeout=600, env={**ENV, "ACCELERATE_USE_CPU": "true"})


# ---------------------------------------------------------------------------- checks
def _close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == STEPS, (got, want)
    for a, b in zip(got, want):
        assert math.isclose(a, b, rel_tol=0, abs_tol=TOL), (got, want)


def _same_params(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=TOL, msg=name)


def _skips_then_reduces(run: dict) -> None:
    # one backward graph without any all-reduce (the micro-batch that accumulates), one
    # with them (the last); the accumulated sum reduced once per optimizer step
    assert len(run["all_reduces"]) == 2 and run["all_reduces"][0] == 0 < run["all_reduces"][1], run["all_reduces"]
    assert run["deferred"] == STEPS


def test_core_no_sync_matches_the_large_batch(lightning_results):
    core = lightning_results[0]["core"]
    ref_losses, ref_params = core["ref"]
    _close(core["losses"], ref_losses)
    _same_params(core["params"], ref_params)
    assert core["mesh"] == [2, 1]
    _skips_then_reduces(core)
    assert core["losses"][0] != core["losses"][-1]


def test_trainer_accumulate_grad_batches_on_hybrid_shard_matches_the_large_batch(lightning_results):
    for rank, result in enumerate(lightning_results):
        acc, large = result["lightning"]["accumulated"], result["lightning"]["large"]
        assert acc["micro"] == 2 * STEPS and acc["global_step"] == STEPS, rank
        # HYBRID_SHARD on 2 nodes of 1 device: replicate over the nodes; device_mesh=(2, 1) the same
        assert acc["device_mesh"] == large["device_mesh"] == [2, 1], rank
        _close(acc["step_losses"], large["losses"])
        _same_params(acc["params"], large["params"])
        _skips_then_reduces(acc)
        # the large batch never accumulates: one backward graph, all-reducing
        assert len(large["all_reduces"]) == 1 and large["all_reduces"][0] > 0 and large["deferred"] == 0


def test_fabric_no_backward_sync_matches_the_large_batch(lightning_results):
    fabric, core = lightning_results[0]["fabric"], lightning_results[0]["core"]
    ref_losses, ref_params = core["ref"]
    assert fabric["mesh"] == [2, 1]
    _close(fabric["losses"], ref_losses)
    _same_params(fabric["params"], ref_params)
    _skips_then_reduces(fabric)


@pytest.mark.parametrize("spelling", ["parallelism_config", "hybrid_shard", "plugin_mesh"])
def test_accelerate_accumulate_matches_the_large_batch(accelerate_results, spelling):
    ref_losses, ref_params = accelerate_results[0]["ref"]
    for rank, result in enumerate(accelerate_results):
        run = result[spelling]
        assert run["report_mesh"] == [2, 1], (rank, run["report_mesh"])
        _close(run["losses"], ref_losses)
        _same_params(run["params"], ref_params)
        _skips_then_reduces(run)
    if spelling == "hybrid_shard":
        # Accelerate's FSDP2 path: accumulate() called set_requires_gradient_sync(False) on
        # the first micro-batch of each step and (True) after it
        assert accelerate_results[0]["hybrid_shard"]["calls"] == [False, True] * STEPS
