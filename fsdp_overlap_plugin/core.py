"""The core interface: everything an adapter (``lightning/``, ``accelerate/``) needs from the
plugin, in one place. Adapters import this module and ``config/`` (plus their own compat
module), nothing else of the package; ``tests/repo/test_layout.py`` holds them to it.

What an adapter does with it, in the order a run needs it:

- **set up the processes**: ``devices`` (device type -> backend, the device module, the
  process group on a store namespace of its own), ``build_mesh`` (a ``DeviceMesh`` from the
  config's mesh sizes), ``preflight`` (the checks every entry point runs first, pure);
- **prepare a model**: ``take_over_compiled`` (a model the user compiled), ``parallelize``
  (plan -> shard -> compile, in place), ``pop_compile_notes``, ``materialize`` (meta ->
  shards), ``install_excepthook`` (a configuration error printed once, short);
- **ask about a prepared model**: ``get_state`` (its ``OverlapState``, or None),
  ``is_sharded``, ``replica_sync_of`` / ``replica_all_reduce_skipped`` (HSDP's deferred
  replica all-reduce under gradient accumulation);
- **state in and out**: ``full_state_dict``, ``gather_disabled``, the atomic-checkpoint trio
  ``written_atomically`` / ``check_complete`` / ``retire``, ``patch_optimizer_state_dict``;
- **tell the user**: ``schedule_report`` / ``format_report``, ``say`` / ``process_rank``.

Each name is imported on first use (PEP 562, ``_lazy.py``, as the package root's): an adapter's
``from ..core import devices`` loads ``runtime/devices.py`` only, so registering the
Lightning names at import stays cheap; ``parallelize`` and the passes load when first used.
"""

from __future__ import annotations

from ._lazy import lazy_names

#: Each name and the module (relative to the package) that defines it.
_WHERE = {
    # set up the processes
    "devices": ".runtime.devices",  # the module
    "build_mesh": ".shard.sharding",
    "preflight": ".shard.preflight",
    "Preflight": ".shard.preflight",  # what preflight found, handed on to parallelize(checked=...)
    # prepare a model
    "install_excepthook": ".report.messages",
    "materialize": ".shard.initialize",
    "parallelize": ".parallelize",
    "pop_compile_notes": ".parallelize",
    "take_over_compiled": ".parallelize",
    # ask about a prepared model
    "get_state": ".runtime.state",
    "is_sharded": ".shard.sharding",
    "replica_all_reduce_skipped": ".runtime.accumulation",
    "replica_sync_of": ".runtime.accumulation",
    # state in and out
    "check_complete": ".shard.atomic_checkpoint",
    "refuse_tensor_parallel_checkpoint": ".shard.tensor_parallel",
    "full_state_dict": ".shard.export",
    "gather_disabled": ".shard.sharding",
    "patch_optimizer_state_dict": "._torch_compat",
    "retire": ".shard.atomic_checkpoint",
    "written_atomically": ".shard.atomic_checkpoint",
    # tell the user
    "format_report": ".report.schedule_text",
    "process_rank": ".report.messages",
    "say": ".report.messages",
    "schedule_report": ".report.schedule",
}

#: The names that are a module (the entry names the module itself).
_MODULES = {"devices"}

__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_names(__name__, _WHERE, modules=_MODULES)
