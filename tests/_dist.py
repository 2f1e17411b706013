"""Run a function on N gloo ranks in fresh processes and collect what each returns.

Each rank is a fresh process (forked from a fork server that has imported torch once:
``rank_context``) with one intra-op thread (the CI machine has two cores), a TCP store
on a free loopback port, and a timeout so a hang fails the test instead of the CI job. A rank that dies in native code (a signal: SIGSEGV, SIGABRT,
...) is named with faulthandler's Python stacks of every thread, and the test fails at
once: a native crash is never rerun. Each one is counted (``count_crash``), for the
terminal summary and .ci/run to print; a crash on a thread that was running this
package's code gets a message of its own (``fail_if_package_crashed``). See
``run_ranks``.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib.util
import io
import multiprocessing as mp
import os
import queue
import re
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing import forkserver
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NATIVE_CRASHES = (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE)


class NativeCrash(AssertionError):
    """A rank died by a signal, in native code, and could report nothing itself. It
    fails the test; it is never rerun."""


# What every native-crash failure says after its stacks: how to chase one down.
NEVER_RERUN = (
    "A native crash is never rerun: it fails the test at once, and is counted in the "
    '"native crashes" line of the summary. To find its cause, run benchmarks/stress.py, '
    "which counts native deaths per config variant over many fresh runs (--malloc-check, "
    "--perturb N, --valgrind, --cores keep evidence of heap corruption and gdb backtraces); "
    "see docs/troubleshooting.md."
)

# Every native crash that failed a run in this process, as "test id (what)"; the
# terminal summary (conftest.py) prints them. Where CRASH_LOG_ENV names a file, each is
# also appended there, for .ci/run to print (and fail on) after the whole suite.
crashes: list[str] = []
CRASH_LOG_ENV = "FSDP_OVERLAP_CRASH_LOG"


def count_crash(what: Callable | str) -> None:
    """Count one native crash of ``what`` (a function, or words such as "accelerate
    launch") in the current test: in ``crashes``, and in the file CRASH_LOG_ENV names."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0] or "(not in a test)"
    entry = f"{test} ({what if isinstance(what, str) else what.__name__})"
    crashes.append(entry)
    if path := os.environ.get(CRASH_LOG_ENV):
        with open(path, "a") as f:
            f.write(entry + "\n")


def _read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        return f.read()


def _died(exitcode: int | None, crash_log: str) -> str:
    """How a process that never reported ended, in words, with the Python stack of
    every thread at the crash (written by faulthandler) when there is one."""
    if exitcode is None or exitcode == -signal.SIGKILL:
        return "still running, stopped by the test"
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    text = f"killed by {signal.Signals(-exitcode).name}"
    if log := _read(crash_log):
        text += " in native code; Python stacks at the crash:\n" + log[-6000:]
    return text


def crashing_thread_stack(crash_log: str) -> list[str]:
    """The frames faulthandler listed for the thread the fatal signal hit (its
    "Current thread ..." block, most recent call first); empty when no block is marked
    current.

    faulthandler's handler runs in the thread that faulted (SIGSEGV, SIGBUS, SIGILL and
    SIGFPE are delivered to the faulting thread, abort() signals its own thread) and
    marks as current the Python thread state of *that* thread. A native thread with no
    Python state, such as gloo's ``pt_gloo_runloop`` workers, has none, so every
    thread, the main one included, is then listed as a plain "Thread ..." block.
    """
    lines = crash_log.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Current thread ")]
    if not starts:
        return []
    frames = []
    for line in lines[starts[-1] + 1 :]:
        if not line.startswith("  "):
            break
        frames.append(line.strip())
    return frames


_FRAME_FILE = re.compile(r'^File "(.*)", line \d+ in ')


def _package_dir() -> str:
    spec = importlib.util.find_spec("fsdp_overlap_plugin")  # found, not imported
    assert spec is not None and spec.submodule_search_locations, "fsdp_overlap_plugin is not importable"
    return os.path.realpath(list(spec.submodule_search_locations)[0])


def package_frames(frames: list[str], package_dir: str | None = None) -> list[str]:
    """The frames whose file lies inside the fsdp_overlap_plugin package (the importable
    one, or ``package_dir``: a copy that subprocesses import instead)."""
    package = os.path.realpath(package_dir or _package_dir()) + os.sep
    return [f for f in frames if (m := _FRAME_FILE.match(f)) and os.path.realpath(m.group(1)).startswith(package)]


