"""The ``inductor_overlap`` setting: what each value lets inductor's own distributed passes
do to our graphs, whether this torch and config can run it, and how the report names it.
``compile/torch_passes.py`` applies it to a compile; what the passes are and why the
default is off: there and in docs/performance.md."""

from __future__ import annotations

from typing import Any

from .. import _torch_compat as compat

__all__ = ["NAMES", "SETTINGS", "available", "describe", "device_error", "setting_error", "summary_line"]

SETTINGS = ("off", "simple", "auto")

# the names the report and the docs use for each of torch's passes
NAMES = {
    "simple_overlap": "simple overlap (aten_distributed_optimizations.enable_simple_overlap)",
    "overlap_scheduling": "overlap scheduling with bucketing (aten_distributed_optimizations.enable_overlap_scheduling)",
}


def available() -> dict[str, bool]:
    """Which of torch's passes this torch has."""
    return compat.inductor_distributed_passes()


def setting_error(setting: str, passes_on: bool, backend: str) -> str | None:
    """Why ``inductor_overlap: setting`` cannot run with this config on this torch, or None."""
    if setting == "off":
        return None
    if backend != "inductor":
        return (
            f"inductor_overlap: {setting} names inductor's own passes, which run only with backend: inductor "
            f"(this config has backend: {backend}); use inductor_overlap: off with it."
        )
    have = available()
    if setting == "simple" and not have["simple_overlap"]:
        return (
            f"inductor_overlap: simple needs torch 2.14 or newer (inductor's enable_simple_overlap); this torch "
            f"is {compat.TORCH_VERSION}: use off, or auto (with manual_bucketing and overlap_grad_reduce false)."
        )
    if setting == "auto":
        if not have["overlap_scheduling"]:
            return (
                f"inductor_overlap: auto needs inductor's enable_overlap_scheduling, which torch "
                f"{compat.TORCH_VERSION} does not have; use off."
            )
        if passes_on:
            return (
                "inductor_overlap: auto hands the whole schedule to torch's overlap scheduler, which replaces ours: "
                "set manual_bucketing: false and overlap_grad_reduce: false with it, or use inductor_overlap: "
                "simple (torch's pass that only refines our order) or off. (With our passes on, torch 2.15's "
                "scheduler fails to lower our merged graphs.)"
            )
    return None


def device_error(setting: str, device_type: str) -> str | None:
    """Why ``setting`` cannot run on ``device_type`` with this torch, or None. Off CUDA the
    plugin costs torch's scheduler itself (``compile/torch_passes.runtime_estimator``), but
    torch 2.11's scheduler also runs a roofline of its own that asserts a CUDA device."""
    if setting == "auto" and device_type != "cuda" and compat.TORCH_VERSION < "2.13":
        return (
            f"inductor_overlap: auto on {device_type} needs torch 2.13 or newer: torch {compat.TORCH_VERSION}'s "
            "overlap scheduler asserts a CUDA device in its cost model. Use off, or upgrade torch."
        )
    return None


def describe(setting: str, backend: str | None) -> dict[str, Any]:
    """For the report: the setting, which of torch's passes ran on our graphs, which were
    held off, and which this torch does not have."""
    have = available() if backend == "inductor" else {k: False for k in NAMES}
    on = {"simple_overlap": setting in ("simple", "auto"), "overlap_scheduling": setting == "auto"}
    return {
        "setting": setting,
        "ran": [k for k in NAMES if have[k] and on[k]] if backend == "inductor" else [],
        "held_off": [k for k in NAMES if have[k] and not on[k]] if backend == "inductor" else [],
        "absent": [k for k in NAMES if not have[k]] if backend == "inductor" else [],
    }


def summary_line(torch_passes: dict[str, Any]) -> str:
    """One line of the schedule summary: which of torch's passes ran on our graphs."""
    ran = torch_passes.get("ran") or []
    held = torch_passes.get("held_off") or []
    absent = torch_passes.get("absent") or []
    words = {"simple_overlap": "simple overlap", "overlap_scheduling": "overlap scheduling"}
    parts = [("ran: " + ", ".join(words[k] for k in ran)) if ran else "none ran"]
    if held:
        parts.append("held off: " + ", ".join(words[k] for k in held))
    if absent:
        parts.append("not in this torch: " + ", ".join(words[k] for k in absent))
    return f"  torch's distributed passes (inductor_overlap: {torch_passes['setting']}): " + "; ".join(parts)
