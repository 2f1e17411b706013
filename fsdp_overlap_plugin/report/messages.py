"""What a rank tells the user on its own: a configuration error once, short; and that the
first step is compiling, then how long it took.

**A configuration error, once.** ``OverlapConfigError`` (and ``TorchFeatureError``: the
configuration asks for something this torch lacks) stay exceptions, so callers and
``pytest.raises`` see them as before. Only when one reaches the top of a process uncaught
does ``sys.excepthook`` (installed by ``install_excepthook``, chained to the hook that was
there for every other exception) handle it: one rank prints

    fsdp-overlap: configuration error: <the message, naming the key and the fix>
    fsdp-overlap: raised in parallelize, from train.py:50 (`...`) on rank 0; ...

with no traceback (``FSDP_OVERLAP_TRACEBACK=1`` prints the traceback instead), the other
ranks print nothing, and every rank exits with code 2 (the ``fsdp-overlap`` command's
code for a bad config). Which rank prints: configuration errors come from pure checks,
so every rank normally raises the same one at the same point. Rank 0 prints it, then
posts it in a store (the elastic agent's under torchrun / ``accelerate launch``, else the
default process group's); every other rank that raised one waits up to ``WAIT_S`` for
rank 0's, stays quiet when it is the same message, and prints its own (naming its rank)
when rank 0 posted another or nothing in time (a rank-local error). Without a store
(an error before the process group, outside an elastic launcher) only rank 0 prints.
Under an elastic launcher each failing rank also writes a one-line pointer to the
message into ``TORCHELASTIC_ERROR_FILE``, so the launcher's summary says what stopped
the rank instead of "To enable traceback see ...".

**Progress.** ``CompileProgress``: on rank 0, the first call of a compiled model says
that it is compiling, and when it returns, how long it took and how many graphs came
from the compile cache; a recompile is announced the same way, a few times per model at
most. Silenced by ``FSDP_OVERLAP_PROGRESS=0`` or by the logger level:
``logging.getLogger("fsdp_overlap_plugin.progress").setLevel(logging.WARNING)``.
"""

from __future__ import annotations

import json
import linecache
import logging
import os
import socket
import sys
import sysconfig
import time
import traceback
from datetime import timedelta
from types import TracebackType
from typing import Any, TextIO

from ..runtime.records import cache_hits

__all__ = [
    "CONFIG_ERROR_EXIT",
    "PROGRESS_ENV",
    "PROGRESS_LOGGER",
    "TRACEBACK_ENV",
    "CompileProgress",
    "install_excepthook",
    "is_config_error",
    "process_rank",
]

CONFIG_ERROR_EXIT = 2  # the fsdp-overlap command's exit code for a bad config
TRACEBACK_ENV = "FSDP_OVERLAP_TRACEBACK"
PROGRESS_ENV = "FSDP_OVERLAP_PROGRESS"
PROGRESS_LOGGER = "fsdp_overlap_plugin.progress"

#: How long a rank other than 0 waits for rank 0's error, and rank 0 for the others to
#: have read it (it may host the store), before each goes on alone.
WAIT_S = 10.0
_POLL_S = 0.02
_LINGER_S = 2.0  # a quiet rank's wait after rank 0 is done, under an elastic launcher
_AFTER_EXIT_S = 0.5  # ... after rank 0's process ended: the launcher's next poll sees it first
_OFF = ("0", "false", "no", "off")


# ------------------------------------------------------------------ configuration errors
def is_config_error(exc: BaseException | None) -> bool:
    """One of the plugin's startup configuration errors."""
    from .._torch_compat import TorchFeatureError
    from ..config.schema import OverlapConfigError

    return isinstance(exc, (OverlapConfigError, TorchFeatureError))


