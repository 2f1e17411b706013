"""fsdp-overlap demo: a small GPT on 2 CPU ranks (gloo), sharded FSDP2-style, compiled
with the overlap passes, trained for a few steps; rank 0 prints the schedule summary.

    make demo                                     # sets everything up, then runs this
    torchrun --standalone --nproc-per-node 2 examples/gpt_demo.py [--backend aot_eager] [--report-json r.json]
    python examples/gpt_demo.py                   # re-launches itself under torchrun
"""

import argparse
import os
import sys
import time

# ---- settings (nanoGPT style: edit here) -------------------------------------------
STEPS = 8
BATCH_PER_RANK = 4
SEQ = 32
LR = 3e-3
CONFIG = {
    "bucket_plans": "auto",  # one bucket per block, + embeddings, + norm/head
    "manual_bucketing": True,
    "overlap_grad_reduce": True,
    "reshard_after_forward": True,
}
# --------------------------------------------------------------------------------------

if "RANK" not in os.environ:  # started without torchrun: start 2 ranks of ourselves
    from torch.distributed.run import main as torchrun

    torchrun(["--standalone", "--nproc-per-node", "2", __file__, *sys.argv[1:]])
    sys.exit(0)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fsdp_overlap_plugin as fo  # noqa: E402
from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
parser.add_argument("--report-json", help="write the schedule report here (read it with `fsdp-overlap explain`)")
args = parser.parse_args()

torch.set_num_threads(1)  # two ranks share a small machine
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

torch.manual_seed(0)  # same initial weights on every rank; each keeps its own shard
model = gpt_small(n_layer=4, d_model=64, block_size=SEQ)
fo.parallelize(model, CONFIG, backend=args.backend)
optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

data = fixed_batches(2, BATCH_PER_RANK * world, SEQ, model.cfg.vocab_size)  # a tiny dataset
for step in range(STEPS):
    x, y = data[step % len(data)]
    start = time.perf_counter()
    mine = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    loss = loss_fn(model(x[mine]), y[mine])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
    if rank == 0:
        note = " (includes compilation)" if step == 0 else ""
        print(f"step {step}: loss {loss.item():.4f}  {time.perf_counter() - start:.2f} s{note}", flush=True)

if rank == 0:
    report = fo.schedule_report(model)
    print()
    print(fo.format_report(report))
    if args.report_json:
        import json

        with open(args.report_json, "w") as f:
            json.dump(report, f)
        print(f"report written to {args.report_json}")
dist.destroy_process_group()
