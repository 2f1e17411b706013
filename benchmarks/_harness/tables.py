"""Summary statistics the benchmarks' tables print, and gpu_check.py's Markdown tables
(its training phases, the paths)."""

from __future__ import annotations

import shlex
import statistics
from typing import Any


def time_stats(times: list[float]) -> dict:
    """Median, fastest and slowest step time, and how many steps."""
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "steps": len(times)}


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table; a phase that did not finish shows its status and dashes."""
    head = ["", "compile s", "first step s", "step s", "tokens/s", "model TFLOP/s", "MFU", "peak GiB", "final loss"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        label = r["label"] if r["status"] == "ok" else f"{r['label']} ({r['status']})"
        cells = [
            label,
            fmt(r.get("compile_s"), ".1f"),
            fmt(r.get("first_step_s"), ".1f"),
            fmt(r.get("step_s"), ".3f"),
            fmt(r.get("tokens_per_s"), ",.0f"),
            fmt(r.get("model_tflops"), ".0f"),
            "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%",
            fmt(r.get("peak_gib"), ".1f"),
            fmt(r.get("final_loss"), ".4f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_paths(result: dict[str, Any]) -> list[str]:
    """The paths table: each example's status, wall time and losses, and its command."""
    lines = ["| path | status | wall s | steps | loss, first -> last quarter (mean) |", "|---|---|---|---|---|"]
    commands = []
    for name, r in (result.get("runs") or {}).items():
        losses = r.get("losses") or []
        k = max(1, len(losses) // 4)
        trend = (
            f"{statistics.fmean(losses[:k]):.4f} -> {statistics.fmean(losses[-k:]):.4f}"
            + ("" if r.get("falling") else " (not falling)")
            if len(losses) >= 2
            else "-"
        )
        lines.append(f"| {r['label']} | {r['status']} | {r['wall_s']:.0f} | {len(losses)} | {trend} |")
        commands.append(f"- {name}: `{shlex.join(r['command'])}` (output: {r['log']})")
    return lines + ["", *commands]
