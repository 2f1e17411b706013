"""Run a function on N gloo ranks in fresh processes and collect what each returns.

Each rank is a spawned process with one intra-op thread (the CI machine has two
cores), a TCP store on a free loopback port, and a timeout so a hang fails the test
instead of the CI job.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, results: Any, env: dict) -> None:
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


def run_ranks(fn: Callable, *args: Any, world: int = 2, timeout: float = 600, env: dict | None = None) -> list[Any]:
    """``[fn(0, world, *args), ..., fn(world-1, world, *args)]``, each in its own process."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world, port, fn, args, results, dict(env or {})), daemon=False)
        for rank in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    wait = timeout
    try:
        for _ in range(world):
            rank, status, value = results.get(timeout=wait)
            if status == "ok":
                import torch

                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
                # the other ranks may now wait forever in a collective: give them a short
                # while to report their own error (often the root cause), no more
                wait = min(wait, 20)
    except queue.Empty:
        if not errors:
            errors.append(f"timed out after {timeout} s waiting for ranks {sorted(set(range(world)) - set(out))}")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("a rank failed:\n" + "\n".join(errors))
    return [out[r] for r in range(world)]


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
