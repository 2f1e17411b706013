"""Tensor parallel through the Lightning Trainer: a ModelParallelStrategy user's
``configure_model`` (its tensor-parallel part) runs under ``FSDPOverlapStrategy`` with only
the strategy line changed, on four gloo ranks at data-parallel 2 x tensor-parallel 2.

One 4-rank job runs every scenario:

* the user's ``parallelize_module(self.model..., self.device_mesh["tensor_parallel"], plan)``
  in ``configure_model``, ``FSDPOverlapStrategy(data_parallel_size=2, tensor_parallel_size=2)``:
  the losses and final weights equal one process on the union of the two data-parallel
  ranks' batches (the two ranks of a tensor-parallel group read the same batch), within 1e-5;
* the same model with the config's ``tp_plan`` instead of ``configure_model``'s plan;
* a ``configure_model`` that also calls ``fully_shard`` (the rest of a ModelParallelStrategy
  recipe): stopped at setup with an error saying to drop it;
* Fabric with ``FSDPOverlapFabricStrategy(tensor_parallel_size=2, tp_plan=...)``: its
  ``setup_dataloaders`` gives both ranks of a tensor-parallel group the same batches, and the
  training equals the same reference; its sharded checkpoint loads into a fresh model;
* checkpoints: the Trainer's sharded checkpoint of the 2 x 2 model resumes a second epoch
  bitwise like a run that never stopped; a full one (``state_dict_type="full"``, not tested
  yet) is refused with an error.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from _dist import run_ranks
from _lightning import dataset, loader, reference_run, trainer
from _train import full_params
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader, DistributedSampler

from fsdp_overlap_plugin.config.schema import OverlapConfigError
from fsdp_overlap_plugin.lightning import FSDPOverlapStrategy
from fsdp_overlap_plugin.models import gpt_small, loss_fn

pytestmark = pytest.mark.slow

WORLD, TP = 4, 2
DP = WORLD // TP
GPT = {"n_layer": 2, "d_model": 32, "n_head": 4, "vocab_size": 256, "block_size": 32}
PLAN = {"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}
SAMPLES, PER_RANK = 16, 2  # 4 steps: each data-parallel rank reads 2 sequences per step
TOL = 1e-5
ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}


class TensorParallelGPT(LightningModule):
    """ModelParallelStrategy's recipe: the model built in ``__init__``, split in
    ``configure_model`` with the strategy's ``device_mesh["tensor_parallel"]``."""

    def __init__(self, split: bool = True, also_fully_shard: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.model = gpt_small(**GPT)
        self.split, self.also_fully_shard = split, also_fully_shard
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if not self.split:
            return
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp_mesh = self.device_mesh["tensor_parallel"]
        for block in self.model.blocks:
            parallelize_module(block.mlp, tp_mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
        if self.also_fully_shard:
            from torch.distributed.fsdp import fully_shard

            for block in self.model.blocks:
                fully_shard(block, mesh=self.device_mesh["data_parallel"])

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = loss_fn(self(x), y)
        self.losses.append(loss.detach().float().item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit(root: str, module: TensorParallelGPT, epochs: int = 1, resume: str | None = None, **strategy) -> dict:
    torch._dynamo.reset()
    run = trainer(
        root,
        devices=WORLD,
        strategy=FSDPOverlapStrategy(backend="aot_eager", **strategy),
        max_epochs=epochs,
    )
    run.fit(module, loader(dataset(SAMPLES), batch=PER_RANK), ckpt_path=resume)
    try:
        run.save_checkpoint(f"{root}/last.ckpt")
        refused = None
    except OverlapConfigError as exc:
        refused = str(exc)
    return {
        "checkpoint": refused,
        "losses": module.losses,
        "params": full_params(module.model),
        "sampler": run.strategy.distributed_sampler_kwargs,
        "mesh": run.strategy.device_mesh.mesh_dim_names,
    }


def _fabric(root: str) -> dict:
    from lightning.fabric import Fabric

    from fsdp_overlap_plugin.lightning import FSDPOverlapFabricStrategy

    torch._dynamo.reset()
    strategy = FSDPOverlapFabricStrategy(backend="aot_eager", tensor_parallel_size=TP, tp_plan=PLAN)
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=WORLD)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup(gpt_small(**GPT))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5))
    data = fabric.setup_dataloaders(DataLoader(dataset(SAMPLES), batch_size=PER_RANK, shuffle=True))
    losses = []
    torch.manual_seed(0)  # the sampler's shuffle seed: Fabric's DistributedSampler uses seed 0
    for x, y in data:
        loss = loss_fn(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().float().item())
    fabric.save(f"{root}/fabric.ckpt", {"model": model, "optimizer": optimizer, "step": len(losses)})
    # a fresh model from another seed, loaded from the sharded checkpoint: the trained weights
    torch.manual_seed(1)
    again = fabric.setup(gpt_small(**GPT))
    again_optimizer = fabric.setup_optimizers(torch.optim.SGD(again.parameters(), lr=0.5))
    state = {"model": again, "optimizer": again_optimizer, "step": 0}
    fabric.load(f"{root}/fabric.ckpt", state)
    return {
        "losses": losses,
        "params": full_params(model.module if hasattr(model, "module") else model),
        "loaded": full_params(again.module if hasattr(again, "module") else again),
        "loaded_step": state["step"],
    }


