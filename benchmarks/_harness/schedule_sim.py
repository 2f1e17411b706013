"""What one traced step's schedule would take over a modelled link: ``step_time.py --trace-dir``.

The comm-only replay (``step_time.py``) says how long the step's collectives take back to
back; compute-only how long its compute takes. ``max`` of the two is the transport bound,
but a real schedule cannot reach it where a collective must wait for compute (the first
all-gather of a bucket nobody prefetched, the last reduce-scatter after the last
gradient) or compute for a collective. This module splits the distance between a traced
`both` step and that bound, from each rank's main thread in the profiler trace:

* **the schedule's own exposure**: both ranks run the traced compute (the time between
  one collective call and the next on the main thread, launches included, blocking in
  waits left out) in the graph's order, with the ranks in step (each piece of compute
  the mean of the two ranks'), and every collective moving over a link that carries one
  collective at a time, in launch order, at the comm-only replay's rate (each collective
  its share of the replay's time by bytes sent). A collective starts once both ranks
  have launched it and the one before it is through; a wait blocks until its collective
  is through. What this ``simulate`` gives over ``max(compute, replay)`` is what the
  schedule leaves exposed on any host and link of these speeds.
* **the host and the transport**: the same with each rank's own compute (the skew
  between the ranks as traced); its distance from the in-step run is what the ranks
  falling out of step cost. The traced step against the two shows what the real link
  and collectives (gloo's send-first order, the rendezvous) do against the model's link.
* **the compute's own slowdown**: on a CPU host gloo's threads and the kernel's
  networking run on the same cores as the compute, so the traced compute is longer than
  the compute-only step's. The in-step schedule with its compute scaled down to the
  compute-only step is what the same schedule gives where communicating costs the
  compute nothing (a GPU), against max(compute-only, replay): the issue's bound. Scaled
  to the main threads' CPU time instead, it keeps the step's own extra work (bucket
  copies, local sums, launching) and drops only the time spent waiting for a CPU.

This is a model: its link carries one collective at a time at the replay's average
rate. Given what the traced step had (each rank's own compute) it came out 4-15% longer
than the traced step in every run of ``benchmarks/RESULTS.md``: the real link does better
than the model's, so what the in-step runs say the schedule leaves exposed is an upper
estimate.
"""

from __future__ import annotations

import statistics

__all__ = ["LAUNCHES", "WAIT", "program", "simulate", "split_step"]

LAUNCHES = {
    "_c10d_functional::all_gather_into_tensor_out": "all_gather",
    "_c10d_functional::all_gather_into_tensor": "all_gather",
    "_c10d_functional::all_to_all_single": "all_to_all",
    "_c10d_functional::reduce_scatter_tensor": "reduce_scatter",
}
WAIT = "_c10d_functional::wait_tensor"


def program(events: list[tuple[float, float, str]], step: tuple[float, float], order: list[tuple]) -> list[tuple]:
    """One rank's step as ``[(compute_ms, action, k), ...]`` plus a last ``(tail_ms,
    "end", None)``: ``events`` are its main thread's collective calls ``(begin_ms,
    end_ms, profiler name)``, ``step`` the step's ``(start_ms, end_ms)``, ``order`` the
    graphs' ``("launch", name, op, bytes)`` / ``("wait", name)`` in graph order
    (``schedule_report``). ``k`` numbers the collectives in launch order. A launch's own
    time counts as compute; a wait's does not (it is what the simulation decides).
    Raises ``ValueError`` where the trace's calls do not line up with ``order``."""
    calls = sorted(e for e in events if e[2] in LAUNCHES or e[2] == WAIT)
    if len(calls) != len(order):
        raise ValueError(f"{len(calls)} collective calls traced, {len(order)} in the schedule")
    index: dict[str, int] = {}
    out: list[tuple] = []
    mark = step[0]
    for (begin, end, name), planned in zip(calls, order):
        action = planned[0]
        if action == "launch":
            if LAUNCHES.get(name) != planned[2]:
                raise ValueError(f"traced {name} where the schedule launches {planned[2]} ({planned[1]})")
            index[planned[1]] = len(index)
            out.append((end - mark, "launch", index[planned[1]]))
        else:
            if name != WAIT or planned[1] not in index:
                raise ValueError(f"traced {name} where the schedule waits for {planned[1]}")
            out.append((begin - mark, "wait", index[planned[1]]))
        mark = end
    out.append((step[1] - mark, "end", None))
    return out


