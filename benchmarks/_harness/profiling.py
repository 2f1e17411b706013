"""gpu_check.py's compute profile: torch.profiler rows per kernel (per ATen op on a CPU),
their kinds and per-name aggregation, and the schedule's FLOPs and bytes they are held
against (what compute_profile.json holds)."""

from __future__ import annotations

from typing import Any


def schedule_totals(report: dict) -> dict[str, int]:
    """FLOPs and bytes the passes' schedule counts for one training step: every ``compute``
    event in ``schedule["after"]`` of the forward and backward graphs that run now (the
    latest compile; every piece where graph breaks split a graph: ``records.current``, as
    the cost model's ``predicted`` picks them), or of ``report[kind]`` where the report has
    no per-graph records with a schedule. Per rank: the graphs hold one rank's batch."""
    from fsdp_overlap_plugin.runtime.records import current

    running = current(report.get("graphs") or [], (report.get("config") or {}).get("fullgraph", True))
    flops = nbytes = graphs = 0
    for kind in ("forward", "backward"):
        records = [r for r in running if r.get("graph") == kind and not r.get("inference") and "schedule" in r]
        if not records and (report.get(kind) or {}).get("schedule"):
            records = [report[kind]]
        for record in records:
            graphs += 1
            for event in record["schedule"]["after"]:
                if event["op"] == "compute":
                    flops += event["flops"]
                    nbytes += event["bytes"]
    return {"flops": flops, "bytes": nbytes, "graphs": graphs}


# Kinds of kernel (or, on a CPU, of ATen op) by name, first match wins: attention before
# matmul, as flash-attention kernels are CUTLASS templates too; inductor's generated kernels
# (triton_*) before copy, as their names carry the ops they fuse (a cast is "_to_copy").
_KINDS = (
    ("collective", ("nccl", "c10d", "all_gather", "reduce_scatter", "allgather")),
    ("attention", ("flash", "fmha", "attention", "scaled_dot_product")),
    ("matmul", ("gemm", "cutlass", "cublas", "nvjet", "xmma", "triton_tem_", "aten::mm", "aten::addmm", "aten::bmm")),
    ("triton", ("triton_",)),
    ("copy", ("memcpy", "memset", "copy", "catarraybatched", "chunk_cat", "split_with_sizes")),
)


def op_kind(name: str) -> str:
    """collective, attention, matmul, triton (inductor's generated kernels: element-wise,
    norms, casts, fused copy-in/out), copy (memcpy, memset, ATen's copy kernels) or other,
    from a kernel's or op's name."""
    low = name.lower()
    for kind, words in _KINDS:
        if any(w in low for w in words):
            return kind
    return "other"


def aggregate_ops(rows: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """Profiler rows (``name``, ``seconds``, ``count``; a name may repeat) summed per name:
    count, total seconds, per step (over ``steps`` profiled steps), share of all the rows'
    time, and the kind (``op_kind``); longest first."""
    by_name: dict[str, dict[str, Any]] = {}
    for row in rows:
        entry = by_name.setdefault(
            row["name"], {"name": row["name"], "kind": op_kind(row["name"]), "count": 0, "total_s": 0.0}
        )
        entry["count"] += int(row.get("count", 1))
        entry["total_s"] += float(row["seconds"])
    total = sum(e["total_s"] for e in by_name.values())
    out = []
    for e in sorted(by_name.values(), key=lambda e: (-e["total_s"], e["name"])):
        out.append(
            {
                **e,
                "per_step_s": e["total_s"] / steps,
                "calls_per_step": e["count"] / steps,
                "share": e["total_s"] / total if total else 0.0,
            }
        )
    return out


def compute_profile(
    rows: list[dict[str, Any]],
    *,
    steps: int,
    step_s: float,
    schedule: dict[str, int],
    device: str,
    torch_version: str,
    model: dict[str, Any],
    world: int,
    model_flops_per_step: float | None = None,
    matmul_flops_per_s: float | None = None,
) -> dict[str, Any]:
    """What compute_profile.json holds (the cost model reads the top-level keys): the device,
    versions, model and world; ``step_s`` (the median step measured without the profiler);
    the schedule's FLOPs and bytes per step (``schedule_totals``) and the FLOP rate that step
    time gives; the model FLOPs MFU counts (``llama_flops_per_token`` x tokens), to hold the
    schedule's count against; the measured matmul rate (None where the matmul phase did not run); the
    kernels' time per step and its share of the step (``busy_fraction``), per kind; and
    ``ops``, every kernel (op on a CPU) aggregated by name (``aggregate_ops``)."""
    ops = aggregate_ops(rows, steps)
    kernel_s = sum(o["total_s"] for o in ops) / steps
    kinds: dict[str, float] = {}
    for o in ops:
        kinds[o["kind"]] = kinds.get(o["kind"], 0.0) + o["per_step_s"]
    profile = {
        "device": device,
        "torch": torch_version,
        "model": model,
        "world": world,
        "step_s": step_s,
        "schedule_flops_per_step": schedule["flops"],
        "schedule_bytes_per_step": schedule["bytes"],
        "achieved_flops_per_s": schedule["flops"] / step_s if step_s > 0 else None,
        "model_flops_per_step": model_flops_per_step,
        "profiled_steps": steps,
        "kernel_s_per_step": kernel_s,
        "busy_fraction": kernel_s / step_s if step_s > 0 else None,
        "kind_s_per_step": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "ops": ops,
    }
    return with_matmul_rate(profile, matmul_flops_per_s)


def with_matmul_rate(profile: dict[str, Any], matmul_flops_per_s: float | None) -> dict[str, Any]:
    """``profile`` with the measured matmul rate and the achieved rate's fraction of it (the
    parent adds them once the matmul phase has run: the world8 process does not know them)."""
    achieved = profile.get("achieved_flops_per_s")
    return {
        **profile,
        "matmul_flops_per_s": matmul_flops_per_s,
        "achieved_of_matmul": achieved / matmul_flops_per_s if achieved and matmul_flops_per_s else None,
    }


def profiler_rows(step: Any, steps: int, device_type: str) -> list[dict[str, Any]]:
    """Run ``step(i)`` ``steps`` times under torch.profiler; one row per kernel name (per
    ATen op on a CPU): ``name``, ``seconds`` (its own device time; CPU time on a CPU),
    ``count``. Kernels only on a GPU, so an op and the kernels it launched are not both counted."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device_type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for i in range(steps):
            step(i)
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for avg in prof.key_averages():
        if cuda:
            if avg.device_type != DeviceType.CUDA:
                continue
            us = getattr(avg, "self_device_time_total", None)
            us = avg.self_cuda_time_total if us is None else us
        else:
            if avg.device_type != DeviceType.CPU:
                continue
            us = avg.self_cpu_time_total
        if us > 0:
            rows.append({"name": avg.key, "seconds": us / 1e6, "count": avg.count})
    return rows
