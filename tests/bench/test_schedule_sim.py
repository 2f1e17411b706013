"""``benchmarks/schedule_sim.py``: a traced step's schedule replayed on an ideal link."""

from __future__ import annotations

import _bench
import pytest

sim = _bench.load("_harness.schedule_sim")
step_time = _bench.load("step_time")

AG, A2A, WAIT = "_c10d_functional::all_gather_into_tensor_out", "_c10d_functional::all_to_all_single", sim.WAIT
# two all-gathers (the second prefetched before the first's wait), one all-to-all
ORDER = [
    ("launch", "ag0", "all_gather", 400),
    ("launch", "ag1", "all_gather", 400),
    ("wait", "ag0"),
    ("wait", "ag1"),
    ("launch", "a2a", "all_to_all", 800),
    ("wait", "a2a"),
]


def _calls(start: float, gaps: list[float], waits: list[float]) -> tuple[list, tuple]:
    """Main-thread calls in ORDER: ``gaps[i]`` ms of compute before call i, each launch
    taking 1 ms and each wait ``waits.pop(0)`` ms."""
    names = [AG, AG, WAIT, WAIT, A2A, WAIT]
    waits = list(waits)
    t, calls = start, []
    for gap, name in zip(gaps, names):
        t += gap
        dur = waits.pop(0) if name == WAIT else 1.0
        calls.append((t, t + dur, name))
        t += dur
    return calls, (start, t + 5.0)  # 5 ms after the last call (loss, optimizer)


def test_program_counts_launches_as_compute_and_leaves_out_blocking():
    calls, step = _calls(100.0, [2.0, 3.0, 10.0, 0.0, 20.0, 4.0], [7.0, 1.0, 30.0])
    prog = sim.program(calls, step, ORDER)
    assert prog == [
        (3.0, "launch", 0),  # 2 ms compute + the 1 ms launch
        (4.0, "launch", 1),
        (10.0, "wait", 0),  # the 7 ms blocked in it are not compute
        (0.0, "wait", 1),
        (21.0, "launch", 2),
        (4.0, "wait", 2),
        (5.0, "end", None),
    ]


def test_program_refuses_a_trace_that_does_not_line_up():
    calls, step = _calls(0.0, [1.0] * 6, [1.0] * 3)
    with pytest.raises(ValueError, match="5 collective calls traced, 6 in the schedule"):
        sim.program(calls[:-1], step, ORDER)
    swapped = [ORDER[0], ORDER[1], ORDER[2], ORDER[3], ("launch", "a2a", "reduce_scatter", 800), ORDER[5]]
    with pytest.raises(ValueError, match="where the schedule launches reduce_scatter"):
        sim.program(calls, step, swapped)


def test_simulate_one_collective_at_a_time_in_launch_order():
    prog = [(3.0, "launch", 0), (4.0, "launch", 1), (10.0, "wait", 0), (0.0, "wait", 1), (21.0, "launch", 2)]
    prog += [(4.0, "wait", 2), (5.0, "end", None)]
    # ag0 at 3 -> 13; ag1 launched at 7 waits for the link -> 23; compute reaches wait0 at 17
    # and wait1 at 17 -> 23; a2a launched at 44 -> 64; wait at 48 -> 64; +5 = 69
    assert sim.simulate([prog, prog], [10.0, 10.0, 20.0]) == 69.0
    # no communication: the compute alone
    assert sim.simulate([prog], [0.0, 0.0, 0.0]) == 47.0
    # the slower rank launches later: the collective starts when both have launched
    late = [(13.0, "launch", 0), *prog[1:]]
    assert sim.simulate([prog, late], [10.0, 10.0, 20.0]) == 79.0


def test_split_step_in_step_against_own_compute():
    even, step0 = _calls(0.0, [2.0, 3.0, 10.0, 0.0, 20.0, 4.0], [7.0, 1.0, 30.0])
    skewed, step1 = _calls(0.0, [12.0, 3.0, 10.0, 0.0, 20.0, 4.0], [1.0, 1.0, 30.0])
    split = sim.split_step([even, skewed], [step0, step1], ORDER, replay_ms=40.0, world=2)
    # link shares by bytes sent: 400, 400, 800 of 40 ms -> 10, 10, 20 ms
    assert split["compute_ms"] == [47.0, 57.0]
    assert split["bound_ms"] == 52.0  # the mean compute is above the replay
    assert split["in_step_ms"] == 74.0  # every gap the mean of the two ranks': ag0 launched at 8
    assert split["own_compute_ms"] == 79.0  # the later rank's first launch holds both
    assert split["x_bound"]["own_compute"] == pytest.approx(79.0 / 52.0)
    assert split["traced_ms"] == pytest.approx((step0[1] + step1[1]) / 2)
    assert split["scaled"] == {}
    # the compute-only step took 26 ms: every in-step gap halved, against max(26, 40)
    scaled = sim.split_step([even, skewed], [step0, step1], ORDER, 40.0, 2, compute_only_ms=26.0, cpu_ms=[50, 54])
    assert scaled["scaled"]["compute-only"] == {
        "compute_ms": 26.0,
        "bound_ms": 40.0,
        "in_step_ms": 57.0,
        "x_bound": 57.0 / 40.0,
    }
    # the main threads' CPU time is the traced compute: the in-step simulation unchanged
    assert scaled["scaled"]["main-thread CPU"]["in_step_ms"] == 74.0
    assert scaled["scaled"]["main-thread CPU"]["bound_ms"] == 52.0


def test_trace_summary_splits_the_step_when_the_replay_ran():
    calls0, step0 = _calls(1000.0, [2.0, 3.0, 10.0, 0.0, 20.0, 4.0], [7.0, 1.0, 30.0])
    calls1, step1 = _calls(1000.0, [2.0, 3.0, 10.0, 0.0, 20.0, 4.0], [7.0, 1.0, 30.0])

    def trace(calls, step):
        return {
            "path": "t.json",
            "step_ms": list(step),
            "launches": [(c[0], "allgather_base") for c in calls if c[2] != WAIT],
            "runs": [],
            "wait_ms": 38.0,
            "calls": calls,
            "order": [list(o) for o in ORDER],  # as it comes back through JSON
            "cpu_ms": {},
            "cpu_wall_ms": 1.0,
        }

    results = [{"trace": trace(calls0, step0)}, {"trace": trace(calls1, step1)}]
    summary = step_time.trace_summary(results, replay_s=0.040, compute_only_s=0.047)
    assert summary["split"]["in_step_ms"] == summary["split"]["own_compute_ms"] == 69.0
    assert summary["split"]["scaled"]["compute-only"]["in_step_ms"] == 69.0  # as fast as traced
    assert "main-thread CPU" not in summary["split"]["scaled"]  # no CPU times in these traces
    step_time.print_trace(summary)
    assert step_time.trace_summary(results)["split"] is None  # no comm-only in the run
    results[1]["trace"]["calls"] = calls1[:-1]  # rank 1's trace came out short
    summary = step_time.trace_summary(results, replay_s=0.040)
    assert "in the schedule" in summary["split"]["error"]
    step_time.print_trace(summary)  # formats both ways
