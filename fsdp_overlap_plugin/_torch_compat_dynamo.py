"""The Dynamo and AOT autograd names of ``_torch_compat`` (split off by job, as its 600-line
limit asks; ``_torch_compat`` re-exports every one of them, so callers use ``compat.<name>``
as before): AOT autograd and its partitioner, make_fx's table of symbolic sizes, Dynamo's
counters, recompile limit, guard failures and exceptions. Each is found by a feature probe
(a guarded import, ``hasattr``), never by the torch version."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any


def _attr(module: str, name: str) -> Any | None:
    """``module.name``, or None when the module or the name is not in this torch."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


# --------------------------------------------------------------------------- AOT / functorch / dynamo
def aot_autograd(**kwargs: Any) -> Any:
    from torch._dynamo.backends.common import aot_autograd as make

    return make(**kwargs)


def min_cut_partition(joint: Any, joint_inputs: Any, **kwargs: Any) -> Any:
    """The partitioner torch's own backends use (it honours the recompute tags)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def _proxy_tensor_slots() -> Any | None:
    """torch.fx.experimental.proxy_tensor where it has what the function below wraps."""
    try:
        module = importlib.import_module("torch.fx.experimental.proxy_tensor")
    except ImportError:
        return None
    ok = callable(getattr(module, "set_proxy_slot", None)) and hasattr(module, "py_sym_types")
    return module if ok else None


def symbolic_sizes_traceable_under_tensor_parallel() -> bool:
    """Whether ``symbols_keep_their_first_proxy`` can be installed in this torch."""
    return _proxy_tensor_slots() is not None


@contextlib.contextmanager
def symbols_keep_their_first_proxy() -> Iterator[None]:
    """While the plugin compiles a tensor-parallel graph, make_fx's table from symbols to
    proxies (``sympy_expr_tracker``) keeps each symbol's first entry, torch's own rule for
    the values it tracks by identity. DTensor's ``sym_max(s, 1)`` of a length known >= 2 is
    ``s`` again, and its lazy proxy, built from ``s``'s, replaced ``s``'s entry: forcing it
    recursed without end (torch 2.13-2.15; docs/tensor-parallel.md)."""
    module = _proxy_tensor_slots()
    if module is None:
        yield
        return
    original, sym_types = module.set_proxy_slot, module.py_sym_types

    def set_proxy_slot(obj: Any, tracer: Any, proxy: Any) -> None:
        table = getattr(tracer, "sympy_expr_tracker", None)
        kept = table.get(obj.node.expr) if table is not None and isinstance(obj, sym_types) else None
        original(obj, tracer, proxy)
        if kept is not None:
            table[obj.node.expr] = kept

    module.set_proxy_slot = set_proxy_slot
    try:
        yield
    finally:
        module.set_proxy_slot = original


def dynamo_counters() -> Any:
    from torch._dynamo.utils import counters

    return counters


def recompile_limit() -> Any:
    """Dynamo's per-frame recompile limit (``recompile_limit``; ``cache_size_limit`` where
    a release still names it so), or ``"?"``."""
    import torch._dynamo

    config = torch._dynamo.config
    return getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", "?")


def guard_failure_counts() -> dict[Any, int]:
    """How many guard failures Dynamo has recorded per code object so far (it records one
    per recompilation, worded as its ``recompiles`` log words it); for
    ``guard_failures_since``."""
    failures = _attr("torch._dynamo.utils", "guard_failures")
    return {code: len(reasons) for code, reasons in failures.items()} if failures is not None else {}


def guard_failures_since(counts: dict[Any, int]) -> list[str]:
    """The guard failures Dynamo recorded after ``guard_failure_counts()`` returned ``counts``."""
    failures = _attr("torch._dynamo.utils", "guard_failures") or {}
    return [reason for code, reasons in list(failures.items()) for reason in reasons[counts.get(code, 0) :]]


def dynamo_restart_error() -> type:
    """The exception by which a compile asks Dynamo to trace the frame again (for example
    to turn a float scalar into a tensor under dynamic shapes): no failure."""
    return _attr("torch._dynamo.exc", "RestartAnalysis") or type("NoRestart", (Exception,), {})


def dynamo_unsupported_error() -> type:
    """The exception Dynamo raises for code it cannot trace."""
    return _attr("torch._dynamo.exc", "Unsupported") or RuntimeError
