"""Step time at a dynamic sequence length against the same length compiled static (issue 45).

With the default ``dynamic: auto`` a model compiles its first call's sizes as constants
and, at the first call with another sequence length, once more with the length symbolic;
that second graph then serves every length. This measures what the symbolic graph costs
per step: two gloo ranks on loopback (one thread each), per model, two modes side by side
in one run, timed at one length L, step by step in turn:

    static    ``dynamic: false``, warmed at L only: one compile, a graph for L alone
    dynamic   ``dynamic: auto`` (the default config), warmed at two other lengths (by
              default L/2 and 3L/4: the static graph is compiled for the first, the
              symbolic one at the second), then at L: the graph that runs at L is the
              symbolic one. Checked: 2 compiles after warm-up, none more at L or after.

Warm-up steps run forward and backward but no optimizer step, so both modes enter the
timed steps with the same parameters and see the same batches at L: their losses must
agree (the table's last column; kernels generated for a symbolic length may sum in
another order, so differences of order 1e-6 are expected). The timed steps alternate the
modes step by step (each mode first in turn), each step starting and ending at a
barrier, so that load from outside hits both alike; besides the ratio of the medians the
summary gives the median of the step-by-step ratios and the ratio of the fastest steps. Compile time per mode: the wall time of each step that compiled
(compile plus that step), and inductor's cache hits (a fresh ``TORCHINDUCTOR_CACHE_DIR``
per run unless ``--warm-cache`` or ``--quick``, so every compile is a cold one: on 2
vCPUs each costs 40-60 s with both ranks compiling at once).

Models (``--models``, comma-separated): ``gpt`` (step_time.py's GPT small: d=256, 4
blocks, vocab 512, seq 128, 3.4M parameters), ``hf-llama`` (step_time.py's transformers
Llama small, seq 128), ``gpt-tiny`` (``fsdp_overlap_plugin.models.gpt_small``: d=64, 4
blocks, vocab 256, seq 64, 0.2M parameters; what ``--quick`` runs).

    python benchmarks/dynamic_lengths.py                       # gpt and hf-llama, L = 128
    python benchmarks/dynamic_lengths.py --quick               # gpt-tiny, fewer steps, warm cache: < 2 min
                                                               # (the first run compiles cold: ~3 min)
    python benchmarks/dynamic_lengths.py --models gpt --length 96 --warm-lengths 48,64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from _harness.launch import run_workers
from _harness.models import BATCH_PER_RANK, LR, build_model, gpt_preset, loss_for, parse_lengths, vocab_and_seq
from _harness.tables import time_stats

MODELS = ("gpt", "hf-llama", "gpt-tiny")
MODES = ("static", "dynamic")
CONFIGS = {"static": {"dynamic": False}, "dynamic": {}}  # {} = the defaults: dynamic: auto
TINY = {"vocab": 256, "seq": 64}  # gpt_small()'s GPTConfig defaults


# =============================================================================== parent
def default_warm_lengths(length: int) -> list[int]:
    """Two lengths other than ``length``: about its half and three quarters."""
    first, second = max(2, length // 2), max(3, (3 * length) // 4)
    if second in (first, length):
        second = first + 1
    return [first, second]


def launch(worker_args: list[str], out_dir: Path, timeout: float, env_extra: dict) -> list[dict]:
    """Two ranks on loopback; their JSON back, or SystemExit with the logs' tails."""
    return run_workers(__file__, worker_args, out_dir, timeout, False, env_extra, "dynamic_lengths")


def summarize(results: list[dict]) -> dict:
    """Per model: each mode's median step time (over both ranks' timed steps: rank 0's, as
    the barriers make them equal), the ratio dynamic / static, compile counts and time,
    and the largest loss difference between the modes (rank 0; same batches)."""
    out = {}
    for name, r0 in results[0]["models"].items():
        rows = {}
        for mode in MODES:
            data = r0["modes"][mode]
            rows[mode] = {
                **time_stats(data["times"]),
                "rep_medians_s": [statistics.median(t) for t in data["rep_times"]],
                "compiles": [res["models"][name]["modes"][mode]["compiles"] for res in results],
                "compile_steps_s": data["compile_steps_s"],
                "compile_s": sum(data["compile_steps_s"]),
                "cache": data.get("cache"),
                "recompiled_at_length": [res["models"][name]["modes"][mode]["recompiled_at_length"] for res in results],
                "losses": data["losses"],
            }
        static, dynamic = rows["static"], rows["dynamic"]
        pairs = list(zip(static["losses"], dynamic["losses"]))
        out[name] = {
            "length": r0["length"],
            "warm_lengths": r0["warm_lengths"],
            "rows": rows,
            "ratio": dynamic["median_s"] / static["median_s"],
            "rep_ratios": [d / s for s, d in zip(static["rep_medians_s"], dynamic["rep_medians_s"])],
            # each timed step of one mode next to the other's step on the same batch, run just
            # before or after it: the median of those ratios, and the ratio of the fastest steps
            "pair_ratio": statistics.median(
                d / s for s, d in zip(r0["modes"]["static"]["times"], r0["modes"]["dynamic"]["times"])
            ),
            "min_ratio": dynamic["min_s"] / static["min_s"],
            "max_loss_diff": max(abs(a - b) for a, b in pairs) if pairs else None,
        }
    return out


