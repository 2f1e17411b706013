"""Our custom ops: the copies around a merged collective, one extern call per bucket.

A merged collective needs a copy-in (the members into one flat buffer) and, for an
all-gather, a copy-out (the flat buffer back into one tensor per member). Written as
ATen graph nodes (``cat``, ``copy_`` into a slice, ``split_with_sizes`` views), inductor
fuses each member's copy into a neighbouring kernel: each at its own offset, so every
bucket and every use got a generated kernel of its own (on a 110M transformers Llama:
+27% compile time over passes off with the views, +6-8% with the copy-out as one op and
the copy-ins still fused, -5% with all three as ops; benchmarks/RESULTS.md). As custom ops they are opaque to
inductor: one extern call per bucket, no generated code, the way FSDP2 copies a bucket in
and out in eager (``foreach_copy`` into its slot, ``split_with_sizes_copy`` out) and the
way torch's own bucketing does in its ``custom_ops`` mode
(``torch/_inductor/fx_passes/bucketing.py``: ``bucketing::_pre_bucket_all_gather``).

They are registered when this module is imported (with the package), so a process that
loads compiled code from the inductor cache has them before that code runs. ATen's own
``split_with_sizes_copy`` cannot stand in for ``split_gathered``: inductor has a
decomposition for it and refuses it as a fallback in a post-grad graph ("both a
fallback and a decomp for same op").

Each op takes the members as they are (a member whose value is a dtype cast only for the
collective is passed uncast: the copy converts, as ``copy_`` does, so the cast costs no
kernel and no buffer of its own).
"""

from __future__ import annotations

import torch

from .._torch_compat import foreach_copy_

__all__ = ["FILL_SLOT", "PACK_ROWS", "SPLIT_GATHERED", "fill_slot", "pack_rows", "split_gathered"]


@torch.library.custom_op("fsdp_overlap::fill_slot", mutates_args=())
def fill_slot(shards: list[torch.Tensor], size: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """A merged all-gather's output buffer, ``[size * N]`` of ``dtype`` (``N``: the shards'
    elements together), with slot ``rank`` (elements ``rank * N`` to ``(rank + 1) * N``)
    holding the shards flattened one after the other, converted to ``dtype``. The other
    slots are left for the collective to fill (``all_gather_into_tensor_out`` on the slot
    with ``out=`` this buffer): no separate input buffer lives while it is in flight."""
    numels = [s.numel() for s in shards]
    total = sum(numels)
    out = torch.empty(size * total, dtype=dtype, device=shards[0].device)
    slot = out.narrow(0, rank * total, total)
    foreach_copy_(list(torch.split(slot, numels)), [s.reshape(-1) for s in shards])
    return out


@fill_slot.register_fake
def _fill_slot_fake(shards: list[torch.Tensor], size: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    return shards[0].new_empty(size * sum(s.numel() for s in shards), dtype=dtype)


@torch.library.custom_op("fsdp_overlap::pack_rows", mutates_args=())
def pack_rows(grads: list[torch.Tensor], size: int, dtype: torch.dtype) -> torch.Tensor:
    """A merged reduce-scatter's input, flat: row ``r`` of ``[size, sum(n_j / size)]`` is
    rank ``r``'s chunk of every gradient, one after the other (each gradient viewed as
    ``[size, n_j / size]``, concatenated along dim 1), converted to ``dtype``."""
    rows = [g.reshape(size, -1) for g in grads]
    if all(g.dtype == dtype for g in grads):
        return torch.cat(rows, dim=1).reshape(-1)
    out = torch.empty(size, sum(r.shape[1] for r in rows), dtype=dtype, device=grads[0].device)
    foreach_copy_(list(torch.split(out, [r.shape[1] for r in rows], dim=1)), rows)
    return out.reshape(-1)


@pack_rows.register_fake
def _pack_rows_fake(grads: list[torch.Tensor], size: int, dtype: torch.dtype) -> torch.Tensor:
    return grads[0].new_empty(sum(g.numel() for g in grads), dtype=dtype)


@torch.library.custom_op("fsdp_overlap::split_gathered", mutates_args=())
def split_gathered(rows: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """A merged all-gather's output ``rows`` (``[W, N]``, rank-major) cut into each
    member's columns, each copied into a contiguous ``[W, n_j]`` tensor in one call (the
    copy-out: the flat buffer can die right after it)."""
    return list(torch.split_with_sizes_copy(rows, sizes, dim=1))


@split_gathered.register_fake
def _split_gathered_fake(rows: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return [rows.new_empty((rows.shape[0], n)) for n in sizes]


FILL_SLOT = torch.ops.fsdp_overlap.fill_slot.default
PACK_ROWS = torch.ops.fsdp_overlap.pack_rows.default
SPLIT_GATHERED = torch.ops.fsdp_overlap.split_gathered.default
