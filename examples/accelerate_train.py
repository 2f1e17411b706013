"""fsdp-overlap with Hugging Face Accelerate: a small GPT trained for a few steps; rank 0
prints the schedule summary. Every plugin setting comes from the YAML given to the
launcher (the fsdp_overlap_* keys under fsdp_config); the script has one extra line.

    accelerate launch --config_file configs/overlap.yaml --num_processes 2 examples/accelerate_train.py
    fsdp-overlap launch --config configs/overlap.yaml --num_processes 2 examples/accelerate_train.py

(the second checks the YAML first, and the bucket plan against FSDP_OVERLAP_MODEL below, and
stops naming the key or module before any process starts)

Works on GPUs (nccl), Ascend NPUs (hccl) and, for development, on a CPU-only machine as
2 gloo ranks with the same command. Checkpoints, as in Accelerate's own examples:

    ... examples/accelerate_train.py --checkpointing_steps 4 --output_dir runs/gpt
    ... examples/accelerate_train.py --resume_from_checkpoint runs/gpt/step_4
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.accelerate import config_source, prepare  # import before Accelerator(): see docs/accelerate.md
from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn

# ---- settings (nanoGPT style: edit here) -------------------------------------------
STEPS = 8
BATCH_PER_RANK = 4
SEQ = 32
LR = 3e-3
MAX_GRAD_NORM = 1.0
# The model below, for `fsdp-overlap launch`: it reads this line (without running the
# script) to check the YAML's bucket plan against the model before starting any process.
FSDP_OVERLAP_MODEL = "fsdp_overlap_plugin.models.gpt:gpt_small(n_layer=4, d_model=64, block_size=32)"
# --------------------------------------------------------------------------------------

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=int, default=STEPS)
parser.add_argument("--output_dir", default="runs/accelerate_gpt")
parser.add_argument("--checkpointing_steps", type=int, default=None, help="save_state every N steps")
parser.add_argument("--resume_from_checkpoint", default=None, help="a folder written by save_state")
parser.add_argument("--metrics", default=None, help="write losses and the schedule report here (JSON, rank 0)")
args = parser.parse_args()


class Progress:
    """The step counter, saved and restored with the checkpoint."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


accelerator = Accelerator()
set_seed(0)  # same initial weights on every rank; each keeps its own shard
model = gpt_small(n_layer=4, d_model=64, block_size=SEQ)
optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
# A tiny dataset: two global batches, seen in turn; Accelerate deals each rank its part.
two = fixed_batches(2, BATCH_PER_RANK * accelerator.num_processes, SEQ, model.cfg.vocab_size)
batches = [two[step % 2] for step in range(args.steps)]
dataset = TensorDataset(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
loader = DataLoader(dataset, batch_size=BATCH_PER_RANK)

model, optimizer, loader = prepare(accelerator, model, optimizer, loader)  # <- the fsdp-overlap line
accelerator.print(f"fsdp-overlap settings from {config_source(model)}")

progress = Progress()
accelerator.register_for_checkpointing(progress)
if args.resume_from_checkpoint:
    accelerator.load_state(args.resume_from_checkpoint)
    accelerator.print(f"resumed from {args.resume_from_checkpoint} at step {progress.step}")

local = sum(p.to_local().numel() for p in model.parameters())
total = sum(p.numel() for p in model.parameters())
shard = next(model.parameters()).to_local()
# On a CPU every rank is a process on the same CPU (accelerator.device says "cpu" for all)
where = str(shard.device) if shard.device.type != "cpu" else f"CPU process {os.getpid()}"
# One write per line: the ranks share the terminal, and print()'s separate newline write
# lets another rank's line start in the middle of this one.
sys.stdout.write(
    f"[rank {accelerator.process_index}/{accelerator.num_processes}] {where}, "
    f"{type(model).__name__} not wrapped, holds {local} of {total} parameter elements "
    f"({type(next(model.parameters())).__name__} shards)\n"
)
sys.stdout.flush()
accelerator.wait_for_everyone()

losses = {}
for x, y in accelerator.skip_first_batches(loader, progress.step):
    start = time.perf_counter()
    loss = loss_fn(model(x), y)
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = accelerator.reduce(loss.detach(), "mean").item()
    note = "" if losses else " (includes compilation)"
    losses[progress.step] = loss
    accelerator.print(f"step {progress.step}: loss {loss:.6f}  {time.perf_counter() - start:.2f} s{note}")
    progress.step += 1
    if args.checkpointing_steps and progress.step % args.checkpointing_steps == 0:
        accelerator.save_state(str(Path(args.output_dir) / f"step_{progress.step}"))

# The schedule summary was printed after the first optimizer step (the main process);
# fo.schedule_report(model) is the same report as data.
if accelerator.is_main_process and args.metrics:
    report = fo.schedule_report(model)
    Path(args.metrics).write_text(json.dumps({"losses": losses, "report": report}, default=str))
accelerator.end_training()
