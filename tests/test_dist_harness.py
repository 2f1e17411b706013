"""The multi-rank test harness itself: a failure on one rank must name that rank and
how it ended, even when it died in native code and could report nothing."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist
from _dist import RerunAfterCrash, run_ranks


def _sum(rank: int, world: int) -> float:
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    return t.sum().item()


def _rank1_segfaults(rank: int, world: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)  # what a crash in gloo's transport thread does
    dist.all_reduce(torch.ones(4))


def _crashes_unless_rerun(rank: int, world: int, workdir: str) -> list[str]:
    seen = sorted(os.listdir(workdir))  # empty: a rerun starts in a fresh directory
    dist.barrier()
    if rank == 1 and "-rerun-" not in workdir:
        open(os.path.join(workdir, "left-behind"), "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.all_reduce(torch.ones(4))
    return seen


def _rank0_raises(rank: int, world: int) -> None:
    if rank == 0:
        raise ValueError("bad input on rank 0")
    dist.all_reduce(torch.ones(4))  # waits for rank 0, which never comes


def test_results_come_back_in_rank_order():
    assert run_ranks(_sum) == [12.0, 12.0]


def test_a_rank_killed_by_a_signal_is_named_with_its_stack():
    with pytest.warns(RerunAfterCrash):  # rerun once, crashed again
        with pytest.raises(AssertionError) as info:
            run_ranks(_rank1_segfaults, timeout=120)
    message = str(info.value)
    assert "--- rank 1 ---\nkilled by SIGSEGV in native code; Python stacks at the crash:" in message
    assert "in _rank1_segfaults" in message  # faulthandler's stack of the crashing rank
    assert "--- rank 0 ---" in message  # its "connection reset" or the stopped wait


def test_a_native_crash_is_rerun_once_in_a_fresh_directory(tmp_path):
    with pytest.warns(RerunAfterCrash, match="rerunning _crashes_unless_rerun after a native crash"):
        seen = run_ranks(_crashes_unless_rerun, str(tmp_path), timeout=120)
    assert seen == [[], []]
    assert os.listdir(tmp_path) == ["left-behind"]  # the crashed run's directory, untouched


def test_a_rank_that_raises_is_reported_with_its_traceback_and_never_rerun(recwarn):
    with pytest.raises(AssertionError) as info:
        run_ranks(_rank0_raises, timeout=120)
    message = str(info.value)
    assert "ValueError: bad input on rank 0" in message
    assert "--- rank 1 ---" in message
    assert not [w for w in recwarn if issubclass(w.category, RerunAfterCrash)]
