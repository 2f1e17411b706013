"""The GPU path in one command: CUDA unit tests; a transformers Llama trained with the
plugin's defaults next to torch's own FSDP2 (``fully_shard`` + ``torch.compile``), on one
NCCL rank and on a fake world of 8 ranks with Llama3-8B layer shapes, with a per-kernel
compute profile and inductor's generated code checked for the bucketed collectives in the
planned order; and the Lightning and Accelerate paths run on the GPU.

    python benchmarks/gpu_check.py                  # one CUDA GPU; files go to $OUT or ./gpu_check_out
    python benchmarks/gpu_check.py --dry-run        # anywhere: meta-device models, plan, bytes, commands
    python benchmarks/gpu_check.py --phases gpt     # the ~1B-parameter GPT phases (opt-in, ~4 minutes)
    python benchmarks/gpu_check.py --phases all --budget 600

Phases, each in its own process with its own time limit (a hang or crash is reported and
the next phase still runs; files are rewritten after every phase). The default run, with
the seconds each is expected to take on one H200 or H100 (cold inductor cache; compiling
dominates, a first compile costs ~10 s of process start and imports plus 20-30 s of
Dynamo, AOT autograd and Triton for these 4-8 layer graphs; gpt_1b's 24 layers took 49-58 s):

    matmul     ~12 s  GPU name, versions, and the measured bf16 matmul rate (MFU's denominator)
    tests      ~80 s  pytest -m cuda tests/**/test_*_cuda.py (the unit tests with a CUDA variant;
                      six tests, three inductor compiles of a small GPT)
    hf-1rank   ~70 s  transformers LlamaForCausalLM from a LlamaConfig (8 layers, hidden 2048,
                      0.51B parameters, sdpa), batch 4 x 2048, one NCCL rank, bf16 params / fp32
                      reduce: the plugin's parallelize() defaults, then torch's fully_shard per
                      decoder layer + torch.compile; two compiles (~25 s each), 14 steps each
                      (~0.07 s a step)
    world8     ~75 s  Llama3-8B layer shapes, 4 layers (1.92B parameters), batch 2 x 4096, on a
                      fake process group of 8 ranks on the GPU: the same two variants (two
                      compiles, 14 steps of ~0.15 s each), inductor's generated code of the plugin's
                      step checked for the bucketed collectives in order, and a torch.profiler
                      compute profile of 3 plugin steps (compute_profile.json)
    paths      ~60 s  examples/hf_lightning.py (Trainer, strategy fsdp_overlap, 1 GPU, bf16-mixed)
                      and accelerate launch --config_file configs/overlap.yaml --num_processes 1
                      examples/hf_accelerate.py, 40 steps each of a tiny Llama (the loss must fall):
                      ~30 s each, mostly imports and one small compile
                      (~300 s in all; --budget 345, the issue's bound is 6 minutes)

Opt-in (--phases gpt, or name them; ~250 s together), the ~1B-parameter GPT
(fsdp_overlap_plugin.models.gpt_1b, 1.35B at the default sizes):

    compiled-off  parallelize(), inductor, bf16 params / fp32 reduce, passes off  (~75 s)
    compiled-on   the same with the passes on (bucketing, gradient overlap, order pinning)  (~75 s)
    code-order    a fake process group of --code-world ranks on the GPU: compile with the
                  passes on, run one step, check inductor's generated code  (~40 s)
    eager         compile: false (FSDP2 fully_shard per bucket), the baseline  (~25 s)

Opt-in as well (--phases torch-passes, or all; issue 57), too long for the default budget
beside the five default phases (~297 + ~120 s against --budget 345):

    torch-passes ~120 s  inductor's own distributed passes vs ours, on world8's setup with 2 of
                      Llama3-8B's layers (1.49B parameters), batch 2 x 4096, a fake process group of
                      8 ranks, in one process: our defaults (inductor_overlap off); + simple (torch
                      2.14+, else recorded as absent); our passes off + auto (torch's scheduler and
                      bucketing, native reduce-scatter); our passes off + torch's
                      manual_overlap_bucketing with our plan as inductor's post-grad pass (checked
                      to bucket); our passes off alone (the baseline). Each compiled in turn (~20-30
                      s each, four on torch 2.11), then timed in --pass-rounds rounds taking turns:
                      compile time, median step (compute side only), step peak memory, collectives
                      in the generated code, any error (a setting that fails does not stop the rest)

They left the default run when the Llama phases came (issue 42): on a world of one the
passes have no collectives to act on, so compiled-off and compiled-on compile nearly the
same graph, and hf-1rank now measures the same compile path against torch's own FSDP2;
world8 checks the generated code as code-order does, at 8 ranks and Llama3-8B shapes.

What a single GPU can show: the 1-rank phases run a world of ONE NCCL rank. On a 1-rank
mesh DTensor skips the gather altogether (there is nothing to gather), so those compiled
graphs hold no collectives: they prove that the GPU compile path works and measure its
compute-side cost (step time, tokens/s, MFU, memory), not overlap. World8 and code-order
compile the graph that N ranks would run on a fake process group: its collectives move no
data, so their step times are the compute side only (copy-in/out, casts, kernels) and their
losses mean nothing (the gathered parameters are whatever the buffers held).

Exit status: 0 when every phase ran and every check passed; 1 when a check failed, a
phase failed or ran out of time; 2 for bad arguments or no CUDA GPU (before anything
expensive). Files written to --out: summary.md (the tables and the checks), results.json,
console.log, phases.log (every phase's output), compute_profile.json (world8), paths_*.log
(the two examples' output), code_world8_forward.py / code_world8_backward.py (and
code_forward.py / code_backward.py from code-order: the generated code that was checked).
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if (REPO / "fsdp_overlap_plugin").is_dir() and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run from a checkout without installing the package

from _harness import torch_passes_phase  # noqa: E402
from _harness.code_order import check_generated_code  # noqa: E402
from _harness.gpu_models import (  # noqa: E402
    LLAMA_VARIANTS,
    flops_per_token,
    fully_shard_and_compile,
    llama_config,
    llama_flops_per_token,
    llama_matmul_params,
    llama_param_count,
    llama_shape,
    memory_estimate,
    param_count,
    throughput,
)
from _harness.models import build_llama, gpt_preset  # noqa: E402
from _harness.phases import (  # noqa: E402
    Console,
    PhaseRun,
    init_world_of_one,
    log_tail,
    read_junit,
    result_file,
    run_child,
    stop_current,
)
from _harness.profiling import compute_profile, profiler_rows, schedule_totals, with_matmul_rate  # noqa: E402
from _harness.tables import fmt, format_paths, format_table  # noqa: E402

# The torch range pyproject.toml admits, read from it (the package's one statement of it).
from fsdp_overlap_plugin._version import supported_range, torch_supported  # noqa: E402

PHASES = (
    "matmul",
    "tests",
    "compiled-off",
    "compiled-on",
    "code-order",
    "eager",
    "hf-1rank",
    "world8",
    "torch-passes",
    "paths",
)
DEFAULT_PHASES = ("matmul", "tests", "hf-1rank", "world8", "paths")
# names --phases also takes: a group of phases
PHASE_GROUPS = {
    "default": DEFAULT_PHASES,
    "all": PHASES,
    "gpt": ("matmul", "compiled-off", "compiled-on", "code-order", "eager"),
}
TRAIN_PHASES = ("compiled-off", "compiled-on", "eager")
GPT_PHASES = (*TRAIN_PHASES, "code-order")
LLAMA_PHASES = ("hf-1rank", "world8")
ROW_LABELS = {
    "eager": "eager fully_shard (compile: false)",
    "compiled-off": "compiled, passes off",
    "compiled-on": "compiled, passes on",
}
# Longest each phase may run (seconds), before the overall --budget; --cap PHASE=S changes one.
DEFAULT_CAPS = {
    "matmul": 60,
    "tests": 120,
    "compiled-off": 150,
    "compiled-on": 150,
    "code-order": 120,
    "eager": 90,
    "hf-1rank": 150,
    "world8": 150,
    "torch-passes": 240,
    "paths": 150,
}
# What each phase is expected to take on one H200 or H100 with a cold compile cache (the
# module doc says why); the default run's must fit DEFAULT_BUDGET_S with room to spare.
ESTIMATED_S = {
    "matmul": 12,
    "tests": 80,
    "compiled-off": 75,
    "compiled-on": 75,
    "code-order": 40,
    "eager": 25,
    "hf-1rank": 70,
    "world8": 75,
    "torch-passes": 120,
    "paths": 60,
}
MIN_PHASE_S = 20  # a phase that would get less than this is skipped, not started
DEFAULT_BUDGET_S = 345  # the issue's bound is 6 minutes; leave room for start-up and files

PROFILE_FILE = "compute_profile.json"


# --------------------------------------------------------------------------- arguments
def default_out() -> str:
    """``$OUT`` when set (the GPU machine's folder that comes back), else ./gpu_check_out."""
    return os.environ.get("OUT") or "gpu_check_out"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpu_check.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=None, help="folder for the files (default: $OUT if set, else ./gpu_check_out)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="no GPU: build the model on the meta device, print the plan, bytes and commands",
    )
    m = p.add_argument_group("model (fsdp_overlap_plugin.models.gpt_1b, overridable)")
    m.add_argument("--n-layer", type=int, default=24)
    m.add_argument("--d-model", type=int, default=2048)
    m.add_argument("--n-head", type=int, default=16)
    m.add_argument("--vocab", type=int, default=32768)
    t = p.add_argument_group("training")
    t.add_argument("--batch", type=int, default=8, help="sequences per step")
    t.add_argument("--seq", type=int, default=2048, help="tokens per sequence (also the model's block_size)")
    t.add_argument("--steps", type=int, default=20, help="timed steps per phase")
    t.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one compiles)")
    t.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate")
    t.add_argument("--seed", type=int, default=0)
    c = p.add_argument_group("checks")
    c.add_argument(
        "--loss-rtol", type=float, default=2e-2, help="passes off vs on: largest relative loss difference per step"
    )
    c.add_argument(
        "--eager-rtol", type=float, default=5e-2, help="eager fully_shard vs compiled: the same, looser (other kernels)"
    )
    c.add_argument(
        "--code-layers", type=int, default=4, help="blocks of the code-order model (same width as the main model)"
    )
    c.add_argument("--code-world", type=int, default=2, help="fake ranks the code-order phase compiles for")
    c.add_argument(
        "--llama-rtol",
        type=float,
        default=5e-2,
        help="hf-1rank: the plugin vs torch's fully_shard + compile, largest relative loss difference per step",
    )
    h = p.add_argument_group("transformers Llama (hf-1rank, world8) and the examples (paths)")
    h.add_argument("--llama-steps", type=int, default=12, help="timed steps per variant (after --warmup)")
    h.add_argument("--profile-steps", type=int, default=3, help="world8: plugin steps the profiler records")
    h.add_argument("--path-steps", type=int, default=40, help="paths: training steps of each example")
    h.add_argument(
        "--pass-rounds",
        type=int,
        default=3,
        help="torch-passes: rounds in which the settings take turns; each runs --llama-steps / rounds steps a round",
    )
    r = p.add_argument_group("time")
    r.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for all phases together")
    r.add_argument("--cap", action="append", default=[], metavar="PHASE=SECONDS", help="change one phase's time limit")
    r.add_argument(
        "--phases",
        default="default",
        help=f"comma-separated phases or groups: {', '.join(PHASES)}; "
        + "; ".join(f"{k} = {','.join(v)}" for k, v in PHASE_GROUPS.items()),
    )
    # internal: the parent starts each phase as `gpu_check.py --_phase NAME --_result FILE ...`
    p.add_argument("--_phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    # tests only: run the training phases on CPU (gloo, aot_eager) to exercise the plumbing
    p.add_argument("--_device", default="cuda", choices=("cuda", "cpu"), help=argparse.SUPPRESS)
    # tests only: the tiny Llamas (LLAMA_SHAPES) in hf-1rank and world8, so a CPU runs them in seconds
    p.add_argument("--_size", default="default", choices=("default", "tiny"), help=argparse.SUPPRESS)
    return p


def _suggest(word: str, choices: tuple[str, ...]) -> str:
    from fsdp_overlap_plugin.config.keys import suggest

    return suggest(word, choices)


def validate(args: argparse.Namespace) -> list[str]:
    """Every problem with the arguments, found before anything is built or started."""
    errors = []
    names = ("n_layer", "d_model", "n_head", "vocab", "batch", "seq", "steps", "code_layers", "llama_steps")
    for name in (*names, "profile_steps", "path_steps", "pass_rounds"):
        if getattr(args, name) < 1:
            errors.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 1:
        errors.append(f"--warmup must be >= 1 (the first step compiles and is never timed), got {args.warmup}")
    if args.n_head >= 1 and args.d_model % args.n_head:
        errors.append(f"--d-model {args.d_model} is not divisible by --n-head {args.n_head}")
    if args.code_world < 2:
        errors.append(f"--code-world must be >= 2 (a 1-rank mesh has no collectives to check), got {args.code_world}")
    if args.lr <= 0:
        errors.append(f"--lr must be > 0, got {args.lr}")
    for name in ("loss_rtol", "eager_rtol", "llama_rtol"):
        if not 0 < getattr(args, name) < 1:
            errors.append(f"--{name.replace('_', '-')} must be between 0 and 1, got {getattr(args, name)}")
    if args.budget < MIN_PHASE_S:
        errors.append(f"--budget must be >= {MIN_PHASE_S} s, got {args.budget}")
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    if not phases:
        errors.append(f"--phases is empty; valid: {', '.join(PHASES)}")
    names = (*PHASES, *PHASE_GROUPS)
    for name in phases:
        if name not in names:
            errors.append(
                f"--phases: unknown phase {name!r}.{_suggest(name, names)} Valid: {', '.join(PHASES)}; "
                f"groups: {', '.join(PHASE_GROUPS)}"
            )
    phases = [x for name in phases for x in PHASE_GROUPS.get(name, (name,))]
    args.phase_list = [x for x in PHASES if x in phases]  # always run in the documented order
    args.caps = dict(DEFAULT_CAPS)
    for item in args.cap:
        name, sep, value = item.partition("=")
        if not sep or name not in PHASES:
            errors.append(
                f"--cap {item!r}: expected PHASE=SECONDS with PHASE one of {', '.join(PHASES)}.{_suggest(name, PHASES)}"
            )
            continue
        try:
            args.caps[name] = float(value)
        except ValueError:
            errors.append(f"--cap {item!r}: {value!r} is not a number of seconds")
            continue
        if args.caps[name] < MIN_PHASE_S:
            errors.append(f"--cap {item!r}: a phase needs at least {MIN_PHASE_S} s")
    if args._phase is not None and args._phase not in PHASES:
        errors.append(f"--_phase: unknown phase {args._phase!r}")
    return errors


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    errors = validate(args)
    if errors:
        parser.error("\n  " + "\n  ".join(errors))
    args.out = args.out or default_out()
    return args


def model_kwargs(args: argparse.Namespace, n_layer: int | None = None) -> dict[str, int]:
    """Keyword overrides for ``gpt_1b`` (block_size is the sequence length)."""
    return {
        "n_layer": args.n_layer if n_layer is None else n_layer,
        "d_model": args.d_model,
        "n_head": args.n_head,
        "vocab_size": args.vocab,
        "block_size": args.seq,
    }


def variant_config(phase: str) -> dict[str, Any]:
    """The OverlapConfig of each training phase: bf16 params, fp32 reduce, auto plan."""
    base = {"bucket_plans": "auto", "param_dtype": "bf16", "reduce_dtype": "fp32", "backend": "inductor"}
    if phase == "eager":
        return {**base, "compile": False}
    if phase == "compiled-off":
        return {**base, "manual_bucketing": False, "overlap_grad_reduce": False, "separate_gather_group": False}
    if phase == "compiled-on":
        return dict(base)  # passes on; separate gather group: the nccl default (on)
    if phase == "code-order":
        # as compiled-on on NCCL, spelt out so a CPU run (gloo default: off) checks the same
        return {**base, "separate_gather_group": True}
    raise ValueError(f"no training config for phase {phase!r}")


# --------------------------------------------------------------------------- arithmetic


def compare_losses(a: list[float], b: list[float], rtol: float) -> dict[str, Any]:
    """Step-by-step relative difference of two loss curves; ``ok`` when every step is
    within ``rtol``, both are finite, and they have the same length."""
    if not a or len(a) != len(b):
        return {"ok": False, "max_rel": None, "worst_step": None, "why": f"{len(a)} vs {len(b)} losses"}
    if not all(math.isfinite(x) for x in a + b):
        return {"ok": False, "max_rel": None, "worst_step": None, "why": "a loss is not finite"}
    rel = [abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)]
    worst = max(range(len(rel)), key=rel.__getitem__)
    return {"ok": rel[worst] <= rtol, "max_rel": rel[worst], "worst_step": worst, "why": ""}


