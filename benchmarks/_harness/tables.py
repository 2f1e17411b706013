"""Summary statistics the benchmarks' tables print."""

from __future__ import annotations

import statistics


def time_stats(times: list[float]) -> dict:
    """Median, fastest and slowest step time, and how many steps."""
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "steps": len(times)}
