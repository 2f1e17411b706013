"""Activation checkpointing as recompute tags on the joint graph.

A checkpointed module's forward is traced inside ``torch.fx.traceback.annotate`` with
``{AC_KEY: fqn}`` (see ``shard/activation_checkpointing.py``), so every node it makes carries
the module's FQN in ``node.meta["custom"]``. This pass turns those marks into what
``torch.utils.checkpoint`` would have produced under ``torch.compile``: each forward node
of a region is tagged ``PREFER_RECOMPUTE`` with the region's own ``ac_graph_id``, and the
partitioner then saves only what enters a region (and what leaves it for the next one)
and recomputes the rest in backward.

Why not ``torch.utils.checkpoint`` itself: Dynamo traces it as a higher-order op whose
body holds the DTensor all-gathers of the sharded parameters, and AOT autograd then saves
the ``DeviceMesh`` object for backward (``expected all tensors_saved_with_vc_check to be
Tensors``). Tags on the plain joint graph have no such body: the gathers are ordinary
nodes, and the reshard pass, which runs after this one, tags their chains
(``MUST_RECOMPUTE``: the backward re-gathers once, for the recompute and the gradients
alike; or ``MUST_SAVE`` for the bucket kept gathered).

Random ops are always saved, never recomputed. The attention kernels are among them (for
their dropout, even at ``dropout_p=0``): recomputing one makes AOT autograd thread RNG
state through the forward graph's outputs, and torch 2.13 appends that state after the
``DeviceMesh`` a DTensor gradient carries, so the forward crashes at its first call
(``expected all tensors_saved_with_vc_check to be Tensors``). Saving them is exact for
any dropout, and costs one attention output (plus its log-sum-exp) per region.

Policies:

* ``full``: recompute everything inside the region;
* ``matmuls_saved``: save the outputs of matrix multiplications and attention (the
  expensive ops) and recompute the rest (norms, activations, elementwise ops, views), as
  torchtitan's selective activation checkpointing does per op.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..contract import AC_KEY, AC_POLICIES, SAVED_OPS

__all__ = ["AC_KEY", "POLICIES", "SAVED_OPS", "annotate_activation_checkpointing", "region_of"]

POLICIES = AC_POLICIES


def _is_seeded(target) -> bool:
    """A random op to the partitioner (attention kernels are, for their dropout)."""
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


def region_of(node: fx.Node) -> str | None:
    """The checkpointed module that traced ``node``, or None."""
    custom = node.meta.get("custom")
    return custom.get(AC_KEY) if isinstance(custom, dict) else None


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Every node computed from a tangent (an incoming gradient): the backward part of a
    joint graph. Nodes outside it are forward nodes the partitioner may recompute."""
    backward: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if "tangent" in node.name:
                backward.add(node)
        elif any(i in backward for i in node.all_input_nodes):
            backward.add(node)
    return backward


def annotate_activation_checkpointing(gm: fx.GraphModule, policy: str = "full") -> dict:
    """Tag the forward nodes of each checkpointed region of the joint graph ``gm``.

    Each region (one checkpointed module, in the order the forward runs them) gets its own
    ``ac_graph_id`` (1, 2, ...): the partitioner saves a tensor that one region makes and
    the next one reads, as ``torch.utils.checkpoint`` saves each block's input. Returns
    statistics: the regions, nodes tagged recompute, and nodes saved by the policy.
    """
    if policy not in POLICIES:
        raise ValueError(f"activation checkpointing policy {policy!r}; expected one of {POLICIES}")
    backward = _backward_nodes(gm.graph)
    ids: dict[str, int] = {}
    recomputed = saved = 0
    for node in gm.graph.nodes:
        region = region_of(node)
        if region is None or node.op != "call_function" or node in backward:
            continue
        graph_id = ids.setdefault(region, len(ids) + 1)
        op = node.args[0].target if node.target is operator.getitem else node.target
        keep = _is_seeded(op) or (policy == "matmuls_saved" and op in SAVED_OPS)
        node.meta["recompute"] = CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        node.meta["ac_graph_id"] = graph_id
        if keep:
            saved += 1
        else:
            recomputed += 1
    return {"regions": list(ids), "policy": policy, "recompute": recomputed, "saved_by_policy": saved}
