"""A process group whose all-to-all posts every receive before any send (gloo, opt-in).

gloo's collectives send each chunk and then post its receive (``gloo/alltoall.cc``). A
receive's "ready" notice travels on the same TCP connection as this rank's own bytes, and
a peer's send waits for it, so on a slow link the rank that launches second writes its
whole chunk before the other direction may start: the link carries one direction at a
time. Measured at 300 Mbit on 2 ranks (``benchmarks/RESULTS.md``): the same bytes moved
point to point with every receive posted first take 0.526 s per step instead of 0.601 s.

``reduce_scatter_impl: receive_first`` runs the gradient all-to-alls of
``passes/all_to_all.py`` on such a group. ``ReceiveFirstGroup`` is a Python
``dist.ProcessGroup`` over the shard group, registered under its own name so that the
compiled graph's functional ``all_to_all_single`` (which names its group by string)
reaches it; the graph is otherwise the one ``all_to_all`` builds. Its ``alltoall_base``
posts a receive from every peer, then a send to every peer, on the shard group (tag
``EXCHANGE_TAG``), copies its own chunk locally and returns one work that waits for all
of them. The bytes moved, and so the results, are those of gloo's ``all_to_all_single``.

Only all-to-alls. A Python process group does take the functional ``all_gather_into_tensor``
(through its ``allgather_into_tensor_coalesced``, torch 2.11 to 2.15), but not the ``out=``
variant that ``passes/merge.py`` uses to write each rank's shards straight into its slot of
the gathered buffer ("No backend type associated with device type cpu" on every torch we
support). On this group the all-gathers would need a separate input buffer, one shard of
the bucket per gather in flight, so parameter all-gathers stay on the shard group.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .._torch_compat import register_process_group, resolve_process_group

__all__ = [
    "EXCHANGE_TAG",
    "GROUP_PREFIX",
    "ReceiveFirstGroup",
    "build_receive_first_group",
    "exchange",
    "exchanges_run",
]

EXCHANGE_TAG = 0x5F1D  # the point-to-point slot the exchanges use on the shard group
GROUP_PREFIX = "fsdp_overlap_receive_first:"

# registered name -> the group: the C++ registry holds the Python object only through its
# C++ half, so the Python side (its ``alltoall_base``) must be kept alive here
_LIVE: dict[str, ReceiveFirstGroup] = {}


@functools.cache
def _works_class() -> type:
    """A ``dist.Work`` that waits for several (one per peer and direction)."""

    class Works(dist.Work):
        def __init__(self, works: list) -> None:
            super().__init__()
            self.works = works

        def wait(self, timeout=None) -> bool:
            for work in self.works:
                work.wait()
            return True

        def is_completed(self) -> bool:
            return all(work.is_completed() for work in self.works)

    return Works


def exchange(outs: list[torch.Tensor], ins: list[torch.Tensor], group: dist.ProcessGroup) -> dist.Work:
    """Rank ``r`` of ``group`` receives ``outs[p]`` from every peer ``p`` and sends it
    ``ins[p]``, every receive posted before any send; its own chunk is copied locally.
    Returns one work that waits for all of them. (``benchmarks/step_time.py`` replays
    whole steps, all-gathers included, with it.)"""
    me = group.rank()
    works = [group.recv([out], peer, EXCHANGE_TAG) for peer, out in enumerate(outs) if peer != me]
    works += [group.send([src], peer, EXCHANGE_TAG) for peer, src in enumerate(ins) if peer != me]
    if outs[me].numel() and outs[me].data_ptr() != ins[me].data_ptr():
        outs[me].copy_(ins[me])
    return _works_class()(works)


class ReceiveFirstGroup(dist.ProcessGroup):
    """``inner``'s ranks, with an all-to-all that receives before it sends (module doc).
    ``exchanges`` counts the all-to-alls run on it in this process."""

    def __init__(self, inner: dist.ProcessGroup) -> None:
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self.exchanges = 0

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "fsdp_overlap_receive_first"

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts=None,
    ) -> dist.Work:
        size, rows = self.size(), input.shape[0]
        out_sizes = list(output_split_sizes) or [output.shape[0] // size] * size
        in_sizes = list(input_split_sizes) or [rows // size] * size
        if not output.is_contiguous():
            raise ValueError("fsdp-overlap receive_first: the all-to-all's output must be contiguous")
        self.exchanges += 1
        return exchange(list(output.split(out_sizes)), list(input.contiguous().split(in_sizes)), self.inner)

    alltoall_base = all_to_all_single  # the name c10d's functional all_to_all_single calls


def build_receive_first_group(inner: dist.ProcessGroup) -> str:
    """Register a ``ReceiveFirstGroup`` over ``inner`` (once per ``inner``) and return the
    name the compiled graphs use for it. After ``destroy_process_group`` and a new
    ``init_process_group`` the name may come back for a new shard group: the group is then
    made again over the new one."""
    name = GROUP_PREFIX + inner.group_name
    live = _LIVE.get(name)
    if live is not None and live.inner is inner and _registered(name) is live:
        return name
    group = ReceiveFirstGroup(inner)
    register_process_group(name, group)
    _LIVE[name] = group
    return name


def _registered(name: str) -> dist.ProcessGroup | None:
    return resolve_process_group(name)  # None: not registered (or unregistered by destroy_process_group)


def exchanges_run(*names: str) -> int:
    """How many all-to-alls the receive-first groups ``names`` have run in this process."""
    return sum(_LIVE[name].exchanges for name in names if name in _LIVE)
