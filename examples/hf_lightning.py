"""A Hugging Face ``transformers`` causal LM (Llama-style, ``LlamaForCausalLM``) trained with
``Trainer(strategy="fsdp_overlap", precision="bf16-mixed")``: sharded FSDP2-style,
compiled with the overlap passes, on 2 CPU ranks (gloo) by default. The strategy prints the
schedule summary after the first step (as in examples/lightning_gpt.py); rank 0 prints the
losses at the end.

    python examples/hf_lightning.py                                        # 2 CPU ranks (Lightning starts the second)
    python examples/hf_lightning.py --accelerator gpu --devices 1          # one GPU (nccl)
    torchrun --standalone --nproc-per-node 2 examples/hf_lightning.py --steps 3
    python examples/hf_lightning.py --config-json path/to/config.json      # any local transformers config.json
    python examples/hf_lightning.py --weights path/to/folder               # a folder written by save_pretrained
    python examples/hf_lightning.py --meta                                 # build on the meta device
    python examples/hf_lightning.py --export trained/                      # save the trained model (from_pretrained loads it)
    python examples/hf_lightning.py --backend aot_eager                    # no code generation: quicker to start

Nothing is downloaded: the default model is the tiny Llama of
``fsdp_overlap_plugin.models.TINY_LLAMA`` (``lm_head`` shares the embedding's weight),
``--config-json`` reads a local ``config.json``.

By default the model is built in ``__init__`` on every rank, in real memory, from the same
seed, and the strategy shards it. With ``--meta`` or ``--weights`` it is built the way a
model too large for one host must be: on the meta device in ``configure_model`` (no
memory), sharded by the strategy and materialized on the shards, initialised as
transformers initialises it (``_init_weights``, rotary ``inv_freq``); ``--weights`` then
loads the checkpoint into the shards in ``on_fit_start`` (``fsdp_overlap_plugin.load_pretrained``:
each rank reads only its rows of each tensor from the safetensors files). ``--export`` saves
the trained model in ``on_train_end`` (``fsdp_overlap_plugin.save_pretrained``, on every rank:
rank 0 writes the folder, tensor by tensor).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch.utils.data import DataLoader, TensorDataset

import fsdp_overlap_plugin as fo  # registers strategy="fsdp_overlap"
from fsdp_overlap_plugin.lightning import FSDPOverlapStrategy
from fsdp_overlap_plugin.models import TINY_LLAMA, counting_sequences
from fsdp_overlap_plugin.shard.hf import load_config, model_from_config

# ---- settings (nanoGPT style: edit here) -------------------------------------------
STEPS = 8
BATCH_PER_RANK = 4
SEQ = 32
SAMPLES = 256
LR = 3e-3
MAX_GRAD_NORM = 1.0
TRAINER = {
    "strategy": "fsdp_overlap",  # bucket_plans: auto (one bucket per decoder layer), all passes on, inductor
    "precision": "bf16-mixed",  # gather in bf16, reduce in fp32, fp32 master weights
    "accelerator": "auto",  # cpu (gloo) here; cuda (nccl) on GPUs (--accelerator)
    "devices": 2,  # ranks on this machine (--devices; 1 on a one-GPU machine)
    "log_every_n_steps": 1,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "logger": False,
}
# --------------------------------------------------------------------------------------


def build_model(config: Any = None) -> nn.Module:
    """The causal LM, randomly initialised from ``config`` (a dict of config.json keys, a
    path to a config.json, or a transformers config; None: ``TINY_LLAMA``). Never reaches
    the hub. Under ``torch.device("meta")`` it allocates nothing."""
    return model_from_config(_config(TINY_LLAMA if config is None else config))


def _config(config: Any) -> Any:
    if isinstance(config, dict):
        from transformers import AutoConfig

        return AutoConfig.for_model(**config)
    if isinstance(config, (str, Path)):
        return load_config(config)
    return config


class CausalLMModule(LightningModule):
    """``self.model`` is the transformers model; its own loss (``labels=input_ids``,
    shifted inside the model) is the loss. ``meta`` (implied by ``weights``, a local
    ``save_pretrained`` folder): built in ``configure_model`` on the meta device."""

    def __init__(
        self,
        config: Any = None,
        weights: str | None = None,
        lr: float = LR,
        seed: int = 0,
        meta: bool = False,
        export: str | None = None,
    ) -> None:
        super().__init__()
        self.lr = lr
        self.weights = weights
        self.export = export
        if weights is not None and config is None:
            config = load_config(weights)  # the checkpoint's own config.json
        self.model_config = config
        self.model: nn.Module | None = None
        if not (meta or weights):
            torch.manual_seed(seed)  # the same initial weights on every rank; each keeps its shard
            self.model = build_model(config)
        self.losses: list[float] = []  # this rank's loss per step
        self.all_losses: list[list[float]] | None = None  # every rank's, after fit

    def configure_model(self) -> None:
        if self.model is None:  # meta: shapes only; the strategy materializes the shards
            with torch.device("meta"):
                self.model = build_model(self.model_config)

    def on_fit_start(self) -> None:
        if self.weights is not None:  # into the materialized shards, each rank its rows
            fo.load_pretrained(self.model, self.weights)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.detach().float().item())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def on_train_end(self) -> None:
        gathered = self.all_gather(torch.tensor(self.losses, dtype=torch.float64))
        self.all_losses = gathered.reshape(-1, len(self.losses)).tolist()
        if self.export is not None:  # every rank gathers; rank 0 writes the save_pretrained folder
            fo.save_pretrained(self.model, self.export)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-json", default=None, help="a local transformers config.json (default: TINY_LLAMA)")
    parser.add_argument("--weights", default=None, help="a local folder written by save_pretrained")
    parser.add_argument("--meta", action="store_true", help="build on the meta device (implied by --weights)")
    parser.add_argument("--export", default=None, help="save the trained model here as a save_pretrained folder")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument(
        "--devices", type=int, default=TRAINER["devices"], help="ranks on this machine (default: %(default)s)"
    )
    parser.add_argument(
        "--accelerator", default=TRAINER["accelerator"], help="cpu, gpu, or auto (default: %(default)s)"
    )
    parser.add_argument(
        "--backend", default=None, help="the strategy's compile backend: inductor (its default) or aot_eager"
    )
    parser.add_argument("--metrics", default=None, help="write losses and the schedule report here (JSON, rank 0)")
    args = parser.parse_args()

    torch.set_num_threads(1)  # two ranks share a small machine
    seed_everything(0)
    module = CausalLMModule(args.config_json, args.weights, meta=args.meta, export=args.export)
    vocab = _config(module.model_config or TINY_LLAMA).vocab_size
    loader = DataLoader(TensorDataset(counting_sequences(SAMPLES, SEQ, vocab)), batch_size=BATCH_PER_RANK)
    # Lightning replaces the sampler by a shuffling DistributedSampler: each rank reads its part.
    settings = dict(TRAINER, devices=args.devices, accelerator=args.accelerator)
    if args.backend is not None:  # the strategy by name takes no options: build it
        settings["strategy"] = FSDPOverlapStrategy(backend=args.backend)
    trainer = Trainer(**settings, max_steps=args.steps, gradient_clip_val=MAX_GRAD_NORM)
    trainer.fit(module, loader)

    if trainer.is_global_zero:
        # the schedule summary was printed by the strategy after the first optimizer step
        report = trainer.strategy.schedule_report
        losses = [sum(step) / len(step) for step in zip(*module.all_losses)]  # mean over ranks
        print()
        print(f"{type(module.model).__name__}: losses {', '.join(f'{x:.4f}' for x in losses)}")
        if args.export:
            print(f"saved the trained model to {args.export}: from_pretrained({args.export!r}) loads it")
        if args.metrics:
            data = {"losses": losses, "rank_losses": module.all_losses, "report": report}
            Path(args.metrics).write_text(json.dumps(data, default=str))


if __name__ == "__main__":
    main()
