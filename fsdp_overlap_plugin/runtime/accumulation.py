"""Gradient accumulation on HSDP: the replica all-reduce on the last micro-batch only.

FSDP2's names, on the compiled model (``compile: false`` is FSDP2 itself and has them):

* ``model.set_requires_all_reduce(False)``: the micro-batches that follow skip the replica
  all-reduce. The sharded gradient of each micro-batch (reduce-scattered over the shard
  group, as always) accumulates in ``param.grad`` unreduced across replicas. The flag is
  read while tracing, so Dynamo compiles a second graph without the all-reduces the first
  time (once: both stay cached).
* ``model.set_requires_all_reduce(True)`` after that: the accumulated gradients leave
  ``param.grad`` and are all-reduced across the replicas in one asynchronous collective per
  dtype, which runs behind the next micro-batch's forward and backward; that backward's own
  graph all-reduces its gradients (overlapped as usual), and when it ends the two are added.
  An average is linear, so the sum equals one all-reduce of the whole accumulated gradient
  (to rounding).
* ``model.set_requires_gradient_sync(False)`` does the same here, and only that: FSDP2 also
  skips the reduce-scatter and keeps full-size, unreduced gradients until the last
  micro-batch; here the reduce-scatter is part of the compiled backward graph and runs on
  every micro-batch (over the shard group, the fast link), so gradients stay sharded
  (less memory than FSDP2's) and only the replica all-reduce is deferred. The numbers are
  the same either way. The first call says so once (INFO, logger
  ``fsdp_overlap_plugin.runtime.accumulation``); there is no switch that skips the reduce-scatter.
* ``model.no_sync()``: a context manager for ``set_requires_gradient_sync(False)``.

Accelerate's ``accumulate`` calls ``set_requires_gradient_sync`` on an FSDP2 model; the
Lightning strategies call these from their backward-sync hooks.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._torch_compat import queue_backward_callback

__all__ = ["ReplicaSync", "install", "replica_all_reduce_skipped", "replica_sync_of"]

log = logging.getLogger(__name__)
_SAID: set[str] = set()


def _say_once(key: str, message: str) -> None:
    if key not in _SAID:
        _SAID.add(key)
        log.info(message)


class ReplicaSync:
    """The accumulation state of one HSDP model: whether its graphs all-reduce across
    replicas, and the accumulated gradients being all-reduced outside them."""

    def __init__(self, model: nn.Module, gather, replicate_group: dist.ProcessGroup | None):
        self._model = model
        self._gather = gather
        self._group = replicate_group
        self._replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self._pending: list[tuple[dist.Work, torch.Tensor, list[tuple[nn.Parameter, int, int]]]] = []
        self._queued = False
        self.deferred_all_reduces = 0
        """How many accumulated sums were all-reduced behind a last micro-batch (one per
        optimizer step that accumulated): what tests and users can count."""
        self._hooks = []
        if self._group is not None:
            for param in self._params():
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_grad))

    def _params(self) -> list[nn.Parameter]:
        seen: set[int] = set()
        out = []
        for param in self._model.parameters():
            if isinstance(param, DTensor) and param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                out.append(param)
        return out

    @property
    def requires_all_reduce(self) -> bool:
        return self._gather.all_reduce

    def set_requires_all_reduce(self, requires_all_reduce: bool) -> None:
        if self._group is None:
            return  # one replica: nothing to skip
        if requires_all_reduce and not self._gather.all_reduce:
            self._launch()
        elif not requires_all_reduce:
            self.finish()  # a sync step that never ran its backward: settle it first
        self._gather.all_reduce = bool(requires_all_reduce)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """FSDP2's name (Accelerate's ``accumulate`` / ``no_sync`` call it): here it skips the
        replica all-reduce only; the reduce-scatter runs on every micro-batch (module doc)."""
        if not requires_gradient_sync and self._group is not None:
            _say_once(
                "gradient_sync",
                "fsdp_overlap: set_requires_gradient_sync(False): the micro-batches that accumulate skip the "
                "all-reduce across replicas; their reduce-scatter over the shard group is compiled into the "
                "backward and still runs, so gradients stay sharded (FSDP2 would keep them full-size and skip "
                "it). Results are the same.",
            )
        self.set_requires_all_reduce(requires_gradient_sync)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    def _launch(self) -> None:
        """All-reduce (sum) every accumulated gradient across replicas, asynchronously, one
        flat buffer per dtype; ``param.grad`` is cleared so the next backward writes its
        own (all-reduced) gradient there."""
        by_dtype: dict[torch.dtype, list[tuple[nn.Parameter, torch.Tensor]]] = {}
        for param in self._params():
            if param.grad is None:
                continue
            local = param.grad.to_local()
            by_dtype.setdefault(local.dtype, []).append((param, local))
            param.grad = None
        for items in by_dtype.values():
            flat = torch.cat([local.reshape(-1) for _, local in items])
            layout, offset = [], 0
            for param, local in items:
                layout.append((param, offset, local.numel()))
                offset += local.numel()
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
            self._pending.append((work, flat, layout))
        if by_dtype:
            self.deferred_all_reduces += 1

    def _on_grad(self, param: nn.Parameter) -> None:
        if self._pending and not self._queued:
            self._queued = True
            queue_backward_callback(self.finish)

    def finish(self) -> None:
        """Wait for the accumulated gradients' all-reduce and add them to ``param.grad``
        (the end of the sync micro-batch's backward; also before a new accumulation)."""
        pending, self._pending, self._queued = self._pending, [], False
        with torch.no_grad():
            for work, flat, layout in pending:
                work.wait()
                flat.div_(self._replicas)
                for param, offset, numel in layout:
                    piece = flat[offset : offset + numel].view(param.to_local().shape)
                    if param.grad is None:
                        param.grad = DTensor.from_local(
                            piece.clone(),
                            param.device_mesh,
                            param.placements,
                            run_check=False,
                            shape=param.shape,
                            stride=param.stride(),
                        )
                    else:
                        param.grad.to_local().add_(piece)


def install(model: nn.Module, gather, mesh) -> ReplicaSync:
    """Attach FSDP2's accumulation methods to ``model`` (see the module doc)."""
    group = mesh.get_group(0) if mesh.ndim == 2 and mesh.shape[0] > 1 else None
    sync = ReplicaSync(model, gather, group)
    for name in ("set_requires_all_reduce", "set_requires_gradient_sync", "no_sync"):
        object.__setattr__(model, name, getattr(sync, name))
    return sync


def replica_sync_of(model: nn.Module | None):
    """What skips ``model``'s replica all-reduce while accumulating: its ``ReplicaSync``
    (compiled, HSDP), the FSDP2 root itself (``compile: false`` on HSDP: FSDP2's own
    ``set_requires_all_reduce``), or None (one replica: nothing to skip)."""
    if model is None:
        return None
    from .state import get_state

    state = get_state(model)
    if state is None or len(state.mesh_shape) != 2 or state.mesh_shape[0] == 1:
        return None
    if state.replica_sync is not None:
        return state.replica_sync
    return model if hasattr(model, "set_requires_all_reduce") else None


@contextlib.contextmanager
def replica_all_reduce_skipped(model: nn.Module | None) -> Iterator[bool]:
    """Inside: the micro-batches skip ``model``'s replica all-reduce; on exit the next
    backward all-reduces the accumulated gradients too. Yields whether anything is
    skipped (False off HSDP)."""
    sync = replica_sync_of(model)
    if sync is None:
        yield False
        return
    sync.set_requires_all_reduce(False)
    try:
        yield True
    finally:
        sync.set_requires_all_reduce(True)