def print_table(summary: dict) -> None:
    print(
        f"{'model':<9} {'mode':<8} {'L':>4} {'median s':>9} {'min s':>7} {'max s':>7} {'x static':>8}"
        f"  {'compiles r0/r1':>14}  compile steps s (FX cache hits/graphs) max |loss diff|"
    )
    for name, model in summary.items():
        for mode in MODES:
            row = model["rows"][mode]
            ratio = f"{row['median_s'] / model['rows']['static']['median_s']:.3f}"
            compiles = "/".join(str(c) for c in row["compiles"])
            steps = ", ".join(f"{s:.1f}" for s in row["compile_steps_s"])
            hits = ", ".join(f"{c['fx_graph']['hit']}/{sum(c['fx_graph'].values())}" for c in row["cache"] or []) or "-"
            diff = f"{model['max_loss_diff']:.1e}" if mode == "dynamic" and model["max_loss_diff"] is not None else ""
            print(
                f"{name:<9} {mode:<8} {model['length']:>4} {row['median_s']:>9.4f} {row['min_s']:>7.4f}"
                f" {row['max_s']:>7.4f} {ratio:>8}  {compiles:>14}  {steps + f' ({hits})':<34} {diff}"
            )
        reps = ", ".join(f"{r:.3f}" for r in model["rep_ratios"])
        warm = ",".join(str(x) for x in model["warm_lengths"])
        print(
            f"  {name}: dynamic / static = {model['ratio']:.3f} (medians; per repetition: {reps}; median of the"
            f" step-by-step ratios {model['pair_ratio']:.3f}; fastest steps {model['min_ratio']:.3f});"
            f" dynamic warmed at {warm}, then {model['length']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt,hf-llama", help="comma-separated subset of: " + ", ".join(MODELS))
    parser.add_argument("--length", type=int, help="the timed length L (default: the model's seq, 128; gpt-tiny 64)")
    parser.add_argument(
        "--warm-lengths", help="the dynamic mode's two warm-up lengths, other than L (default L/2 and 3L/4)"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode per repetition")
    parser.add_argument("--reps", type=int, default=5, help="repetitions, the modes alternating within each")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="gpt-tiny, 3 repetitions x 5 steps, inductor's own cache (< 2 minutes once it holds the graphs)",
    )
    parser.add_argument("--warm-cache", action="store_true", help="keep inductor's cache (default: a fresh one)")
    parser.add_argument("--json", help="write the summary and raw step times here")
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.reps, args.steps = 3, 5
        if args.models == parser.get_default("models"):
            args.models = "gpt-tiny"
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; valid: {', '.join(MODELS)}")
    warm = parse_lengths(args.warm_lengths) if args.warm_lengths else None
    if warm is not None and (len(warm) != 2 or len(set(warm)) != 2 or args.length in warm):
        parser.error("--warm-lengths: two different lengths, neither of them --length")
    worker_args = ["--models", ",".join(models), "--steps", str(args.steps), "--reps", str(args.reps)]
    if args.length:
        worker_args += ["--length", str(args.length)]
    if warm:
        worker_args += ["--warm-lengths", ",".join(map(str, warm))]
    header = (
        f"dynamic_lengths: 2 gloo ranks on loopback, one thread each, batch {BATCH_PER_RANK}/rank, SGD,"
        f" inductor, default config; static (dynamic: false, warmed at L) vs dynamic (dynamic: auto, warmed at two"
        f" other lengths, then L); {args.reps} x {args.steps} timed steps per mode, alternating"
    )
    print(header, flush=True)
    out_dir = Path(tempfile.mkdtemp(prefix="fsdp_overlap_dyn_"))
    fresh = not (args.warm_cache or args.quick)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(out_dir / "inductor_cache")} if fresh else {}
    start = time.time()
    results = launch(worker_args, out_dir, args.timeout, env)
    summary = summarize(results)
    print()
    print(f"results ({time.time() - start:.0f} s in all; medians of the timed steps, rank 0):")
    print_table(summary)
    if args.json:
        payload = {"header": header, "summary": summary, "raw": results}
        Path(args.json).write_text(json.dumps(payload, indent=1))
        print(f"json written to {args.json}")


