"""Activation checkpointing: what each policy saves for backward, and what it costs.

Two gloo ranks on loopback (one thread each) train a model in every mode below; for
each, per rank: the tensors the forward saves for backward (count and bytes, measured
with ``fsdp_overlap_plugin.runtime.memory.SavedActivations``: the peak of saved-activation
memory, since backward releases them) and the median step time. Modes are timed
interleaved over repetitions, so drift hits them alike; ratios are against ``off``
measured in the same run.

    compiled off            parallelize() defaults (inductor, passes on), no checkpointing
    compiled full           activation_checkpointing: every block, policy full
    compiled matmuls_saved  every block, policy matmuls_saved
    eager-fsdp2 off         compile: false (fully_shard per bucket)
    eager-fsdp2 full        compile: false, torch.utils.checkpoint per block

Models: the repo GPT (``--model gpt``) and a transformers ``LlamaForCausalLM`` from a
config (``--model hf-llama``; needs transformers), or both (the default).

    python benchmarks/activation_memory.py               # both models, ~10 minutes on 2 cores
    python benchmarks/activation_memory.py --quick       # smaller models, fewer steps
    python benchmarks/activation_memory.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODES = {  # name -> OverlapConfig overrides (checkpointing set per model)
    "compiled off": {},
    "compiled full": {"ac": "full"},
    "compiled matmuls_saved": {"ac": "matmuls_saved"},
    "eager-fsdp2 off": {"compile": False},
    "eager-fsdp2 full": {"compile": False, "ac": "full"},
}
SIZES = {  # (layers, width, heads, seq, per-rank batch, vocab)
    "full": (8, 256, 8, 128, 4, 1024),
    "quick": (4, 128, 4, 64, 2, 512),
}


def build(model: str, size: tuple):
    import torch
    from _harness.models import build_gpt, build_llama, llama_config

    layers, width, heads, seq, _, vocab = size
    torch.manual_seed(0)
    if model == "gpt":
        return build_gpt(width, layers, heads, vocab, seq), ["blocks.*"]
    config = llama_config(width, layers, heads, heads // 2, width * 8 // 3, vocab, seq)
    return build_llama(config, direct=True), ["model.layers.*"]


def step_fn(model_name: str, model, batch):
    from fsdp_overlap_plugin.models import loss_fn

    x, y = batch
    if model_name == "gpt":
        return lambda: loss_fn(model(x), y)
    return lambda: model(input_ids=x, labels=x).loss


def worker(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import fsdp_overlap_plugin as fo
    from fsdp_overlap_plugin.runtime.memory import SavedActivations

    size = SIZES["quick" if args.quick else "full"]
    _, _, _, seq, batch, vocab = size
    g = torch.Generator().manual_seed(1234 + rank)
    data = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    batch_xy = (data[:, :-1], data[:, 1:])
    results = {}
    for model_name in args.models:
        runners = {}
        for mode, spec in MODES.items():
            torch._dynamo.reset()
            model, blocks = build(model_name, size)
            config = {k: v for k, v in spec.items() if k != "ac"}
            if "ac" in spec:
                config.update(activation_checkpointing=blocks, activation_checkpointing_policy=spec["ac"])
            fo.parallelize(model, **config)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            step = step_fn(model_name, model, batch_xy)
            start = time.perf_counter()
            for _ in range(2):  # compile, then one warm step
                step().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            first = time.perf_counter() - start
            with SavedActivations(model) as saved:
                loss = step()
            loss.backward()
            opt.zero_grad(set_to_none=True)
            runners[mode] = (model, opt, step)
            results[(model_name, mode)] = {
                "saved_count": saved.count,
                "saved_bytes": saved.bytes,
                "times": [],
                "warmup_s": round(first, 2),
                "loss": float(loss.detach()),
            }
        for _ in range(args.reps):
            for mode, (_model, opt, step) in runners.items():
                times = results[(model_name, mode)]["times"]
                for _ in range(args.steps):
                    dist.barrier()
                    start = time.perf_counter()
                    step().backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    dist.barrier()
                    times.append(time.perf_counter() - start)
    Path(out).write_text(json.dumps({f"{m}|{mode}": r for (m, mode), r in results.items()}))
    dist.destroy_process_group()


def summarize(per_rank: list[dict]) -> list[dict]:
    rows = []
    for key in per_rank[0]:
        model, mode = key.split("|")
        r0 = per_rank[0][key]
        times = [t for r in per_rank for t in r[key]["times"]]
        rows.append(
            {
                "model": model,
                "mode": mode,
                "saved_count": max(r[key]["saved_count"] for r in per_rank),
                "saved_mib": max(r[key]["saved_bytes"] for r in per_rank) / 2**20,
                "step_ms": statistics.median(times) * 1e3,
                "warmup_s": r0["warmup_s"],
            }
        )
    for row in rows:
        off = next(r for r in rows if r["model"] == row["model"] and r["mode"] == row["mode"].split()[0] + " off")
        row["saved_vs_off"] = row["saved_mib"] / off["saved_mib"]
        row["time_vs_off"] = row["step_ms"] / off["step_ms"]
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'model':<9} {'mode':<23} {'saved':>6} {'MiB/rank':>9} {'vs off':>7} {'step ms':>8} {'vs off':>7}")
    for r in rows:
        print(
            f"{r['model']:<9} {r['mode']:<23} {r['saved_count']:>6} {r['saved_mib']:>9.2f} "
            f"{r['saved_vs_off']:>6.2f}x {r['step_ms']:>8.1f} {r['time_vs_off']:>6.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["gpt", "hf-llama", "both"], default="both")
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per mode and repetition")
    parser.add_argument("--reps", type=int, default=None, help="interleaved repetitions")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    args.models = ["gpt", "hf-llama"] if args.model == "both" else [args.model]
    args.steps = args.steps or (2 if args.quick else 5)
    args.reps = args.reps or (2 if args.quick else 3)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/store"
        outs = [f"{tmp}/rank{r}.json" for r in range(2)]
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        procs = [mp.get_context("spawn").Process(target=worker, args=(r, 2, init, args, outs[r])) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            sys.exit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        rows = summarize([json.loads(Path(o).read_text()) for o in outs])
    size = SIZES["quick" if args.quick else "full"]
    print(f"2 gloo ranks on loopback; layers {size[0]}, width {size[1]}, seq {size[3]}, batch {size[4]} per rank")
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
