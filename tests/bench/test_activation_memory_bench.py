"""benchmarks/activation_memory.py's own logic (no ranks, no timing assertions)."""

from __future__ import annotations

import _bench
import pytest

activation_memory = _bench.load("activation_memory")


def test_help_runs():
    text = _bench.help_text("activation_memory")
    assert "--quick" in text and "matmuls_saved" in text


def test_summary_takes_the_larger_rank_and_ratios_against_off_of_the_same_path():
    def rank(saved_off, saved_full):
        return {
            "gpt|compiled off": {"saved_count": 10, "saved_bytes": saved_off, "times": [0.2, 0.4, 0.3], "warmup_s": 1},
            "gpt|compiled full": {"saved_count": 4, "saved_bytes": saved_full, "times": [0.3, 0.6], "warmup_s": 1},
            "gpt|eager-fsdp2 off": {"saved_count": 12, "saved_bytes": 2**21, "times": [0.5], "warmup_s": 0},
        }

    rows = {r["mode"]: r for r in activation_memory.summarize([rank(2**20, 2**18), rank(2**20, 2**19)])}
    assert rows["compiled full"]["saved_mib"] == 0.5  # the rank that saved more
    assert rows["compiled full"]["saved_vs_off"] == 0.5
    assert rows["compiled off"]["step_ms"] == pytest.approx(300.0)  # median over both ranks' steps
    assert rows["compiled full"]["time_vs_off"] == pytest.approx(0.45 / 0.3)
    assert rows["eager-fsdp2 off"]["saved_vs_off"] == 1.0  # its own baseline, not the compiled one
