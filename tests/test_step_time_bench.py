"""The benchmark script's own logic (no namespaces, no timing assertions)."""

from __future__ import annotations

import subprocess
import sys

import _bench
import pytest

step_time = _bench.load("step_time")
ROOT = _bench.ROOT


def test_help_runs():
    text = _bench.help_text("step_time")
    assert "--rate" in text and "--quick" in text and "comm-only" in text


@pytest.mark.parametrize("text, bps", [("300mbit", 300e6), ("1gbit", 1e9), ("512kbit", 512e3), ("100", 100.0)])
def test_parse_rate(text, bps):
    assert step_time.parse_rate(text) == bps


def test_summary_bounds_and_ratios():
    def rank(times_by_mode, rss):
        return {
            "modes": {m: {"times": t, "losses": [1.0], "peak_rss_mib": rss} for m, t in times_by_mode.items()},
            "ideal_bytes": 3_750_000,
        }

    times = {
        "fsdp2-eager": [2.0, 2.2, 1.9],
        "both": [1.0, 1.1, 1.2],
        "compute-only": [0.5, 0.5, 0.5],
        "comm-only": [0.8, 0.8, 0.9],
    }
    summary = step_time.summarize([rank(times, 100.0), rank(times, 120.0)], rate_bps=300e6)
    assert summary["transport_bound_s"] == pytest.approx(0.8)
    assert summary["ideal_bound_s"] == pytest.approx(max(0.5, 3_750_000 * 8 / 300e6))  # 0.5 vs 0.1
    both = summary["rows"]["both"]
    assert both["median_s"] == pytest.approx(1.1) and both["x_eager"] == pytest.approx(1.1 / 2.0)
    assert both["x_transport"] == pytest.approx(1.1 / 0.8)
    assert both["peak_rss_mib"] == [100.0, 120.0]


def test_link_phases_counts_busy_time():
    # 1 Mbit/s link; busy (8 kbit per 10 ms = 0.8 Mbit/s) during the first 0.1 s, idle after
    samples = [(i * 0.01, i * 1000 if i <= 10 else 10_000, 0) for i in range(21)]
    marks = [("forward", 0.0), ("backward", 0.1), ("end", 0.2)]
    phases = step_time.link_phases(samples, marks, rate_bps=1e6)["phases"]
    assert phases[0]["busy_fraction"] == pytest.approx(1.0)
    assert phases[1]["busy_fraction"] == pytest.approx(0.0) and phases[1]["idle_s"] == pytest.approx(0.1)


def test_unknown_mode_is_rejected():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "step_time.py"), "--modes", "both,fast"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "unknown mode(s) ['fast']" in out.stderr
