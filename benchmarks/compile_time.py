"""Compile time with the passes off and on: what the passes add to the first step.

Each configuration runs in its own fresh process with its own empty
``TORCHINDUCTOR_CACHE_DIR`` (no FX graph, AOT autograd or kernel cache can hide compile
work), on one rank of a fake process group of world size 2 (collectives return at once,
so the step measures compilation and compute, not communication), one thread, backend
inductor. Passes off: ``manual_bucketing`` and ``overlap_grad_reduce`` false (the joint
reshard pass still runs, as it does in production); on: both true (the defaults).

Measured per configuration:

    first step s    forward + backward of the first step: Dynamo tracing, AOT autograd,
                    inductor (forward and backward graphs), then the computation
    second step s   the same step again, compiled (what the first step costs beyond
                    compiling)
    compile s       time inside the backend Dynamo calls (AOT autograd and inductor for
                    both graphs; the backward is compiled eagerly)
    passes s        time inside ``compile.run_passes`` and ``compile.run_reshard``
                    (timed by monkeypatching them from here), including the wiring's
                    recording, recompiling and linting
    share           passes s / compile s

``--warm`` runs each configuration a second time, in a new process against the same cache
directory: what a user's second run spends on its first step when every graph comes from
the compile cache (the passes do not run then). Its table splits that first step:

    first step s    as above, wall
    cpu s           the process's own CPU time in it; children cpu s: its subprocesses'
                    (inductor's per-process vector-ISA probes and precompiled-header hash)
    dynamo s        Dynamo tracing the forward (``compile_times()``: bytecode_tracing)
    load s          AOT autograd's cache loading the compiled graphs (AOTAutogradCache.inductor_load)
    cache           AOT autograd cache / FX graph cache hits

Models: ``gpt`` (the repo's GPT, ``gpt_bench``: 4 blocks of width 256, ~3M parameters;
``--quick``: ``gpt_small``), ``llama`` (a transformers ``LlamaForCausalLM`` of ~110M
parameters built from a ``LlamaConfig``: hidden 768, 12 layers, 12 heads, MLP 2048,
vocabulary 16000, untied head; a short sequence, since one CPU step of 100M is slow).

    python benchmarks/compile_time.py                  # gpt and llama, passes off and on
    python benchmarks/compile_time.py --quick          # gpt_small only (about a minute)
    python benchmarks/compile_time.py --models llama --json out.json
    python benchmarks/compile_time.py --quick --warm   # and each again from the compile cache
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

MODELS = ("gpt", "llama")
# (batch, sequence) of the timed step
SHAPES = {"gpt": (2, 64), "gpt-quick": (2, 16), "llama": (1, 32)}


def _build(model: str, quick: bool):
    import torch

    torch.manual_seed(0)
    if model == "gpt":
        from _harness.models import gpt_preset

        from fsdp_overlap_plugin.models import fixed_batches, loss_fn

        net = gpt_preset("small" if quick else "bench")
        batch, seq = SHAPES["gpt-quick" if quick else "gpt"]
        x, y = fixed_batches(1, batch, seq, net.cfg.vocab_size)[0]
        return net, lambda: loss_fn(net(x), y)
    from _harness.models import build_llama, llama_config

    # hidden 768, 12 layers of 12 heads (no grouping), MLP 2048, vocabulary 16000, untied
    config = llama_config(768, 12, 12, 12, 2048, 16000, 256)
    net = build_llama(config, direct=True)
    batch, seq = SHAPES["llama"]
    x = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    return net, lambda: net(input_ids=x, labels=x).loss


def _cpu() -> tuple[float, float]:
    """CPU seconds so far (user + system): this process's, and its finished children's."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def child(model: str, passes: bool, quick: bool) -> dict:
    """One configuration, in this (fresh) process: the measurements as a dict."""
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import compile_times, counters
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    import fsdp_overlap_plugin as fo
    import fsdp_overlap_plugin.compile.backends as fo_compile

    spent = {"passes": 0.0, "compile": 0.0, "post_grad_graphs": 0, "joint_graphs": 0}

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent["passes"] += time.perf_counter() - start
                spent[key] += 1

        return wrapper

    # looked up by name when the backend is built (compile_model), so patch before parallelize
    fo_compile.run_passes = timed(fo_compile.run_passes, "post_grad_graphs")
    fo_compile.run_reshard = timed(fo_compile.run_reshard, "joint_graphs")
    inner_backend = fo_compile._inner_backend

    def timed_inner(state):
        inner = inner_backend(state)

        def compile_graph(gm, example_inputs):
            start = time.perf_counter()
            try:
                return inner(gm, example_inputs)
            finally:
                spent["compile"] += time.perf_counter() - start

        return compile_graph

    fo_compile._inner_backend = timed_inner
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    net, step = _build(model, quick)
    params = sum(p.numel() for p in net.parameters())
    fo.parallelize(net, backend="inductor", manual_bucketing=passes, overlap_grad_reduce=passes)
    times = []
    cpu_before = _cpu()
    for _ in range(2):
        start = time.perf_counter()
        step().backward()
        times.append(time.perf_counter() - start)
        if len(times) == 1:
            cpu_first = [after - before for after, before in zip(_cpu(), cpu_before)]
    dist.destroy_process_group()
    phases = {name: float(value) for name, value in zip(*compile_times(repr="csv", aggregate=True))}
    return {
        "model": model + ("-small" if quick and model == "gpt" else ""),
        "params": params,
        "passes": passes,
        "first_step_s": times[0],
        "second_step_s": times[1],
        "compile_s": spent["compile"],
        "passes_s": spent["passes"],
        "post_grad_graphs": spent["post_grad_graphs"],
        "joint_graphs": spent["joint_graphs"],
        "first_step_cpu_s": cpu_first[0],
        "first_step_children_cpu_s": cpu_first[1],
        "dynamo_s": phases.get("bytecode_tracing", 0.0),
        "cache_load_s": phases.get("AOTAutogradCache.inductor_load", 0.0),
        "aot_cache_hits": counters["aot_autograd"]["autograd_cache_hit"],
        "fx_cache_hits": counters["inductor"]["fxgraph_cache_hit"],
    }


