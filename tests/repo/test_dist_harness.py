"""The multi-rank test harness itself: a failure on one rank must name that rank and
how it ended, even when it died in native code and could report nothing; a native crash
fails the test at once, with faulthandler's stacks, is never rerun, and is counted; a
crash on a thread that ran this package's code says so first."""

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
    NativeCrash,
    crashing_thread_stack,
    package_frames,
    raise_on_launcher_crash,
    raise_on_native_crash,
    run_ranks,
)


@pytest.fixture(autouse=True)
def own_crash_count(monkeypatch, tmp_path_factory) -> SimpleNamespace:
    """The native crashes these tests provoke on purpose are counted here (``entries``,
    and the file ``log``), not in the session's count that the summary and .ci/run print
    (and .ci/run fails on)."""
    counted = SimpleNamespace(entries=[], log=tmp_path_factory.mktemp("crashes") / "crashes.log")
    monkeypatch.setattr(_dist, "crashes", counted.entries)
    monkeypatch.setenv(_dist.CRASH_LOG_ENV, str(counted.log))
    return counted


def _entries(*whats: str) -> list[str]:
    """The crash entries ``count_crash(what)`` writes for each of ``whats`` in this test."""
    test = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
    return [f"{test} ({what})" for what in whats]


def _counted_once(counted: SimpleNamespace, what: str) -> None:
    """The current test's one crash entry, ``what`` naming the run, in both places."""
    assert counted.entries == _entries(what)
    assert counted.log.read_text().splitlines() == _entries(what)


def _not_counted(counted: SimpleNamespace) -> None:
    assert counted.entries == [] and not counted.log.exists()


def _says_never_rerun(message: str) -> None:
    assert "A native crash is never rerun: it fails the test at once" in message, message
    for pointer in ("benchmarks/stress.py", "--malloc-check", "--perturb", "--valgrind", "--cores"):
        assert pointer in message, (pointer, message)
    assert "docs/troubleshooting.md" in message


def _sum(rank: int, world: int) -> float:
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    return t.sum().item()


def _record_attempt(attempts: str, line: str) -> int:
    """Appends ``line`` to the file ``attempts`` (a file outlives the process, so a second
    run would show) and returns how many lines it holds now."""
    with open(attempts, "a") as f:
        f.write(line + "\n")
    with open(attempts) as f:
        return len(f.readlines())


def _segfault_in_native_code() -> None:
    ctypes.string_at(0)  # reads address 0: a real SIGSEGV inside a C function


def _rank1_crashes(rank: int, world: int, attempts: str, how: str) -> None:
    _record_attempt(attempts, f"rank {rank}")
    dist.barrier()
    if rank == 1:
        if how == "SIGSEGV":
            _segfault_in_native_code()
        else:
            os.abort()
    dist.all_reduce(torch.ones(4))


def _rank0_raises(rank: int, world: int) -> None:
    if rank == 0:
        raise ValueError("bad input on rank 0")
    dist.all_reduce(torch.ones(4))  # waits for rank 0, which never comes


def test_results_come_back_in_rank_order():
    assert run_ranks(_sum) == [12.0, 12.0]


def _what_the_rank_started_with(rank: int, world: int) -> dict:
    import gc
    import sys

    preloaded = "lightning.pytorch" in sys.modules  # this module imports neither it nor transformers
    frozen = gc.get_freeze_count()  # before this rank's own imports
    import torch._inductor.config as inductor
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return {
        "preloaded": preloaded,
        "frozen": frozen,
        "fx_graph_cache": inductor.fx_graph_cache,
        "compile_threads": inductor.compile_threads,
        "cache_dir": cache_dir(),
    }