# =============================================================================== worker
def build(name: str):
    """``(model, loss(x, y), vocab, seq)``, seeded: the same on every rank and in every mode."""
    if name == "gpt-tiny":
        model = gpt_preset("small", seed=0)
        return model, loss_for("gpt", model), TINY["vocab"], TINY["seq"]
    model = build_model(name, "small")
    vocab, seq = vocab_and_seq(name, "small")
    return model, loss_for(name, model), vocab, seq


class Runner:
    """One mode's model: a warm-up step (forward, backward, no update) or a training step,
    on this rank's half of the batch, with the compiles each step caused."""

    def __init__(self, name: str, mode: str, world: int):
        import torch

        import fsdp_overlap_plugin as fo
        from fsdp_overlap_plugin.runtime.state import get_state

        self.model, self.loss, self.vocab, self.seq = build(name)
        fo.parallelize(self.model, CONFIGS[mode])
        self.state = get_state(self.model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.world = world

    def step(self, batch, update: bool = True) -> tuple[float, int]:
        """``(loss, compiles this step caused)``."""
        import torch.distributed as dist

        rank = dist.get_rank()
        x, y = (t[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK] for t in batch)
        before = self.state.dynamo_graphs
        loss = self.loss(x, y)
        loss.backward()
        if update:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item(), self.state.dynamo_graphs - before


def batches(length: int, count: int, vocab: int, world: int, seed: int):
    from fsdp_overlap_plugin.models import fixed_batches

    return fixed_batches(count, BATCH_PER_RANK * world, length, vocab, seed=seed)


def run_model(name: str, args: argparse.Namespace, world: int, log) -> dict:
    import torch.distributed as dist

    _, _, vocab, seq = build(name)
    length = args.length or seq
    warm = parse_lengths(args.warm_lengths) if args.warm_lengths else default_warm_lengths(length)
    if length > seq or max(warm) > seq:
        raise SystemExit(f"{name}: lengths up to {seq} (its positions)")
    timed = batches(length, args.reps * args.steps, vocab, world, seed=11)
    out: dict = {"length": length, "warm_lengths": warm, "modes": {}}
    runners: dict[str, Runner] = {}
    # the dynamic mode first: Dynamo's automatic dynamic shapes remember, per code object
    # (both modes run the same forward), the sizes seen; warmed after a static model at L,
    # the dynamic model would compile its first length symbolic already
    for mode in ("dynamic", "static"):
        runner = runners[mode] = Runner(name, mode, world)
        lengths = [*warm, length, length] if mode == "dynamic" else [length, length]
        compiles, compile_steps, recompiled_at_length = [], [], False
        for k, n in enumerate(lengths):
            batch = batches(n, 1, vocab, world, seed=100 + k)[0]
            dist.barrier()
            t = time.perf_counter()
            _, graphs = runner.step(batch, update=False)
            wall = time.perf_counter() - t
            compiles.append(graphs)
            if graphs:
                compile_steps.append(wall)
                recompiled_at_length |= n == length and mode == "dynamic"
        out["modes"][mode] = {
            "warmup_lengths": lengths,
            "warmup_compiles": compiles,
            "compile_steps_s": compile_steps,
            "cache": [
                {"graph": c["graph"], "aot_autograd": c["aot_autograd"], "fx_graph": c["fx_graph"]}
                for c in runner.state.compile_cache
            ],
            "recompiled_at_length": recompiled_at_length,
            "times": [],
            "rep_times": [],
            "losses": [],
        }
        log(f"[{name} {mode}] warm-up lengths {lengths}: compiles {compiles}, compile steps {compile_steps} s")
    for rep in range(args.reps):
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for i in range(rep * args.steps, (rep + 1) * args.steps):
            for mode in MODES if i % 2 == 0 else MODES[::-1]:  # step by step, each mode first in turn
                dist.barrier()
                t = time.perf_counter()
                loss, graphs = runners[mode].step(timed[i])
                dist.barrier()
                times[mode].append(time.perf_counter() - t)
                out["modes"][mode]["losses"].append(loss)
                if graphs:
                    out["modes"][mode]["recompiled_at_length"] = True
        for mode in MODES:
            out["modes"][mode]["times"] += times[mode]
            out["modes"][mode]["rep_times"].append(times[mode])
        medians = " ".join(f"{mode} {statistics.median(times[mode]):.4f}" for mode in MODES)
        log(f"[{name}] rep {rep + 1}/{args.reps} median s/step: {medians}")
    for mode, runner in runners.items():
        out["modes"][mode]["compiles"] = runner.state.dynamo_graphs
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    world = dist.get_world_size()

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    out = {"rank": rank, "models": {}}
    for name in args.models.split(","):
        out["models"][name] = run_model(name, args, world, log)
    Path(args.out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