def fail_if_package_crashed(crash_logs: dict[str, str], failure: str, package_dir: str | None = None) -> None:
    """A crash on a thread that was running our code is ours to fix: raise
    ``AssertionError`` naming each such crash (``crash_logs`` maps a name to a
    faulthandler file's text) with the crashing thread's stack, then ``failure``.
    ``package_dir``: the copy of the package the processes imported, if not this one.
    Counting the crash is the caller's (``_raise_crash``)."""
    ours = {}
    for name, text in crash_logs.items():
        stack = crashing_thread_stack(text)
        if package_frames(stack, package_dir):
            ours[name] = stack
    if ours:
        raise AssertionError(
            "a rank crashed in native code while the crashing thread ran fsdp_overlap_plugin code (not rerun):\n"
            + "".join(
                f"--- {name}: the crashing thread's stack ---\n" + "\n".join(stack) + "\n"
                for name, stack in ours.items()
            )
            + failure
        )


def _raise_crash(what: Callable | str, crash_logs: dict[str, str], crash: NativeCrash, package_dir: str | None) -> None:
    """Count one native crash of ``what``, then raise: the package-code ``AssertionError``
    when a crashing thread in ``crash_logs`` ran the package's code, else ``crash``."""
    count_crash(what)
    fail_if_package_crashed(crash_logs, f"{crash}", package_dir)
    raise crash


def raise_on_native_crash(
    crash_logs: dict[str, str], failure: str, package_dir: str | None = None, *, what: str = "torchrun"
) -> None:
    """The policy of ``run_ranks`` for processes started some other way (torchrun), each
    with a faulthandler file: ``crash_logs`` maps a file's name to its text, empty where
    the process hit no fatal signal (a SIGKILL writes nothing). Returns when every log is
    empty; else counts the crash (``count_crash``) and raises ``AssertionError`` when a
    crashing thread ran the package's code (``fail_if_package_crashed``), else
    ``NativeCrash``. Neither is to be rerun. ``what``: the run, as ``count_crash`` names it."""
    logs = {name: text for name, text in crash_logs.items() if text.strip()}
    if not logs:
        return
    report = "".join(f"--- {name} ---\n{text[-4000:]}\n" for name, text in logs.items()) + failure
    crash = NativeCrash(f"a rank crashed in native code (faulthandler's stacks):\n{report}\n{NEVER_RERUN}")
    _raise_crash(what, logs, crash, package_dir)


# One failure in the summary a torch elastic launcher (torchrun, ``accelerate launch``)
# prints when a rank failed: "rank      : 0 (local_rank: 0)" then "exitcode  : -6 (pid: 7)".
_LAUNCHER_FAILURE = re.compile(r"^\s*rank\s*: (\d+) \(local_rank: \d+\)\n\s*exitcode\s*: (-?\d+) \(pid: \d+\)", re.M)


def launcher_native_crashes(text: str) -> dict[int, str]:
    """``{rank: signal name}`` for each rank that a torch elastic launcher's failure
    summary in ``text`` reports killed by a fatal signal in native code (SIGSEGV,
    SIGABRT, ...); the SIGTERM the launcher sends the other ranks is not one."""
    crashes = {}
    for rank, code in _LAUNCHER_FAILURE.findall(text):
        if int(code) < 0 and -int(code) in NATIVE_CRASHES:
            crashes[int(rank)] = signal.Signals(-int(code)).name
    return crashes


def faulthandler_dumps(text: str) -> list[str]:
    """Each dump faulthandler wrote into ``text`` (the output of processes run with
    PYTHONFAULTHANDLER=1): from a "Fatal Python error: " line to the next one or the end."""
    starts = [m.start() for m in re.finditer(r"^Fatal Python error: ", text, re.M)]
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)])]


def raise_on_launcher_crash(text: str, failure: str, package_dir: str | None = None, *, what: str = "launcher") -> None:
    """The policy of ``run_ranks`` for a launcher command that failed (``text``: its
    output, the ranks run with PYTHONFAULTHANDLER=1). Returns when its failure summary
    names no rank killed by a native signal (an exception, a bad config, a timeout: for
    the test to show); else counts the crash (``count_crash``) and raises
    ``AssertionError`` when a faulthandler dump's crashing thread ran the package's
    code, else ``NativeCrash``. A crash with no dump (one at interpreter exit, after
    faulthandler is disabled) is a NativeCrash. Neither is to be rerun. ``what``: the
    command, as ``count_crash`` names it."""
    crashed = launcher_native_crashes(text)
    if not crashed:
        return
    dumps = {f"faulthandler dump {i + 1}": dump for i, dump in enumerate(faulthandler_dumps(text))}
    ranks = ", ".join(f"rank {rank} by {name}" for rank, name in sorted(crashed.items()))
    shown = "".join(f"--- {name} ---\n{dump[:6000]}\n" for name, dump in dumps.items()) or "(no faulthandler dump)\n"
    crash = NativeCrash(f"the launcher reports {ranks} in native code:\n{shown}{failure}\n{NEVER_RERUN}")
    _raise_crash(what, dumps, crash, package_dir)


