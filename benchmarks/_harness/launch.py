"""Launching gloo ranks: ``script --worker`` as one process per rank, in the network
namespaces (``netns.py``) or on loopback, their JSON results back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from _harness.netns import ADDRS, NETNS, VETH


def _free_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def run_workers(
    script: str,
    worker_args: list[str],
    out_dir: Path,
    timeout: float,
    use_netns: bool = False,
    env_extra: dict | None = None,
    what: str = "benchmark",
    *,
    nodes: list[int] | None = None,
    netns: tuple[str, ...] = NETNS,
    veth: tuple[str, ...] = VETH,
    master_addr: str = ADDRS[0],
    port: str = "29631",
) -> list[dict]:
    """``script --worker`` as ranks 0 and 1 (in the namespaces, or on loopback); their
    ``rank<r>.json`` back, or SystemExit with the tails of their logs. ``nodes``: the
    namespace index of each rank, one per rank (default: rank r in namespace r), with
    ``netns`` / ``veth`` / ``master_addr`` / ``port`` for another script's namespaces
    (hsdp_step.py: 4 ranks, two per namespace)."""
    nodes = list(range(2)) if nodes is None else nodes
    world = len(nodes)
    port = port if use_netns else _free_port()  # loopback is shared with whatever else runs here
    procs = []
    for rank, node in enumerate(nodes):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR=master_addr if use_netns else "127.0.0.1",
            MASTER_PORT=port,
            GLOO_SOCKET_IFNAME=veth[node] if use_netns else "lo",
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            **(env_extra or {}),
        )
        cmd = [sys.executable, script, "--worker", "--out-dir", str(out_dir), *worker_args]
        if use_netns:
            cmd = ["ip", "netns", "exec", netns[node], *cmd]
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.time() + timeout
    failed = None
    try:
        while any(p.poll() is None for p, _ in procs):
            if time.time() > deadline:
                failed = f"timed out after {timeout:.0f} s"
                break
            if any(p.poll() not in (None, 0) for p, _ in procs):
                failed = "a rank failed"
                break
            time.sleep(0.5)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
            log.close()
    if failed or any(p.returncode != 0 for p, _ in procs):
        tails = "\n".join(f"--- rank {r} ---\n" + (out_dir / f"rank{r}.log").read_text()[-3000:] for r in range(world))
        raise SystemExit(f"{what} {failed or 'failed'}:\n{tails}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