def _scenarios(rank: int, world: int, root: str) -> dict:
    torch.set_num_threads(1)
    out = {
        "own_plan": _fit(f"{root}/a", TensorParallelGPT(), data_parallel_size=DP, tensor_parallel_size=TP),
        "config_plan": _fit(
            f"{root}/b", TensorParallelGPT(split=False), tensor_parallel_size=TP, tp_plan=PLAN, state_dict_type="full"
        ),
    }
    # a second epoch resumed from own_plan's sharded checkpoint, and two epochs straight
    out["resumed"] = _fit(f"{root}/r", TensorParallelGPT(), 2, f"{root}/a/last.ckpt", tensor_parallel_size=TP)
    out["straight"] = _fit(f"{root}/s", TensorParallelGPT(), 2, tensor_parallel_size=TP)
    out["fabric"] = _fabric(root)
    try:
        _fit(f"{root}/c", TensorParallelGPT(also_fully_shard=True), tensor_parallel_size=TP)
        out["fully_shard"] = None
    except OverlapConfigError as exc:
        out["fully_shard"] = str(exc)
    if rank == 0:
        # what Lightning's sampler gives data-parallel rank d, step by step: the reference's global batch
        data = dataset(SAMPLES)
        per_dp = []
        for d in range(DP):
            sampler = DistributedSampler(data, num_replicas=DP, rank=d, shuffle=True, seed=0)
            per_dp.append(list(DataLoader(data, batch_size=PER_RANK, sampler=sampler)))
        steps = [
            tuple(torch.cat([per_dp[d][s][i] for d in range(DP)]) for i in range(2)) for s in range(len(per_dp[0]))
        ]
        torch.manual_seed(0)
        out["reference"] = reference_run(gpt_small(**GPT), steps, lr=0.5)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_scenarios, str(tmp_path_factory.mktemp("tp")), world=WORLD, env=ENV, timeout=900)


@pytest.mark.parametrize("name", ["own_plan", "config_plan", "fabric"])
def test_trains_like_one_process(results, name):
    reference = results[0]["reference"]
    for rank, result in enumerate(results):
        ours = result[name]
        # each rank's local losses: a data-parallel rank's batch, the same on its two tensor-parallel ranks
        if name != "fabric":
            assert ours["sampler"] == {"num_replicas": DP, "rank": rank // TP}
            assert ours["mesh"] == ("data_parallel", "tensor_parallel")
        assert ours["losses"] == result[name]["losses"]
        if rank % TP:
            assert ours["losses"] == results[rank - 1][name]["losses"]  # the same batches as its group's first rank
        assert ours["params"].keys() == reference["params"].keys()
        worst = max((ours["params"][k] - reference["params"][k]).abs().max().item() for k in ours["params"])
        assert worst <= TOL, (name, rank, worst)
    # the mean of the data-parallel ranks' local losses is the global batch's loss
    for step, want in enumerate(reference["losses"]):
        got = sum(results[d * TP][name]["losses"][step] for d in range(DP)) / DP
        assert abs(got - want) <= TOL, (name, step, got, want)


def test_a_sharded_checkpoint_resumes_bitwise(results):
    """Lightning's sharded checkpoint (torch.distributed.checkpoint) of the 2 x 2 model: the
    second epoch resumed from it equals the second epoch of a run that never stopped."""
    for result in results:
        assert result["own_plan"]["checkpoint"] is None  # saved
        resumed, straight = result["resumed"], result["straight"]
        assert resumed["losses"] == straight["losses"][len(straight["losses"]) // 2 :]
        for name, value in straight["params"].items():
            assert torch.equal(resumed["params"][name], value), name


def test_fabric_saves_and_loads_a_sharded_checkpoint(results):
    for result in results:
        fabric = result["fabric"]
        assert fabric["loaded_step"] == len(fabric["losses"])
        for name, value in fabric["params"].items():
            assert torch.equal(fabric["loaded"][name], value), name


def test_a_full_checkpoint_is_refused_until_tested(results):
    for result in results:
        message = result["config_plan"]["checkpoint"]
        assert message is not None and message.startswith(
            "Trainer checkpoint save (state_dict_type='full'): the model is tensor-parallel"
        ), message


def test_a_leftover_fully_shard_is_refused_with_what_to_do(results):
    message = results[0]["fully_shard"]
    assert message is not None and "was sharded by torch's fully_shard" in message
    assert "remove the fully_shard calls (in configure_model" in message