def _worker(
    rank: int, world: int, port: int, fn: Callable, args: tuple, results: Any, env: dict, crash_dir: str
) -> None:
    # a crash in native code writes every thread's Python stack here, for the parent
    crash_log = open(os.path.join(crash_dir, f"rank{rank}.txt"), "w")  # noqa: SIM115 (open until exit)
    faulthandler.enable(crash_log, all_threads=True)
    os.environ.clear()
    os.environ.update(env)  # the test's whole environment (run_ranks)
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
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is not None and inductor_config.compile_threads is not None:
        # decided when the fork server imported it: decided again with this rank's environment
        inductor_config.compile_threads = inductor_config.decide_compile_threads()
    # the ranks of tests that never call parallelize (which registers it) get the plugin's
    # exit hook too: torch's gloo abort at exit is not what those tests test
    from fsdp_overlap_plugin.runtime.devices import settle_gloo_workers_at_exit

    settle_gloo_workers_at_exit()
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
    # A forked process ends with os._exit, which skips the exit hooks: run them here, as a
    # process that exits does (the plugin's gloo hook; a hook that aborts kills the rank
    # after its result is in, and the test fails). What os._exit still skips is tearing the
    # interpreter down: the launcher tests and benchmarks/stress.py run real processes.
    atexit._run_exitfuncs()


def _rank_logs(crash_dir: str, ranks: list[int]) -> dict[str, str]:
    """The faulthandler file of each of ``ranks``, by "rank r"."""
    return {f"rank {r}": _read(os.path.join(crash_dir, f"rank{r}.txt")) for r in ranks}


# What the fork server imports before it forks a rank: torch, Dynamo, DTensor, transformers
# and Lightning (about 5.5 s of CPU per rank on the CI machine, which every rank of a
# transformers or Lightning test paid again; tests start a few hundred ranks). Dynamo,
# inductor, transformers and huggingface_hub read some settings from the environment when
# they are imported (TORCHINDUCTOR_*, HF_*, ...): a rank forked from the server has the
# server's values of those. So the server serves only ranks whose environment agrees with
# its own on every such name (``IMPORT_TIME_PREFIXES``); a rank whose test sets one of them
# differently (a cache directory of its own, a cache switched on) starts with ``spawn``
# instead and imports everything itself. TORCHINDUCTOR_COMPILE_THREADS, which the four-rank
# tests set, is the exception: each rank decides its compile threads again (``_worker``).
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch.distributed.tensor",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "lightning.pytorch",
    "_preloaded",  # last: gc.freeze() over everything the imports above made
]
IMPORT_TIME_PREFIXES = ("TORCH", "PYTORCH", "TRANSFORMERS", "HF_", "HUGGINGFACE", "PL_", "LIGHTNING", "USE_")
_server_started = False  # with _SESSION_SETTINGS


# Not compared: read at import, but decided again in each rank (``_worker``); read at each
# use, never at import (inductor's ``cache_dir()`` reads TORCHINDUCTOR_CACHE_DIR whenever it
# looks up or writes an entry, on every torch of the matrix: a test's own cache folder keeps
# its ranks on the fork server); and what the preloaded imports set themselves (Lightning
# sets PYTORCH_NVML_BASED_CUDA_CHECK=1), which this process has or not depending on whether
# it has imported them yet.
NOT_COMPARED = ("TORCHINDUCTOR_COMPILE_THREADS", "TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK")


def import_time_settings(environ: dict | os._Environ) -> dict[str, str]:
    """The variables of ``environ`` that the preloaded modules may read when imported."""
    return {k: v for k, v in environ.items() if k.startswith(IMPORT_TIME_PREFIXES) and k not in NOT_COMPARED}


# the session's, as the test modules that import this one are collected
_SESSION_SETTINGS = import_time_settings(os.environ)


def rank_context(environ: dict | None = None):
    """The multiprocessing context ranks with ``environ`` start from: ``forkserver`` with
    ``PRELOAD`` imported, where ``environ`` agrees with the fork server's environment on
    ``IMPORT_TIME_PREFIXES``, else ``spawn``. The fork server starts on the first call, with
    those variables as the session had them when this module was imported. A rank does not
    inherit the environment from the fork server: ``run_ranks`` sends it the test's."""
    global _server_started
    ctx = mp.get_context("forkserver")
    if not _server_started:
        # started now, with the session's settings whatever the current test has changed
        ctx.set_forkserver_preload(PRELOAD)
        saved = dict(os.environ)
        try:
            for name in import_time_settings(os.environ):
                del os.environ[name]
            os.environ.update(_SESSION_SETTINGS)
            # Python 3.11's server takes the caller's sys.path but does not apply it: this
            # folder (``_preloaded``) reaches it through PYTHONPATH
            os.environ["PYTHONPATH"] = os.pathsep.join(
                p for p in (os.path.dirname(os.path.abspath(__file__)), saved.get("PYTHONPATH")) if p
            )
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _server_started = True
    if import_time_settings(environ if environ is not None else os.environ) != _SESSION_SETTINGS:
        return mp.get_context("spawn")
    return ctx


