"""Compiler passes over FX graphs. No process-group calls, no tensor values.

One protocol: ``pass(gm, ...) -> dict`` of statistics. A pass rewrites ``gm.graph`` in
place and may tag nodes (``node.meta``: bucket indices, recompute tags); it never writes
``gm.meta`` and never regenerates the code. The compile wiring
(``compile.pass_table.POST_GRAD_PASSES``, ``JOINT_PASSES``) records the statistics, and
recompiles and lints a forward or backward graph once, after all its passes.

* ``annotate_activation_checkpointing``  joint graph: recompute tags of checkpointed modules
* ``annotate_reshard``      joint graph: reshard-after-forward recompute tags per bucket
* ``merge_tied_reductions``  backward: one gradient reduction per tied parameter
* ``manual_bucketing``      merge each plan entry's collectives, prefetch one bucket ahead
* ``overlap_grad_reduce``   launch gradient reduce-scatters early, sink their waits
* ``use_gather_group``      run FSDP all-gathers on their own process group
* ``reduce_scatter_as_all_to_all``  (opt-in) gradient reduce-scatters as all-to-all + sum
* ``pin_collective_order``  (inductor) make the chosen order survive code generation

``events.graph_events`` is no pass: it reads a graph's schedule (launches, waits, compute)
for the report, before and after the passes.
"""

from .all_to_all import reduce_scatter_as_all_to_all
from .bucketing import manual_bucketing, use_gather_group
from .checkpointing import annotate_activation_checkpointing
from .grad_overlap import overlap_grad_reduce
from .pin import pin_collective_order
from .reshard import annotate_reshard
from .tied import merge_tied_reductions

__all__ = [
    "annotate_activation_checkpointing",
    "annotate_reshard",
    "manual_bucketing",
    "merge_tied_reductions",
    "overlap_grad_reduce",
    "pin_collective_order",
    "reduce_scatter_as_all_to_all",
    "use_gather_group",
]