def test_ranks_fork_from_the_preloaded_server_only_where_their_environment_agrees_with_it(tmp_path):
    """The fork server imports transformers and Lightning once (``_dist.PRELOAD``); what those
    imports read from the environment is the server's. A rank whose test sets such a variable
    differently starts with ``spawn`` and gets its own; the compile threads are decided again,
    and the cache folder is read where inductor uses it."""
    plain = run_ranks(_what_the_rank_started_with)
    assert all(r["preloaded"] for r in plain), plain
    # the server froze what it imported (tests/_preloaded.py): the collector never walks it
    assert all(r["frozen"] > 100_000 for r in plain), plain
    threads = run_ranks(_what_the_rank_started_with, env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})
    assert all(r["preloaded"] and r["compile_threads"] == 1 for r in threads), threads
    # a cache folder of the test's own: read when inductor uses it, so the server serves it too
    own_cache = run_ranks(_what_the_rank_started_with, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
    assert all(r["preloaded"] and r["cache_dir"] == str(tmp_path) for r in own_cache), own_cache
    assert plain[0]["cache_dir"] != str(tmp_path)
    import torch._inductor.config

    default = torch._inductor.config.decide_compile_threads()
    assert default != 1 or "TORCHINDUCTOR_COMPILE_THREADS" in os.environ, "the check above could not fail"
    assert all(r["compile_threads"] == default for r in plain), (plain, default)
    own = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0" if plain[0]["fx_graph_cache"] else "1"}
    spawned = run_ranks(_what_the_rank_started_with, env=own)
    assert all(not r["preloaded"] and r["fx_graph_cache"] != plain[0]["fx_graph_cache"] for r in spawned), spawned
    assert all(r["frozen"] == 0 for r in spawned), spawned


@pytest.mark.parametrize("how", ["SIGSEGV", "SIGABRT"])
def test_a_native_crash_fails_at_once_named_with_its_stacks_and_counted(tmp_path, own_crash_count, how):
    """A segmentation fault in a C function, or an abort: the run is not repeated, the
    rank is named with how it died and faulthandler's stacks, and the crash is counted."""
    attempts = tmp_path / "attempts"
    with pytest.raises(NativeCrash) as info:
        run_ranks(_rank1_crashes, str(attempts), how, timeout=120)
    assert sorted(attempts.read_text().splitlines()) == ["rank 0", "rank 1"]  # one run, never a second
    message = str(info.value)
    assert message.startswith("rank 1 died in native code (not rerun):\n"), message[:300]
    assert f"--- rank 1 ---\nkilled by {how} in native code; Python stacks at the crash:" in message
    # faulthandler's stack of the crashing thread, down to the test's function
    frames = ["in _segfault_in_native_code", "in _rank1_crashes"] if how == "SIGSEGV" else ["in _rank1_crashes"]
    for frame in frames:
        assert frame in message, (frame, message)
    assert "--- rank 0 ---" in message  # its "connection reset" or the stopped wait
    _says_never_rerun(message)
    _counted_once(own_crash_count, "_rank1_crashes")


def _rank1_aborts_at_exit(rank: int, world: int) -> float:
    if rank == 1:
        import atexit

        atexit.register(os.abort)  # after its result is sent: as "terminate called" at exit
    return _sum(rank, world)


def test_a_rank_that_dies_at_exit_after_reporting_fails_too(own_crash_count):
    """Every rank returned its result, then rank 1 aborted at exit: that is a native crash,
    not a pass."""
    with pytest.raises(NativeCrash) as info:
        run_ranks(_rank1_aborts_at_exit, timeout=120)
    message = str(info.value)
    assert message.startswith("a rank died in native code after its last step (not rerun):\n"), message[:300]
    assert "--- rank 1 ---\nreported its result, then was killed by SIGABRT" in message
    assert "--- rank 0 ---" not in message
    _says_never_rerun(message)
    _counted_once(own_crash_count, "_rank1_aborts_at_exit")


def test_a_rank_that_raises_is_reported_with_its_traceback_and_not_counted(own_crash_count):
    with pytest.raises(AssertionError) as info:
        run_ranks(_rank0_raises, timeout=120)
    assert not isinstance(info.value, NativeCrash)
    message = str(info.value)
    assert "ValueError: bad input on rank 0" in message
    assert "--- rank 1 ---" in message
    _not_counted(own_crash_count)


def test_run_ranks_has_no_rerun_left():
    """No way back to reruns: no parameter for them, nothing named for them."""
    with pytest.raises(TypeError, match="crash_reruns"):
        run_ranks(_sum, crash_reruns=1)
    for gone in ("RerunAfterCrash", "count_rerun", "reruns", "RERUN_LOG_ENV", "_fresh_if_directory"):
        assert not hasattr(_dist, gone), gone
    for gone in ("crash_reruns", "before_rerun"):
        with pytest.raises(TypeError, match=gone):
            _accelerate.accelerate_launch(_accelerate.OVERLAP_YAML, **{gone: None})


# ----------------------------------------------------------------------------- package code
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


def _crash_in_package_code(rank: int, world: int, attempts: str) -> None:
    dist.barrier()
    if rank == 1:
        _record_attempt(attempts, "attempt")
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
    if rank == 1:
        _record_attempt(attempts, "attempt")
        start = {"native": _start_native_thread_crash, "python": _start_python_thread_crash}[how]
        _package_code()["wait_in_package"](start)
    dist.all_reduce(torch.ones(4))
    return rank


@pytest.mark.slow
def test_a_crash_on_a_thread_running_package_code_fails_at_once_with_its_own_message(tmp_path, own_crash_count):
    attempts = tmp_path / "attempts"
    with pytest.raises(AssertionError) as info:
        run_ranks(_crash_in_package_code, str(attempts), timeout=120)
    message = str(info.value)
    assert not isinstance(info.value, NativeCrash)
    assert message.startswith("a rank crashed in native code while the crashing thread ran fsdp_overlap_plugin code")
    assert "while the crashing thread ran fsdp_overlap_plugin code (not rerun)" in message
    assert "--- rank 1: the crashing thread's stack ---\nFile " in message
    assert '_harness_crash.py", line 6 in crash' in message
    assert "killed by SIGSEGV" in message  # then the whole failure, every rank
    _says_never_rerun(message)
    assert attempts.read_text() == "attempt\n"  # ran once
    _counted_once(own_crash_count, "_crash_in_package_code")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["native", "python"])