def install_excepthook() -> None:
    """Make ``sys.excepthook`` report the plugin's configuration errors (module docstring);
    every other exception goes to the hook that was there. Called on import and again at
    each entry point (``parallelize``, the adapters), because ``init_process_group``
    wraps whatever hook it finds in its own ("[rank0]: " before each line): ours is then
    outermost again. A no-op while ours is the current hook."""
    previous = sys.excepthook
    if getattr(previous, "_fsdp_overlap", False):
        return

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> Any:
        if not is_config_error(exc):
            return previous(exc_type, exc, tb)
        # wrapped by another hook (torch's captures sys.stderr to prefix it, and would
        # lose what we write when we exit from inside it): write to the process's stderr
        stream = sys.stderr if sys.excepthook is hook else (sys.__stderr__ or sys.stderr)
        try:
            report_config_error(exc, tb, stream, previous)
        except Exception:  # never hide the error behind our own
            previous(exc_type, exc, tb)
        raise SystemExit(CONFIG_ERROR_EXIT)

    hook._fsdp_overlap = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def report_config_error(exc: BaseException, tb: TracebackType | None, stream: TextIO, previous: Any = None) -> bool:
    """Print ``exc`` on ``stream`` if this rank is the one to (module docstring); True if
    it printed. Writes the launcher's error file when there is one."""
    rank, world = _rank_world()
    text = error_text(exc)
    if world <= 1 or rank == 0:
        _print(exc, tb, stream, previous, rank if world > 1 else None, note="")  # first: nothing may delay it
        _error_file(exc, f"printed above by rank {rank}" if world > 1 else "printed above")
        store = _store(world)
        if store is not None:
            _post_and_wait(store, world, text)
        return True
    store = _store(world)
    if store is None:
        _error_file(exc, "rank 0 printed it above, if it stopped with it too")
        return False
    try:
        reference = _wait_for_rank0(store)
    except Exception:  # the store is gone: its host (rank 0) has exited
        reference = None
    if reference == text:
        _error_file(exc, "the same as rank 0's, printed above")  # before rank 0 may exit
        _read(store)
        _let_rank0_exit_first(store)
        return False
    note = (
        f"rank 0 did not report this error within {WAIT_S:.0f} s"
        if reference is None
        else "rank 0 stopped with another one"
    )
    _print(exc, tb, stream, previous, rank, note=note)
    _error_file(exc, f"printed above by rank {rank}")
    if reference is not None:
        _read(store)
    return True


def error_text(exc: BaseException) -> str:
    """The message without a leading "fsdp-overlap: " (the printed line starts with it)."""
    text = str(exc).strip()
    return text[len("fsdp-overlap: ") :] if text.startswith("fsdp-overlap: ") else text


def _print(
    exc: BaseException, tb: TracebackType | None, stream: TextIO, previous: Any, rank: int | None, note: str
) -> None:
    if os.environ.get(TRACEBACK_ENV, "").strip().lower() not in ("", *_OFF) and previous is not None:
        saved, sys.stderr = sys.stderr, stream
        try:
            previous(type(exc), exc, tb)
        finally:
            sys.stderr = saved
        stream.flush()
        return
    where = [f"raised {_where(tb)}"]
    if rank is not None:
        where.append(f"on rank {rank}" + (f" ({note})" if note else ""))
    stream.write(
        f"fsdp-overlap: configuration error: {error_text(exc)}\n"
        f"fsdp-overlap: {' '.join(where)}; {TRACEBACK_ENV}=1 prints the traceback\n"
    )
    stream.flush()


# the package's folder (this file is in report/)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def _library_dirs() -> tuple[str, ...]:
    package = _PACKAGE
    paths = sysconfig.get_paths()
    dirs = {
        package,
        *(os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths),
    }
    return tuple(d.rstrip(os.sep) + os.sep for d in dirs)


def _where(tb: TracebackType | None) -> str:
    """``in parallelize, from train.py:50 (`fo.parallelize(model, ...)`)``: the
    plugin function the user's code called (the first frame inside the package) and the
    user's line that called it (the last frame outside any library)."""
    frames = list(traceback.walk_tb(tb))
    package = _PACKAGE + os.sep
    libraries = _library_dirs()
    entry, caller = None, None
    for frame, lineno in frames:
        filename = frame.f_code.co_filename
        # generated code (a dataclass's __init__: "<string>") belongs to its module
        path = os.path.realpath(frame.f_globals.get("__file__") or filename)
        if path.startswith(package):
            if entry is None:
                entry = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
        elif not path.startswith(libraries) and not filename.startswith("<frozen"):
            caller, entry = (filename, lineno), None
    words = f"in {entry}" if entry else ""
    if caller is not None:
        filename, lineno = caller
        shown = filename
        if os.path.isabs(filename) and not os.path.relpath(filename).startswith(".."):
            shown = os.path.relpath(filename)
        line = linecache.getline(filename, lineno).strip()
        words += (", from" if words else "at") + f" {shown}:{lineno}" + (f" (`{line}`)" if line else "")
    return words or "at startup"


