"""fsdp-overlap with transformers' ``Trainer``: a Llama-style causal LM (``LlamaForCausalLM``)
trained by an ordinary ``Trainer`` script, launched with the plugin's Accelerate config. The
script has one fsdp-overlap line, an import; the ``Trainer``'s own ``accelerator.prepare``
then shards and compiles the model with the passes, and the schedule summary is printed after
the first optimizer step. Every plugin setting comes from the YAML's fsdp_overlap_* keys.

    accelerate launch --config_file configs/overlap.yaml --num_processes 2 examples/hf_trainer.py
    ... examples/hf_trainer.py --save-steps 2 --eval-steps 3    # checkpoints, evaluation during training
    ... examples/hf_trainer.py --resume out/hf_trainer/checkpoint-4   # resume_from_checkpoint (or --resume latest)
    ... examples/hf_trainer.py --export trained/                # trainer.save_model: a folder from_pretrained loads
    python examples/hf_trainer.py --batch 8                     # the same training in one process, without the plugin

Nothing is downloaded: the model is the tiny Llama of ``fsdp_overlap_plugin.models.TINY_LLAMA``
(``lm_head`` shares the embedding's weight), the data sequences that count up
(``counting_sequences``). docs/trainer.md explains each step and what the Trainer's options do.
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

import fsdp_overlap_plugin.accelerate  # noqa: F401  <- the fsdp-overlap line: import before creating the Trainer
from fsdp_overlap_plugin.models import TINY_LLAMA, counting_sequences

# ---- settings (nanoGPT style: edit here) -------------------------------------------
STEPS = 6
BATCH_PER_RANK = 4
SEQ = 32
LR = 3e-3
MAX_GRAD_NORM = 1.0
# --------------------------------------------------------------------------------------

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--output-dir", default="out/hf_trainer", help="the Trainer's output_dir (checkpoints)")
parser.add_argument("--steps", type=int, default=STEPS, help="max_steps")
parser.add_argument("--batch", type=int, default=BATCH_PER_RANK, help="per_device_train_batch_size")
parser.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
parser.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every N steps (0: none)")
parser.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps (0: never)")
parser.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True)")
parser.add_argument("--resume", default=None, help="a checkpoint folder, or 'latest' (resume_from_checkpoint=True)")
parser.add_argument("--export", default=None, help="trainer.save_model(EXPORT) after training")
parser.add_argument("--metrics", default=None, help="write the Trainer's log history here (JSON, main process)")
args = parser.parse_args()


class Tokens(torch.utils.data.Dataset):
    """Causal-LM samples: the labels are the inputs (the model shifts them)."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


torch.manual_seed(0)  # the same initial weights in every process; the plugin keeps each rank's shard
model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_LLAMA))
data = counting_sequences(512, SEQ, TINY_LLAMA["vocab_size"])
training_args = TrainingArguments(
    output_dir=args.output_dir,
    max_steps=args.steps,
    per_device_train_batch_size=args.batch,
    per_device_eval_batch_size=args.batch,
    gradient_accumulation_steps=args.grad_accum,
    learning_rate=LR,
    max_grad_norm=MAX_GRAD_NORM,
    bf16=args.bf16,
    use_cpu=not torch.cuda.is_available(),  # what bf16 asks for on a machine without GPUs
    logging_steps=1,
    save_strategy="steps" if args.save_steps else "no",
    save_steps=args.save_steps or 500,
    eval_strategy="steps" if args.eval_steps else "no",
    eval_steps=args.eval_steps or None,
    report_to=[],
    disable_tqdm=True,
    seed=0,
)
trainer = Trainer(model=model, args=training_args, train_dataset=Tokens(data[:448]), eval_dataset=Tokens(data[448:]))
trainer.train(resume_from_checkpoint=True if args.resume == "latest" else args.resume)
if args.export:
    trainer.save_model(args.export)  # every process: the plugin gathers the weights, the main process writes
if args.metrics and trainer.is_world_process_zero():
    Path(args.metrics).write_text(
        json.dumps({"log_history": trainer.state.log_history, "world": training_args.world_size})
    )