def run_ranks(fn: Callable, *args: Any, world: int = 2, timeout: float = 600, env: dict | None = None) -> list[Any]:
    """``[fn(0, world, *args), ..., fn(world-1, world, *args)]``, each in its own process,
    run once.

    A failure raises ``AssertionError`` with every rank's traceback, and for a rank that
    died silently, how it ended. A rank killed by a signal in native code (SIGSEGV,
    SIGABRT, ...; gloo's worker threads in torch 2.13 crashed rarely, see
    docs/troubleshooting.md) raises ``NativeCrash`` at once, with faulthandler's Python
    stacks of every thread of that rank, and is counted (``count_crash``): it is never
    rerun, so a rare crash shows up as a failure, not as a pass after a second try. When
    the crashing thread's stack (faulthandler's "Current thread" block) names a frame of
    fsdp_overlap_plugin, the failure is ``fail_if_package_crashed``'s ``AssertionError``
    instead, which puts that stack first. To chase a native crash, run
    benchmarks/stress.py (``NEVER_RERUN``).
    """
    environ = {**os.environ, **dict(env or {})}  # as the test has it now, not as the fork server had it
    ctx = rank_context(environ)
    results = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ranks-") as crash_dir:
        procs = [
            ctx.Process(target=_worker, args=(rank, world, port, fn, args, results, environ, crash_dir), daemon=False)
            for rank in range(world)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        errors: list[str] = []
        reported: set[int] = set()
        deadline = time.monotonic() + timeout
        try:
            while len(reported) < world:
                if time.monotonic() > deadline:
                    if not errors:
                        missing = sorted(set(range(world)) - reported)
                        errors.append(f"timed out after {timeout} s waiting for ranks {missing}")
                    break
                try:
                    rank, status, value = results.get(timeout=1)
                except queue.Empty:
                    if all(procs[r].exitcode is not None for r in range(world) if r not in reported):
                        # whoever has not reported is dead (its message would be here by now)
                        if not errors:
                            errors.append("a rank ended without reporting")
                        break
                    continue
                reported.add(rank)
                if status == "ok":
                    import torch

                    out[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    errors.append(f"--- rank {rank} ---\n{value}")
                    # the other ranks may now wait forever in a collective: give them a
                    # short while to report their own error (often the root cause), no more
                    deadline = min(deadline, time.monotonic() + 20)
        finally:
            for p in procs:
                p.join(timeout=5 if errors else 60)
                if p.is_alive():
                    p.kill()  # shown as "stopped by the test" below
                    p.join()
        # a rank that reported its result and then died by a signal (in
        # destroy_process_group, or at exit: "terminate called without an active
        # exception") crashed all the same
        late = [r for r in reported if procs[r].exitcode is not None and -procs[r].exitcode in NATIVE_CRASHES]
        if late and not errors:
            crash_logs = _rank_logs(crash_dir, late)
            shown = "\n".join(
                f"--- rank {r} ---\nreported its result, then was "
                f"{_died(procs[r].exitcode, os.path.join(crash_dir, f'rank{r}.txt'))}"
                for r in late
            )
            crash = NativeCrash(f"a rank died in native code after its last step (not rerun):\n{shown}\n{NEVER_RERUN}")
            _raise_crash(fn, crash_logs, crash, None)
        if errors:
            # a rank that died in native code reports nothing itself, and its peers only
            # see "connection reset by peer": name it and show where it was
            silent = {r: p.exitcode for r, p in enumerate(procs) if r not in reported}
            errors += [
                f"--- rank {r} ---\n{_died(code, os.path.join(crash_dir, f'rank{r}.txt'))}"
                for r, code in silent.items()
            ]
            crashed = [r for r, code in silent.items() if code is not None and -code in NATIVE_CRASHES]
            if crashed:
                crash_logs = _rank_logs(crash_dir, crashed)
                names = ", ".join(f"rank {r}" for r in crashed)
                crash = NativeCrash(
                    f"{names} died in native code (not rerun):\n" + "\n".join(errors) + f"\n{NEVER_RERUN}"
                )
                _raise_crash(fn, crash_logs, crash, None)
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
