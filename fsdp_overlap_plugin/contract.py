"""The contract between the stages that annotate a graph and the passes that read it.

Sharding and activation checkpointing write node metadata at trace time; the passes in
``passes/`` read it back from the joint and post-grad graphs. The keys, the policies both
sides implement, and the bucket plan's index live here, so neither side imports the other
and the passes need nothing from the configuration or the runtime: a pass gets plain data
(module paths, a rank) and an FX graph.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

__all__ = [
    "AC_KEY",
    "AC_POLICIES",
    "PARAM_KEY",
    "SAVED_OPS",
    "BucketIndex",
    "OverlapConfigError",
    "check_disjoint",
]


class OverlapConfigError(ValueError):
    """A configuration problem, raised at startup, naming the key or module at fault."""


#: ``node.meta["custom"][PARAM_KEY]``: the FQN (relative to the sharded root) of the
#: parameter whose gather produced the node. ``sharding`` sets it at trace time with
#: ``torch.fx.traceback.annotate``; AOT autograd copies it to the backward nodes (by
#: sequence number) and the partitioner keeps it, so forward all-gathers, backward
#: re-gathers and gradient reduce-scatters all carry it.
PARAM_KEY = "fsdp_overlap_param"

#: ``node.meta["custom"][AC_KEY]``: the FQN of the checkpointed module that traced the node.
AC_KEY = "fsdp_overlap_checkpoint"

#: ``activation_checkpointing_policy``'s values; ``passes/checkpointing.py`` implements each.
AC_POLICIES = ("full", "matmuls_saved")


def _ops(*names: str) -> frozenset:
    """The default overloads of the ``aten`` ops named (those this torch has)."""
    found = set()
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            found.add(packet.default)
    return frozenset(found)


#: What ``matmuls_saved`` keeps: matrix multiplications and attention kernels.
SAVED_OPS = _ops(
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


class BucketIndex:
    """Maps module paths to plan entries; an entry ``X`` owns ``X`` and everything under it.

    Lookup walks up the path's prefixes, so it costs O(depth) per node, not O(plan).
    """

    def __init__(self, buckets: list[list[str]]):
        self.buckets = [list(b) for b in buckets]
        self._owner: dict[str, int] = {}
        for i, bucket in enumerate(self.buckets):
            for fqn in bucket:
                self._owner.setdefault(fqn, i)

    def bucket_of(self, path: str | None) -> int | None:
        """The plan index owning ``path``, or None if no entry covers it."""
        if path is None:
            return None
        cur = path
        while True:
            if cur in self._owner:
                return self._owner[cur]
            if "." not in cur:
                return None
            cur = cur.rsplit(".", 1)[0]

    def key(self, path: str | None) -> Hashable:
        """A grouping key: the bucket index, or ``("module", path)`` for uncovered nodes."""
        index = self.bucket_of(path)
        return index if index is not None else ("module", path)

    def describe(self, key: Hashable) -> str:
        if isinstance(key, int):
            return f"bucket {key} {self.buckets[key]}"
        return f"unbucketed module {key[1]!r}" if isinstance(key, tuple) else str(key)


def check_disjoint(buckets: list[list[str]]) -> None:
    """Raise if two buckets share a module (the same FQN, or one inside the other).

    O(entries x depth): every FQN's ancestors are looked up in the owner map, so an
    entry inside another one is found from the inner side.
    """
    owner: dict[str, int] = {}
    for i, bucket in enumerate(buckets):
        for fqn in bucket:
            j = owner.get(fqn)
            if j is not None and j != i:
                _overlap(j, i, fqn, fqn)
            owner[fqn] = i
    for fqn, i in owner.items():
        parts = fqn.split(".")
        for k in range(1, len(parts)):
            ancestor = ".".join(parts[:k])
            j = owner.get(ancestor)
            if j is not None and j != i:
                _overlap(min(i, j), max(i, j), ancestor, fqn)


def _overlap(first: int, second: int, a: str, b: str) -> None:
    raise OverlapConfigError(
        f"bucket_plans: entries {first} and {second} overlap: {a!r} and {b!r} share "
        f"modules. Each module may belong to one bucket only."
    )
