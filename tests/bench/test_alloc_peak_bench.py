"""benchmarks/alloc_peak.py: the exact per-step allocation peak on a fake process group."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _bench import BENCHMARKS, help_text


def test_help_names_the_fake_process_group():
    assert "fake process group" in help_text("alloc_peak")


def test_eager_mode_counts_fsdp2s_gathers_and_reductions():
    """One mode in a fresh process (the benchmark's child): the peak of the step's
    allocations, and among the largest alive at it FSDP2's own all-gather and
    reduce-scatter buffers (a block of gpt small: 3 MiB gathered)."""
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "alloc_peak.py"), "--child", "fsdp2-eager", "--batch", "1", "--top", "4"],
        capture_output=True,
        text=True,
        check=True,
    )
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["mode"] == "fsdp2-eager" and 10 < row["peak_mib"] < 40, row
    assert abs(row["end_mib"]) < 1.0, row  # the step frees what it allocated
    sites = [a["site"] for a in row["largest"]]
    assert any("FSDP::all_gather" in s for s in sites) and any("post_backward_reduce" in s for s in sites), sites
    assert all(a["mib"] <= 3.1 for a in row["largest"])


def test_set_reads_values_as_json_else_as_strings():
    import importlib.util

    spec = importlib.util.spec_from_file_location("alloc_peak", BENCHMARKS / "alloc_peak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module._setting("max_prefetch_bytes=14MiB") == ("max_prefetch_bytes", "14MiB")
    assert module._setting("prefetch_depth=2") == ("prefetch_depth", 2)
    assert module._setting("max_prefetch_bytes=null") == ("max_prefetch_bytes", None)
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        module._setting("prefetch_depth")
