"""Shared training loops for tests: a sharded run on each rank and the single-process
reference it must match (same initial weights, the union of the ranks' batches)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn

STEPS = 5
BATCH = 4  # global batch; each of the 2 ranks takes half
SEQ = 16
LR = 0.5


def make_model(seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    return gpt_small(**overrides)


def batches(steps: int = STEPS, vocab: int = 256) -> list:
    return fixed_batches(steps, BATCH, SEQ, vocab)


def local_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per : (rank + 1) * per]


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        out[name] = value.detach().float().cpu().clone()
    return out


def train_sharded(
    model,
    rank: int,
    world: int,
    steps: int = STEPS,
    lr: float = LR,
    clip: float | None = None,
    same_batch: bool = False,
    data: list | None = None,
) -> list[float]:
    """SGD on this rank's part of each batch (``data``, default ``batches(steps)``);
    returns the global mean loss per step. ``same_batch`` repeats the first batch, so the
    loss must go down."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    data = data if data is not None else batches(steps, model_vocab(model))
    if same_batch:
        data = [data[0]] * steps
    for x, y in data:
        loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().float().clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
    return losses


def train_reference(
    model, steps: int = STEPS, lr: float = LR, clip: float | None = None, data: list | None = None
) -> tuple[list[float], dict]:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in data if data is not None else batches(steps, model_vocab(model)):
        loss = loss_fn(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, full_params(model)


def model_vocab(model) -> int:
    return model.cfg.vocab_size
