"""Manual bucketing per plan (not implemented yet: the graph is returned unchanged)."""

from __future__ import annotations

import torch.fx as fx


def manual_bucketing(
    gm: fx.GraphModule, module_bucket_plans: list, *, insert_overlap_deps: bool = False, separate_gather_group=None
) -> fx.GraphModule:
    gm.meta.setdefault("fsdp_overlap", {})["manual_bucketing"] = {"implemented": False}
    return gm
