"""Pinning the collective order for inductor (not implemented yet)."""

from __future__ import annotations

import torch.fx as fx


def pin_collective_order(gm: fx.GraphModule) -> dict:
    return {"implemented": False}
