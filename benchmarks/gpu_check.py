"""The GPU path in one command: CUDA unit tests, a ~1B-parameter GPT compiled with inductor
on NCCL (passes off and on, and eager FSDP2 ``fully_shard``), its losses, speed and memory,
and inductor's generated code checked for the bucketed collectives in the planned order.

    python benchmarks/gpu_check.py                  # one CUDA GPU; files go to $OUT or ./gpu_check_out
    python benchmarks/gpu_check.py --dry-run        # anywhere: meta-device model, plan, bytes, commands
    python benchmarks/gpu_check.py --n-layer 12 --batch 4 --phases compiled-on,code-order

Phases, each in its own process with its own time limit (a hang or crash is reported and
the next phase still runs; files are rewritten after every phase):

    matmul        GPU name, versions, and the measured bf16 matmul rate (MFU's denominator)
    tests         pytest -m cuda tests/test_*_cuda.py (the unit tests with a CUDA variant)
    compiled-off  parallelize(), inductor, bf16 params / fp32 reduce, passes off
    compiled-on   the same with the passes on (bucketing, gradient overlap, order pinning)
    eager         compile: false (FSDP2 fully_shard per bucket), the baseline
    code-order    a fake process group of --code-world ranks on the GPU: compile with the
                  passes on, run one step, check inductor's generated code

What a single GPU can show: the three training phases run a world of ONE NCCL rank. On a
1-rank mesh DTensor skips the gather altogether (there is nothing to gather), so those
compiled graphs hold no collectives: they prove that the GPU compile path works and
measure its compute-side cost (step time, tokens/s, MFU, memory), not overlap. The
collectives, and whether inductor's GPU code keeps them where the passes put them, are
checked by the code-order phase on a fake process group (it compiles the graph that N
ranks would run; its collectives move no data, so it is not timed).

Exit status: 0 when every phase ran and every check passed; 1 when a check failed, a
phase failed or ran out of time; 2 for bad arguments or no CUDA GPU (before anything
expensive). Files written to --out: summary.md (the table and the checks), results.json,
console.log, phases.log (every phase's output), code_forward.py / code_backward.py (the
generated code the code-order phase checked).
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
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if (REPO / "fsdp_overlap_plugin").is_dir() and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run from a checkout without installing the package

# The torch range pyproject.toml admits, read from it (the package's one statement of it).
from fsdp_overlap_plugin._version import supported_range, torch_supported  # noqa: E402

PHASES = ("matmul", "tests", "compiled-off", "compiled-on", "code-order", "eager")
TRAIN_PHASES = ("compiled-off", "compiled-on", "eager")
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
}
MIN_PHASE_S = 20  # a phase that would get less than this is skipped, not started
DEFAULT_BUDGET_S = 345  # the issue's bound is 6 minutes; leave room for start-up and files

# Generated code: a launch, its output-size assert, a wait, and the kernels that count as
# compute a launch can hide behind (matmuls and attention; inductor's templates too).
# A merged all-gather writes into a buffer allocated before it (out=; passes/merge.py),
# an unmerged one returns a new buffer whose size inductor asserts.
_LAUNCH = re.compile(
    r"^\s*(?:(buf\d+) = torch\.ops\._c10d_functional\.all_gather_into_tensor\.default\("
    r"|torch\.ops\._c10d_functional\.all_gather_into_tensor_out\.default\(.*out=(buf\d+)\))"
)
_SIZE = re.compile(r"(?:assert_size_stride\(|^\s*)(buf\d+)(?:, | = empty_strided_\w+\()\(([\d, ]*)\)")
_WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((buf\d+)\)")
_COMPUTE = re.compile(
    r"extern_kernels\.(mm|addmm|bmm|baddbmm)\("
    r"|torch\.ops\.aten\._scaled_dot_product_\w+\.default\("
    r"|torch\.ops\.aten\._(flash|efficient)_attention_(forward|backward)\.default\("
    r"|\btriton_tem_\w+\.run\("
)


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
    r = p.add_argument_group("time")
    r.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for all phases together")
    r.add_argument("--cap", action="append", default=[], metavar="PHASE=SECONDS", help="change one phase's time limit")
    r.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of: {', '.join(PHASES)}")
    # internal: the parent starts each phase as `gpu_check.py --_phase NAME --_result FILE ...`
    p.add_argument("--_phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    # tests only: run the training phases on CPU (gloo, aot_eager) to exercise the plumbing
    p.add_argument("--_device", default="cuda", choices=("cuda", "cpu"), help=argparse.SUPPRESS)
    return p


def _suggest(word: str, choices: tuple[str, ...]) -> str:
    from fsdp_overlap_plugin.config import suggest

    return suggest(word, choices)


def validate(args: argparse.Namespace) -> list[str]:
    """Every problem with the arguments, found before anything is built or started."""
    errors = []
    for name in ("n_layer", "d_model", "n_head", "vocab", "batch", "seq", "steps", "code_layers"):
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
    for name in ("loss_rtol", "eager_rtol"):
        if not 0 < getattr(args, name) < 1:
            errors.append(f"--{name.replace('_', '-')} must be between 0 and 1, got {getattr(args, name)}")
    if args.budget < MIN_PHASE_S:
        errors.append(f"--budget must be >= {MIN_PHASE_S} s, got {args.budget}")
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    if not phases:
        errors.append(f"--phases is empty; valid: {', '.join(PHASES)}")
    for name in phases:
        if name not in PHASES:
            errors.append(f"--phases: unknown phase {name!r}.{_suggest(name, PHASES)} Valid: {', '.join(PHASES)}")
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
def matmul_params(cfg: dict[str, int]) -> int:
    """Parameters that take part in matmuls (every Linear weight: blocks and head); the
    embeddings are lookups and the biases and norms are element-wise."""
    d, v, n = cfg["d_model"], cfg["vocab_size"], cfg["n_layer"]
    return n * 12 * d * d + d * v


def flops_per_token(cfg: dict[str, int], seq: int) -> float:
    """Training FLOPs per token: 6 per matmul parameter (forward 2, backward 4), plus
    attention's scores and weighted sum, 12 * n_layer * seq * d_model (PaLM, appendix B:
    the full seq x seq matrix is counted, as the causal half is not skipped by every kernel)."""
    return 6 * matmul_params(cfg) + 12 * cfg["n_layer"] * seq * cfg["d_model"]


def throughput(
    tokens_per_step: int, step_s: float, fpt: float, matmul_flops_per_s: float | None
) -> dict[str, float | None]:
    """tokens/s, achieved model TFLOP/s and MFU (a fraction of the measured matmul rate)."""
    tokens_per_s = tokens_per_step / step_s
    achieved = tokens_per_s * fpt
    return {
        "tokens_per_s": tokens_per_s,
        "model_tflops": achieved / 1e12,
        "mfu": achieved / matmul_flops_per_s if matmul_flops_per_s else None,
    }


def param_count(cfg: dict[str, int]) -> int:
    """All parameters of the GPT (independent of building it)."""
    d, v, t, n = cfg["d_model"], cfg["vocab_size"], cfg["block_size"], cfg["n_layer"]
    block = 12 * d * d + 13 * d  # qkv 3d^2+3d, proj d^2+d, fc 4d^2+4d, proj 4d^2+d, 2 LayerNorms 4d
    return v * d + t * d + n * block + 2 * d + d * v


def memory_estimate(cfg: dict[str, int], batch: int, seq: int) -> dict[str, int]:
    """A rough peak for one rank holding the whole model (bytes): fp32 master weights,
    fp32 gradients, AdamW's two fp32 states, a bf16 copy of the weights, activations at
    ~34 bytes per token per layer per model dimension (Korthikanti et al., flash attention),
    and the logits (bf16, their fp32 copy for the loss, and its gradient)."""
    n = param_count(cfg)
    tokens = batch * seq
    parts = {
        "weights+grads+adam (fp32)": 16 * n,
        "bf16 weights": 2 * n,
        "activations": 34 * tokens * cfg["d_model"] * cfg["n_layer"],
        "logits": 10 * tokens * cfg["vocab_size"],
    }
    parts["total"] = sum(parts.values())
    return parts


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


# --------------------------------------------------------------------------- the plan
def plan_summary(args: argparse.Namespace, n_layer: int | None = None) -> dict[str, Any]:
    """Build the GPT on the meta device and resolve its plan exactly as ``parallelize``
    would (same config, same functions); bytes are as gathered, in bf16."""
    import torch

    from fsdp_overlap_plugin import resolve_plan
    from fsdp_overlap_plugin.models import gpt_1b
    from fsdp_overlap_plugin.plan import auto_plan_info

    cfg = model_kwargs(args, n_layer)
    with torch.device("meta"):
        model = gpt_1b(**cfg)
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


def gather_numel(model: Any, bucket: list[str], world: int) -> int:
    """Elements one all-gather of ``bucket`` returns on ``world`` ranks: every parameter
    padded to a multiple of ``world`` rows (``torch.chunk`` shards, as FSDP2 pads)."""
    total = 0
    seen = set()
    for fqn in bucket:
        for p in model.get_submodule(fqn).parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            rows = p.shape[0] if p.dim() else 1
            rest = p.numel() // rows if rows else 0
            total += world * math.ceil(rows / world) * rest
    return total


# --------------------------------------------------------------------------- generated code
@dataclass
class Window:
    """One all-gather in generated code: where it launches, where it is waited on, how
    many compute kernels (matmul, attention) run in between, and how many elements it returns."""

    buf: str
    launch: int
    wait: int | None
    compute: int
    numel: int | None


def gather_windows(code: str) -> list[Window]:
    """The all-gathers of one generated module, in launch order."""
    lines = code.splitlines()
    launches: list[tuple[str, int]] = []
    waits: dict[str, int] = {}
    sizes: dict[str, int] = {}
    compute: list[int] = []
    for i, line in enumerate(lines):
        if m := _LAUNCH.search(line):
            launches.append((m.group(1) or m.group(2), i))
        elif m := _WAIT.search(line):
            waits.setdefault(m.group(1), i)
        elif _COMPUTE.search(line):
            compute.append(i)
        if m := _SIZE.search(line):
            dims = [int(x) for x in m.group(2).replace(" ", "").split(",") if x]
            sizes.setdefault(m.group(1), math.prod(dims))
    out = []
    for buf, start in launches:
        end = waits.get(buf)
        n = sum(1 for i in compute if start < i < end) if end is not None else 0
        out.append(Window(buf, start, end, n, sizes.get(buf)))
    return out


def check_code_order(code: str, expected_numels: list[int], needs_compute: list[bool], graph: str) -> list[str]:
    """Problems with one generated module's all-gathers (empty: all good).

    ``expected_numels``: the planned all-gathers in the order the passes put them;
    ``needs_compute[k]``: the k-th must have compute between its launch and its wait (it
    is prefetched behind the previous bucket's matmuls). Checked: the count; the sizes in
    order (where inductor printed them); each launch before the previous one's wait; the
    compute in each window that needs it; every launch waited on.
    """
    windows = gather_windows(code)
    problems = []
    if len(windows) != len(expected_numels):
        problems.append(f"{graph}: {len(windows)} all-gathers in the generated code, {len(expected_numels)} planned")
        return problems
    for k, (w, numel) in enumerate(zip(windows, expected_numels)):
        if w.wait is None:
            problems.append(f"{graph}: all-gather {k} ({w.buf}) is never waited on")
            continue
        if w.numel is not None and w.numel != numel:
            problems.append(
                f"{graph}: all-gather {k} ({w.buf}) returns {w.numel} elements, planned {numel} (out of order?)"
            )
        if k and windows[k - 1].wait is not None and not w.launch < windows[k - 1].wait:
            problems.append(f"{graph}: all-gather {k} ({w.buf}) launches after all-gather {k - 1}'s wait (no prefetch)")
        if needs_compute[k] and w.compute < 1:
            problems.append(
                f"{graph}: no matmul or attention between all-gather {k}'s launch and its wait (nothing hides it)"
            )
    return problems


def expected_gathers(model: Any, plan: list[list[str]], world: int, report: dict) -> dict[str, Any]:
    """What the generated code must hold, from the plan and the passes' own record.

    Forward: one all-gather per bucket, in plan order, each of the bucket's padded size
    (computed from the parameters, independently of the record, which must agree); each
    one after the first hides behind the previous bucket's matmuls when that bucket has any.
    Backward: every repeated block but the buckets kept gathered is re-gathered (reshard
    after forward), last block first; the record must say so, and its sizes are the expectation
    (the backward re-gathers only the parameters it uses: a block's biases are left out);
    each hides behind compute.
    """
    import torch.nn as nn

    from fsdp_overlap_plugin.passes.prefetch import kept_buckets
    from fsdp_overlap_plugin.plan import find_repeated_blocks

    has_matmul = [any(isinstance(m, nn.Linear) for f in b for m in model.get_submodule(f).modules()) for b in plan]
    forward = [gather_numel(model, b, world) for b in plan]
    itemsize = 2  # bf16 (variant_config's param_dtype)
    problems = []
    fwd_events = [
        e for e in (report.get("forward") or {}).get("schedule", {}).get("after", []) if e["op"] == "all_gather"
    ]
    bwd_events = [
        e for e in (report.get("backward") or {}).get("schedule", {}).get("after", []) if e["op"] == "all_gather"
    ]
    fwd_buckets = [e["bucket"] for e in fwd_events]
    if fwd_buckets != list(range(len(plan))):
        problems.append(
            f"forward: the passes launch all-gathers of buckets {fwd_buckets}, planned {list(range(len(plan)))}"
        )
    recorded = [e["bytes"] // itemsize for e in fwd_events]
    if fwd_buckets == list(range(len(plan))) and recorded != forward:
        problems.append(f"forward: the passes' all-gathers hold {recorded} elements, the plan {forward}")
    # reshard after forward: backward re-gathers each block, last first; not the buckets
    # the forward keeps gathered (the last one, and the block before it where the last
    # gathers fewer bytes: passes.prefetch.kept_buckets for the run's prefetch_depth and
    # budget, on the plan's sizes, as `fsdp-overlap check` applies it), nor the embeddings
    # (their backward needs only the indices)
    found = find_repeated_blocks(model)
    blocks = set(found[1]) if found else set()
    config = report["config"]
    kept = kept_buckets(
        [n * itemsize for n in forward],  # bytes: the budget is in bytes
        config["prefetch_depth"],
        config["max_prefetch_bytes"],
        cover=config["manual_bucketing"],
    )
    planned_bwd = [i for i in reversed(range(len(plan) - kept)) if plan[i][0] in blocks]
    bwd_buckets = [e["bucket"] for e in bwd_events]
    if bwd_buckets != planned_bwd:
        problems.append(f"backward: the passes re-gather buckets {bwd_buckets}, planned {planned_bwd}")
    return {
        "forward": forward,
        "forward_needs_compute": [False] + has_matmul[:-1],
        "backward": [e["bytes"] // itemsize for e in bwd_events],
        "backward_buckets": bwd_buckets,
        "backward_needs_compute": [True] * len(bwd_events),
        "problems": problems,
    }


# --------------------------------------------------------------------------- phases (children)
def _init_world_of_one(device_type: str = "cuda") -> None:
    """A 1-rank default process group (nccl; gloo for the CPU tests) through a FileStore:
    no network at all."""
    import torch
    import torch.distributed as dist

    from fsdp_overlap_plugin import accelerators

    if device_type == "cuda":
        torch.cuda.set_device(0)
    backend = accelerators.backend_for(device_type)
    folder = tempfile.mkdtemp(prefix="gpu_check_store_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    store = dist.FileStore(os.path.join(folder, "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)


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
    from fsdp_overlap_plugin.models import fixed_batches, gpt_1b, loss_fn

    device = args._device
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    config = variant_config(phase)
    if not cuda:
        config["backend"] = "aot_eager"
    _init_world_of_one(device)
    try:
        cfg = model_kwargs(args)
        torch.manual_seed(args.seed)
        with torch.device(device):
            model = gpt_1b(**cfg)
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
    from fsdp_overlap_plugin.models import fixed_batches, gpt_1b, loss_fn

    seq = seq or kwargs["block_size"]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    torch._dynamo.reset()
    try:
        device = torch.device(device_type, 0) if device_type != "cpu" else torch.device("cpu")
        torch.manual_seed(0)
        with torch.device(device):
            model = gpt_1b(**kwargs)
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
        fo.parallelize(model, variant_config("code-order"), mesh=mesh)
        x, y = (t.to(device) for t in fixed_batches(1, batch, seq, kwargs["vocab_size"])[0])
        start = time.perf_counter()
        _, codes = run_and_get_code(lambda: loss_fn(model(x), y).backward())
        compile_s = time.perf_counter() - start
        report = fo.schedule_report(model)
        plan = report["plan"]
        expected = expected_gathers(model, plan, world, report)
        problems = list(expected["problems"])
        if len(codes) != 2:
            problems.append(f"expected 2 generated modules (forward, backward), got {len(codes)}")
            codes = (list(codes) + ["", ""])[:2]
        problems += check_code_order(codes[0], expected["forward"], expected["forward_needs_compute"], "forward")
        problems += check_code_order(codes[1], expected["backward"], expected["backward_needs_compute"], "backward")
        return {
            "world": world,
            "model": kwargs,
            "plan": plan,
            "compile_s": compile_s,
            "expected": {k: v for k, v in expected.items() if k != "problems"},
            "windows": {
                kind: [w.__dict__ for w in gather_windows(code)] for kind, code in zip(("forward", "backward"), codes)
            },
            "passes": {k: (report.get(k) or {}).get("passes") for k in ("forward", "backward")},
            "problems": problems,
            "codes": list(codes),
        }
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
def result_file(folder: Path, phase: str) -> Path:
    """Where a phase leaves its result: pytest's junit XML for the tests, JSON otherwise."""
    return folder / f"{phase}.{'xml' if phase == 'tests' else 'json'}"


# the options a phase process needs (the parent forwards them; everything else stays with it)
FORWARDED = ("n_layer", "d_model", "n_head", "vocab", "batch", "seq", "steps", "warmup", "lr", "seed")
FORWARDED += ("code_layers", "code_world", "_device")


def child_command(args: argparse.Namespace, phase: str, result: str | Path) -> list[str]:
    """The exact command the parent runs for a phase."""
    if phase == "tests":
        files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*_cuda.py"))
        pytest = ["-m", "pytest", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider"]
        return [sys.executable, *pytest, "--junitxml", str(result), *files]
    argv = [sys.executable, str(Path(__file__).resolve()), "--_phase", phase, "--_result", str(result)]
    argv += ["--out", str(args.out)]
    for name in FORWARDED:
        argv += [f"--{name.replace('_', '-')}" if not name.startswith("_") else f"--{name}", str(getattr(args, name))]
    return argv


@dataclass
class PhaseRun:
    name: str
    status: str = "not run"  # ok | failed | timeout | skipped
    seconds: float = 0.0
    limit: float = 0.0
    result: dict = field(default_factory=dict)
    note: str = ""


class Console:
    """Prints and keeps a copy in console.log."""

    def __init__(self, path: Path):
        self.path = path

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        with self.path.open("a") as f:
            f.write(text + "\n")


_CURRENT_CHILD: subprocess.Popen | None = None


def _stop(proc: subprocess.Popen) -> None:
    """End a phase we started, and everything it started (its own process group)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_child(cmd: list[str], log: Path, limit: float, env: dict[str, str]) -> tuple[str, float]:
    """Run ``cmd`` with its output appended to ``log``; ``("ok" | "failed" | "timeout", seconds)``."""
    global _CURRENT_CHILD
    start = time.perf_counter()
    with log.open("a") as f:
        f.write(f"\n===== {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        _CURRENT_CHILD = proc
        try:
            rc = proc.wait(timeout=limit)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            _stop(proc)
            status = "timeout"
        finally:
            _CURRENT_CHILD = None
    return status, time.perf_counter() - start


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def read_junit(path: Path) -> dict[str, int]:
    """Counts from pytest's junit XML: tests, failures, errors, skipped, passed."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


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


def format_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table; a phase that did not finish shows its status and dashes."""
    head = ["", "compile s", "first step s", "step s", "tokens/s", "model TFLOP/s", "MFU", "peak GiB", "final loss"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        label = r["label"] if r["status"] == "ok" else f"{r['label']} ({r['status']})"
        cells = [
            label,
            _fmt(r.get("compile_s"), ".1f"),
            _fmt(r.get("first_step_s"), ".1f"),
            _fmt(r.get("step_s"), ".3f"),
            _fmt(r.get("tokens_per_s"), ",.0f"),
            _fmt(r.get("model_tflops"), ".0f"),
            "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%",
            _fmt(r.get("peak_gib"), ".1f"),
            _fmt(r.get("final_loss"), ".4f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
    return checks


def write_files(
    out: Path, args: argparse.Namespace, runs: dict[str, PhaseRun], env_info: dict, final: bool
) -> tuple[str, list]:
    """summary.md and results.json, rewritten after every phase (so a kill keeps what ran)."""
    cfg = model_kwargs(args)
    fpt = flops_per_token(cfg, args.seq)
    rate = env_info.get("matmul_flops_per_s")
    rows = table_rows(runs, fpt, rate)
    checks = evaluate(runs, args)
    passed = final and all(ok for _, ok, _ in checks) and all(r.status == "ok" for r in runs.values())
    lines = [
        f"# GPU check ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"- device: {env_info.get('device', '?')} (compute capability {env_info.get('capability', '?')}, "
        f"{_fmt((env_info.get('total_memory') or 0) / 2**30 or None, '.0f')} GiB); torch {env_info.get('torch', '?')}, "
        f"CUDA {env_info.get('cuda', '?')}, triton {env_info.get('triton', '?')}, NCCL {env_info.get('nccl', '?')}",
        f"- model: gpt_1b({', '.join(f'{k}={v}' for k, v in cfg.items())}), {param_count(cfg) / 1e9:.2f}B parameters; "
        f"batch {args.batch} x {args.seq} tokens; {args.warmup} warm-up + {args.steps} timed steps; AdamW lr {args.lr}",
        "- bf16 params, fp32 reduce, auto plan, inductor; one NCCL rank (world of 1)",
        f"- MFU: model FLOPs ({fpt / 1e9:.2f} GFLOP/token, 6 x matmul params + attention) over the measured bf16 "
        f"matmul rate ({_fmt(rate and rate / 1e12, '.0f')} TFLOP/s); compile s = first step - median step; "
        "each phase compiles into its own empty inductor cache",
        "",
        format_table(rows),
        "",
        "World of one: DTensor skips the gather on a 1-rank mesh, so these compiled graphs hold no",
        "collectives and passes off/on compile nearly the same graph. The rows measure the GPU compile",
        "path and its compute-side cost, not overlap. The collectives' order in inductor's GPU code is",
        f"checked on a fake process group of {args.code_world} ranks (code-order phase, {args.code_layers} blocks).",
        "",
        "## Checks",
        "",
    ]
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
    say(f"budget: {args.budget:.0f} s in all; phases in order, with their limits:")
    tmp = Path(tempfile.gettempdir()) / "gpu_check_XXXX"
    for phase in args.phase_list:
        say(
            f"  {phase:<12} <= {args.caps[phase]:.0f} s   {shlex.join(child_command(args, phase, result_file(tmp, phase)))}"
        )
    payload = {
        **info,
        "code_order_plan": code_info["plan"],
        "flops_per_token": fpt,
        "memory_estimate": mem,
        "commands": {p: child_command(args, p, result_file(tmp, p)) for p in args.phase_list},
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
    for name in ("console.log", "phases.log"):
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
        if _CURRENT_CHILD is not None:
            _stop(_CURRENT_CHILD)
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
            say(f"[{phase}] {run.status} in {run.seconds:.0f} s" + (f": {run.note}" if run.note else ""))
            if run.status != "ok":
                say("  last lines of phases.log:\n    " + _tail(out / "phases.log").replace("\n", "\n    "))
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
