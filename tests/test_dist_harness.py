"""The multi-rank test harness itself: a failure on one rank must name that rank and
how it ended, even when it died in native code and could report nothing; a native crash
is rerun and counted, unless the crashing thread ran this package's code."""

from __future__ import annotations

import ctypes
import faulthandler
import os
import re
import signal
import threading
from types import SimpleNamespace

import _accelerate
import _dist
import conftest
import pytest
import torch
import torch.distributed as dist
from _dist import (
    RerunAfterCrash,
    crashing_thread_stack,
    package_frames,
    raise_on_launcher_crash,
    raise_on_native_crash,
    run_ranks,
)


@pytest.fixture(autouse=True)
def own_rerun_count(monkeypatch, tmp_path_factory) -> SimpleNamespace:
    """The reruns these tests provoke on purpose are counted here (``entries``, and the
    file ``log``), not in the session's count that the summary and .ci/run print."""
    counted = SimpleNamespace(entries=[], log=tmp_path_factory.mktemp("reruns") / "reruns.log")
    monkeypatch.setattr(_dist, "reruns", counted.entries)
    monkeypatch.setenv(_dist.RERUN_LOG_ENV, str(counted.log))
    return counted


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


# ----------------------------------------------------------------------------- strict reruns
# Code that runs with a file name inside the package, as code of ours would, without
# adding anything to the package: faulthandler names each frame by its code's file name.
_PACKAGE_CODE = """\
import faulthandler
import time


def crash():
    faulthandler._sigsegv()  # a fault on this thread, inside a frame of the package


def wait_in_package(start_crash):
    start_crash()
    time.sleep(60)  # the main thread sits here, in the package, while another thread crashes
"""


def _package_code() -> dict:
    import fsdp_overlap_plugin

    path = os.path.join(os.path.dirname(fsdp_overlap_plugin.__file__), "_harness_crash.py")
    namespace: dict = {}
    exec(compile(_PACKAGE_CODE, path, "exec"), namespace)
    return namespace


def _first_attempt(attempts: str) -> bool:
    """Counts this attempt in the file ``attempts`` (a file, so a rerun keeps it)."""
    with open(attempts, "a") as f:
        f.write("attempt\n")
    with open(attempts) as f:
        return len(f.readlines()) == 1


def _crash_in_package_code(rank: int, world: int, attempts: str) -> None:
    dist.barrier()
    if rank == 1:
        _first_attempt(attempts)
        _package_code()["crash"]()
    dist.all_reduce(torch.ones(4))


def _start_native_thread_crash() -> None:
    # a thread with no Python state that faults at once, as gloo's pt_gloo_runloop does:
    # its start routine is raise() and its argument SIGSEGV (the first argument register)
    libc = ctypes.CDLL(None)
    libc.pthread_create.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    thread = ctypes.c_ulong()
    start = ctypes.cast(libc["raise"], ctypes.c_void_p)
    assert libc.pthread_create(ctypes.byref(thread), None, start, ctypes.c_void_p(int(signal.SIGSEGV))) == 0


def _start_python_thread_crash() -> None:
    threading.Thread(target=faulthandler._sigsegv, name="crasher", daemon=True).start()


def _other_thread_crashes_while_main_is_in_package(rank: int, world: int, attempts: str, how: str) -> int:
    dist.barrier()
    if rank == 1 and _first_attempt(attempts):
        start = {"native": _start_native_thread_crash, "python": _start_python_thread_crash}[how]
        _package_code()["wait_in_package"](start)
    dist.all_reduce(torch.ones(4))
    return rank


@pytest.mark.slow
def test_a_crash_on_a_thread_running_package_code_fails_at_once(tmp_path, recwarn, own_rerun_count):
    attempts = tmp_path / "attempts"
    with pytest.raises(AssertionError) as info:
        run_ranks(_crash_in_package_code, str(attempts), timeout=120)
    message = str(info.value)
    assert not isinstance(info.value, _dist.NativeCrash)
    assert "while the crashing thread ran fsdp_overlap_plugin code (not rerun)" in message
    assert "--- rank 1: the crashing thread's stack ---\nFile " in message
    assert '_harness_crash.py", line 6 in crash' in message
    assert attempts.read_text() == "attempt\n"  # ran once
    assert not [w for w in recwarn if issubclass(w.category, RerunAfterCrash)]
    assert own_rerun_count.entries == [] and not own_rerun_count.log.exists()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["native", "python"])
def test_another_thread_crashing_while_main_runs_package_code_is_rerun_and_counted(tmp_path, own_rerun_count, how):
    """Only the crashing thread's stack counts: the main thread waiting inside the
    package (as in a compiled step while gloo's worker thread crashes) does not."""
    attempts = tmp_path / "attempts"
    with pytest.warns(RerunAfterCrash) as warned:
        assert run_ranks(_other_thread_crashes_while_main_is_in_package, str(attempts), how, timeout=120) == [0, 1]
    assert attempts.read_text() == "attempt\n" * 2
    crash = str(warned[0].message)
    # the main thread, in the package (starting the crashing thread, or past that, asleep)
    assert re.search(r'_harness_crash.py", line 1[01] in wait_in_package', crash), crash
    test = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
    entry = f"{test} (_other_thread_crashes_while_main_is_in_package)"
    assert own_rerun_count.entries == [entry]
    assert own_rerun_count.log.read_text() == entry + "\n"