def _rank_world() -> tuple[int, int]:
    """This process's rank and world size: the default process group's, else the
    launcher's variables (torchrun, accelerate launch), else a single process."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    try:
        return int(os.environ["RANK"]), int(os.environ.get("WORLD_SIZE", "1"))
    except (KeyError, ValueError):
        return 0, 1


def process_rank() -> int:
    """This process's rank (``_rank_world``): for a line said before, or without, a
    process group."""
    return _rank_world()[0]


def _store(world: int) -> Any:
    """Where ranks compare their errors: the elastic agent's store (it outlives every
    rank), else the default process group's (rank 0 hosts it), else None."""
    if world <= 1:
        return None
    try:
        import torch.distributed as dist

        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_PORT" in os.environ:
            return dist.TCPStore(
                os.environ.get("MASTER_ADDR", "localhost"),
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=timedelta(seconds=WAIT_S),
            )
        if dist.is_available() and dist.is_initialized() and dist.get_backend() != "fake":
            from .._torch_compat import default_store

            return default_store()
    except Exception:
        return None
    return None


def _key(leaf: str) -> str:
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"fsdp_overlap/config_error/{run}/{attempt}/{leaf}"


def _post_and_wait(store: Any, world: int, text: str) -> None:
    """Rank 0: post the message, then give the others up to ``WAIT_S`` to read it (it
    may host the store they read it from)."""
    try:
        store.set(_key("rank0"), text)
        deadline = time.monotonic() + WAIT_S
        while store.add(_key("read"), 0) < world - 1 and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        store.set(_key("pid"), f"{socket.gethostname()}:{os.getpid()}")  # before "done"
        store.set(_key("done"), "1")
    except Exception:
        pass


def _read(store: Any) -> None:
    """Tell rank 0 this rank has read its message (it may then exit)."""
    try:
        store.add(_key("read"), 1)
    except Exception:
        pass


def _poll(store: Any, key: str) -> bool:
    """Whether ``key`` was set within ``WAIT_S`` (polled: ``store.wait`` timing out logs a
    C++ warning per attempt)."""
    deadline = time.monotonic() + WAIT_S
    while not store.check([key]):
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S * 5)
    return True


def _let_rank0_exit_first(store: Any) -> None:
    """Under an elastic launcher the first rank to exit is its "root cause" and the others
    are terminated: wait until rank 0 is done and its process has ended (bounded), then a
    moment longer, so that rank 0, which printed the message, is the one the launcher's
    summary names. Interpreter teardown takes rank 0 seconds on a loaded machine, so a
    fixed pause after "done" alone is not enough; a rank 0 on another host (whose process
    this rank cannot see) gets the fixed pause."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    try:
        if not _poll(store, _key("done")):
            return
        host, _, pid = store.get(_key("pid")).decode().rpartition(":")
        if host == socket.gethostname() and _wait_for_exit(int(pid)):
            time.sleep(_AFTER_EXIT_S)
        else:
            time.sleep(_LINGER_S)
    except Exception:
        pass


def _wait_for_exit(pid: int) -> bool:
    """Whether process ``pid`` ended (gone, or a zombie its launcher has not reaped yet)
    within ``WAIT_S``; False where /proc cannot tell."""
    stat = f"/proc/{pid}/stat"
    if not os.path.exists("/proc/self/stat"):
        return False
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            with open(stat) as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            return True  # gone
        if state in ("Z", "X"):
            return True
        time.sleep(_POLL_S)
    return False


def _wait_for_rank0(store: Any) -> str | None:
    """Rank 0's message, or None when it posted none within ``WAIT_S``."""
    if not _poll(store, _key("rank0")):
        return None
    return store.get(_key("rank0")).decode()


