"""One gradient reduction per tied parameter.

A parameter read by two modules (tied embeddings: ``lm_head.weight is
embed_tokens.weight``) is gathered once per read, so autograd gives the backward one
reduced gradient per read and adds them up::

    g1 --> reduce_scatter --> wait --+
                                     add --> the parameter's gradient
    g2 --> reduce_scatter --> wait --+

(on HSDP each branch also all-reduces over the replicas). That moves the largest
tensor of the model twice. An unsharded model adds the gradients first and reduces
once, and so does this pass::

    g1 --+
         add --> reduce_scatter --> wait --> the parameter's gradient
    g2 --+

The reduction chains must be the same collectives with the same arguments (same
group, reduce op, sizes) on inputs of one shape and dtype; anything else is left as it
is and counted. The merged reduction carries the annotation of the read whose gradient
is ready last (for tied embeddings: the embedding, the forward's first read, whose
gradient is the backward's last), so the bucketing puts it in that read's bucket: the
same bucket the forward's single (CSE-merged) gather belongs to. The full-size
gradient of the earlier read is held until then, as in an unsharded model.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .graph import (
    collective_of_wait,
    data_users,
    is_fsdp_reduce_scatter,
    is_selection,
    is_wait,
    node_args,
    param_fqn,
)

__all__ = ["merge_tied_reductions"]

# what the sum of the inputs inherits from the last one: its value's metadata (shape,
# dtype, for the passes' byte counts) and where it came from (the parameter annotation)
_KEPT_META = ("val", "tensor_meta", "custom", "stack_trace", "nn_module_stack")


def _chain(leaf: fx.Node) -> list[tuple[fx.Node, fx.Node, list[fx.Node]]] | None:
    """``[(collective, wait, views), ...]`` from the reduction's input to ``leaf`` (a
    wait), innermost first, where ``views`` are the single-use views and copies between
    this wait and the next collective (HSDP: the reduce-scatter's wait, a view, the
    replica all-reduce); None if ``leaf`` is not such a chain."""
    pairs = []
    cur, views = leaf, []
    while is_wait(cur):
        collective = collective_of_wait(cur)
        if collective is None or node_args(cur)[0] is not collective or len(collective.users) != 1:
            return None
        pairs.append((collective, cur, views))
        source = node_args(collective)[0]
        if not isinstance(source, fx.Node) or len(source.users) != 1:
            break
        end, views = _selections(source)
        if not is_wait(end) or len(end.users) != 1:
            break
        cur = end
    if not pairs or not any(is_fsdp_reduce_scatter(c) for c, _, _ in pairs):
        return None
    pairs.reverse()
    return pairs


def _signature(pairs: list[tuple[fx.Node, fx.Node, list[fx.Node]]]) -> tuple:
    def key(node: fx.Node) -> tuple:
        args = node_args(node)[1:]
        return (node.target, args, tuple(sorted(node.kwargs.items())))

    source = node_args(pairs[0][0])[0]
    val = source.meta.get("val")
    # sizes as words: a symbolic size cannot be hashed, and comparing it would add a guard
    shape = (tuple(str(s) for s in val.shape), val.dtype) if isinstance(val, torch.Tensor) else None
    return (shape, tuple(key(c) + (w.target, tuple(_view_key(v) for v in views)) for c, w, views in pairs))


def _leaves(add: fx.Node) -> list[fx.Node] | None:
    """The operands a (possibly nested) sum adds up, or None."""
    leaves, stack = [], [add]
    while stack:
        cur = stack.pop()
        if _is_add(cur) and (cur is add or len(cur.users) == 1):
            if not all(isinstance(a, fx.Node) for a in cur.args):
                return None
            stack.extend(cur.args)
        else:
            leaves.append(cur)
    return leaves


def _is_add(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and node.target is torch.ops.aten.add.Tensor
        and len(node.args) == 2
        and not node.kwargs
    )


def _selections(leaf: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """``leaf``'s chain of single-use views and copies back to a wait: ``(wait or
    whatever ends the chain, [views, from the wait outward])``."""
    views = []
    cur = leaf
    # (a rank whose shard is shorter narrows the reduce-scatter's padded result to its rows)
    while not is_wait(cur) and is_selection(cur):
        inputs = cur.all_input_nodes
        if len(inputs) != 1 or len(cur.users) != 1:
            break
        views.append(cur)
        cur = inputs[0]
    views.reverse()
    return cur, views


def _view_key(node: fx.Node) -> tuple:
    return (node.target, tuple(a for a in node.args[1:]), tuple(sorted(node.kwargs.items())))


def merge_tied_reductions(gm: fx.GraphModule) -> dict:
    """Rewrite every sum of identical gradient reductions into one reduction of the sum.
    Returns ``{"merged": n, "reductions_removed": k, "params": [...], "left": m}``:
    the tied parameters merged, the collectives that no longer run, their FQNs, and sums
    of reductions that could not be merged (different chains)."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    merged, removed, left, params = 0, 0, 0, []
    for add in list(graph.nodes):
        if add not in order or not (add.op == "call_function" and add.target is torch.ops.aten.add.Tensor):
            continue
        if any(u.target is torch.ops.aten.add.Tensor for u in data_users(add)):
            continue  # an inner sum: its outermost add handles it
        leaves = _leaves(add)
        if not leaves or len(leaves) < 2:
            continue
        ends = [_selections(leaf) for leaf in leaves]
        chains = [_chain(end) if is_wait(end) else None for end, _ in ends]
        if any(c is None for c in chains):
            if sum(c is not None for c in chains) >= 2:
                left += 1
            continue
        keys = {(_signature(c), tuple(_view_key(v) for v in views)) for c, (_, views) in zip(chains, ends)}
        if len(keys) != 1:
            left += 1
            continue
        sources = [node_args(c[0][0])[0] for c in chains]
        last = max(range(len(chains)), key=lambda i: order[sources[i]])
        # the sum of the inputs, right after the last of them is computed
        total, anchor = sources[0], sources[last]
        for other in sources[1:]:
            with graph.inserting_after(anchor):
                total = graph.call_function(torch.ops.aten.add.Tensor, (total, other))
            total.meta.update({k: v for k, v in sources[last].meta.items() if k in _KEPT_META})
            anchor = total
        # one copy of the last read's chain, on the sum
        value = total
        for collective, wait, views in chains[last]:
            with graph.inserting_after(anchor):
                new_collective = graph.node_copy(
                    collective, lambda n, c=collective, v=value: v if n is node_args(c)[0] else n
                )
            with graph.inserting_after(new_collective):
                new_wait = graph.node_copy(wait, lambda n, w=wait, nc=new_collective: nc if n is node_args(w)[0] else n)
            anchor = value = new_wait
            for view in views:  # between this wait and the next collective
                with graph.inserting_after(anchor):
                    anchor = value = graph.node_copy(view, lambda n, v=value: v)
        for view in ends[last][1]:  # the same selection of this rank's rows, once
            with graph.inserting_after(anchor):
                anchor = value = graph.node_copy(view, lambda n, v=value: v)
        add.replace_all_uses_with(value)
        _erase_sum(graph, add)
        for chain, (_, views) in zip(chains, ends):
            for view in reversed(views):
                graph.erase_node(view)
            for collective, wait, between in reversed(chain):
                for view in reversed(between):
                    graph.erase_node(view)
                graph.erase_node(wait)
                graph.erase_node(collective)
        removed += sum(len(c) for c in chains) - len(chains[last])
        merged += 1
        fqns = sorted({param_fqn(chain[0][0]) for chain in chains} - {None})
        params.append(fqns[0] if len(fqns) == 1 else " = ".join(fqns) or None)
    return {"merged": merged, "reductions_removed": removed, "params": params, "left": left}


def _erase_sum(graph: fx.Graph, add: fx.Node) -> None:
    stack = [add]
    while stack:
        cur = stack.pop()
        if cur.users or not (cur.op == "call_function" and cur.target is torch.ops.aten.add.Tensor):
            continue
        inputs = [a for a in cur.args if isinstance(a, fx.Node)]
        graph.erase_node(cur)
        stack.extend(inputs)
