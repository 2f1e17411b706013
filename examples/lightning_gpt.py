"""A small GPT trained with ``Trainer(strategy="fsdp_overlap")``: sharded FSDP2-style,
compiled with the overlap passes, on 2 CPU ranks (gloo) by default. The schedule summary
is printed (and logged as ``fsdp_overlap/...`` metrics) after the first step.

    python examples/lightning_gpt.py                                       # 2 CPU ranks
    python examples/lightning_gpt.py fit --config configs/lightning.yaml   # LightningCLI (jsonargparse)
    python examples/lightning_gpt.py fit --config configs/lightning.yaml \\
        --trainer.precision bf16-mixed --trainer.strategy.init_args.backend aot_eager
    torchrun --standalone --nproc-per-node 2 examples/lightning_gpt.py fit --config configs/lightning.yaml

Lightning starts the second rank itself (it re-runs this script); under ``torchrun``
each rank is started by torchrun instead. The model is built on the meta device in
``configure_model`` (``--model.init_on_meta true``) or in ``__init__`` (the default).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

import fsdp_overlap_plugin  # noqa: F401  (registers strategy="fsdp_overlap")
from fsdp_overlap_plugin.models import GPT, GPTConfig, loss_fn

if TYPE_CHECKING:
    from lightning.pytorch.cli import LightningCLI

# Used when the script runs with no arguments (LightningCLI's YAML overrides them).
TRAINER_DEFAULTS = {
    "strategy": "fsdp_overlap",  # bucket_plans: auto, all passes on
    "accelerator": "cpu",
    "devices": 2,
    "max_steps": 30,
    "log_every_n_steps": 1,
    "enable_model_summary": False,
}


class GPTLitModule(LightningModule):
    """nanoGPT-style LightningModule; ``self.model`` is what the strategy parallelizes."""

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        d_model: int = 64,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        init_on_meta: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.cfg = GPTConfig(
            vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, d_model=d_model
        )
        # Built here (every rank starts from the same seeded weights) or, with
        # init_on_meta, in configure_model without allocating (materialized on the shards).
        self.model: GPT | None = None if init_on_meta else GPT(self.cfg)
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            with torch.device("meta"):
                self.model = GPT(self.cfg)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = loss_fn(self(x), y)
        self.losses.append(loss.detach().float().item())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        return torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)


def token_sequences(samples: int, seq_len: int, vocab_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, target) token sequences that can be learnt: each counts up from a random
    start by a random stride (mod the vocabulary), so two tokens predict the next."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size, (samples, 1), generator=g)
    stride = torch.randint(1, 8, (samples, 1), generator=g)
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab_size
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class GPTDataModule(LightningDataModule):
    """``samples`` counting sequences of ``seq_len`` tokens (see ``token_sequences``)."""

    def __init__(
        self, samples: int = 256, seq_len: int = 32, vocab_size: int = 256, batch_size: int = 4, seed: int = 1234
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        hp = self.hparams
        self.dataset = TensorDataset(*token_sequences(hp.samples, hp.seq_len, hp.vocab_size, hp.seed))

    def train_dataloader(self) -> DataLoader:
        # Lightning replaces the sampler by a shuffling DistributedSampler: each rank reads its part.
        return DataLoader(self.dataset, batch_size=self.hparams.batch_size)


def cli_main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """LightningCLI (needs ``jsonargparse[signatures]``): the YAML sets trainer, strategy,
    model and data; any key can be overridden on the command line."""
    from lightning.pytorch.cli import LightningCLI

    torch.set_num_threads(1)  # two ranks share a small machine
    return LightningCLI(
        GPTLitModule,
        GPTDataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def main() -> None:
    """No arguments: a plain Trainer with TRAINER_DEFAULTS. Arguments: LightningCLI."""
    if len(sys.argv) > 1:
        cli_main()
        return
    torch.set_num_threads(1)
    seed_everything(0)
    trainer = Trainer(**TRAINER_DEFAULTS)
    trainer.fit(GPTLitModule(), datamodule=GPTDataModule())


if __name__ == "__main__":
    main()