def _error_file(exc: BaseException, where: str) -> None:
    """The launcher's error file (``TORCHELASTIC_ERROR_FILE``): its failure summary shows
    this line for the rank. Not the message itself, which is printed once above."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    line = f"fsdp-overlap: configuration error ({type(exc).__name__}), {where}"
    try:
        with open(path, "w") as f:
            # the layout torch's own ErrorHandler.record_exception writes (the launcher
            # shows py_callstack); a plain string message makes the agent log 3 warnings
            json.dump(
                {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}},
                f,
            )
    except OSError:
        pass


# ------------------------------------------------------------------------------ progress
class _StderrHandler(logging.StreamHandler):
    """Writes to the current ``sys.stderr`` (a test's capture, a redirected stream)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)  # writes and flushes


def progress_logger() -> logging.Logger:
    """The logger of the progress lines: INFO, to stderr, unless the user configured it
    (or the package's logger) first."""
    logger = logging.getLogger(PROGRESS_LOGGER)
    if not getattr(logger, "_fsdp_overlap_ready", False):
        logger._fsdp_overlap_ready = True  # type: ignore[attr-defined]
        if logger.level == logging.NOTSET and logging.getLogger("fsdp_overlap_plugin").level == logging.NOTSET:
            logger.setLevel(logging.INFO)
        if not logger.handlers:
            logger.addHandler(_StderrHandler())
            logger.propagate = False  # a root handler would print it twice
    return logger


def say(rank: int, message: str) -> None:
    """One progress line on rank 0."""
    if rank != 0 or os.environ.get(PROGRESS_ENV, "").strip().lower() in _OFF:
        return
    progress_logger().info(message)


class CompileProgress:
    """Rank 0's lines about compiling one model: announced before the first call (which
    always compiles) and at up to ``RECOMPILES`` later compiles, each followed by how long
    that call took and what the compile cache did."""

    RECOMPILES = 3

    def __init__(self, state: Any) -> None:
        self.state = state
        self.recompiles = 0
        self.announced = False  # in the current call
        self.start = 0.0
        self.cache_before = 0
        self.graphs_before = 0
        self.grad = True

    def call_started(self, first: bool) -> None:
        import torch

        self.start = time.perf_counter()
        self.cache_before = len(self.state.compile_cache)
        self.graphs_before = self.state.dynamo_graphs
        self.grad = torch.is_grad_enabled()
        self.announced = first
        if first:
            say(self.state.rank, "fsdp-overlap: compiling the model (first step; later steps reuse it)...")

    def graph_started(self, reason: str | None) -> None:
        """Dynamo hands the backend a graph: announce a recompile not yet announced."""
        if self.announced or reason is None or self.recompiles >= self.RECOMPILES:
            return
        self.recompiles += 1
        self.announced = True
        if "_fsdp_overlap_gather.all_reduce" in reason:  # runtime/accumulation.py's flag, in Dynamo's guard
            short = "gradient accumulation: the micro-batches that skip the replica all-reduce get a graph of their own"
        else:
            short = reason if len(reason) <= 100 else reason[:97] + "..."
        say(self.state.rank, f"fsdp-overlap: compiling the model again ({short})...")

    def call_finished(self, fallback: bool = False) -> None:
        if not self.announced:
            return
        self.announced = False
        seconds = time.perf_counter() - self.start
        if fallback:
            say(
                self.state.rank,
                f"fsdp-overlap: compiling failed after {seconds:.1f} s; on_compile_error: eager, so the model "
                "runs uncompiled (the warning says why)",
            )
            return
        graphs = self.state.dynamo_graphs - self.graphs_before
        if graphs <= 0:
            return
        what = "forward and backward" if self.grad else "forward only, no grad"
        say(self.state.rank, f"fsdp-overlap: compiled in {seconds:.1f} s ({what}; {self._cache_words(graphs)})")

    def _cache_words(self, graphs: int) -> str:
        cache = self.state.compile_cache[self.cache_before :]
        plural = "s" if graphs != 1 else ""
        if not cache:  # aot_eager: inductor's caches are not used
            return f"{graphs} graph{plural}, backend {self.state.config.backend}: no compile cache"
        return f"{cache_hits(cache)} of {len(cache)} graph{'s' if len(cache) != 1 else ''} from the compile cache"
