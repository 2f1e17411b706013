"""Moving nodes without rescanning the graph.

``Positions`` keeps a float position per node. Moving a group of nodes before a target
gives them evenly spaced positions between the target's predecessor and the target, so
later comparisons stay O(1) and no pass re-enumerates the node list per moved node
(which would be quadratic on 100k-node graphs).
"""

from __future__ import annotations

import heapq

import torch.fx as fx

__all__ = ["Positions", "relink", "repair_order"]


class Positions:
    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.pos: dict[fx.Node, float] = {n: float(i) for i, n in enumerate(graph.nodes)}

    def __getitem__(self, node: fx.Node) -> float:
        return self.pos[node]

    def _place_between(self, prev: fx.Node, nxt: fx.Node, nodes: list[fx.Node]) -> None:
        lo = self.pos.get(prev, -1.0) if prev.op != "root" else -1.0
        hi = self.pos.get(nxt) if nxt.op != "root" else None
        if hi is None:
            hi = lo + len(nodes) + 1.0
        step = (hi - lo) / (len(nodes) + 1)
        for i, node in enumerate(nodes, start=1):
            self.pos[node] = lo + step * i

    def move_before(self, nodes: list[fx.Node], target: fx.Node) -> int:
        """Move ``nodes`` (kept in their current relative order) to just before ``target``.
        Returns how many nodes changed place."""
        nodes = sorted((n for n in nodes if n is not target), key=self.pos.__getitem__)
        if not nodes or _contiguous_before(nodes, target):
            return 0
        for node in nodes:
            target.prepend(node)
        self._place_between(nodes[0].prev, target, nodes)
        return len(nodes)

    def move_after(self, nodes: list[fx.Node], target: fx.Node) -> int:
        """Move ``nodes`` (kept in their relative order) to just after ``target``."""
        nodes = sorted((n for n in nodes if n is not target), key=self.pos.__getitem__)
        if not nodes or _contiguous_before(nodes, target.next) and nodes[0].prev is target:
            return 0
        anchor = target.next
        for node in reversed(nodes):
            target.append(node)
        self._place_between(target, anchor, nodes)
        return len(nodes)

    def ancestors_after(self, node: fx.Node, limit: float) -> list[fx.Node]:
        """``node`` and its non-placeholder ancestors placed at or after ``limit``."""
        out = []
        seen = {node}
        stack = [node]
        while stack:
            cur = stack.pop()
            out.append(cur)
            for arg in cur.all_input_nodes:
                if arg in seen or arg.op in ("placeholder", "get_attr") or self.pos[arg] < limit:
                    continue
                seen.add(arg)
                stack.append(arg)
        return out


def _contiguous_before(nodes: list[fx.Node], target: fx.Node) -> bool:
    """True if ``nodes`` already sit, in this order, directly before ``target``."""
    cur = target
    for node in reversed(nodes):
        if cur.prev is not node:
            return False
        cur = node
    return True


def relink(graph: fx.Graph, order: list[fx.Node]) -> None:
    """Put the graph's nodes in ``order`` (all nodes, output last), in O(N)."""
    output = next(iter(reversed(graph.nodes)))
    for node in order:
        if node is not output:
            output.prepend(node)


def repair_order(graph: fx.Graph) -> int:
    """Make the node order topological again, keeping every node as early as its
    original place allows (a stable topological sort). Returns how many nodes had an
    input placed after them; 0 means nothing was changed."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    broken = sum(1 for n in nodes if any(index[a] > index[n] for a in n.all_input_nodes))
    if not broken:
        return 0
    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
    heap = [(index[n], n.name, n) for n in nodes if waiting[n] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, _, node = heapq.heappop(heap)
        order.append(node)
        for user in node.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(heap, (index[user], user.name, user))
    if len(order) != len(nodes):
        raise RuntimeError("fsdp-overlap: the graph has a cycle after reordering (a pass bug)")
    relink(graph, order)
    return broken
