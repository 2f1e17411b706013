"""Peak tensor memory of one training step per mode, counted exactly: a fake process group.

``step_time.py --memory`` measures what real gloo ranks hold (resident memory), which
includes gloo's staging buffers and moves by about +-1 MiB between runs; torch.profiler's
allocation events miss the frees gloo does on its worker threads. Here one process is
rank 0 of a fake process group of world size 2 (collectives return at once, on this
thread, ``torch.testing._internal.distributed.fake_pg``), so every allocation and free
of the step is an event on the profiled thread and the running sum is exact: the same
number on every run. What it cannot show is how long a collective is in flight on a real
link (the fake one finishes at once; the waits' positions in the graph still decide
which buffers meet).

Per mode (``step_time.py``'s modes, built the same way: its models, sizes and configs):
three warm-up steps (forward, backward, SGD step), then one profiled step; peak = the
most bytes allocated during that step and not yet freed (parameter shards and what the
step started with are not counted). With ``--top N``, the largest allocations alive at the
peak and the op that made them.

    python benchmarks/alloc_peak.py                                   # gpt small, batch 8
    python benchmarks/alloc_peak.py --size large --batch 1            # parameters > activations
    python benchmarks/alloc_peak.py --modes fsdp2-eager,both --top 10 --json out.json
    python benchmarks/alloc_peak.py --size large --batch 1 --set max_prefetch_bytes=14MiB
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

DEFAULT_MODES = ("fsdp2-eager", "compiled", "bucketing", "grad-overlap", "both+native", "both")


def child(mode: str, model: str, size: str, batch: int, top: int, overrides: dict | None = None) -> dict:
    """One mode in this (fresh) process: the step's peak and what is alive at it."""
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _harness.models import vocab_and_seq
    from _harness.runners import make_runner

    from fsdp_overlap_plugin.models import fixed_batches

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    runner = make_runner(mode, model, size, {}, 0.0, 2, overrides=overrides)
    vocab, seq = vocab_and_seq(model, size)
    x, y = fixed_batches(1, batch, seq, vocab, seed=7)[0]
    opt = torch.optim.SGD(runner.model.parameters(), lr=0.01)

    def step() -> None:
        runner.loss(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    dist.destroy_process_group()
    events: list[tuple[int, int, int, str]] = []  # (time, address, +/-bytes, the op that allocated)

    def walk(node, parents: list[str]) -> None:
        if node.name == "[memory]":
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.ptr, fields.alloc_size, " > ".join(parents[-2:])))
        for child_node in node.children:
            walk(child_node, parents + [node.name])

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, [])
    events.sort(key=lambda e: e[0])
    alive: dict[int, tuple[int, str]] = {}
    running = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for _, ptr, nbytes, site in events:
        if nbytes > 0:
            alive[ptr] = (nbytes, site)
        elif alive.pop(ptr, None) is None:
            continue  # allocated before the profiled step: not counted either way
        running += nbytes
        if running > peak:
            peak, at_peak = running, dict(alive)
    largest = sorted(at_peak.values(), key=lambda a: -a[0])[:top]
    label = mode + "".join(f" {k}={v}" for k, v in (overrides or {}).items() if mode != "fsdp2-eager")
    return {
        "mode": label,
        "peak_mib": peak / 2**20,
        "end_mib": running / 2**20,
        "largest": [{"mib": n / 2**20, "site": site} for n, site in largest],
    }


def _setting(item: str) -> tuple[str, object]:
    """``KEY=VALUE`` from ``--set``: the value as JSON where it parses (2, true, null),
    else the string (``14MiB``: the config reads byte strings)."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set {item!r}: expected KEY=VALUE, e.g. max_prefetch_bytes=14MiB")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def run_fresh(mode: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--model", args.model, "--size", args.size]
    cmd += ["--batch", str(args.batch), "--top", str(args.top)]
    for item in args.set:
        cmd += ["--set", item]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt", choices=("gpt", "hf-llama"))
    parser.add_argument("--size", default="small", help="step_time.py's sizes: small, medium, large")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (step_time.py uses 8 per rank)")
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated step_time.py modes")
    parser.add_argument("--top", type=int, default=0, help="list the N largest allocations alive at the peak")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config key on top of each compiled mode's own, e.g. max_prefetch_bytes=14MiB (repeatable)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    overrides = dict(_setting(item) for item in args.set)
    if args.child:
        print(json.dumps(child(args.child, args.model, args.size, args.batch, args.top, overrides)))
        return
    rows = [run_fresh(mode.strip(), args) for mode in args.modes.split(",") if mode.strip()]
    eager = next((r["peak_mib"] for r in rows if r["mode"] == "fsdp2-eager"), None)
    settings = "".join(f"; {k}={v} on the compiled modes" for k, v in overrides.items())
    print(
        f"peak tensor memory of one step, MiB (rank 0 of a fake world of 2, {args.model} {args.size}, "
        f"batch {args.batch}; every allocation and free counted{settings})"
    )
    for r in rows:
        ratio = f"{r['peak_mib'] / eager:8.2f}x eager" if eager else ""
        print(f"{r['mode']:>14} {r['peak_mib']:9.2f} {ratio}")
        for a in r["largest"]:
            print(f"{'':>16}{a['mib']:8.3f}  {a['site']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
