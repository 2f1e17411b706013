"""gpu_check.py's code-order oracle: the all-gathers in inductor's generated forward and
backward modules (where each launches, is waited on, what compute runs between, how many
elements it returns) checked against a parallelized model's plan and the passes' record."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

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

    from fsdp_overlap_plugin.config.plan import find_repeated_blocks
    from fsdp_overlap_plugin.passes.prefetch import kept_buckets

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


def check_generated_code(model: Any, codes: list[str], world: int) -> dict[str, Any]:
    """Inductor's generated forward and backward modules of a parallelized ``model``'s first
    step (``run_and_get_code``) against its plan and the passes' record (``expected_gathers``,
    ``check_code_order``): the plan, what was expected, each all-gather's window, the passes'
    statistics, the problems (empty: all good) and the code itself."""
    import fsdp_overlap_plugin as fo

    report = fo.schedule_report(model)
    plan = report["plan"]
    expected = expected_gathers(model, plan, world, report)
    problems = list(expected["problems"])
    codes = list(codes)
    if len(codes) != 2:
        problems.append(f"expected 2 generated modules (forward, backward), got {len(codes)}")
        codes = (codes + ["", ""])[:2]
    problems += check_code_order(codes[0], expected["forward"], expected["forward_needs_compute"], "forward")
    problems += check_code_order(codes[1], expected["backward"], expected["backward_needs_compute"], "backward")
    return {
        "plan": plan,
        "expected": {k: v for k, v in expected.items() if k != "problems"},
        "windows": {
            kind: [w.__dict__ for w in gather_windows(code)] for kind, code in zip(("forward", "backward"), codes)
        },
        "passes": {k: (report.get(k) or {}).get("passes") for k in ("forward", "backward")},
        "problems": problems,
        "codes": codes,
    }