def test_only_the_current_threads_frames_decide():
    package = os.path.dirname(_dist._package_dir())
    ours = f'  File "{package}/fsdp_overlap_plugin/compile.py", line 9 in run_passes'
    theirs = '  File "/usr/lib/python3.11/threading.py", line 327 in wait'
    log = "\n".join(
        [
            "Fatal Python error: Segmentation fault",
            "",
            "Thread 0x00007f0fccc1db80 (most recent call first):",
            ours,
            "",
            "Current thread 0x00007f70004786c0 (most recent call first):",
            theirs,
            "",
            "Extension modules: torch._C (total: 1)",
        ]
    )
    assert crashing_thread_stack(log) == [theirs.strip()]
    assert package_frames(crashing_thread_stack(log)) == []
    swapped = log.replace("Current thread 0x00007f70", "Thread 0x00007f70")
    swapped = swapped.replace("Thread 0x00007f0f", "Current thread 0x00007f0f")
    assert package_frames(crashing_thread_stack(swapped)) == [ours.strip()]
    # a fault on a thread without Python state (gloo's workers): no block is current
    assert crashing_thread_stack(log.replace("Current thread", "Thread")) == []
    # a path that merely contains the package's name is not the package
    assert package_frames(['File "/elsewhere/fsdp_overlap_plugin/x.py", line 1 in f']) == []


def test_crash_logs_of_processes_started_elsewhere_follow_the_same_policy(tmp_path):
    """The restart soak's torchrun processes: empty faulthandler files (no crash, or the
    planned SIGKILL) pass; a crash on a thread outside the package is a NativeCrash
    (rerun); one on a thread inside the copy of the package they imported is not."""
    copy = tmp_path / "package" / "fsdp_overlap_plugin"
    fault = "Fatal Python error: Segmentation fault\n\n"
    gloo = fault + 'Thread 0x1 (most recent call first):\n  File "/x/soak_train.py", line 3 in <module>\n'
    ours = fault + f'Current thread 0x2 (most recent call first):\n  File "{copy}/compile.py", line 9 in run_passes\n'
    raise_on_native_crash({"attempt0-rank0.txt": "", "attempt0-rank1.txt": " \n"}, "torchrun failed")
    with pytest.raises(_dist.NativeCrash, match="(?s)attempt1-rank1.txt.*soak_train.py.*torchrun failed"):
        raise_on_native_crash({"attempt1-rank0.txt": "", "attempt1-rank1.txt": gloo}, "torchrun failed", str(copy))
    with pytest.raises(AssertionError, match="ran fsdp_overlap_plugin code \\(not rerun\\)") as info:
        raise_on_native_crash({"attempt1-rank1.txt": ours}, "torchrun failed", str(copy))
    assert not isinstance(info.value, _dist.NativeCrash)
    # the same frame is not ours when the processes imported some other copy
    with pytest.raises(_dist.NativeCrash):
        raise_on_native_crash({"attempt1-rank1.txt": ours}, "torchrun failed", str(tmp_path / "other"))


LAUNCH_CRASH = _accelerate.ROOT / "tests" / "fixtures" / "launch_crash.py"


def _launcher_failure(rank: int, code: int, signame: str) -> str:
    """One failure as torch's elastic launcher prints it (accelerate launch, torch 2.13)."""
    trace = f"Signal {-code} ({signame}) received by PID 17" if code < 0 else "To enable traceback see: ..."
    return (
        f"[{rank}]:\n  time      : 2026-12-03_06:54:54\n  host      : localhost\n"
        f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code} (pid: 17) {f' ({signame})' if code < 0 else ''}\n"
        f"  error_file: <N/A>\n  traceback : {trace}\n"
    )


