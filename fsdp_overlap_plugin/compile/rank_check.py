"""The cross-rank check of each compiled graph: every rank must have compiled the same
Dynamo graph, and the passes must have left the same collectives on every rank, or
the ranks would issue collectives that never match. One store round each (through
``RankAgreement``, not a collective, so it cannot hang); the backend calls it.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from typing import Any

from .. import _torch_compat as compat
from ..runtime.records import record_name, summarize_pass

__all__ = ["check_same_collectives", "check_same_graph", "collective_entries"]


def check_same_graph(agreement: Any, digest: str, entries: list, index: int, mode: str) -> None:
    _must_agree(
        agreement,
        "fingerprint",
        digest,
        entries,
        mode,
        f"fsdp-overlap: the ranks compiled different graphs (graph {index}): {{}}. Every rank must run the same "
        "model code and config; ranks running different graphs would issue collectives that never match. "
        "(rank_check: warn only warns; off skips this.)",
    )


def _must_agree(agreement: Any, name: str, digest: str, entries: list, mode: str, message: str) -> None:
    """One store round comparing ``digest`` with rank 0's; on a difference raise
    ``RankMismatchError`` (``rank_check: error``) or warn, with ``message`` naming it."""
    from ..runtime.ranks import RankMismatchError

    difference = agreement.same_graph(name, digest, entries)
    if difference is None:
        return
    if mode == "error":
        raise RankMismatchError(message.format(difference))
    warnings.warn(message.format(difference), stacklevel=4)


# shard-group collectives, whose sizes must agree (a reduce-scatter run as all-to-all too)
_SIZED = ("all_gather", "reduce_scatter", "all_to_all")


def collective_entries(records: list[dict]) -> list[list[str]]:
    """What every rank's compiled graphs must share, in graph order: each collective's kind,
    group size and bytes (shard-group collectives: all-gathers, reduce-scatters and their
    all-to-all form move padded, equal sizes on every rank; a replica all-reduce moves
    this rank's shard, whose size legitimately differs between shard positions), and each
    pass's decisions in a few numbers. Entries as ``ranks.first_difference`` reads them."""
    entries = []
    for r in records:
        for e in (r.get("schedule") or {}).get("after", []):
            if e["op"] in ("compute", "wait"):
                continue
            words = f"{record_name(r)} graph: {e['op']}" + (f" of {e['bytes']} bytes" if e["op"] in _SIZED else "")
            size = compat.process_group_size(e.get("group"))
            if size is not None:  # a group's name differs between its instances (HSDP's shard groups)
                words += f" on a group of {size} ranks"
            entries.append([words, "", words])
        for name, stats in r.get("passes", {}).items():
            words = f"{record_name(r)} graph: {summarize_pass(name, stats)}"
            entries.append([words, "", words])
    return entries


def check_same_collectives(agreement: Any, entries: list[list[str]], index: int, mode: str) -> None:
    """Every rank's passes must leave the same collectives, in kind, order and size, or the
    ranks would issue collectives that never match (a hang, or gloo's "Received data
    size doesn't match"). The Dynamo graphs agree (checked just before), but the graphs
    the passes see carry each rank's local shard shapes, so a pass that decides on shapes
    could decide differently per rank: that is a bug in fsdp-overlap, stopped here at
    the first step instead of in a collective."""
    _must_agree(
        agreement,
        "collectives",
        hashlib.sha256(json.dumps(entries).encode()).hexdigest(),
        entries,
        mode,
        f"fsdp-overlap: the passes left different collectives on different ranks (graph {index}): {{}}. This is a "
        "bug in fsdp-overlap; please report it with this message. (rank_check: warn only warns.)",
    )
