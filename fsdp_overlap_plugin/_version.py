"""Package version, and the torch versions this release was tested with."""

from __future__ import annotations

import warnings

__version__ = "0.1.0"

# The oldest and newest torch minor versions CI ran on. The passes read torch internals
# (FX metadata, inductor options, the partitioner's recompute tags) that change between
# releases, so other versions get a warning rather than silent surprises.
TESTED_TORCH = ((2, 13), (2, 13))


def check_torch_version() -> None:
    import torch

    parts = torch.__version__.split("+")[0].split(".")
    try:
        version = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return
    low, high = TESTED_TORCH
    if not low <= version <= high:
        warnings.warn(
            f"fsdp-overlap {__version__} was tested with torch {low[0]}.{low[1]}"
            f"{'' if low == high else f' to {high[0]}.{high[1]}'}; found torch {torch.__version__}.",
            stacklevel=3,
        )