def run_fresh(model: str, passes: bool, quick: bool, warm: bool = False) -> list[dict]:
    """``child`` in a new process with an empty inductor cache directory of its own; with
    ``warm``, then once more in another new process against that cache."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="fsdp-overlap-compile-time-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS="1")
        cmd = [sys.executable, __file__, "--child", model, "--passes", "on" if passes else "off"]
        if quick:
            cmd.append("--quick")
        for run in ("cold", "warm") if warm else ("cold",):
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"{model} passes {'on' if passes else 'off'} failed:\n{out.stderr[-4000:]}")
            rows.append(dict(json.loads(out.stdout.strip().splitlines()[-1]), run=run))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="gpt_small only, smallest sizes")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: gpt, llama")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--warm", action="store_true", help="run each configuration again from the compile cache")
    parser.add_argument("--child", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--passes", choices=("on", "off"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.passes == "on", args.quick)))
        return
    models = ["gpt"] if args.quick else [m.strip() for m in args.models.split(",") if m.strip()]
    rows, warm = [], []
    for model in models:
        for passes in (False, True):
            cold, *again = run_fresh(model, passes, args.quick, args.warm)
            rows.append(cold)
            warm.extend(again)
    print(
        "one rank of a fake process group of world size 2 (collectives return at once), inductor, one thread, "
        "a fresh process and an empty TORCHINDUCTOR_CACHE_DIR per row"
    )
    print(
        f"{'model':>10} {'params':>8} {'passes':>6} {'first step s':>12} {'second step s':>13} {'compile s':>9} "
        f"{'passes s':>8} {'share':>6}"
    )
    for r in rows:
        print(
            f"{r['model']:>10} {r['params'] / 1e6:>7.1f}M {'on' if r['passes'] else 'off':>6} "
            f"{r['first_step_s']:>12.2f} {r['second_step_s']:>13.2f} {r['compile_s']:>9.2f} {r['passes_s']:>8.3f} "
            f"{r['passes_s'] / r['compile_s']:>6.1%}"
        )
    for model in dict.fromkeys(r["model"] for r in rows):
        off = next(r for r in rows if r["model"] == model and not r["passes"])
        on = next(r for r in rows if r["model"] == model and r["passes"])
        print(
            f"{model}: passes on - off: first step {on['first_step_s'] - off['first_step_s']:+.2f} s "
            f"({(on['first_step_s'] - off['first_step_s']) / off['first_step_s']:+.1%}), compile "
            f"{on['compile_s'] - off['compile_s']:+.2f} s ({(on['compile_s'] - off['compile_s']) / off['compile_s']:+.1%}); "
            f"time inside the passes with passes on: {on['passes_s']:.3f} s = {on['passes_s'] / on['compile_s']:.1%} "
            "of compile time"
        )
    if warm:
        _print_warm(rows, warm)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows + warm, f, indent=2)


def _print_warm(cold: list[dict], warm: list[dict]) -> None:
    print()
    print("the same again in a new process against the same cache (a user's second run):")
    print(
        f"{'model':>10} {'passes':>6} {'first step s':>12} {'cpu s':>6} {'children cpu s':>14} {'dynamo s':>8} "
        f"{'load s':>6} {'passes s':>8} {'cache':>16}   cold first step s"
    )
    for r, c in zip(warm, cold):
        print(
            f"{r['model']:>10} {'on' if r['passes'] else 'off':>6} {r['first_step_s']:>12.2f} "
            f"{r['first_step_cpu_s']:>6.2f} {r['first_step_children_cpu_s']:>14.2f} {r['dynamo_s']:>8.2f} "
            f"{r['cache_load_s']:>6.2f} {r['passes_s']:>8.3f} {r['aot_cache_hits']:>3} AOT {r['fx_cache_hits']:>2} FX   "
            f"{c['first_step_s']:.2f}"
        )


if __name__ == "__main__":
    main()
