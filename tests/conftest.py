"""Test-session setup: a private inductor cache so every run compiles (and runs the
passes) from scratch, unless FSDP_OVERLAP_TEST_CACHE names a cache to reuse."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ.get("FSDP_OVERLAP_TEST_CACHE") or tempfile.mkdtemp(
        prefix="fsdp_overlap_inductor_"
    )


def pytest_terminal_summary(terminalreporter) -> None:
    """How many multi-rank runs were repeated after a native crash (tests/_dist.py), by
    test: a rerun that passed is still a crash someone should look at."""
    import _dist

    terminalreporter.write_line(f"native-crash reruns: {len(_dist.reruns)}", yellow=bool(_dist.reruns))
    for entry in _dist.reruns:
        terminalreporter.write_line(f"  {entry}")
