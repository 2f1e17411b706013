"""The rank worker loop that step_time.py and hsdp_step.py share: each mode built on its
first use and warmed up (untimed; the first step compiles), then timed between two
barriers step by step, the modes interleaved over the repetitions so that drift hits
them alike. What differs between the scripts comes in as callbacks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def timed_steps(
    modes: list[str],
    build: Callable[[str, dict[str, Any]], Any],
    data: list,
    results: dict[str, dict],
    *,
    reps: int,
    steps: int,
    warmup: int,
    barrier: Callable[[], Any],
    log: Callable[[str], None],
    summary: str = "mean",
    on_ready: Callable[[str, Any], None] | None = None,
    on_step: Callable[[str, Any, int], None] | None = None,
    on_rep: Callable[[str, list[float]], None] | None = None,
) -> tuple[dict[str, Any], dict[str, int]]:
    """Run ``reps`` repetitions of ``steps`` timed steps of every mode, each on its own
    batches of ``data`` in order.

    ``build(mode, runners)`` makes a mode's runner (``runners``: those built so far, for
    the replays that read another mode's schedule); ``warmup`` untimed steps follow, then
    ``on_ready(mode, runner)``. Every timed step appends its seconds to
    ``results[mode]["times"]`` and its loss, unless None, to ``results[mode]["losses"]``,
    then calls ``on_step(mode, runner, index)`` (``index``: the step's batch in ``data``);
    after each repetition ``on_rep(mode, times)`` gets that repetition's step times, and
    rank 0's ``log`` (the caller's) a line with their ``summary`` ("mean" or "median").
    Returns the runners and, per mode, the index of its next unused batch."""
    runners: dict[str, Any] = {}
    index = dict.fromkeys(modes, 0)
    for rep in range(reps):
        for mode in modes:
            if mode not in runners:
                t = time.perf_counter()
                runners[mode] = build(mode, runners)
                for _ in range(warmup):
                    runners[mode].step(data[index[mode]])
                    index[mode] += 1
                if on_ready is not None:
                    on_ready(mode, runners[mode])
                log(f"[{mode}] ready after {time.perf_counter() - t:.1f} s (compile + {warmup} warm-up steps)")
            runner = runners[mode]
            times: list[float] = []
            for _ in range(steps):
                barrier()
                t = time.perf_counter()
                loss = runner.step(data[index[mode]])
                barrier()
                times.append(time.perf_counter() - t)
                results[mode]["times"].append(times[-1])
                if loss is not None:
                    results[mode]["losses"].append(loss)
                if on_step is not None:
                    on_step(mode, runner, index[mode])
                index[mode] += 1
            if on_rep is not None:
                on_rep(mode, times)
            value = statistics.median(times) if summary == "median" else statistics.fmean(times)
            log(f"rep {rep + 1}/{reps} {mode:<18} {summary} {value:.3f} s/step")
    return runners, index