def loss_fell(losses: list[float]) -> bool:
    """Finite, and the mean of the last quarter of the steps below the mean of the first
    quarter (at least one step each): a per-batch loss is noisy, a trend is not."""
    if len(losses) < 2 or not all(math.isfinite(x) for x in losses):
        return False
    k = max(1, len(losses) // 4)
    return statistics.fmean(losses[-k:]) < statistics.fmean(losses[:k])


# --------------------------------------------------------------------------- Llama arithmetic


# --------------------------------------------------------------------------- compute profile


# --------------------------------------------------------------------------- the plan
def plan_summary(args: argparse.Namespace, n_layer: int | None = None) -> dict[str, Any]:
    """Build the GPT on the meta device and resolve its plan exactly as ``parallelize``
    would (same config, same functions); bytes are as gathered, in bf16."""
    import torch

    from fsdp_overlap_plugin import resolve_plan
    from fsdp_overlap_plugin.config.plan import auto_plan_info

    cfg = model_kwargs(args, n_layer)
    with torch.device("meta"):
        model = gpt_preset("1b", **cfg)
    config = variant_config("compiled-on")
    plan = resolve_plan(model, config)
    info = auto_plan_info(model, config)
    assert info.buckets == plan  # bucket_plans is "auto": the same function decides both
    return {
        "model": cfg,
        "params": sum(p.numel() for p in model.parameters()),
        "plan": plan,
        "bucket_bytes": info.bucket_bytes,
        "target_bytes": info.target_bytes,
        "blocks": info.blocks,
    }


def llama_summary(phase: str, size: str = "default") -> dict[str, Any]:
    """A Llama phase's model built on the meta device (nothing allocated, nothing
    downloaded): its parameter count (the formula's must agree: ``llama_param_count``),
    the plugin's auto plan for it, FLOPs per token and tokens per step per rank."""
    import torch.nn as nn

    from fsdp_overlap_plugin import resolve_plan

    shape = llama_shape(phase, size)
    model = build_llama(llama_config(shape), device="meta")
    params = sum(p.numel() for p in model.parameters())
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    if (params, matmul) != (llama_param_count(shape), llama_matmul_params(shape)):
        raise AssertionError(
            f"{phase}: the model has {params:,} parameters ({matmul:,} in matmuls), the formulas say "
            f"{llama_param_count(shape):,} ({llama_matmul_params(shape):,})"
        )
    return {
        "shape": shape,
        "params": params,
        "matmul_params": matmul,
        "plan": resolve_plan(model, variant_config("compiled-on")),
        "flops_per_token": llama_flops_per_token(shape, shape["seq"]),
        "tokens_per_step": shape["batch"] * shape["seq"],
    }


# --------------------------------------------------------------------------- phases (children)


def phase_matmul(args: argparse.Namespace) -> dict[str, Any]:
    """Device facts and the best bf16 matmul rate over a few square sizes (CUDA events)."""
    import torch

    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    rates = {}
    for n in (4096, 8192, 16384):
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        iters = max(5, int(4e13 / (2 * n**3)))  # ~40 TFLOP per size: tens of ms
        best = 0.0
        for _ in range(2):  # the best of two: the clocks ramp up from idle during the first
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                a @ b
            end.record()
            torch.cuda.synchronize()
            best = max(best, 2 * n**3 * iters / (start.elapsed_time(end) / 1e3))
        rates[n] = best
        print(f"bf16 matmul {n}x{n}x{n}: {rates[n] / 1e12:.1f} TFLOP/s ({iters} products)", flush=True)
        del a, b
    return {
        "device": props.name,
        "capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "total_memory": total,
        "free_memory": free,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "nccl": ".".join(str(x) for x in torch.cuda.nccl.version()),
        "matmul_tflops": {str(n): r / 1e12 for n, r in rates.items()},
        "matmul_flops_per_s": max(rates.values()),
    }


def phase_train(args: argparse.Namespace, phase: str) -> dict[str, Any]:
    """Build the GPT on the GPU (same seed, so every phase starts from the same weights),
    ``parallelize`` it on a 1-rank NCCL group, train warmup + steps on two fixed batches
    (so the loss falls and the curves are worth comparing). ``--_device cpu`` (tests
    only) does the same on gloo with ``aot_eager``, which compiles in seconds on a CPU."""
    import torch
    import torch.distributed as dist

    import fsdp_overlap_plugin as fo
    from fsdp_overlap_plugin.models import fixed_batches, loss_fn

    device = args._device
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    config = variant_config(phase)
    if not cuda:
        config["backend"] = "aot_eager"
    init_world_of_one(device)
    try:
        cfg = model_kwargs(args)
        torch.manual_seed(args.seed)
        with torch.device(device):
            model = gpt_preset("1b", **cfg)
        params = sum(p.numel() for p in model.parameters())
        start = time.perf_counter()
        fo.parallelize(model, config)
        setup_s = time.perf_counter() - start
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        data = fixed_batches(2, args.batch, args.seq, args.vocab, seed=args.seed)
        batches = [(x.to(device), y.to(device)) for x, y in data]
        losses, times = [], []
        for step in range(args.warmup + args.steps):
            x, y = batches[step % len(batches)]
            sync()
            start = time.perf_counter()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
            print(f"{phase} step {step}: loss {losses[-1]:.5f}  {times[-1]:.3f} s", flush=True)
        collectives = None
        if config.get("compile", True):
            report = fo.schedule_report(model)
            print(fo.format_report(report), flush=True)
            # what the graphs held before our passes; None where no pass ran (passes off)
            collectives = {k: (report.get(k) or {}).get("before") for k in ("forward", "backward")}
        step_s = statistics.median(times[args.warmup :])
        return {
            "params": params,
            "setup_s": setup_s,
            "first_step_s": times[0],
            "compile_s": max(times[0] - step_s, 0.0),
            "step_s": step_s,
            "step_times": times,
            "losses": losses,
            "tokens_per_step": args.batch * args.seq,
            "peak_allocated": torch.cuda.max_memory_allocated() if cuda else None,
            "peak_reserved": torch.cuda.max_memory_reserved() if cuda else None,
            "collectives": collectives,
        }
    finally:
        dist.destroy_process_group()


def code_order_check(
    kwargs: dict[str, int], world: int, device_type: str, batch: int = 2, seq: int | None = None
) -> dict[str, Any]:
    """Compile the GPT with the passes on for ``world`` ranks of a fake process group on
    ``device_type`` (one process; collectives move no data), run one step, and check the
    generated code against the plan. Works on CPU too (the unit tests run it there)."""
    import torch
    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fsdp_overlap_plugin as fo
    from fsdp_overlap_plugin.models import fixed_batches, loss_fn

    seq = seq or kwargs["block_size"]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    torch._dynamo.reset()
    try:
        device = torch.device(device_type, 0) if device_type != "cpu" else torch.device("cpu")
        torch.manual_seed(0)
        with torch.device(device):
            model = gpt_preset("1b", **kwargs)
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
        fo.parallelize(model, variant_config("code-order"), mesh=mesh)
        x, y = (t.to(device) for t in fixed_batches(1, batch, seq, kwargs["vocab_size"])[0])
        start = time.perf_counter()
        _, codes = run_and_get_code(lambda: loss_fn(model(x), y).backward())
        compile_s = time.perf_counter() - start
        return {"world": world, "model": kwargs, "compile_s": compile_s, **check_generated_code(model, codes, world)}
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


def phase_code_order(args: argparse.Namespace) -> dict[str, Any]:
    result = code_order_check(
        model_kwargs(args, args.code_layers), args.code_world, "cuda", batch=2, seq=min(args.seq, 512)
    )
    out = Path(args.out)
    for kind, code in zip(("forward", "backward"), result.pop("codes")):
        (out / f"code_{kind}.py").write_text(code)
    return result


def _save_partial(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Write what a phase has so far to its result file (status "partial"): a phase stopped
    at its time limit still leaves the variants it finished for the parent's table."""
    if args._result:
        Path(args._result).write_text(json.dumps({**result, "status": "partial"}, indent=1, default=str))


def train_llama(
    variant: str,
    shape: dict[str, Any],
    batches: list[Any],
    args: argparse.Namespace,
    mesh: Any,
    *,
    capture_code: bool = False,
    profile_steps: int = 0,
) -> dict[str, Any]:
    """Build the Llama of ``shape`` on the device (same seed: both variants start from the
    same weights), shard and compile it the ``variant`` way on ``mesh``, train warmup +
    llama_steps AdamW steps on the two ``batches`` (its own causal-LM loss,
    ``labels=input_ids``). ``capture_code``: keep inductor's code of the first step and check
    it (``check_generated_code``); ``profile_steps``: profile that many more steps."""
    import torch

    import fsdp_overlap_plugin as fo

    device = args._device
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    backend = "inductor" if cuda else "aot_eager"  # aot_eager: a CPU test compiles in seconds
    torch._dynamo.reset()
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # this variant's peak (the last one's memory is freed)
    torch.manual_seed(args.seed)
    model = build_llama(llama_config(shape), device=device)
    params = sum(p.numel() for p in model.parameters())
    attention = getattr(model.config, "_attn_implementation", None)
    start = time.perf_counter()
    if variant == "plugin":
        fo.parallelize(model, {**variant_config("compiled-on"), "backend": backend}, mesh=mesh)
        run = model
    else:
        run = fully_shard_and_compile(model, mesh, backend)
    setup_s = time.perf_counter() - start
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def step(i: int) -> Any:
        ids = batches[i % len(batches)]
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    losses, times, codes = [], [], None
    for i in range(args.warmup + args.llama_steps):
        sync()
        start = time.perf_counter()
        if i == 0 and capture_code:
            from torch._inductor.utils import run_and_get_code

            loss, codes = run_and_get_code(step, i)
        else:
            loss = step(i)
        sync()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        print(f"{variant} step {i}: loss {losses[-1]:.5f}  {times[-1]:.3f} s", flush=True)
    step_s = statistics.median(times[args.warmup :])
    out: dict[str, Any] = {
        "params": params,
        "attention": attention,
        "setup_s": setup_s,
        "first_step_s": times[0],
        "compile_s": max(times[0] - step_s, 0.0),
        "step_s": step_s,
        "step_times": times,
        "losses": losses,
        "tokens_per_step": shape["batch"] * shape["seq"],
        "peak_allocated": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_reserved": torch.cuda.max_memory_reserved() if cuda else None,
    }
    if variant == "plugin":
        report = fo.schedule_report(model)
        print(fo.format_report(report), flush=True)
        out["schedule"] = schedule_totals(report)
        out["collectives"] = {k: (report.get(k) or {}).get("after") for k in ("forward", "backward")}
        if codes is not None:
            out["code"] = check_generated_code(model, codes, shape["world"])
    if profile_steps:
        out["profile_rows"] = profiler_rows(step, profile_steps, device)
    return out


def _free_models(cuda: bool) -> None:
    """Release what a finished variant held: Dynamo's caches keep its model alive."""
    import gc

    import torch

    torch._dynamo.reset()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def phase_llama(args: argparse.Namespace, phase: str) -> dict[str, Any]:
    """hf-1rank (one NCCL rank; gloo on a CPU) or world8 (a fake process group of 8 ranks on
    the device): both variants, one after the other in this process, on the same batches
    of counting sequences (learnable, so the loss falls). The plugin runs first, into a cold
    compile cache; torch's variant reuses the kernels the two have in common (the same
    process), so its first step is if anything flattered. A variant that fails is reported
    and the other still runs. World8 also checks the plugin step's generated code and
    writes compute_profile.json."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_overlap_plugin.models import counting_sequences

    shape = llama_shape(phase, args._size)
    device, world = args._device, shape["world"]
    cuda = device == "cuda"
    if world == 1:
        init_world_of_one(device)
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if cuda:
            torch.cuda.set_device(0)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    result: dict[str, Any] = {
        "shape": shape,
        "world": world,
        "params": llama_param_count(shape),
        "flops_per_token": llama_flops_per_token(shape, shape["seq"]),
        "tokens_per_step": shape["batch"] * shape["seq"],
        "variants": {},
        "problems": [],
    }
    out = Path(args.out)
    try:
        mesh = init_device_mesh(device, (world,), mesh_dim_names=("shard",))
        tokens = counting_sequences(2 * shape["batch"], shape["seq"], shape["vocab"], seed=args.seed)
        batches = [t.to(device) for t in tokens.split(shape["batch"])]
        for variant in LLAMA_VARIANTS:
            plugin_world8 = phase == "world8" and variant == "plugin"
            try:
                r = train_llama(
                    variant,
                    shape,
                    batches,
                    args,
                    mesh,
                    capture_code=plugin_world8 and cuda,  # inductor's code: the GPU's (aot_eager on a CPU has none)
                    profile_steps=args.profile_steps if plugin_world8 else 0,
                )
                r["status"] = "ok"
            except Exception as exc:  # the other variant still runs
                traceback.print_exc()
                r = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
                result["problems"].append(f"{variant}: {r['error']}")
            _free_models(cuda)
            if "code" in r:
                for kind, code in zip(("forward", "backward"), r["code"].pop("codes")):
                    (out / f"code_{phase}_{kind}.py").write_text(code)
            if "profile_rows" in r:
                profile = compute_profile(
                    r.pop("profile_rows"),
                    steps=args.profile_steps,
                    step_s=r["step_s"],
                    schedule=r["schedule"],
                    device=torch.cuda.get_device_name(0) if cuda else "cpu",
                    torch_version=torch.__version__,
                    model={k: v for k, v in shape.items() if k != "world"},
                    world=world,
                    model_flops_per_step=result["flops_per_token"] * result["tokens_per_step"],
                )
                (out / PROFILE_FILE).write_text(json.dumps(profile, indent=1))
                r["profile"] = {k: v for k, v in profile.items() if k != "ops"}
                r["profile"]["ops"] = len(profile["ops"])
                r["profile"]["top"] = profile["ops"][:10]
            result["variants"][variant] = r
            _save_partial(args, result)
        return result
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


def phase_torch_passes(args: argparse.Namespace) -> dict[str, Any]:
    """Inductor's own distributed passes vs ours (issue 57) on world8's setup with fewer
    layers (``torch_passes_phase.LAYERS``): a fake process group of 8 ranks, Llama3-8B layer
    shapes, world8's batch and plugin config, inductor on every device (the settings are
    inductor's; on a CPU, tests only, the tiny Llama). Each setting this torch can run is
    compiled and timed in this one process; see ``_harness/torch_passes_phase.py``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_overlap_plugin.models import counting_sequences

    shape = llama_shape("world8", args._size)
    if args._size == "default":
        shape["n_layer"] = torch_passes_phase.LAYERS
    device, world = args._device, shape["world"]
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh(device, (world,), mesh_dim_names=("shard",))
        tokens = counting_sequences(2 * shape["batch"], shape["seq"], shape["vocab"], seed=args.seed)
        batches = [t.to(device) for t in tokens.split(shape["batch"])]
        head = {
            "shape": shape,
            "world": world,
            "params": llama_param_count(shape),
            "device": torch.cuda.get_device_name(0) if device == "cuda" else device,
        }
        result = torch_passes_phase.run_settings(
            shape=shape,
            base_config={**variant_config("compiled-on"), "backend": "inductor"},
            device=device,
            warmup=args.warmup,
            steps=max(1, args.llama_steps // args.pass_rounds),
            reps=args.pass_rounds,
            lr=args.lr,
            seed=args.seed,
            build_model=lambda s, d: build_llama(llama_config(s), device=d),
            batches=batches,
            mesh=mesh,
            on_progress=lambda r: _save_partial(args, {**head, **r}),
        )
        return {**head, **result}
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


# --------------------------------------------------------------------------- paths (examples)
PATH_LABELS = {
    "lightning": "Lightning Trainer (examples/hf_lightning.py)",
    "accelerate": "accelerate launch (examples/hf_accelerate.py)",
}


def accelerate_launcher() -> list[str]:
    """``accelerate launch`` of this Python: the console script beside the interpreter when
    there is one, else the module it runs."""
    script = Path(sys.executable).with_name("accelerate")
    if script.is_file():
        return [str(script), "launch"]
    return [sys.executable, "-m", "accelerate.commands.launch"]


def path_commands(args: argparse.Namespace, folder: Path, yaml_path: Path | None = None) -> dict[str, list[str]]:
    """The two examples as a user runs them on a one-GPU machine, from the repository root:
    the Lightning Trainer on 1 GPU with bf16-mixed (the example's default precision), and
    ``accelerate launch`` of 1 process with configs/overlap.yaml as the docs show it (its
    mixed_precision 'no': fp32). Each writes its losses to ``folder``. On a CPU (tests): 1 CPU device, the Lightning strategy and the
    Accelerate YAML (``yaml_path``, a copy of configs/overlap.yaml) on aot_eager."""
    cuda = args._device == "cuda"
    steps = str(args.path_steps)
    lightning = [sys.executable, "examples/hf_lightning.py", "--accelerator", "gpu" if cuda else "cpu"]
    lightning += ["--devices", "1", "--steps", steps, "--metrics", str(folder / "paths_lightning.json")]
    if not cuda:
        lightning += ["--backend", "aot_eager"]
    config = yaml_path or REPO / "configs" / "overlap.yaml"
    accelerate = [*accelerate_launcher(), "--config_file", str(config), "--num_processes", "1"]
    accelerate += ["examples/hf_accelerate.py"]
    accelerate += ["--steps", steps, "--metrics", str(folder / "paths_accelerate.json")]
    return {"lightning": lightning, "accelerate": accelerate}


def read_path_losses(metrics: Path, log: Path) -> list[float]:
    """An example's losses per step: from its --metrics JSON (the Lightning example writes a
    list, the Accelerate one a dict by step), else its printed ``step N: loss X`` lines."""
    try:
        losses = json.loads(metrics.read_text())["losses"]
        if isinstance(losses, dict):
            losses = [losses[k] for k in sorted(losses, key=int)]
        return [float(x) for x in losses]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return [float(x) for x in re.findall(r"^step \d+: loss ([-+\d.eE]+|nan|inf)", text, re.M)]


def phase_paths(args: argparse.Namespace) -> dict[str, Any]:
    """Run the Lightning and the Accelerate example, one after the other, each with its
    output in paths_NAME.log in --out; each must exit 0 with its loss falling (``loss_fell``).
    Each gets at most an even share of what is left of the phase's limit (the parent passes
    it as $GPU_CHECK_PHASE_LIMIT), so a hang in the first leaves time for the second."""
    limit = float(os.environ.get("GPU_CHECK_PHASE_LIMIT") or DEFAULT_CAPS["paths"])
    deadline = time.monotonic() + limit - 5
    out = Path(args.out)
    folder = Path(tempfile.mkdtemp(prefix="gpu_check_paths_"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    yaml_path = None
    if args._device != "cuda":
        yaml_path = folder / "overlap.yaml"
        text = (REPO / "configs" / "overlap.yaml").read_text()
        yaml_path.write_text(re.sub(r"(?m)^(\s*fsdp_overlap_backend:)\s*inductor", r"\1 aot_eager", text))
    commands = path_commands(args, folder, yaml_path)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    for name in ("FSDP_OVERLAP_CONFIG", "LOCAL_RANK", "RANK", "WORLD_SIZE", "ACCELERATE_USE_CPU"):
        env.pop(name, None)  # nothing an outer launcher exported: a user's shell
    previous = signal.signal(signal.SIGTERM, _stop_current_and_exit)
    runs = {}
    try:
        for k, (name, cmd) in enumerate(commands.items()):
            log = out / f"paths_{name}.log"
            log.unlink(missing_ok=True)
            share = max(MIN_PHASE_S, (deadline - time.monotonic()) / (len(commands) - k))
            print(f"[paths] {shlex.join(cmd)} (limit {share:.0f} s)", flush=True)
            status, seconds = run_child(cmd, log, share, env)
            losses = read_path_losses(folder / f"paths_{name}.json", log)
            runs[name] = {
                "label": PATH_LABELS[name],
                "command": cmd,
                "status": status,
                "wall_s": seconds,
                "losses": losses,
                "falling": loss_fell(losses),
                "log": log.name,
            }
            print(f"[paths] {name}: {status} in {seconds:.0f} s; losses {losses[:1]} ... {losses[-1:]}", flush=True)
            if status != "ok":
                print(log_tail(log, 30), flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return {"runs": runs}


def _stop_current_and_exit(signum: int, frame: Any) -> None:
    """A phase process told to stop ends the example it started (its own process group) first."""
    stop_current()
    sys.exit(1)


def run_phase(args: argparse.Namespace) -> int:
    """Child side: run one phase, write its result JSON (also on failure), exit 0 or 1."""
    result_path = Path(args._result)
    started = time.perf_counter()
    try:
        if args._phase == "matmul":
            result = phase_matmul(args)
        elif args._phase == "code-order":
            result = phase_code_order(args)
        elif args._phase in TRAIN_PHASES:
            result = phase_train(args, args._phase)
        elif args._phase in LLAMA_PHASES:
            result = phase_llama(args, args._phase)
        elif args._phase == "torch-passes":
            result = phase_torch_passes(args)
        elif args._phase == "paths":
            result = phase_paths(args)
        else:
            raise ValueError(f"phase {args._phase!r} does not run in a child")
        result["status"] = "ok"
    except BaseException as exc:  # report everything to the parent, which keeps going
        traceback.print_exc()
        result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    result["wall_s"] = time.perf_counter() - started
    result_path.write_text(json.dumps(result, indent=1, default=str))
    return 0 if result["status"] == "ok" else 1


# --------------------------------------------------------------------------- parent


# the options a phase process needs (the parent forwards them; everything else stays with it)
FORWARDED = ("n_layer", "d_model", "n_head", "vocab", "batch", "seq", "steps", "warmup", "lr", "seed")
FORWARDED += ("code_layers", "code_world", "llama_steps", "profile_steps", "path_steps", "pass_rounds", "_device")
FORWARDED += ("_size",)


def child_command(args: argparse.Namespace, phase: str, result: str | Path) -> list[str]:
    """The exact command the parent runs for a phase."""
    if phase == "tests":
        files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*_cuda.py"))
        pytest = ["-m", "pytest", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider"]
        return [sys.executable, *pytest, "--junitxml", str(result), *files]
    argv = [sys.executable, str(Path(__file__).resolve()), "--_phase", phase, "--_result", str(result)]
    argv += ["--out", str(args.out)]
    for name in FORWARDED:
        argv += [f"--{name.replace('_', '-')}" if not name.startswith("_") else f"--{name}", str(getattr(args, name))]
    return argv


def table_rows(runs: dict[str, PhaseRun], fpt: float, matmul_rate: float | None) -> list[dict[str, Any]]:
    """One row per training phase, with the derived numbers (tokens/s, MFU)."""
    rows = []
    for phase in ("eager", "compiled-off", "compiled-on"):
        run = runs.get(phase)
        if run is None:
            continue
        r = run.result if run.status == "ok" else {}
        row = {"phase": phase, "label": ROW_LABELS[phase], "status": run.status}
        if r:
            row.update(
                compile_s=r["compile_s"] if phase != "eager" else None,
                first_step_s=r["first_step_s"],
                step_s=r["step_s"],
                peak_gib=r["peak_allocated"] / 2**30 if r.get("peak_allocated") is not None else None,
                final_loss=r["losses"][-1],
                **throughput(r["tokens_per_step"], r["step_s"], fpt, matmul_rate),
            )
        rows.append(row)
    return rows


def llama_rows(runs: dict[str, PhaseRun], matmul_rate: float | None) -> list[dict[str, Any]]:
    """One row per Llama phase and variant (the plugin, torch's fully_shard + compile), with
    the derived numbers; a variant that did not finish shows its own status, or the phase's
    (a phase stopped at its limit keeps the variants it finished). No final loss at world 8:
    on a fake process group the losses mean nothing."""
    rows = []
    for phase in LLAMA_PHASES:
        run = runs.get(phase)
        if run is None:
            continue
        r = run.result or {}
        for variant, label in LLAMA_VARIANTS.items():
            v = (r.get("variants") or {}).get(variant) or {}
            status = v.get("status") or (run.status if run.status != "ok" else "not run")
            row = {"phase": phase, "variant": variant, "label": f"{phase}: {label}", "status": status}
            if status == "ok":
                row.update(
                    compile_s=v["compile_s"],
                    first_step_s=v["first_step_s"],
                    step_s=v["step_s"],
                    peak_gib=v["peak_allocated"] / 2**30 if v.get("peak_allocated") is not None else None,
                    final_loss=v["losses"][-1] if r.get("world") == 1 else None,
                    **throughput(v["tokens_per_step"], v["step_s"], r["flops_per_token"], matmul_rate),
                )
            rows.append(row)
    return rows


def step_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per Llama phase, the plugin's median step time over torch's (below 1: the plugin is faster)."""
    steps = {(r["phase"], r["variant"]): r.get("step_s") for r in rows}
    return {
        phase: steps[(phase, "plugin")] / steps[(phase, "fully_shard")]
        for phase in LLAMA_PHASES
        if steps.get((phase, "plugin")) and steps.get((phase, "fully_shard"))
    }


def evaluate(runs: dict[str, PhaseRun], args: argparse.Namespace) -> list[tuple[str, bool, str]]:
    """Every check: (name, passed, detail). A phase that did not finish is a failed check."""
    checks = []
    for name, run in runs.items():
        if run.status != "ok":
            detail = run.note or run.result.get("error", "")
            checks.append((f"phase {name}", False, f"{run.status}: {detail}".strip(": ")))
    tests = runs.get("tests")
    if tests and tests.status == "ok":
        c = tests.result
        checks.append(
            ("CUDA unit tests", c.get("passed", 0) >= 1, f"{c.get('passed', 0)} passed, {c.get('skipped', 0)} skipped")
        )
    ok = {p: runs[p].result for p in TRAIN_PHASES if p in runs and runs[p].status == "ok"}
    for p, r in ok.items():
        losses = r["losses"]
        fell = all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
        checks.append((f"{p}: loss finite and falling", fell, f"{losses[0]:.4f} -> {losses[-1]:.4f}"))
    pairs = [("compiled-off", "compiled-on", args.loss_rtol), ("compiled-off", "eager", args.eager_rtol)]
    for a, b, rtol in pairs:
        if a in ok and b in ok:
            cmp = compare_losses(ok[b]["losses"], ok[a]["losses"], rtol)
            detail = (
                cmp["why"] or f"max relative difference {cmp['max_rel']:.2e} at step {cmp['worst_step']} (rtol {rtol})"
            )
            checks.append((f"losses agree: {b} vs {a}", cmp["ok"], detail))
    code = runs.get("code-order")
    if code and code.status == "ok":
        problems = code.result.get("problems", [])
        n = len(code.result.get("windows", {}).get("forward", []))
        m = len(code.result.get("windows", {}).get("backward", []))
        detail = (
            "; ".join(problems)
            if problems
            else f"{n} forward / {m} backward all-gathers in planned order, each hidden behind compute"
        )
        checks.append(("generated code keeps the bucketed collectives in order", not problems, detail))
    checks += llama_checks(runs, args)
    passes = runs.get("torch-passes")
    if passes and passes.status == "ok":
        checks += torch_passes_phase.checks(passes.result)
    paths = runs.get("paths")
    if paths and paths.status == "ok":
        for r in (paths.result.get("runs") or {}).values():
            losses = r.get("losses") or []
            trend = f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps" if losses else "no losses read"
            ok = r["status"] == "ok" and r.get("falling", False)
            checks.append(
                (f"paths: {r['label']} exits 0, loss falling", ok, f"{r['status']} in {r['wall_s']:.0f} s; {trend}")
            )
    return checks


def llama_checks(runs: dict[str, PhaseRun], args: argparse.Namespace) -> list[tuple[str, bool, str]]:
    """hf-1rank: each variant ran, its loss is finite and falls (``loss_fell``), and the two
    agree per step within --llama-rtol. World8: each variant ran, the plugin step's
    generated code keeps the bucketed collectives in order, the compute profile has kernels
    and schedule FLOPs. (World8's losses are not checked: a fake process group gathers nothing.)"""
    checks = []
    for phase in LLAMA_PHASES:
        run = runs.get(phase)
        if run is None or run.status != "ok":
            continue  # reported as a failed phase
        variants = run.result.get("variants") or {}
        for variant, v in variants.items():
            if v.get("status") != "ok":
                checks.append((f"{phase}: {LLAMA_VARIANTS[variant]} ran", False, v.get("error", "not run")))
            elif phase == "hf-1rank":
                losses = v["losses"]
                checks.append(
                    (
                        f"{phase}: {variant} loss finite and falling",
                        loss_fell(losses),
                        f"{losses[0]:.4f} -> {losses[-1]:.4f}",
                    )
                )
        ok = {k: v for k, v in variants.items() if v.get("status") == "ok"}
        if phase == "hf-1rank" and len(ok) == 2:
            cmp = compare_losses(ok["fully_shard"]["losses"], ok["plugin"]["losses"], args.llama_rtol)
            detail = cmp["why"] or (
                f"max relative difference {cmp['max_rel']:.2e} at step {cmp['worst_step']} (rtol {args.llama_rtol})"
            )
            checks.append((f"{phase}: losses agree: fully_shard vs plugin", cmp["ok"], detail))
        plugin = ok.get("plugin") or {}
        if "code" in plugin:
            code = plugin["code"]
            n, m = (len(code["windows"].get(k, [])) for k in ("forward", "backward"))
            detail = (
                "; ".join(code["problems"])
                if code["problems"]
                else f"{n} forward / {m} backward all-gathers in planned order, each hidden behind compute"
            )
            checks.append(
                (f"{phase}: generated code keeps the bucketed collectives in order", not code["problems"], detail)
            )
        if "profile" in plugin:
            prof = plugin["profile"]
            good = prof["ops"] > 0 and prof["schedule_flops_per_step"] > 0
            checks.append(
                (
                    f"{phase}: compute profile written ({PROFILE_FILE})",
                    good,
                    f"{prof['ops']} kernels over {prof['profiled_steps']} steps; "
                    f"schedule {prof['schedule_flops_per_step'] / 1e12:.2f} TFLOP per step",
                )
            )
    return checks


def llama_lines(args: argparse.Namespace, runs: dict[str, PhaseRun], rows: list[dict[str, Any]]) -> list[str]:
    """The Llama section of summary.md: the models, the table, the step-time ratios, what
    a fake process group measures, and the compute profile's headline."""
    lines = []
    for phase in LLAMA_PHASES:
        if phase not in runs:
            continue
        shape = llama_shape(phase, args._size)
        where = (
            "one NCCL rank"
            if shape["world"] == 1
            else f"a fake process group of {shape['world']} ranks on the GPU (tokens per rank)"
        )
        lines.append(
            f"- {phase}: LlamaForCausalLM, {shape['n_layer']} layers, hidden {shape['hidden']}, intermediate "
            f"{shape['intermediate']}, {shape['heads']} heads / {shape['kv_heads']} kv heads, vocab {shape['vocab']}, "
            f"rope theta {shape['rope_theta']:g} ({llama_param_count(shape) / 1e9:.2f}B parameters, sdpa); batch "
            f"{shape['batch']} x {shape['seq']} tokens; {where}; "
            f"{llama_flops_per_token(shape, shape['seq']) / 1e9:.2f} GFLOP/token"
        )
    lines += [
        f"- both variants: bf16 params / fp32 reduce, AdamW lr {args.lr}, {args.warmup} warm-up + {args.llama_steps} "
        "timed steps, the same weights and batches. plugin: parallelize() with its defaults (auto plan, every "
        "pass on, inductor); torch: fully_shard per decoder layer and on the root (MixedPrecisionPolicy bf16 / "
        "fp32), then torch.compile(model). The plugin runs first: torch's variant reuses the kernels they share "
        "(one process), so its first step is if anything flattered",
        "- MFU: 6 x matmul params + 12 x layers x hidden x seq FLOPs per token over the measured bf16 matmul rate",
        "",
        format_table(rows),
        "",
    ]
    ratios = step_ratios(rows)
    if ratios:
        lines.append(
            "Step time, plugin / torch: "
            + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())
            + " (below 1: the plugin's step is shorter)."
        )
    if "hf-1rank" in runs:
        lines.append(
            "hf-1rank, one rank: DTensor skips the gather on a 1-rank mesh, so the plugin's graphs hold no "
            "collectives; the rows compare the compiled compute (one graph vs one per layer around FSDP2's hooks)."
        )
    if "world8" in runs:
        lines.append(
            "world8, a fake process group: its collectives move no data, so these rows are the compute side only "
            "(copy-in/out, casts, kernels), not communication or overlap, and its losses mean nothing (the "
            "gathered parameters are whatever the buffers held); at 8 real ranks overlap is what separates them."
        )
        prof = ((runs["world8"].result.get("variants") or {}).get("plugin") or {}).get("profile")
        if prof:
            kinds = prof.get("kind_s_per_step") or {}
            busy = prof.get("kernel_s_per_step") or 0.0
            shares = ", ".join(f"{k} {100 * v / busy:.0f}%" for k, v in kinds.items()) if busy else "-"
            achieved = prof.get("achieved_flops_per_s")
            lines.append(
                f"Compute profile of the world8 plugin step ({PROFILE_FILE}, {prof['profiled_steps']} steps): "
                f"kernels {busy:.3f} s per {prof['step_s']:.3f} s step ({100 * (prof.get('busy_fraction') or 0):.0f}% "
                f"busy; {shares}); the schedule counts {prof['schedule_flops_per_step'] / 1e12:.1f} TFLOP per step, "
                f"{fmt(achieved and achieved / 1e12, '.0f')} TFLOP/s at the measured step time."
            )
    return lines


def write_files(
    out: Path, args: argparse.Namespace, runs: dict[str, PhaseRun], env_info: dict, final: bool
) -> tuple[str, list]:
    """summary.md and results.json, rewritten after every phase (so a kill keeps what ran)."""
    cfg = model_kwargs(args)
    fpt = flops_per_token(cfg, args.seq)
    rate = env_info.get("matmul_flops_per_s")
    rows = table_rows(runs, fpt, rate)
    l_rows = llama_rows(runs, rate)
    checks = evaluate(runs, args)
    passed = final and all(ok for _, ok, _ in checks) and all(r.status == "ok" for r in runs.values())
    lines = [
        f"# GPU check ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"- device: {env_info.get('device', '?')} (compute capability {env_info.get('capability', '?')}, "
        f"{fmt((env_info.get('total_memory') or 0) / 2**30 or None, '.0f')} GiB); torch {env_info.get('torch', '?')}, "
        f"CUDA {env_info.get('cuda', '?')}, triton {env_info.get('triton', '?')}, NCCL {env_info.get('nccl', '?')}",
        f"- bf16 matmul rate (MFU's denominator): {fmt(rate and rate / 1e12, '.0f')} TFLOP/s; "
        "compile s = first step - median step; each phase compiles into its own empty inductor cache",
    ]
    if any(p in runs for p in GPT_PHASES):
        lines += [
            "",
            "## GPT (gpt_1b)",
            "",
            f"- model: gpt_1b({', '.join(f'{k}={v}' for k, v in cfg.items())}), {param_count(cfg) / 1e9:.2f}B parameters; "
            f"batch {args.batch} x {args.seq} tokens; {args.warmup} warm-up + {args.steps} timed steps; AdamW lr {args.lr}",
            "- bf16 params, fp32 reduce, auto plan, inductor; one NCCL rank (world of 1)",
            f"- MFU: model FLOPs ({fpt / 1e9:.2f} GFLOP/token, 6 x matmul params + attention) over the measured bf16 "
            "matmul rate",
            "",
            format_table(rows),
            "",
            "World of one: DTensor skips the gather on a 1-rank mesh, so these compiled graphs hold no",
            "collectives and passes off/on compile nearly the same graph. The rows measure the GPU compile",
            "path and its compute-side cost, not overlap. The collectives' order in inductor's GPU code is",
            f"checked on a fake process group of {args.code_world} ranks (code-order phase, {args.code_layers} blocks).",
        ]
    if any(p in runs for p in LLAMA_PHASES):
        lines += ["", "## Transformers Llama: the plugin vs torch's FSDP2 (fully_shard + torch.compile)", ""]
        lines += llama_lines(args, runs, l_rows)
    if "torch-passes" in runs:
        lines += ["", "## Inductor's own distributed passes vs ours (torch-passes, issue 57)", ""]
        lines += torch_passes_phase.summary_lines(runs["torch-passes"].result, runs["torch-passes"].status)
    if "paths" in runs:
        lines += ["", "## Lightning and Accelerate on the GPU (paths)", ""]
        paths = runs["paths"]
        if paths.result.get("runs"):
            lines += format_paths(paths.result)
        else:
            lines.append(f"(not run: {paths.status})")
    lines += ["", "## Checks", ""]
    lines += [f"- [{'x' if ok else ' '}] {name}: {detail}" for name, ok, detail in checks]
    counts = []
    for p in ("compiled-off", "compiled-on"):
        c = runs[p].result.get("collectives") if p in runs else None
        if c is not None:
            known = [v for v in c.values() if v is not None]
            n = sum(v.get("all_gather", 0) for v in known)
            counts.append(f"{p} {n}" if known else f"{p} not recorded (no pass ran)")
    if counts:
        lines += ["", "All-gathers in the 1-rank compiled graphs (0 expected, see above): " + ", ".join(counts)]
    lines += ["", "## Phases", "", "| phase | status | seconds | limit |", "|---|---|---|---|"]
    lines += [f"| {r.name} | {r.status} | {r.seconds:.0f} | {r.limit:.0f} |" for r in runs.values()]
    if env_info.get("torch") and not torch_supported(env_info["torch"]):
        lines += ["", f"WARNING: torch {env_info['torch']} is outside the supported range ({supported_range()})."]
    lines += ["", f"Result: {'PASS' if passed else ('FAIL' if final else 'incomplete')}"]
    summary = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(summary)
    payload = {
        "args": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "env": env_info,
        "flops_per_token": fpt,
        "rows": rows,
        "llama_rows": l_rows,
        "llama_step_ratios": step_ratios(l_rows),
        "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in checks],
        "phases": {name: {**r.__dict__} for name, r in runs.items()},
        "passed": passed,
    }
    (out / "results.json").write_text(json.dumps(payload, indent=1, default=str))
    return summary, checks


def dry_run(args: argparse.Namespace, out: Path, say: Console) -> int:
    """No GPU needed: the model on the meta device, the plan and bytes, what would run."""
    info = plan_summary(args)
    cfg = info["model"]
    code_info = plan_summary(args, args.code_layers)
    fpt = flops_per_token(cfg, args.seq)
    mem = memory_estimate(cfg, args.batch, args.seq)
    say(f"gpu_check dry run (torch {__import__('torch').__version__}; nothing is started)")
    say(
        f"model: gpt_1b({', '.join(f'{k}={v}' for k, v in cfg.items())}): {info['params']:,} parameters "
        f"({info['params'] / 1e9:.2f}B), built on the meta device"
    )
    say(f"config (compiled-on): {variant_config('compiled-on')}")
    say(
        f"plan: {len(info['plan'])} buckets (auto; target {info['target_bytes'] / 2**20:.1f} MiB = median block), bytes as gathered in bf16:"
    )
    for i, (bucket, size) in enumerate(zip(info["plan"], info["bucket_bytes"])):
        say(f"  {i:>3}  {size:>13,} B  {size / 2**20:8.1f} MiB  {', '.join(bucket)}")
    say(f"  total {sum(info['bucket_bytes']):,} B")
    say(
        f"per step: {args.batch * args.seq:,} tokens, {fpt / 1e9:.2f} GFLOP/token ({fpt * args.batch * args.seq / 1e12:.1f} TFLOP/step)"
    )
    say("memory estimate (one rank holds everything): " + ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in mem.items()))
    say(f"code-order model: {args.code_layers} blocks, {len(code_info['plan'])} buckets, fake world {args.code_world}")
    llamas = {}
    for phase in LLAMA_PHASES:
        llamas[phase] = info_l = llama_summary(phase, args._size)
        shape = info_l["shape"]
        say(
            f"{phase}: LlamaForCausalLM({', '.join(f'{k}={v}' for k, v in shape.items())}): {info_l['params']:,} "
            f"parameters ({info_l['params'] / 1e9:.2f}B), built on the meta device; {len(info_l['plan'])} buckets "
            f"(auto), {info_l['flops_per_token'] / 1e9:.2f} GFLOP/token, {info_l['tokens_per_step']:,} tokens and "
            f"{info_l['flops_per_token'] * info_l['tokens_per_step'] / 1e12:.1f} TFLOP per step per rank"
        )
    tmp = Path(tempfile.gettempdir()) / "gpu_check_XXXX"
    chosen = set(args.phase_list)
    expected = sum(ESTIMATED_S[p] for p in args.phase_list)
    say(
        f"budget: {args.budget:.0f} s in all, ~{expected} s expected on one H200/H100 (cold caches); phases in "
        "order, with their limits and expected seconds (opt-in: not in this run):"
    )
    for phase in PHASES:
        mark = "         " if phase in chosen else "(opt-in) "
        say(
            f"  {phase:<12} <= {args.caps[phase]:.0f} s  ~{ESTIMATED_S[phase]:>3} s  "
            f"{mark}{shlex.join(child_command(args, phase, result_file(tmp, phase)))}"
        )
    examples = path_commands(args, tmp)
    say("  paths runs, from the repository root:")
    for name, cmd in examples.items():
        say(f"    {name:<10} {shlex.join(cmd)}")
    payload = {
        **info,
        "code_order_plan": code_info["plan"],
        "flops_per_token": fpt,
        "memory_estimate": mem,
        "llama": llamas,
        "phases": list(args.phase_list),
        "expected_s": {p: ESTIMATED_S[p] for p in args.phase_list},
        "commands": {p: child_command(args, p, result_file(tmp, p)) for p in PHASES},
        "path_commands": examples,
    }
    (out / "dry_run.json").write_text(json.dumps(payload, indent=1))
    say(f"written: {out / 'dry_run.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._phase:
        return run_phase(args)
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("console.log", "phases.log", PROFILE_FILE):
        (out / name).unlink(missing_ok=True)
    say = Console(out / "console.log")
    if args.dry_run:
        return dry_run(args, out, say)
    if args._device == "cuda" and (not torch.cuda.is_available() or torch.cuda.device_count() < 1):
        print(
            f"gpu_check: no CUDA GPU is visible (torch {torch.__version__}, built with CUDA {torch.version.cuda}, "
            "torch.cuda.is_available() is False). Run it on a machine with an NVIDIA GPU, or check the plan "
            "here with --dry-run.",
            file=sys.stderr,
        )
        return 2
    deadline = time.monotonic() + args.budget
    caches = Path(tempfile.mkdtemp(prefix="gpu_check_cache_"))
    runs: dict[str, PhaseRun] = {}
    env_info: dict[str, Any] = {"torch": torch.__version__}
    say(f"gpu_check: {', '.join(args.phase_list)}; budget {args.budget:.0f} s; files in {out.resolve()}")
    if not torch_supported(torch.__version__):
        say(
            f"WARNING: torch {torch.__version__} is outside the supported range {supported_range()}; a failure "
            "may be the version's, not the GPU path's"
        )

    def on_signal(signum, frame):  # keep what ran: stop the phase, write the files, exit 1
        stop_current()
        write_files(out, args, runs, env_info, final=True)
        say(f"gpu_check: stopped by signal {signum}; files written to {out}")
        sys.exit(1)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for phase in args.phase_list:
            run = runs[phase] = PhaseRun(phase)
            left = deadline - time.monotonic()
            run.limit = min(args.caps[phase], left)
            if run.limit < MIN_PHASE_S:
                run.status, run.note = "skipped", f"budget spent ({left:.0f} s left of {args.budget:.0f})"
                say(f"[{phase}] skipped: {run.note}")
                continue
            if phase in TRAIN_PHASES and env_info.get("total_memory"):
                need = memory_estimate(model_kwargs(args), args.batch, args.seq)["total"]
                if need > 0.9 * env_info["total_memory"]:
                    run.status = "skipped"
                    run.note = f"needs ~{need / 2**30:.0f} GiB of {env_info['total_memory'] / 2**30:.0f}; lower --batch or --seq"
                    say(f"[{phase}] skipped: {run.note}")
                    continue
            result = result_file(caches, phase)
            # an empty compile cache per phase (inductor's and Triton's): cold, comparable compile times
            cache = caches / f"cache-{phase}"
            env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=str(cache))
            env["TRITON_CACHE_DIR"] = str(cache / "triton")
            env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
            env["GPU_CHECK_PHASE_LIMIT"] = f"{run.limit:.0f}"  # paths shares it between its two examples
            say(f"[{phase}] running (limit {run.limit:.0f} s)")
            run.status, run.seconds = run_child(child_command(args, phase, result), out / "phases.log", run.limit, env)
            if phase == "tests" and result.exists():
                run.result = read_junit(result)
                if run.status == "failed":
                    run.note = "{failures} failed, {errors} errors, {passed} passed".format(**run.result)
            elif result.exists():
                run.result = json.loads(result.read_text())
                if run.result.get("status") == "failed" and run.status == "ok":
                    run.status = "failed"
            if run.status == "timeout":
                run.note = f"stopped after {run.limit:.0f} s (raise it with --cap {phase}=SECONDS or shrink the model)"
            if phase == "matmul" and run.status == "ok":
                env_info.update(run.result)
            profile = out / PROFILE_FILE
            if phase == "world8" and profile.exists() and env_info.get("matmul_flops_per_s"):
                # the world8 process does not know the matmul phase's rate: add it here
                data = with_matmul_rate(json.loads(profile.read_text()), env_info["matmul_flops_per_s"])
                profile.write_text(json.dumps(data, indent=1))
            say(f"[{phase}] {run.status} in {run.seconds:.0f} s" + (f": {run.note}" if run.note else ""))
            if run.status != "ok":
                say("  last lines of phases.log:\n    " + log_tail(out / "phases.log").replace("\n", "\n    "))
            write_files(out, args, runs, env_info, final=False)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(caches, ignore_errors=True)
    summary, checks = write_files(out, args, runs, env_info, final=True)
    say("")
    say(summary)
    failed = [name for name, ok, _ in checks if not ok]
    say(f"gpu_check: {'FAILED: ' + '; '.join(failed) if failed else 'all checks passed'} (files in {out.resolve()})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
