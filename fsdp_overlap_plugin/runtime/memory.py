"""What a forward keeps alive for its backward, measured.

``SavedActivations`` counts the tensors autograd saves for backward while it is active,
through ``torch.autograd.graph.saved_tensors_hooks``: eager modules, eager FSDP2 and the
compiled graphs alike (a compiled graph saves its activations with
``ctx.save_for_backward``, which the hooks see). Each storage counts once, whole (a saved
view keeps its whole storage alive), and the model's own parameter shards do not count:
they are alive anyway. Gathered parameters kept for backward (the bucket that stays
gathered after the forward) do count: they are memory the forward left behind.

Everything saved is released during backward, so the total at the end of a forward is
the peak of saved-activation memory for the step. Used by the activation-checkpointing
tests and ``benchmarks/activation_memory.py``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = ["SavedActivations"]


def _storage(tensor: torch.Tensor) -> tuple[tuple[str, int], int] | None:
    """``((device type, data pointer), bytes)`` of the storage under ``tensor`` (a
    DTensor's local one), or None for a tensor without one."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    if tensor.device.type == "meta" or tensor.is_sparse:
        return None
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a subclass without one storage
        return None
    return (tensor.device.type, storage.data_ptr()), storage.nbytes()


class SavedActivations:
    """A context manager: ``count`` and ``bytes`` of the distinct storages saved for
    backward inside it, leaving out the parameters (and buffers) of ``model``::

        with SavedActivations(model) as saved:
            loss = loss_fn(model(x), y)
        print(saved.count, saved.bytes)
        loss.backward()
    """

    def __init__(self, model: nn.Module | None = None):
        self._exclude: set = set()
        if model is not None:
            for tensor in (*model.parameters(), *model.buffers()):
                found = _storage(tensor.detach())
                if found is not None:
                    self._exclude.add(found[0])
        self._seen: set = set()
        self.count = 0
        self.bytes = 0
        self._hooks = None

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        found = _storage(tensor)
        if found is not None and found[0] not in self._exclude and found[0] not in self._seen:
            self._seen.add(found[0])
            self.count += 1
            self.bytes += found[1]
        return tensor

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None
