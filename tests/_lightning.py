"""Helpers for the Lightning tests: a LightningModule around the test GPT, the data each
rank reads, and the core ``parallelize()`` / single-process runs the Trainer and Fabric
runs are compared with.

How the Trainer runs in tests: each rank is a ``run_ranks`` process (gloo already
initialised, ``LOCAL_RANK``/``RANK``/``WORLD_SIZE`` set), and the Trainer is built *inside*
the rank. Lightning's ``LightningEnvironment`` sees ``LOCAL_RANK`` and treats the
processes as externally launched (as under torchrun), so neither its subprocess launcher
(which would re-run pytest) nor a spawn launcher is used, and Lightning reuses the
process group that is already there.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
import torch._dynamo
import torch.distributed as dist
from _train import full_params
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn

SEQ = 16
VOCAB = 256
PER_RANK = 2  # sequences per rank and micro-batch


def dataset(samples: int, seed: int = 1234) -> TensorDataset:
    x, y = fixed_batches(1, samples, SEQ, VOCAB, seed=seed)[0]
    return TensorDataset(x, y)


def make_optimizer(kind: str, params, lr: float, weight_decay: float = 0.01) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def _lit_gpt(base: type) -> type:
    class LitGPT(base):
        """``self.model`` is the test GPT, built in ``__init__`` (seeded) or, with ``meta``,
        in ``configure_model`` on the meta device. Records each micro-batch's local loss."""

        def __init__(self, seed: int = 0, meta: bool = False, optimizer: str = "sgd", lr: float = 0.5, **gpt):
            super().__init__()
            self.opt_kind, self.lr, self.gpt = optimizer, lr, gpt
            self.model = None
            if not meta:
                torch.manual_seed(seed)
                self.model = gpt_small(**gpt)
            self.losses: list[float] = []
            self.val_losses: list[float] = []
            self.initial: dict | None = None

        def configure_model(self) -> None:
            if self.model is None:
                with torch.device("meta"):
                    self.model = gpt_small(**self.gpt)

        def forward(self, x):
            return self.model(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = loss_fn(self(x), y)
            self.losses.append(loss.detach().float().item())
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            loss = loss_fn(self(x), y)
            self.val_losses.append(loss.detach().float().item())
            self.log("val_loss", loss, sync_dist=True)

        def configure_optimizers(self):
            return make_optimizer(self.opt_kind, self.parameters(), self.lr)

    return LitGPT


LitGPT = _lit_gpt(LightningModule)


def standalone_lit_gpt() -> type:
    """The same module for the standalone ``pytorch_lightning`` package."""
    import pytorch_lightning

    return _lit_gpt(pytorch_lightning.LightningModule)


class RecordInitial(Callback):
    """Full (gathered) parameters at the start of fit, after sharding/materializing."""

    def on_fit_start(self, trainer, pl_module):
        pl_module.initial = full_params(pl_module.model)


def loader(data: TensorDataset, batch: int = PER_RANK) -> DataLoader:
    return DataLoader(data, batch_size=batch)


def trainer(root: str, standalone: bool = False, **kwargs) -> Trainer:
    """A Trainer for 2 CPU ranks with no logger/checkpoints unless asked; ``standalone``
    builds a ``pytorch_lightning.Trainer`` instead."""
    defaults = dict(
        strategy="fsdp_overlap",
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    defaults.update(kwargs)
    if standalone:
        import pytorch_lightning

        return pytorch_lightning.Trainer(**defaults)
    return Trainer(**defaults)


def rank_batches(data: TensorDataset, rank: int, world: int, epochs: int = 1, batch: int = PER_RANK) -> list:
    """Exactly the batches Lightning gives this rank in training, epoch by epoch: for the
    training loader it always injects ``DistributedSampler(shuffle=True, seed=0)`` (seed
    from ``PL_GLOBAL_SEED`` when set), whatever the loader's own ``shuffle``."""
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.extend(DataLoader(data, batch_size=batch, sampler=sampler))
    return out


def core_run(
    model: torch.nn.Module,
    batches: list,
    *,
    optimizer: str = "sgd",
    lr: float = 0.5,
    clip: float | None = None,
    accumulate: int = 1,
    autocast: torch.dtype | None = None,
    default_dtype: torch.dtype | None = None,
    weight_decay: float = 0.01,
    **config,
) -> dict:
    """The same training as the Trainer's, on the core: ``parallelize`` (+ ``materialize``
    for a meta-device model) and a plain loop."""
    torch._dynamo.reset()
    fo.parallelize(model, **config)
    if any(p.device.type == "meta" for p in model.parameters()):
        fo.materialize(model, "cpu")
    initial = full_params(model)
    opt = make_optimizer(optimizer, model.parameters(), lr, weight_decay)
    losses, norms = [], []
    for i, (x, y) in enumerate(batches):
        with _forward_context(autocast, default_dtype):
            loss = loss_fn(model(x), y)
        losses.append(loss.detach().float().item())
        (loss / accumulate).backward()
        if (i + 1) % accumulate == 0:
            if clip is not None:
                norms.append(float(_full(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))))
            opt.step()
            opt.zero_grad()
    return {"losses": losses, "params": full_params(model), "norms": norms, "initial": initial}


def reference_run(model: torch.nn.Module, global_batches: list, *, lr: float = 0.5, clip: float | None = None) -> dict:
    """One process, no sharding: SGD on each global batch (the union of the ranks')."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, norms = [], []
    for x, y in global_batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": full_params(model), "norms": norms}


def global_batches(per_rank: list[list], group: int = 1) -> list:
    """Concatenate the ranks' batches step by step (``group`` micro-batches per step)."""
    steps = len(per_rank[0]) // group
    out = []
    for s in range(steps):
        parts = [b for rank in per_rank for b in rank[s * group : (s + 1) * group]]
        out.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    return out


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


@contextlib.contextmanager
def _forward_context(autocast: torch.dtype | None, default_dtype: torch.dtype | None):
    previous = torch.get_default_dtype()
    with contextlib.ExitStack() as stack:
        if autocast is not None:
            stack.enter_context(torch.autocast("cpu", dtype=autocast))
        if default_dtype is not None:
            torch.set_default_dtype(default_dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def close(a: list[float], b: list[float], rel: float = 1e-5, abs_: float = 1e-6) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rel, abs_tol=abs_) for x, y in zip(a, b))


def trainer_script(strategy: str, *, n_layer: int, rows: int, max_steps: int) -> str:
    """A script that trains a tiny GPT with ``Trainer(accelerator="cpu", devices=2,
    strategy=<strategy>)``, as a user writes one: run as ``python script.py``, Lightning
    starts the second rank by re-running it. ``strategy`` is the expression in the script."""
    return f"""
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset
from fsdp_overlap_plugin.lightning import FSDPOverlapStrategy
from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn
torch.set_num_threads(1)

class Lit(LightningModule):
    def __init__(self):
        super().__init__()
        self.model = gpt_small(n_layer={n_layer}, d_model=32, vocab_size=64, block_size=16)
    def training_step(self, batch, i):
        return loss_fn(self.model(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

x, y = fixed_batches(1, {rows}, 16, 64)[0]
strategy = {strategy}
trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps={max_steps}, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
trainer.fit(Lit(), DataLoader(TensorDataset(x, y), batch_size=2))
"""