def simulate(programs: list[list[tuple]], link_ms: list[float]) -> float:
    """The step time (ms) of ``programs`` (one per rank, from ``program``) run together
    over a link that carries collective ``k`` in ``link_ms[k]``, one at a time in launch
    order, each starting once every rank has launched it."""
    n = len(link_ms)
    done = [0.0] * n
    for _ in range(2 * n + 2):  # each round fixes at least the earliest collective that moved
        launched = [[0.0] * n for _ in programs]
        ends = []
        for rank, prog in enumerate(programs):
            t = 0.0
            for compute, action, k in prog:
                t += max(compute, 0.0)
                if action == "launch":
                    launched[rank][k] = t
                elif action == "wait":
                    t = max(t, done[k])
            ends.append(t)
        new, free = [], 0.0
        for k in range(n):
            free = max(free, max(at[k] for at in launched)) + link_ms[k]
            new.append(free)
        if new == done:
            return max(ends)
        done = new
    raise RuntimeError("schedule simulation did not settle (a wait before its launch?)")


def split_step(
    rank_events: list[list[tuple[float, float, str]]],
    steps: list[tuple[float, float]],
    order: list[tuple],
    replay_ms: float,
    world: int,
    compute_only_ms: float | None = None,
    cpu_ms: list[float] | None = None,
) -> dict:
    """Both ranks' traced step against the replay (module doc). ``replay_ms`` is the
    comm-only replay's median step; each collective gets its share of it by the bytes a
    rank sends for it (``bytes * (world - 1) / world`` for an all-gather's output and an
    all-to-all's input alike).

    ``scaled`` holds the in-step schedule with every piece of compute scaled by one
    factor, so that they add up to ``compute_only_ms`` (the compute-only step's median:
    no copies into and out of buckets, no local sums, no time off the CPU), and to the
    ranks' mean ``cpu_ms`` (their main threads' CPU time in an unprofiled step of this
    mode: the step's own work, without the time the thread waited for a CPU), each
    against max(that compute, replay)."""
    programs = [program(ev, st, order) for ev, st in zip(rank_events, steps)]
    sent = [planned[3] * (world - 1) / world for planned in order if planned[0] == "launch"]
    link_ms = [replay_ms * s / sum(sent) for s in sent]
    in_step = [(statistics.fmean(p[i][0] for p in programs), *programs[0][i][1:]) for i in range(len(programs[0]))]
    compute = [sum(max(c, 0.0) for c, _, _ in p) for p in programs]
    mean_compute = statistics.fmean(compute)
    traced = statistics.fmean(end - start for start, end in steps)
    bound = max(mean_compute, replay_ms)
    in_step_ms = simulate([in_step] * len(programs), link_ms)
    own_ms = simulate(programs, link_ms)
    scaled = {}
    targets = {"compute-only": compute_only_ms, "main-thread CPU": statistics.fmean(cpu_ms) if cpu_ms else None}
    for label, target in targets.items():
        if target:
            prog = [(c * target / mean_compute, action, k) for c, action, k in in_step]
            ms = simulate([prog] * len(programs), link_ms)
            scaled[label] = {
                "compute_ms": target,
                "bound_ms": max(target, replay_ms),
                "in_step_ms": ms,
                "x_bound": ms / max(target, replay_ms),
            }
    return {
        "traced_ms": traced,
        "compute_ms": compute,
        "replay_ms": replay_ms,
        "bound_ms": bound,
        "in_step_ms": in_step_ms,
        "own_compute_ms": own_ms,
        "x_bound": {"in_step": in_step_ms / bound, "own_compute": own_ms / bound, "traced": traced / bound},
        "scaled": scaled,
    }
