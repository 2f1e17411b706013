"""The ``tp_plan`` key: module names or patterns -> a tensor-parallel style.

Checked here for shape and style (``OverlapConfig.validate``); the names are resolved
against the model, and each style turned into torch's ``ParallelStyle``, by
``shard/tensor_parallel.py`` when the plan is applied.
"""

from __future__ import annotations

from typing import Any

from ..contract import OverlapConfigError
from .keys import suggest

__all__ = ["NO_TENSOR_DIMENSION", "TP_STYLES", "check_tp_plan"]

#: tp_plan's styles, as MindSpeed's and transformers' plans spell them; one
#: ``sequence_parallel`` entry makes the whole plan a sequence-parallel one
#: (``shard/tensor_parallel.py``, docs/tensor-parallel.md#sequence-parallelism)
TP_STYLES = ("colwise", "rowwise", "replicate", "sequence_parallel")
#: styles users write that the plugin does not apply yet, and why (none at present)
NOT_YET: dict[str, str] = {}


def check_tp_plan(plan: Any) -> dict[str, str] | str | None:
    """Shape and style check; module names are checked against the model when it is
    applied, and the tensor dimension it needs once the mesh is known (``mesh.tensor``,
    Lightning's ``tensor_parallel_size`` or a mesh given to ``parallelize``)."""
    if plan is None or plan == "auto":
        return plan
    if not isinstance(plan, dict) or not plan:
        raise OverlapConfigError(
            f'tp_plan: expected "auto" (a transformers model\'s own plan) or a mapping of module FQNs or patterns '
            f"to a style ({', '.join(TP_STYLES)}), e.g. {{'layers.*.mlp.up_proj': colwise}}, got {plan!r}."
        )
    out = {}
    for fqn, style in plan.items():
        if not isinstance(fqn, str) or not fqn:
            raise OverlapConfigError(f"tp_plan: expected module FQNs or patterns as keys, got {fqn!r}.")
        if style in NOT_YET:
            raise OverlapConfigError(f"tp_plan[{fqn!r}]: {style} is not available yet: {NOT_YET[style]}.")
        if style not in TP_STYLES:
            raise OverlapConfigError(
                f"tp_plan[{fqn!r}]: unknown style {style!r}; valid: {', '.join(TP_STYLES)}.{suggest(str(style), TP_STYLES)}"
            )
        out[fqn] = style
    return out


#: a plan with no tensor dimension to split over (``preflight`` and ``parallelize``)
NO_TENSOR_DIMENSION = (
    "tp_plan: a tensor-parallel plan needs a tensor dimension to split the modules over: mesh.tensor > 1 (the "
    "tensor-parallel group size, e.g. mesh: {tensor: 2}; Lightning's tensor_parallel_size), or a mesh passed to "
    "parallelize whose innermost dimension is named tensor, tp or tensor_parallel."
)
