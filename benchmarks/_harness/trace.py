"""Where a step's time goes: the link's byte counters sampled during a step and split
into phases, one step's threads' CPU time and its profiler trace, the collectives' order
from a schedule report, and both ranks' traced steps side by side."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from _harness import schedule_sim

if TYPE_CHECKING:
    from _harness.types import StepRunner


class LinkSampler:
    """Samples the interface's byte counters every few milliseconds in a thread."""

    def __init__(self, ifname: str, period: float = 0.002):
        base = Path("/sys/class/net") / ifname / "statistics"
        self.tx, self.rx = base / "tx_bytes", base / "rx_bytes"
        self.period = period
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()

    def _read(self) -> tuple[int, int]:
        return int(self.tx.read_text()), int(self.rx.read_text())

    def __enter__(self) -> LinkSampler:
        self.t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            tx, rx = self._read()
            self.samples.append((time.perf_counter() - self.t0, tx, rx))
            time.sleep(self.period)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def link_phases(samples, marks: list[tuple[str, float]], rate_bps: float) -> dict:
    """Per phase: duration, fraction of time the link moved data (in either direction,
    and in both at once), idle seconds."""
    rates = []
    for (t0, tx0, rx0), (t1, tx1, rx1) in zip(samples, samples[1:]):
        dt = max(t1 - t0, 1e-6)
        rates.append((t0, t1, (tx1 - tx0) * 8 / dt, (rx1 - rx0) * 8 / dt))
    threshold = 0.1 * rate_bps
    phases = []
    for (name, start), (_, end) in zip(marks, marks[1:]):
        busy = sum(
            max(0.0, min(t1, end) - max(t0, start)) for t0, t1, tx, rx in rates if tx > threshold or rx > threshold
        )
        both = sum(
            max(0.0, min(t1, end) - max(t0, start)) for t0, t1, tx, rx in rates if tx > threshold and rx > threshold
        )
        phases.append(
            {
                "name": name,
                "start_s": start,
                "duration_s": end - start,
                "busy_fraction": busy / max(end - start, 1e-9),
                "both_fraction": both / max(end - start, 1e-9),
                "idle_s": max(0.0, end - start - busy),
            }
        )
    series = [((t0 + t1) / 2, tx, rx) for t0, t1, tx, rx in rates]
    return {"phases": phases, "samples": series}


def thread_cpu_ms() -> dict[str, float]:
    """CPU time (user + system) per thread of this process, by thread id and name."""
    tick = 1000 / os.sysconf("SC_CLK_TCK")
    cpu = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu[f"{tid}:{name}"] = (int(fields[11]) + int(fields[12])) * tick
    return cpu


