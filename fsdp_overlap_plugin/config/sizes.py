"""Sizes as the user reads them, free of torch: a byte count in words, and the default size of
an exported weight file. ``fsdp-overlap --help`` shows both, and imports no torch for them."""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "format_bytes"]

#: transformers 5's ``save_pretrained`` default
DEFAULT_MAX_SHARD_SIZE = "50GB"


def format_bytes(n: int | float) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units, as memory is reported."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
