"""FSDP1's sharding-strategy names, as Lightning's ``FSDPStrategy(sharding_strategy=...)`` and
Accelerate's ``fsdp_sharding_strategy`` spell them, and what each is in this plugin's layout.

One table for both adapters: which names mean something here, which are FSDP1 modes the
FSDP2 layout has no switch for (each adapter words its own pointer to the equivalent, in
its own keys), and the normaliser that reads an enum, a string or the launcher's number.
Torch-free: the values are the names of ``torch.distributed.fsdp.ShardingStrategy``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FSDP1_STRATEGIES", "SUPPORTED", "UNSUPPORTED", "strategy_name"]

#: ``ShardingStrategy``'s names in the order of its values (1-based), the numbers
#: ``accelerate config`` writes; torch spells the last ``_HYBRID_SHARD_ZERO2``.
FSDP1_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")

#: The values an adapter accepts: shard over every rank (``mesh.replicate: 1``), or
#: replicate over the nodes and shard within each (HSDP).
SUPPORTED = ("FULL_SHARD", "HYBRID_SHARD")

#: FSDP1 modes without a sharding-strategy switch here; each has an equivalent in config
#: keys (``reshard_after_forward: false``, ``mesh.shard: 1``), which each adapter names.
UNSUPPORTED = ("SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2", "NO_SHARD")


def strategy_name(value: Any, *, numbered: bool = False) -> str:
    """``value`` as a name of the table: an enum's ``name`` or a string, stripped, upper
    case, and without torch's leading underscore (``_HYBRID_SHARD_ZERO2``). With
    ``numbered``, ``1``..``5`` (Accelerate's launcher writes those) are the names in
    ``FSDP1_STRATEGIES`` order. Anything else comes back as it was written, upper case,
    for the caller's "not a sharding strategy" message."""
    text = str(getattr(value, "name", value)).strip().upper().lstrip("_")
    if numbered and text.isdigit() and 1 <= int(text) <= len(FSDP1_STRATEGIES):
        return FSDP1_STRATEGIES[int(text) - 1]
    return text
