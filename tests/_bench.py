"""The benchmark scripts, for the tests of their own logic: importable, and their ``--help``."""

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