def test_a_launchers_failure_summary_follows_the_same_policy():
    """accelerate launch's output (the ranks run with PYTHONFAULTHANDLER=1): rank 0
    aborted in the script, the launcher then sent rank 1 SIGTERM. Rerun (NativeCrash)
    unless the crashing thread ran the package's code; an exception or a SIGTERM alone is
    a plain failure, returned to the test."""
    package = _dist._package_dir()
    script = '  File "/work/examples/train.py", line 9 in <module>'
    dump = (
        "Fatal Python error: Aborted\n\n"
        'Thread 0x00007f17aee116c0 (most recent call first):\n  File "/usr/lib/python3.11/threading.py", line 982 in run\n\n'
        f"Current thread 0x00007f17cfe49b80 (most recent call first):\n{script}\n\n"
        "Extension modules: torch._C (total: 1)\n"
    )
    summary = (
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n=====\nexamples/train.py FAILED\n"
        f"-----\nFailures:\n{_launcher_failure(1, -15, 'SIGTERM')}-----\nRoot Cause (first observed failure):\n"
        f"{_launcher_failure(0, -6, 'SIGABRT')}=====\n"
    )
    assert _dist.launcher_native_crashes(summary) == {0: "SIGABRT"}
    assert _dist.faulthandler_dumps("rank 0 step 3\n" + dump + dump) == [dump, dump]
    with pytest.raises(_dist.NativeCrash, match="(?s)rank 0 by SIGABRT in native code.*train.py.*launch failed"):
        raise_on_launcher_crash("step 3\n" + dump + summary, "launch failed")
    # no dump at all (an abort at interpreter exit, after faulthandler was disabled)
    with pytest.raises(_dist.NativeCrash, match="no faulthandler dump"):
        raise_on_launcher_crash(summary, "launch failed")
    # the crashing thread in the package: not rerun
    ours = dump.replace(script, f'  File "{package}/passes/merge.py", line 3 in merge')
    with pytest.raises(AssertionError, match="ran fsdp_overlap_plugin code \\(not rerun\\)") as info:
        raise_on_launcher_crash(ours + summary, "launch failed")
    assert not isinstance(info.value, _dist.NativeCrash)
    # a Python exception on rank 0 (exit code 1) and the SIGTERM it caused: not a crash
    plain = summary.replace(_launcher_failure(0, -6, "SIGABRT"), _launcher_failure(0, 1, ""))
    assert _dist.launcher_native_crashes(plain) == {}
    raise_on_launcher_crash(plain, "launch failed")
    # a segmentation fault on either rank, among several failures
    two = summary + _launcher_failure(2, -11, "SIGSEGV")
    assert _dist.launcher_native_crashes(two) == {0: "SIGABRT", 2: "SIGSEGV"}


@pytest.mark.slow
@pytest.mark.parametrize("where", ["outside", "exit"])
def test_accelerate_launch_is_rerun_once_after_a_native_crash_outside_the_package(tmp_path, own_rerun_count, where):
    """The real ``accelerate launch`` (tests/_accelerate.py): rank 0 aborts in the script,
    or at exit after its work, on the first attempt only; the launch is run again, with a
    warning and one rerun counted, and the second attempt's result is returned."""
    attempts = tmp_path / "attempts"
    reruns: list[str] = []
    with pytest.warns(RerunAfterCrash) as warned:
        proc = _accelerate.accelerate_launch(
            _accelerate.OVERLAP_YAML, "--attempts", str(attempts), "--where", where, script=LAUNCH_CRASH,
            before_rerun=lambda: reruns.append("cleaned"),
        )  # fmt: skip
    assert proc.returncode == 0, _accelerate.output(proc)[-4000:]
    assert attempts.read_text() == "attempt\n" * 2 and reruns == ["cleaned"]
    assert "rank 0 summed [2.0, 2.0]" in proc.stdout
    crash = str(warned[0].message)
    assert "rerunning accelerate launch after a native crash" in crash and "rank 0 by SIGABRT" in crash, crash
    if where == "outside":  # faulthandler's dump names the script's line
        assert re.search(r'launch_crash.py", line \d+ in <module>', crash), crash
    test = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
    assert own_rerun_count.entries == [f"{test} (accelerate launch)"]


@pytest.mark.slow
def test_accelerate_launch_crashing_in_package_code_fails_at_once(tmp_path, own_rerun_count, recwarn):
    attempts = tmp_path / "attempts"
    with pytest.raises(AssertionError, match="ran fsdp_overlap_plugin code \\(not rerun\\)") as info:
        _accelerate.accelerate_launch(
            _accelerate.OVERLAP_YAML, "--attempts", str(attempts), "--where", "package", script=LAUNCH_CRASH
        )
    assert '_launch_crash.py", line 2 in crash' in str(info.value)
    assert attempts.read_text() == "attempt\n"  # ran once
    assert not [w for w in recwarn if issubclass(w.category, RerunAfterCrash)]
    assert own_rerun_count.entries == []


class _Reporter:
    def __init__(self):
        self.lines: list[str] = []

    def write_line(self, line: str, **markup) -> None:
        self.lines.append(line)


def test_the_terminal_summary_prints_the_rerun_count(own_rerun_count):
    none = _Reporter()
    conftest.pytest_terminal_summary(none)
    assert none.lines == ["native-crash reruns: 0"]
    own_rerun_count.entries.extend(["tests/test_a.py::test_b (fn)", "tests/test_c.py::test_d[x] (g)"])
    two = _Reporter()
    conftest.pytest_terminal_summary(two)
    assert two.lines == [
        "native-crash reruns: 2",
        "  tests/test_a.py::test_b (fn)",
        "  tests/test_c.py::test_d[x] (g)",
    ]
