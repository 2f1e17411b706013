"""The benchmark scripts, for the tests of their own logic: importable, their ``--help``,
and runs of them as a user types them."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def load(name: str):
    """``benchmarks/<name>.py`` as a module."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def help_text(name: str) -> str:
    """What ``python benchmarks/<name>.py --help`` prints (it must exit 0)."""
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), "--help"], capture_output=True, text=True, check=True
    ).stdout


def run(name: str, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    """``python benchmarks/<name>.py *args``, its output captured as text."""
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), *args], capture_output=True, text=True, timeout=timeout
    )


def smoke_run(name: str, *args: str, out: Path, deadline: int = 600) -> subprocess.CompletedProcess:
    """A real run of ``benchmarks/<name>.py *args`` writing its JSON to ``out``, under the
    script's own ``--timeout deadline`` (the test allows 100 s more); it must exit 0."""
    proc = run(name, *args, "--json", str(out), "--timeout", str(deadline), timeout=deadline + 100)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc
