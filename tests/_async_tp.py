"""A model split with sequence parallelism, and torch's symmetric-memory test mode, for the
``async_tp`` tests (``tests/compile/test_async_tp.py`` and
``tests/compile/integration/test_async_tp_training.py``)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_overlap_plugin.models import fixed_batches

VOCAB, DIM, SEQ, LAYERS = 64, 32, 8, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM, bias=False)
        self.down = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class SeqNet(nn.Module):
    """A residual MLP stack, split the Megatron way with sequence parallelism (``sp_plan``).
    Its Linear layers have no bias, as Llama's: torch's micro-pipeline pass pairs a
    collective with an ``mm``, and a bias makes the matmul an ``addmm`` on the CPU, which it
    does not match."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def sp_plan() -> dict:
    """torchtitan's sequence-parallel layout on ``SeqNet``: the residual stream split by
    sequence between the blocks' matmuls, gathered before each colwise matmul and
    reduce-scattered after each rowwise one."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan = {
        "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(LAYERS):
        plan[f"blocks.{i}.norm"] = SequenceParallel()
        plan[f"blocks.{i}.up"] = ColwiseParallel(input_layouts=Shard(1))
        plan[f"blocks.{i}.down"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def seq_net(seed: int = 0) -> SeqNet:
    torch.manual_seed(seed)
    return SeqNet()


def batch(step: int = 0, batch_size: int = 4):
    return fixed_batches(1, batch_size, SEQ, VOCAB, seed=10 + step)[0]


def seq_loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


@contextlib.contextmanager
def symm_mem_test_mode(groups: set[str] | None = None):
    """torch's symmetric-memory test mode, with the fused ops' fallbacks registered for CPU
    tensors (torch registers them for CUDA only): the fused graph then runs on gloo."""
    from torch.distributed import _symmetric_memory as symm_mem

    lib = torch.library.Library("symm_mem", "IMPL")  # noqa: TOR901 (a test-only registration, destroyed below)
    lib.impl("fused_all_gather_matmul", symm_mem._fused_all_gather_matmul, "CPU")
    lib.impl("fused_matmul_reduce_scatter", symm_mem._fused_matmul_reduce_scatter, "CPU")
    try:
        with symm_mem._test_mode(groups):
            yield
    finally:
        lib._destroy()
