"""Training that survives a crash: sharded checkpoints every few steps, and a restart
(torchrun --max-restarts) picks up from the last complete one with the same losses.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/resumable_train.py \\
        --dir runs/ckpt --crash-at 7          # rank 1 dies at step 7 on the first attempt

Rank 0 appends one JSON line per step ({"step", "loss", "attempt"}) to --loss-log
(not --log: torchrun takes abbreviations of its own options even after the script).
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn
from fsdp_overlap_plugin.shard.checkpoint import load_latest, save

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--dir", required=True, help="checkpoint directory")
parser.add_argument("--loss-log", help="per-step losses, JSON lines (rank 0)")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--every", type=int, default=3, help="checkpoint every N steps")
parser.add_argument("--crash-at", type=int, default=None, help="rank 1 exits during this step, first attempt only")
parser.add_argument("--backend", default="aot_eager", choices=["inductor", "aot_eager"])
args = parser.parse_args()

torch.set_num_threads(1)
fo.init_process_group()  # gloo here; a fresh store namespace per torchrun restart
rank, world = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

torch.manual_seed(0)
model = gpt_small(n_layer=2)
fo.parallelize(model, backend=args.backend)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
resumed = load_latest(args.dir, model, optimizer)
start = resumed[0] if resumed else 0
if rank == 0:
    print(f"attempt {attempt}: starting at step {start}", flush=True)

data = fixed_batches(args.steps, 4 * world, 16, model.cfg.vocab_size)  # batch i belongs to step i
for step in range(start, args.steps):
    x, y = data[step]
    mine = slice(rank * 4, (rank + 1) * 4)
    loss = loss_fn(model(x[mine]), y[mine])
    loss.backward()
    if step == args.crash_at and attempt == 0 and rank == 1:
        os._exit(13)  # a rank dies mid-step: no cleanup, as in a real crash
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = loss.detach()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    if rank == 0 and args.loss_log:
        with open(args.loss_log, "a") as f:
            f.write(json.dumps({"step": step, "loss": loss.item(), "attempt": attempt}) + "\n")
    if (step + 1) % args.every == 0:
        save(args.dir, model, optimizer, step=step + 1)
dist.destroy_process_group()
