"""gpu_check.py's phase processes: a phase child's 1-rank process group, where a phase
leaves its result, running one phase with its output in a log and a time limit (stopping
it and everything it started), its record (``PhaseRun``), pytest's junit counts, and the
console that keeps a copy of what it prints."""

from __future__ import annotations

import atexit
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def init_world_of_one(device_type: str = "cuda") -> None:
    """A 1-rank default process group (nccl; gloo for the CPU tests) through a FileStore:
    no network at all."""
    import torch
    import torch.distributed as dist

    from fsdp_overlap_plugin.runtime import devices

    if device_type == "cuda":
        torch.cuda.set_device(0)
    backend = devices.backend_for(device_type)
    folder = tempfile.mkdtemp(prefix="gpu_check_store_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    store = dist.FileStore(os.path.join(folder, "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)


def result_file(folder: Path, phase: str) -> Path:
    """Where a phase leaves its result: pytest's junit XML for the tests, JSON otherwise."""
    return folder / f"{phase}.{'xml' if phase == 'tests' else 'json'}"


@dataclass
class PhaseRun:
    name: str
    status: str = "not run"  # ok | failed | timeout | skipped
    seconds: float = 0.0
    limit: float = 0.0
    result: dict = field(default_factory=dict)
    note: str = ""


class Console:
    """Prints and keeps a copy in console.log."""

    def __init__(self, path: Path):
        self.path = path

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        with self.path.open("a") as f:
            f.write(text + "\n")


_CURRENT_CHILD: subprocess.Popen | None = None


def _stop(proc: subprocess.Popen) -> None:
    """End a phase we started, and everything it started (its own process group)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_child(cmd: list[str], log: Path, limit: float, env: dict[str, str]) -> tuple[str, float]:
    """Run ``cmd`` with its output appended to ``log``; ``("ok" | "failed" | "timeout", seconds)``."""
    global _CURRENT_CHILD
    start = time.perf_counter()
    with log.open("a") as f:
        f.write(f"\n===== {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        _CURRENT_CHILD = proc
        try:
            rc = proc.wait(timeout=limit)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            _stop(proc)
            status = "timeout"
        finally:
            _CURRENT_CHILD = None
    return status, time.perf_counter() - start


def log_tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def read_junit(path: Path) -> dict[str, int]:
    """Counts from pytest's junit XML: tests, failures, errors, skipped, passed."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def stop_current() -> None:
    """Stop the phase ``run_child`` is waiting on, if any (and everything it started)."""
    if _CURRENT_CHILD is not None:
        _stop(_CURRENT_CHILD)
