"""A small GPT (nanoGPT layout) used by the examples, tests, benchmarks and CLI.

    tok_emb, pos_emb -> blocks[0..n-1] (ln1, attn, ln2, mlp) -> norm -> head

Factories take keyword overrides, so ``fsdp-overlap inspect
fsdp_overlap_plugin.models.gpt:gpt_1b`` works on the meta device without allocating.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "GPTConfig", "fixed_batches", "gpt_small", "gpt_bench", "gpt_1b"]


#: GPT-2's initialiser: weights drawn from N(0, INIT_STD).
INIT_STD = 0.02


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 64
    tie_weights: bool = False


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig | None = None, **overrides):
        super().__init__()
        cfg = cfg or GPTConfig(**overrides)
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init; on a meta model this is a no-op until ``materialize``."""
        for name, p in self.named_parameters():
            if p.device.type == "meta":
                continue
            if p.dim() >= 2:
                # residual projections scaled down by depth, as GPT-2 does
                std = INIT_STD / math.sqrt(2 * self.cfg.n_layer) if name.endswith("proj.weight") else INIT_STD
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.block_size:
            # a plain shape check: compiled, it is a guard on the length, not a graph break; without
            # it a longer input indexes past pos_emb and dies in a native kernel with no traceback
            raise ValueError(
                f"GPT: the input has {t} tokens per sequence, more than block_size {self.cfg.block_size} (the rows "
                f"of pos_emb); pass at most {self.cfg.block_size}, or build the model with block_size={t} or more"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def fixed_batches(
    steps: int, batch: int, seq: int, vocab: int, seed: int = 1234
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic (input, target) token batches: the same on every rank and run."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        data = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((data[:, :-1].contiguous(), data[:, 1:].contiguous()))
    return out


def gpt_small(**overrides) -> GPT:
    """~0.2M parameters: tests and the demo."""
    return GPT(GPTConfig(**overrides))


def gpt_bench(**overrides) -> GPT:
    """~3M parameters, 4 blocks of width 256: the throttled-network benchmark."""
    cfg = dict(vocab_size=2048, block_size=128, n_layer=4, n_head=8, d_model=256)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg))


def gpt_1b(**overrides) -> GPT:
    """~1.3B parameters (24 blocks of width 2048, 32k vocabulary): build it on the meta
    device (``with torch.device("meta"): gpt_1b()``) unless you have the memory."""
    cfg = dict(vocab_size=32768, block_size=2048, n_layer=24, n_head=16, d_model=2048)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg))