def test_another_thread_crashing_while_main_runs_package_code_is_a_native_crash(tmp_path, own_crash_count, how):
    """Only the crashing thread's stack decides which failure it is: the main thread
    waiting inside the package (as in a compiled step while gloo's worker thread crashes)
    does not make it the package's. It fails at once all the same, counted."""
    attempts = tmp_path / "attempts"
    with pytest.raises(NativeCrash) as info:
        run_ranks(_other_thread_crashes_while_main_is_in_package, str(attempts), how, timeout=120)
    assert attempts.read_text() == "attempt\n"  # ran once
    crash = str(info.value)
    assert "--- rank 1 ---\nkilled by SIGSEGV in native code; Python stacks at the crash:" in crash
    assert "ran fsdp_overlap_plugin code" not in crash
    # the main thread, in the package (starting the crashing thread, or past that, asleep)
    assert re.search(r'_harness_crash.py", line 1[01] in wait_in_package', crash), crash
    _says_never_rerun(crash)
    _counted_once(own_crash_count, "_other_thread_crashes_while_main_is_in_package")


def test_only_the_current_threads_frames_decide():
    package = os.path.dirname(_dist._package_dir())
    ours = f'  File "{package}/fsdp_overlap_plugin/compile/compiler.py", line 9 in run_passes'
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


def test_crash_logs_of_processes_started_elsewhere_follow_the_same_policy(tmp_path, own_crash_count):
    """The restart soak's torchrun processes: empty faulthandler files (no crash, or the
    planned SIGKILL) pass, uncounted; a crash on a thread outside the package is a
    NativeCrash; one on a thread inside the copy of the package they imported gets the
    package's message. Each crash is counted once, none is to be rerun."""
    copy = tmp_path / "package" / "fsdp_overlap_plugin"
    fault = "Fatal Python error: Segmentation fault\n\n"
    gloo = fault + 'Thread 0x1 (most recent call first):\n  File "/x/soak_train.py", line 3 in <module>\n'
    ours = fault + f'Current thread 0x2 (most recent call first):\n  File "{copy}/compile.py", line 9 in run_passes\n'
    assert raise_on_native_crash({"attempt0-rank0.txt": "", "attempt0-rank1.txt": " \n"}, "torchrun failed") is None
    _not_counted(own_crash_count)
    with pytest.raises(NativeCrash, match="(?s)attempt1-rank1.txt.*soak_train.py.*torchrun failed") as info:
        raise_on_native_crash({"attempt1-rank0.txt": "", "attempt1-rank1.txt": gloo}, "torchrun failed", str(copy))
    _says_never_rerun(str(info.value))
    _counted_once(own_crash_count, "torchrun")
    with pytest.raises(AssertionError, match="ran fsdp_overlap_plugin code \\(not rerun\\)") as info:
        raise_on_native_crash({"attempt1-rank1.txt": ours}, "torchrun failed", str(copy), what="torchrun killed")
    assert not isinstance(info.value, NativeCrash)
    _says_never_rerun(str(info.value))
    # the same frame is not ours when the processes imported some other copy
    with pytest.raises(NativeCrash):
        raise_on_native_crash({"attempt1-rank1.txt": ours}, "torchrun failed", str(tmp_path / "other"))
    counted = _entries("torchrun", "torchrun killed", "torchrun")
    assert own_crash_count.entries == counted
    assert own_crash_count.log.read_text().splitlines() == counted


LAUNCH_CRASH = _accelerate.ROOT / "tests" / "fixtures" / "launch_crash.py"


def _launcher_failure(rank: int, code: int, signame: str) -> str:
    """One failure as torch's elastic launcher prints it (accelerate launch, torch 2.13)."""
    trace = f"Signal {-code} ({signame}) received by PID 17" if code < 0 else "To enable traceback see: ..."
    return (
        f"[{rank}]:\n  time      : 2026-12-03_06:54:54\n  host      : localhost\n"
        f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code} (pid: 17) {f' ({signame})' if code < 0 else ''}\n"
        f"  error_file: <N/A>\n  traceback : {trace}\n"
    )


