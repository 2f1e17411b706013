"""Ranks agreeing through the process group's store, with timeouts.

Two questions are asked at each graph compile, before any rank runs the graph:

* **Do all ranks compile the same graph?** Each rank fingerprints the graph Dynamo
  hands to the backend (every operation, shape and dtype, in order) and compares it with
  rank 0's. Ranks running different graphs would issue collectives that never match.
* **Did every rank compile it?** A rank whose compile failed must not leave the others
  waiting in a collective it will never join.

Everything goes through the store (``set``/``get``/``add`` on rank 0's TCP store), never
through a collective, and every wait has a deadline, so the check itself cannot hang:
a rank that does not arrive in time is named in the error. Rank 0 posts the reference;
the others compare with it and count themselves done, so the store traffic per graph is
O(world), not O(world^2).
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import timedelta
from typing import Any

import torch
import torch.fx as fx

__all__ = ["RankAgreement", "RankMismatchError", "RankTimeoutError", "graph_fingerprint", "first_difference"]

#: How often a rank waiting for the others reads the store's counter: short against a
#: compile (seconds), long enough that waiting ranks do not load rank 0's store.
_POLL_SECONDS = 0.02


class RankMismatchError(RuntimeError):
    """Ranks compiled different graphs; raised on every rank."""


class RankTimeoutError(RuntimeError):
    """Some ranks did not reach a rank check in time."""


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


def _shape_words(shape: Any) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _describe(node: fx.Node) -> tuple[str, str] | None:
    """``(description, agreed part)`` of one node, or None for a node that only computes
    a size (a symbolic size's placeholder, ``sym_size``, arithmetic on sizes).

    The description (operation, target, shape, dtype) is what a message shows. The agreed
    part is what must be the same on every rank: the operation, its target, the dtype and
    number of dimensions, not the sizes. Ranks legitimately trace different sizes (each
    pads its own batch to its longest sequence), number their symbols differently, and
    one whose input is a slice at a nonzero storage offset gets a symbol for the offset.
    What they must agree on in size, the collectives, is compared after the passes."""
    target = node.target
    if node.op in ("call_function", "call_method"):
        target = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)
    val = node.meta.get("example_value", node.meta.get("val"))
    if node.op != "output" and isinstance(val, _SYMBOLIC):
        return None
    if node.op == "call_method" and target == "to_local" and node.args:
        # a shard's local shape depends on the rank when shards are uneven (the HSDP
        # gather reads the shard itself): describe the DTensor, the same on every rank
        from torch.distributed.tensor import DTensor

        source = getattr(node.args[0], "meta", {}).get("example_value")
        if isinstance(source, DTensor):
            dtype = str(source.dtype).replace("torch.", "")
            words = f"{node.op} {target} of {tuple(source.shape)} {dtype} {source.placements}"
            return words, words  # a parameter's global shape: the same everywhere
    if isinstance(val, torch.Tensor):
        dtype = str(val.dtype).replace("torch.", "")
        return f"{node.op} {target} {_shape_words(val.shape)} {dtype}", f"{node.op} {target} {val.dim()}d {dtype}"
    return f"{node.op} {target}", f"{node.op} {target}"


def _source(node: fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip().startswith("File ")]
    return lines[-1] if lines else ""


def graph_fingerprint(gm: fx.GraphModule, extra: str = "") -> tuple[str, list[list[str]], str]:
    """``(digest, entries, local digest)``.

    ``entries`` holds one ``[description, source line, agreed part]`` per node (nodes that
    only compute sizes left out, see ``_describe``). ``digest`` covers the agreed parts
    and ``extra`` (the plan): what every rank must share. ``local digest`` covers the full
    descriptions, sizes included: this graph on this rank, to file its records under."""
    entries = []
    for node in gm.graph.nodes:
        described = _describe(node)
        if described is not None:
            entries.append([described[0], _source(node), described[1]])
    digest = hashlib.sha256(("\n".join(e[2] for e in entries) + "\n" + extra).encode()).hexdigest()
    local = hashlib.sha256(("\n".join(e[0] for e in entries) + "\n" + extra).encode()).hexdigest()
    return digest, entries, local


def first_difference(reference: list[list[str]], mine: list[list[str]], rank: int) -> str:
    """Where this rank's graph first departs from rank 0's, in words (entries as
    ``graph_fingerprint`` makes them: compared on the agreed part when they have one)."""
    for i, (ref, cur) in enumerate(zip(reference, mine)):
        if ref[-1] != cur[-1]:
            where = f" ({cur[1]})" if cur[1] else ""
            return f"node {i}: rank 0 has `{ref[0]}`, rank {rank} has `{cur[0]}`{where}"
    if len(reference) != len(mine):
        return f"rank 0's graph has {len(reference)} nodes, rank {rank}'s has {len(mine)}"
    return "the graphs are the same node by node, but the bucket plans differ"


class RankAgreement:
    """One agreement round per ``name`` (for example ``graph3/fingerprint``)."""

    def __init__(self, store: Any, rank: int, world: int, prefix: str, timeout_s: float):
        self.store = store
        self.rank = rank
        self.world = world
        self.prefix = prefix
        self.timeout_s = timeout_s

    @classmethod
    def default(cls, prefix: str, timeout_s: float) -> RankAgreement | None:
        """On the default process group's store, or None when there is nothing to agree on."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        if dist.get_backend() == "fake":  # one process playing every rank: no one to agree with
            return None
        from .._torch_compat import default_store

        return cls(default_store(), dist.get_rank(), dist.get_world_size(), prefix, timeout_s)

    def _key(self, name: str, leaf: str) -> str:
        return f"{self.prefix}/{name}/{leaf}"

    def _finish(self, name: str, what: str, why: str | None = None) -> tuple[int, list[str]]:
        """Count this rank as done, wait for all, return (bad ranks, their messages).
        ``why``: what the timeout error says after the count (default: about compiling)."""
        self.store.add(self._key(name, "done"), 1)
        deadline = time.monotonic() + self.timeout_s
        while True:
            done = self.store.add(self._key(name, "done"), 0)
            if done >= self.world:
                break
            if time.monotonic() > deadline:
                raise RankTimeoutError(
                    f"fsdp-overlap: only {done} of {self.world} ranks reached the {what} within "
                    f"{self.timeout_s:.0f} s (rank_check_timeout). "
                    + (
                        why
                        or "The others are still compiling, took a different code path, or failed: check their logs."
                    )
                )
            time.sleep(_POLL_SECONDS)
        bad = self.store.add(self._key(name, "nbad"), 0)
        messages = []
        if bad:
            for r in range(self.world):
                key = self._key(name, f"bad/{r}")
                if self.store.check([key]):
                    messages.append(self.store.get(key).decode())
        return bad, messages

    def same_graph(self, name: str, digest: str, entries: list[list[str]]) -> str | None:
        """None if every rank's digest equals rank 0's, else the first rank's difference."""
        if self.rank == 0:
            self.store.set(self._key(name, "digest"), digest)
            self.store.set(self._key(name, "entries"), json.dumps(entries))
        else:
            try:
                self.store.wait([self._key(name, "digest")], timedelta(seconds=self.timeout_s))
            except Exception as exc:  # DistStoreError on timeout
                raise RankTimeoutError(
                    f"fsdp-overlap: rank 0 did not reach the rank check within {self.timeout_s:.0f} s "
                    f"(rank_check_timeout): {exc}"
                ) from None
            if self.store.get(self._key(name, "digest")).decode() != digest:
                reference = json.loads(self.store.get(self._key(name, "entries")))
                self.store.set(self._key(name, f"bad/{self.rank}"), first_difference(reference, entries, self.rank))
                self.store.add(self._key(name, "nbad"), 1)
        bad, messages = self._finish(name, "rank check")
        if not bad:
            return None
        more = f" ({bad} ranks differ in all)" if bad > 1 else ""
        return messages[0] + more if messages else f"{bad} ranks differ from rank 0"

    def all_arrived(self, name: str, what: str, why: str) -> None:
        """Return once every rank has called this with ``name``; a rank that has not
        within the timeout makes it raise ``RankTimeoutError`` saying ``why``."""
        self._finish(name, what, why)

    def rank0_outcome(self, name: str, error: str | None, timeout_s: float) -> str | None:
        """Rank 0 posts ``error`` (None: it succeeded); every other rank waits up to
        ``timeout_s`` for it and returns it. For work only rank 0 finishes (writing files)."""
        key = self._key(name, "rank0")
        if self.rank == 0:
            self.store.set(key, "" if error is None else error)
            return error
        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
        except Exception as exc:  # DistStoreError on timeout
            raise RankTimeoutError(
                f"fsdp-overlap: rank 0 did not report its outcome within {timeout_s:.0f} s: {exc}"
            ) from None
        return self.store.get(key).decode() or None

    def all_succeeded(self, name: str, error: str | None) -> list[str]:
        """Every rank reports whether it succeeded; returns the failures' messages."""
        if error is not None:
            self.store.set(self._key(name, f"bad/{self.rank}"), f"rank {self.rank}: {error}")
            self.store.add(self._key(name, "nbad"), 1)
        _, messages = self._finish(name, "compile agreement")
        return messages
