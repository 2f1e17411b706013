"""Which bucket a node belongs to, from its module path (``blocks.0.attn.wq`` -> bucket 1)."""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["BucketIndex"]


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
