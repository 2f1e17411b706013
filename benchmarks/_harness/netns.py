"""Link shaping: two network namespaces joined by a veth pair whose ends ``tc ... tbf``
shapes to a rate, the rate's text (``300mbit``), and which namespace each rank runs in when
several share one (``rank_namespaces``)."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess

NETNS = ("fobench0", "fobench1")
VETH = ("fobv0", "fobv1")
ADDRS = ("10.77.1.1", "10.77.1.2")


def parse_rate(text: str) -> float:
    """'300mbit' -> bits per second."""
    text = text.strip().lower()
    for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


def rank_namespaces(world: int, per_namespace: int = 1, namespaces: int = len(NETNS)) -> list[int]:
    """The namespace index of each rank when ``per_namespace`` consecutive ranks share one:
    ``rank_namespaces(4, 2) == [0, 0, 1, 1]`` (``launch.run_workers``' ``nodes``). Ranks of a
    namespace bind its one veth address (``GLOO_SOCKET_IFNAME``), and the kernel carries a
    connection between two of its own addresses over loopback: only traffic between
    namespaces crosses the shaped veth. The default, one rank per namespace, is
    ``[0, 1]`` for two ranks, what step_time.py runs."""
    if per_namespace < 1 or world % per_namespace:
        raise ValueError(f"rank_namespaces: {world} ranks do not split into groups of {per_namespace}")
    if world // per_namespace != namespaces:
        raise ValueError(
            f"rank_namespaces: {world} ranks, {per_namespace} per namespace, need {world // per_namespace} "
            f"namespaces; Namespaces makes {namespaces} (one veth pair)"
        )
    return [rank // per_namespace for rank in range(world)]


class Namespaces:
    """Two network namespaces joined by a shaped veth pair; removed on every exit path.
    ``netns`` / ``veth`` / ``addrs``: another script's names (hsdp_step.py's own)."""

    def __init__(
        self,
        rate: str,
        netns: tuple[str, ...] = NETNS,
        veth: tuple[str, ...] = VETH,
        addrs: tuple[str, ...] = ADDRS,
    ):
        self.rate = rate
        self.netns, self.veth, self.addrs = netns, veth, addrs
        self.created = False

    @staticmethod
    def available() -> tuple[bool, str]:
        if os.geteuid() != 0:
            return False, "not root"
        if not shutil.which("ip") or not shutil.which("tc"):
            return False, "iproute2 (ip, tc) not installed"
        return True, ""

    def _run(self, *cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    def __enter__(self) -> Namespaces:
        self.remove()  # leftovers of an interrupted earlier run
        atexit.register(self.remove)
        self.created = True
        for ns in self.netns:
            self._run("ip", "netns", "add", ns)
        self._run("ip", "link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])
        for ns, dev, addr in zip(self.netns, self.veth, self.addrs):
            self._run("ip", "link", "set", dev, "netns", ns)
            self._run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            self._run("ip", "-n", ns, "link", "set", dev, "up")
            self._run("ip", "-n", ns, "link", "set", "lo", "up")
            self._run(
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                self.rate,
                "burst",
                "64kb",
                "latency",
                "200ms",
            )
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        for ns in self.netns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # also deletes its veth end