def trace_step(runner: StepRunner, batch, trace_dir: Path, rank: int) -> dict:
    """``--trace-dir``: one step's threads' CPU time (of ``--trace-mode``, `both` by
    default), then one more step under
    torch.profiler; its chrome trace goes to ``trace_dir`` and its collectives (launch on
    the main thread, run on gloo's worker threads) and waits come back, in epoch ms so
    that the ranks' clocks (one host) line up."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import fsdp_overlap_plugin as fo

    dist.barrier()
    before, start = thread_cpu_ms(), time.perf_counter()
    runner.step(batch)
    wall, after = time.perf_counter() - start, thread_cpu_ms()
    cpu: dict[str, float] = {}
    main = f"{threading.get_native_id()}:"
    for key, ms in after.items():
        name = "main" if key.startswith(main) else key.split(":", 1)[1]
        cpu[name] = cpu.get(name, 0.0) + ms - before.get(key, 0.0)
    trace_dir.mkdir(parents=True, exist_ok=True)
    path = trace_dir / f"trace{rank}.json"
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.time_ns() / 1e6
        runner.step(batch)
        t1 = time.time_ns() / 1e6
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    base_us = trace.get("baseTimeNanoseconds", 0) / 1e3
    launches, runs, calls = [], [], []
    for event in trace["traceEvents"]:
        if event.get("ph") != "X":
            continue
        name, begin, dur = event["name"], (event["ts"] + base_us) / 1e3, event["dur"] / 1e3
        if name.startswith("c10d::") and "barrier" not in name:
            launches.append((begin, name.removeprefix("c10d::").strip("_")))
        elif name.startswith("gloo:"):
            runs.append((begin, begin + dur))
        elif name in schedule_sim.LAUNCHES or name == schedule_sim.WAIT:
            calls.append((begin, begin + dur, name))
    return {
        "path": str(path),
        "step_ms": [t0, t1],
        "launches": sorted(launches),
        "runs": sorted(runs),
        "wait_ms": sum(end - begin for begin, end, name in calls if name == schedule_sim.WAIT),
        "calls": calls,
        "order": schedule_order(fo.schedule_report(runner.model)),
        "cpu_ms": cpu,
        "cpu_wall_ms": wall * 1e3,
    }


def schedule_order(report: dict) -> list[tuple]:
    """The forward's then the backward's collectives in graph order, from a
    ``schedule_report``: ``("launch", name, op, bytes)`` and ``("wait", of)``, what the
    comm-only replay runs and ``schedule_sim.program`` lines a trace up with."""
    order: list[tuple] = []
    for kind in ("forward", "backward"):
        for event in report[kind]["schedule"]["after"]:
            if event["op"] in ("all_gather", "reduce_scatter", "all_to_all"):
                order.append(("launch", event["name"], event["op"], event["bytes"]))
            elif event["op"] == "wait" and event["of"]:
                order.append(("wait", event["of"]))
    return order


def trace_summary(
    results: list[dict], replay_s: float | None = None, compute_only_s: float | None = None
) -> dict | None:
    """Both ranks' traced steps side by side: per collective (in launch order) each
    rank's launch and completion, from the earlier rank's step start, and the skew; with
    the comm-only replay's median (``replay_s``), the traced step split by
    ``schedule_sim.split_step`` into what the schedule leaves exposed and what the host and
    the transport add."""
    traces = [res.get("trace") for res in results]
    if not all(traces):
        return None
    split = None
    if replay_s and all("calls" in t for t in traces):
        try:
            split = schedule_sim.split_step(
                [t["calls"] for t in traces],
                [tuple(t["step_ms"]) for t in traces],
                [tuple(o) for o in traces[0]["order"]],
                replay_s * 1e3,
                len(traces),
                compute_only_s * 1e3 if compute_only_s else None,
                [t["cpu_ms"].get("main", 0.0) for t in traces] if all(t.get("cpu_ms") for t in traces) else None,
            )
        except ValueError as exc:
            split = {"error": str(exc)}
    zero = min(t["step_ms"][0] for t in traces)
    rows = []
    for k, launch in enumerate(traces[0]["launches"]):
        if any(len(t["launches"]) <= k for t in traces):
            break
        at = [t["launches"][k][0] - zero for t in traces]
        done = [t["runs"][k][1] - zero if k < len(t["runs"]) else None for t in traces]
        rows.append({"op": launch[1], "launch_ms": at, "done_ms": done, "skew_ms": at[1] - at[0]})
    skews = sorted(abs(r["skew_ms"]) for r in rows)
    return {
        "mode": traces[0].get("mode", "both"),
        "rows": rows,
        "split": split,
        "max_skew_ms": skews[-1] if skews else None,
        "median_skew_ms": statistics.median(skews) if skews else None,
        "ranks": [
            {
                "step_ms": t["step_ms"][1] - t["step_ms"][0],
                "wait_ms": t["wait_ms"],
                "cpu_ms": t["cpu_ms"],
                "cpu_wall_ms": t["cpu_wall_ms"],
                "path": t["path"],
            }
            for t in traces
        ],
    }


def print_trace(trace: dict) -> None:
    print(
        f"one traced `{trace.get('mode', 'both')}` step (--trace-dir), ms from the earlier rank's start;"
        " skew = rank 1 - rank 0:"
    )
    print(f"  {'#':>3} {'collective':<24} {'launch r0':>10} {'r1':>8} {'skew':>7} {'done r0':>9} {'r1':>8}")
    for k, row in enumerate(trace["rows"]):
        done = ["-" if d is None else f"{d:.1f}" for d in row["done_ms"]]
        print(
            f"  {k:>3} {row['op']:<24} {row['launch_ms'][0]:>10.1f} {row['launch_ms'][1]:>8.1f}"
            f" {row['skew_ms']:>+7.1f} {done[0]:>9} {done[1]:>8}"
        )
    print(f"  launch skew: median {trace['median_skew_ms']:.1f} ms, largest {trace['max_skew_ms']:.1f} ms")
    split = trace.get("split")
    if split and "error" in split:
        print(f"  schedule simulation: not run ({split['error']})")
    elif split:
        x = split["x_bound"]
        compute = "/".join(f"{ms:.0f}" for ms in split["compute_ms"])
        print(
            f"  the traced step against its bound max(mean of the traced compute {compute} ms r0/r1, comm-only replay"
            f" {split['replay_ms']:.0f} ms) = {split['bound_ms']:.0f} ms (benchmarks/schedule_sim.py):"
        )
        print(
            f"    model, ranks in step                 {split['in_step_ms']:>6.0f} ms"
            f"  {x['in_step']:.2f}x  (what the schedule itself leaves exposed)"
        )
        print(
            f"    model, each rank's own compute       {split['own_compute_ms']:>6.0f} ms"
            f"  {x['own_compute']:.2f}x  (the ranks out of step as traced)"
        )
        print(
            f"    traced                               {split['traced_ms']:>6.0f} ms"
            f"  {x['traced']:.2f}x  (the real link and collectives)"
        )
        for label, scaled in split.get("scaled", {}).items():
            print(
                f"    model, ranks in step, compute scaled to {label} ({scaled['compute_ms']:.0f} ms):"
                f" {scaled['in_step_ms']:.0f} ms = {scaled['x_bound']:.2f}x max(that, replay)"
            )
    for rank, info in enumerate(trace["ranks"]):
        cpu = ", ".join(f"{name} {ms:.0f}" for name, ms in sorted(info["cpu_ms"].items(), key=lambda x: -x[1]) if ms)
        print(
            f"  rank {rank}: profiled step {info['step_ms']:.0f} ms, blocked in waits {info['wait_ms']:.0f} ms;"
            f" an unprofiled step ({info['cpu_wall_ms']:.0f} ms) used CPU ms: {cpu}; trace {info['path']}"
        )
