"""Sharded checkpoints that are never half-written (for plain torchrun training loops;
Lightning and Accelerate use their own checkpointing).

``save(directory, model, optimizer, step=n)`` writes a ``torch.distributed.checkpoint``
(each rank its shards) into ``.step_<n>.partial``; only after every rank has finished
does rank 0 rename it to ``step_<n>`` (``atomic_checkpoint.written_atomically``: a
``step_<n>`` saved again is swapped for the new one in one step) and point ``latest`` at
it (written to a temporary file, then ``os.replace``: atomic on POSIX). A crash at any
moment leaves either the previous checkpoint as ``latest`` or the new one complete;
``load_latest`` never sees a partial directory, and refuses one that lost a file since
(``IncompleteCheckpointError``, naming the file and the newest complete checkpoint
beside it). Leftovers of a killed save are removed by the next save; checkpoints beyond
``keep`` are renamed out of sight before they are deleted.

The model and optimizer state go through
``torch.distributed.checkpoint.state_dict.get_state_dict``, so optimizer state is keyed
by parameter name and the checkpoint loads into the same model sharded on any number of
ranks, or into an eager ``fully_shard`` copy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from .atomic_checkpoint import METADATA, IncompleteCheckpointError, check_complete, retire, written_atomically
from .sharding import gather_disabled

__all__ = ["IncompleteCheckpointError", "load_latest", "save"]

LATEST = "latest"


def _name(step: int) -> str:
    return f"step_{step:08d}"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _optimizers(optimizer: Any) -> Any:
    """What torch's ``get_state_dict`` / ``set_state_dict`` take for "no optimizer"."""
    return [] if optimizer is None else optimizer


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def save(
    directory: str | Path,
    model: nn.Module,
    optimizer: Any = None,
    *,
    step: int,
    extra: dict | None = None,
    keep: int = 2,
) -> Path:
    """Save a sharded checkpoint of ``model`` (and ``optimizer``) as ``step``; keep the
    newest ``keep`` checkpoints. Every rank must call it. Returns the final directory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    directory = Path(directory)
    final = directory / _name(step)
    with gather_disabled():  # torch's helper looks each parameter up by name: read the shards
        model_state, optim_state = get_state_dict(model, _optimizers(optimizer))
    state = {"model": model_state, "optim": optim_state, "meta": {"step": step, "extra": json.dumps(extra or {})}}
    with written_atomically(final, step=step) as partial:
        dcp.save(state, checkpoint_id=str(partial))  # ends with every rank's files written
    if _rank() == 0:
        tmp = directory / f".{LATEST}.tmp"
        tmp.write_text(final.name)
        os.replace(tmp, directory / LATEST)
        checkpoints = sorted(p for p in directory.glob("step_*") if p.is_dir())
        for old in checkpoints[:-keep] if keep > 0 else []:
            retire(old)
    _barrier()
    return final


def load_latest(directory: str | Path, model: nn.Module, optimizer: Any = None) -> tuple[int, dict] | None:
    """Load the checkpoint ``latest`` points to into ``model`` (and ``optimizer``), in place.
    Returns ``(step, extra)``, or None when there is no complete checkpoint yet. A
    checkpoint that lacks a file (removed since it was written) raises
    ``IncompleteCheckpointError`` on every rank, naming the file and the newest complete
    checkpoint beside it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    directory = Path(directory)
    pointer = directory / LATEST
    if not pointer.is_file():
        return None
    path = directory / pointer.read_text().strip()
    check_complete(path, required=(METADATA,))
    with gather_disabled():
        model_state, optim_state = get_state_dict(model, _optimizers(optimizer))
    state = {"model": model_state, "optim": optim_state, "meta": {"step": 0, "extra": ""}}
    dcp.load(state, checkpoint_id=str(path))
    with gather_disabled():
        set_state_dict(
            model,
            _optimizers(optimizer),
            model_state_dict=state["model"],
            optim_state_dict=state["optim"] if optimizer is not None else {},
        )
    meta = state["meta"]
    return int(meta["step"]), json.loads(meta["extra"] or "{}")
