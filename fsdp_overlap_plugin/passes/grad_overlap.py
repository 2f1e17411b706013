"""Gradient reduce-scatter overlap (not implemented yet: the graph is returned unchanged)."""

from __future__ import annotations

import torch.fx as fx


def overlap_grad_reduce(gm: fx.GraphModule) -> fx.GraphModule:
    gm.meta.setdefault("fsdp_overlap", {})["overlap_grad_reduce"] = {"implemented": False}
    return gm
