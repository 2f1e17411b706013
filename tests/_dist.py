"""Run a function on N gloo ranks in fresh processes and collect what each returns.

Each rank is a spawned process with one intra-op thread (the CI machine has two
cores), a TCP store on a free loopback port, and a timeout so a hang fails the test
instead of the CI job. A rank that dies in native code is named with its Python
stacks, and the run is repeated once with a warning (see ``run_ranks``).
"""

from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import os
import queue
import signal
import socket
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NATIVE_CRASHES = (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE)


class NativeCrash(AssertionError):
    """A rank died by a signal, in native code, and could report nothing itself."""


def _died(exitcode: int | None, crash_log: str) -> str:
    """How a process that never reported ended, in words, with the Python stack of
    every thread at the crash (written by faulthandler) when there is one."""
    if exitcode is None or exitcode == -signal.SIGKILL:
        return "still running, stopped by the test"
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    text = f"killed by {signal.Signals(-exitcode).name}"
    if os.path.exists(crash_log) and os.path.getsize(crash_log):
        with open(crash_log) as f:
            text += " in native code; Python stacks at the crash:\n" + f.read()[-6000:]
    return text


def _worker(
    rank: int, world: int, port: int, fn: Callable, args: tuple, results: Any, env: dict, crash_dir: str
) -> None:
    # a crash in native code writes every thread's Python stack here, for the parent
    crash_log = open(os.path.join(crash_dir, f"rank{rank}.txt"), "w")  # noqa: SIM115 (open until exit)
    faulthandler.enable(crash_log, all_threads=True)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
        value = fn(rank, world, *args)
        # By value: tensors sent through a Queue would be shared-memory handles that
        # die with this process before the parent reads them.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _attempt(fn: Callable, args: tuple, world: int, timeout: float, env: dict | None) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ranks-") as crash_dir:
        procs = [
            ctx.Process(
                target=_worker, args=(rank, world, port, fn, args, results, dict(env or {}), crash_dir), daemon=False
            )
            for rank in range(world)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        errors: list[str] = []
        reported: set[int] = set()
        deadline = time.monotonic() + timeout
        try:
            while len(reported) < world:
                if time.monotonic() > deadline:
                    if not errors:
                        missing = sorted(set(range(world)) - reported)
                        errors.append(f"timed out after {timeout} s waiting for ranks {missing}")
                    break
                try:
                    rank, status, value = results.get(timeout=1)
                except queue.Empty:
                    if all(procs[r].exitcode is not None for r in range(world) if r not in reported):
                        # whoever has not reported is dead (its message would be here by now)
                        if not errors:
                            errors.append("a rank ended without reporting")
                        break
                    continue
                reported.add(rank)
                if status == "ok":
                    import torch

                    out[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    errors.append(f"--- rank {rank} ---\n{value}")
                    # the other ranks may now wait forever in a collective: give them a
                    # short while to report their own error (often the root cause), no more
                    deadline = min(deadline, time.monotonic() + 20)
        finally:
            for p in procs:
                p.join(timeout=5 if errors else 60)
                if p.is_alive():
                    p.kill()  # shown as "stopped by the test" below
                    p.join()
        if errors:
            # a rank that died in native code reports nothing itself, and its peers only
            # see "connection reset by peer": name it and show where it was
            silent = {r: p.exitcode for r, p in enumerate(procs) if r not in reported}
            errors += [
                f"--- rank {r} ---\n{_died(code, os.path.join(crash_dir, f'rank{r}.txt'))}"
                for r, code in silent.items()
            ]
            crashed = any(code is not None and -code in NATIVE_CRASHES for code in silent.values())
            raise (NativeCrash if crashed else AssertionError)("a rank failed:\n" + "\n".join(errors))
    return [out[r] for r in range(world)]


def run_ranks(
    fn: Callable, *args: Any, world: int = 2, timeout: float = 600, env: dict | None = None, crash_reruns: int = 1
) -> list[Any]:
    """``[fn(0, world, *args), ..., fn(world-1, world, *args)]``, each in its own process.

    A failure raises ``AssertionError`` with every rank's traceback, and for a rank that
    died silently, how it ended. Only when a rank was killed by a signal in native code
    (gloo's worker threads in torch 2.13 crash rarely, see docs/troubleshooting.md) is
    the whole run repeated, at most ``crash_reruns`` times, each with a warning that
    shows the crash: an assertion, an exception or a hang is never rerun. Arguments
    that name a directory are working directories: a rerun gets fresh, empty ones.
    """
    for _ in range(crash_reruns):
        try:
            return _attempt(fn, args, world, timeout, env)
        except NativeCrash as crash:
            warnings.warn(f"rerunning {fn.__name__} after a native crash:\n{crash}", RerunAfterCrash, stacklevel=2)
            args = tuple(_fresh_if_directory(a) for a in args)
    return _attempt(fn, args, world, timeout, env)


def _fresh_if_directory(arg: Any) -> Any:
    """A rerun must not see what the crashed run left behind: an argument naming an
    existing directory (a test's working directory) becomes a new, empty sibling."""
    if isinstance(arg, str) and os.path.isdir(arg):
        return tempfile.mkdtemp(
            prefix=os.path.basename(arg.rstrip("/")) + "-rerun-", dir=os.path.dirname(arg.rstrip("/"))
        )
    return arg


class RerunAfterCrash(UserWarning):
    """Shown in pytest's warnings summary whenever a run was repeated after a crash."""


def _isolated(fn: Callable, args: tuple, results: Any) -> None:
    try:
        value = fn(*args)
        import torch

        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put(("ok", buffer.getvalue()))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def run_isolated(fn: Callable, *args: Any, timeout: float = 300) -> Any:
    """``fn(*args)`` in a fresh process, for checks that change process-wide state
    (such as naming the PrivateUse1 device "npu", which cannot be undone)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_isolated, args=(fn, args, results))
    proc.start()
    try:
        status, value = results.get(timeout=timeout)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    if status != "ok":
        raise AssertionError("isolated check failed:\n" + value)
    import torch

    return torch.load(io.BytesIO(value), weights_only=False)