def test_a_launchers_failure_summary_follows_the_same_policy(own_crash_count):
    """accelerate launch's output (the ranks run with PYTHONFAULTHANDLER=1): rank 0
    aborted in the script, the launcher then sent rank 1 SIGTERM. A NativeCrash, counted,
    unless the crashing thread ran the package's code (its own message, counted too); an
    exception or a SIGTERM alone is a plain failure, returned to the test, not counted."""
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
    with pytest.raises(NativeCrash, match="(?s)rank 0 by SIGABRT in native code.*train.py.*launch failed") as info:
        raise_on_launcher_crash("step 3\n" + dump + summary, "launch failed")
    _says_never_rerun(str(info.value))
    _counted_once(own_crash_count, "launcher")
    # no dump at all (an abort at interpreter exit, after faulthandler was disabled)
    with pytest.raises(NativeCrash, match="no faulthandler dump"):
        raise_on_launcher_crash(summary, "launch failed", what="accelerate launch")
    # the crashing thread in the package: the package's message
    ours = dump.replace(script, f'  File "{package}/passes/merge.py", line 3 in merge')
    with pytest.raises(AssertionError, match="ran fsdp_overlap_plugin code \\(not rerun\\)") as info:
        raise_on_launcher_crash(ours + summary, "launch failed")
    assert not isinstance(info.value, NativeCrash)
    assert 'passes/merge.py", line 3 in merge' in str(info.value)
    counted = _entries("launcher", "accelerate launch", "launcher")
    # a Python exception on rank 0 (exit code 1) and the SIGTERM it caused: not a crash
    plain = summary.replace(_launcher_failure(0, -6, "SIGABRT"), _launcher_failure(0, 1, ""))
    assert _dist.launcher_native_crashes(plain) == {}
    assert raise_on_launcher_crash(plain, "launch failed") is None
    assert own_crash_count.entries == counted  # the plain failure added nothing
    assert own_crash_count.log.read_text().splitlines() == counted
    # a segmentation fault on either rank, among several failures
    two = summary + _launcher_failure(2, -11, "SIGSEGV")
    assert _dist.launcher_native_crashes(two) == {0: "SIGABRT", 2: "SIGSEGV"}


@pytest.mark.slow
@pytest.mark.parametrize("where", ["outside", "exit"])
def test_accelerate_launch_fails_at_once_on_a_native_crash_outside_the_package(tmp_path, own_crash_count, where):
    """The real ``accelerate launch`` (tests/_accelerate.py): rank 0 aborts in the script,
    or at exit after its work, on its first attempt (a second would end normally); the
    launch is not run again: NativeCrash with faulthandler's dump, counted once."""
    attempts = tmp_path / "attempts"
    with pytest.raises(NativeCrash) as info:
        _accelerate.accelerate_launch(
            _accelerate.OVERLAP_YAML, "--attempts", str(attempts), "--where", where, script=LAUNCH_CRASH
        )
    assert attempts.read_text() == "attempt\n"  # ran once
    crash = str(info.value)
    assert "the launcher reports rank 0 by SIGABRT in native code" in crash, crash
    assert "rank 0 summed [2.0, 2.0]" in crash  # the launch's output, in the failure
    if where == "outside":  # faulthandler's dump names the script's line
        assert re.search(r'launch_crash.py", line \d+ in <module>', crash), crash
    _says_never_rerun(crash)
    _counted_once(own_crash_count, "accelerate launch")


@pytest.mark.slow
def test_accelerate_launch_crashing_in_package_code_fails_at_once(tmp_path, own_crash_count):
    attempts = tmp_path / "attempts"
    with pytest.raises(AssertionError, match="ran fsdp_overlap_plugin code \\(not rerun\\)") as info:
        _accelerate.accelerate_launch(
            _accelerate.OVERLAP_YAML, "--attempts", str(attempts), "--where", "package", script=LAUNCH_CRASH
        )
    assert not isinstance(info.value, NativeCrash)
    assert '_launch_crash.py", line 2 in crash' in str(info.value)
    assert attempts.read_text() == "attempt\n"  # ran once
    _counted_once(own_crash_count, "accelerate launch")


class _Reporter:
    def __init__(self):
        self.lines: list[str] = []
        self.markup: list[dict] = []

    def write_line(self, line: str, **markup) -> None:
        self.lines.append(line)
        self.markup.append(markup)


def test_the_terminal_summary_prints_the_crash_count(own_crash_count):
    none = _Reporter()
    conftest.pytest_terminal_summary(none)
    assert none.lines == ["native crashes: 0"]
    assert not any(none.markup[0].values())  # plain when there is none
    _dist.count_crash("fn")
    own_crash_count.entries.append("tests/test_c.py::test_d[x] (g)")
    two = _Reporter()
    conftest.pytest_terminal_summary(two)
    assert two.lines == ["native crashes: 2", f"  {_entries('fn')[0]}", "  tests/test_c.py::test_d[x] (g)"]
    assert two.markup[0].get("red") or two.markup[0].get("yellow")  # stands out when there is one
