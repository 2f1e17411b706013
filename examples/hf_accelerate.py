"""fsdp-overlap with Hugging Face Accelerate and a ``transformers`` model: a Llama-style
causal LM (``LlamaForCausalLM``) trained for a few steps; rank 0 prints the schedule
summary. Every plugin setting comes from the YAML given to the launcher (the
fsdp_overlap_* keys under fsdp_config); the script has one extra line.

    accelerate launch --config_file configs/overlap.yaml --num_processes 2 examples/hf_accelerate.py
    ... examples/hf_accelerate.py --config-json path/to/config.json   # any local transformers config.json
    ... examples/hf_accelerate.py --weights path/to/folder            # a folder written by save_pretrained
    ... examples/hf_accelerate.py --export trained/                   # save the trained model (from_pretrained loads it)

Nothing is downloaded: the default model is the tiny Llama of
``fsdp_overlap_plugin.models.TINY_LLAMA`` (``lm_head`` shares the embedding's weight),
``--config-json`` reads a local ``config.json``. Without ``--weights`` the model is built in
real memory on every rank from the same seed, and ``prepare`` shards it. With ``--weights``
(or ``--meta``) it is built on the meta device (no memory), ``prepare`` shards and
materializes it (initialised as transformers does), and ``fsdp_overlap_plugin.load_pretrained``
reads the checkpoint into the shards: each rank only its rows of each tensor.
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
from transformers import AutoConfig

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.accelerate import config_source, prepare  # import before Accelerator(): see docs/accelerate.md
from fsdp_overlap_plugin.models import TINY_LLAMA, counting_sequences
from fsdp_overlap_plugin.shard.hf import load_config, model_from_config

# ---- settings (nanoGPT style: edit here) -------------------------------------------
STEPS = 8
BATCH_PER_RANK = 4
SEQ = 32
LR = 3e-3
MAX_GRAD_NORM = 1.0
# --------------------------------------------------------------------------------------

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--config-json", default=None, help="a local transformers config.json (default: TINY_LLAMA)")
parser.add_argument("--weights", default=None, help="a local folder written by save_pretrained")
parser.add_argument("--meta", action="store_true", help="build on the meta device (implied by --weights)")
parser.add_argument("--steps", type=int, default=STEPS)
parser.add_argument("--export", default=None, help="save the trained model here as a save_pretrained folder")
parser.add_argument("--metrics", default=None, help="write losses and the schedule report here (JSON, rank 0)")
args = parser.parse_args()


accelerator = Accelerator()
set_seed(0)  # same initial weights on every rank; each keeps its own shard
config = load_config(args.config_json or args.weights) if (args.config_json or args.weights) else None
config = AutoConfig.for_model(**TINY_LLAMA) if config is None else config
if args.weights or args.meta:
    with torch.device("meta"):  # shapes only: prepare() materializes this rank's shards
        model = model_from_config(config)
else:
    model = model_from_config(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
# One global batch per step; Accelerate deals each rank its part (BATCH_PER_RANK sequences).
tokens = counting_sequences(args.steps * BATCH_PER_RANK * accelerator.num_processes, SEQ, model.config.vocab_size)
loader = DataLoader(TensorDataset(tokens), batch_size=BATCH_PER_RANK)

model, optimizer, loader = prepare(accelerator, model, optimizer, loader)  # <- the fsdp-overlap line
if args.weights:
    fo.load_pretrained(model, args.weights)  # each rank reads its shards' rows
accelerator.print(f"fsdp-overlap settings from {config_source(model)}")

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
for step, (ids,) in enumerate(loader):
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss  # the model's own loss: labels shifted inside
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    losses[step] = accelerator.reduce(loss.detach(), "mean").item()
    note = " (includes compilation)" if step == 0 else ""
    accelerator.print(f"step {step}: loss {losses[step]:.6f}  {time.perf_counter() - start:.2f} s{note}")

if args.export:
    # Accelerate's recipe, unchanged: every rank calls get_state_dict (it gathers the shards;
    # full CPU tensors on the main process), the main process writes the folder.
    state_dict = accelerator.get_state_dict(model)
    accelerator.unwrap_model(model).save_pretrained(
        args.export, is_main_process=accelerator.is_main_process, save_function=accelerator.save, state_dict=state_dict
    )
    accelerator.print(f"saved the trained model to {args.export}: from_pretrained({args.export!r}) loads it")

# The schedule summary was printed after the first optimizer step (the main process);
# fo.schedule_report(model) is the same report as data.
if accelerator.is_main_process and args.metrics:
    report = fo.schedule_report(model)
    Path(args.metrics).write_text(json.dumps({"losses": losses, "report": report}, default=str))
accelerator.end_training()
