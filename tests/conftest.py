"""Test-session setup: a private inductor cache so every run compiles (and runs the
passes) from scratch, unless FSDP_OVERLAP_TEST_CACHE names a cache to reuse."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ.get("FSDP_OVERLAP_TEST_CACHE") or tempfile.mkdtemp(
        prefix="fsdp_overlap_inductor_"
    )


def pytest_terminal_summary(terminalreporter) -> None:
    """How many runs a rank's native crash failed (tests/_dist.py: never rerun), by test:
    each is a failed test, and a crash someone must find the cause of."""
    import _dist

    crashes = _dist.crashes
    terminalreporter.write_line(f"native crashes: {len(crashes)}", red=bool(crashes), bold=bool(crashes))
    for entry in crashes:
        terminalreporter.write_line(f"  {entry}", red=True)


# Each test's time (setup + call + teardown), written at the end of the session to
# $FSDP_OVERLAP_DURATIONS_DIR/torch-<release>-<pid>.tsv when that is set: .ci/run sets it and
# prints the slowest tests of each lane, the data to keep CI under its budget with.
_durations: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session) -> None:
    folder = os.environ.get("FSDP_OVERLAP_DURATIONS_DIR")
    if not folder or not _durations:
        return
    import torch

    release = torch.__version__.split("+")[0]
    path = Path(folder) / f"torch-{release}-{os.getpid()}.tsv"
    rows = sorted(_durations.items(), key=lambda item: -item[1])
    path.write_text("".join(f"{seconds:.1f}\t{nodeid}\n" for nodeid, seconds in rows))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """A test under an ``integration/`` folder starts processes: it must be marked ``slow``
    (``make test-quick`` and the quick loop leave those out; tests/repo/test_layout.py holds
    the other direction, a module marked slow as a whole lives in ``integration/``)."""
    unmarked = [
        item.nodeid for item in items if "integration" in item.path.parts and not item.get_closest_marker("slow")
    ]
    if unmarked:
        raise pytest.UsageError(f"tests under integration/ must be marked slow: {unmarked[:5]}")


def pytest_collection_finish(session) -> None:
    """Every test module is imported now, and with them torch, transformers and Lightning:
    their objects go to the garbage collector's permanent generation (``gc.freeze``), so the
    collections during this session's compiles do not walk them again (as the ranks' fork
    server does: tests/_preloaded.py). FSDP_OVERLAP_TEST_GC_FREEZE=0 leaves them where they are."""
    if os.environ.get("FSDP_OVERLAP_TEST_GC_FREEZE", "1") != "0":
        import gc

        gc.freeze()
