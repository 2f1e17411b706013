"""Testing utilities: FSDP-shaped FX graphs built by hand, and a simulated rank.

Used by the pass unit tests and ``benchmarks/pass_scaling.py``; nothing here needs a
process group. Graphs carry ``meta["val"]`` (fake tensors) and ``nn_module_stack`` /
``fwd_nn_module_stack`` the way Dynamo and AOTAutograd write them, so the passes read
them exactly as they read traced graphs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ._torch_compat import FakeTensorMode, control_deps_op
from .passes.graph import C10D

__all__ = ["GraphBuilder", "SimulatedRank", "fsdp_backward_graph", "fsdp_forward_graph", "random_inputs"]

aten = torch.ops.aten


class GraphBuilder:
    """Builds an FX graph node by node, computing each node's fake ``meta["val"]``."""

    def __init__(self, world: int = 2, group: str = "0", dtype: torch.dtype = torch.float32):
        self.graph = fx.Graph()
        self.mode = FakeTensorMode()
        self.world = world
        self.group = group
        self.dtype = dtype

    @staticmethod
    def stack(path: str | None) -> dict:
        if not path:
            return {}
        parts = path.split(".")
        return {
            "L__self___" + "_".join(parts[: i + 1]): ("L['self']." + ".".join(parts[: i + 1]), torch.nn.Module)
            for i in range(len(parts))
        }

    def placeholder(self, name: str, shape: tuple, dtype: torch.dtype | None = None) -> fx.Node:
        node = self.graph.placeholder(name)
        with self.mode:
            node.meta["val"] = torch.empty(shape, dtype=dtype or self.dtype)
        return node

    def call(self, target: Any, *args: Any, module: str | None = None, backward: bool = False) -> fx.Node:
        node = self.graph.call_function(target, args)
        key = "fwd_nn_module_stack" if backward else "nn_module_stack"
        if module:
            node.meta[key] = self.stack(module)

        def val(a: Any) -> Any:
            if isinstance(a, fx.Node):
                return a.meta["val"]
            if isinstance(a, (list, tuple)):
                return type(a)(val(x) for x in a)
            return a

        with self.mode:
            node.meta["val"] = target(*val(args))
        return node

    # the FSDP shapes ---------------------------------------------------------
    def gather(self, shard: fx.Node, module: str, backward: bool = False) -> fx.Node:
        ag = self.call(C10D.all_gather_into_tensor.default, shard, self.world, self.group, module=module)
        return self.call(C10D.wait_tensor.default, ag, module=module)

    def reduce_scatter(self, grad: fx.Node, module: str) -> fx.Node:
        rs = self.call(
            C10D.reduce_scatter_tensor.default, grad, "avg", self.world, self.group, module=module, backward=True
        )
        return self.call(C10D.wait_tensor.default, rs, module=module, backward=True)

    def finish(self, outputs: list[fx.Node]) -> fx.GraphModule:
        self.graph.output(tuple(outputs))
        gm = fx.GraphModule(torch.nn.Module(), self.graph)
        gm.graph.lint()
        return gm


def fsdp_forward_graph(
    blocks: int = 4,
    params_per_block: int = 2,
    width: int = 8,
    batch: int = 4,
    world: int = 2,
    dtype=torch.float32,
    pointwise: int = 0,
) -> fx.GraphModule:
    """``x -> [block b: for each weight: gather, matmul, relu, pointwise ops] -> out``;
    weights of block ``b`` live in modules ``blocks.b.lin{p}``. ``pointwise`` extra
    element-wise ops per weight set the compute density (norms, activations)."""
    g = GraphBuilder(world=world, dtype=dtype)
    x = g.placeholder("x", (batch, width))
    shards = [
        [g.placeholder(f"w_{b}_{p}", (width // world, width)) for p in range(params_per_block)] for b in range(blocks)
    ]
    h = x
    for b in range(blocks):
        for p in range(params_per_block):
            module = f"blocks.{b}.lin{p}"
            weight = g.gather(shards[b][p], module)
            h = g.call(
                aten.relu.default,
                g.call(aten.mm.default, h, g.call(aten.t.default, weight, module=module), module=module),
                module=module,
            )
            for _ in range(pointwise):
                h = g.call(aten.mul.Tensor, h, x, module=module)
    return g.finish([h])


def fsdp_backward_graph(
    blocks: int = 4,
    params_per_block: int = 2,
    width: int = 8,
    batch: int = 4,
    world: int = 2,
    dtype=torch.float32,
    pointwise: int = 0,
) -> fx.GraphModule:
    """The matching backward: for blocks in reverse, re-gather each weight, compute the
    weight gradient and the input gradient (plus ``pointwise`` element-wise ops),
    reduce-scatter the weight gradient; the reduced gradients are the outputs (in
    parameter order)."""
    g = GraphBuilder(world=world, dtype=dtype)
    shards = {
        (b, p): g.placeholder(f"w_{b}_{p}", (width // world, width))
        for b in range(blocks)
        for p in range(params_per_block)
    }
    acts = {
        (b, p): g.placeholder(f"act_{b}_{p}", (batch, width)) for b in range(blocks) for p in range(params_per_block)
    }
    grad = g.placeholder("tangents_1", (batch, width))
    reduced = {}
    for b in reversed(range(blocks)):
        for p in reversed(range(params_per_block)):
            module = f"blocks.{b}.lin{p}"
            weight = g.gather(shards[(b, p)], module)
            grad_w = g.call(
                aten.mm.default,
                g.call(aten.t.default, grad, module=module, backward=True),
                acts[(b, p)],
                module=module,
                backward=True,
            )
            grad = g.call(aten.mm.default, grad, weight, module=module, backward=True)
            for _ in range(pointwise):
                grad = g.call(aten.mul.Tensor, grad, acts[(b, p)], module=module, backward=True)
            reduced[(b, p)] = g.reduce_scatter(grad_w, module)
    return g.finish([reduced[k] for k in sorted(reduced)] + [grad])


def random_inputs(gm: fx.GraphModule, seed: int = 0, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Real tensors matching each placeholder's metadata (floats cast to ``dtype``)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta["val"]
        if not isinstance(val, torch.Tensor):
            out.append(val)
        elif val.dtype.is_floating_point:
            out.append(torch.randn(tuple(val.shape), generator=gen, dtype=dtype or val.dtype))
        elif val.dtype == torch.bool:
            out.append(torch.rand(tuple(val.shape), generator=gen) > 0.5)
        else:
            out.append(torch.randint(0, 16, tuple(val.shape), generator=gen, dtype=val.dtype))
    return out


class SimulatedRank(fx.Interpreter):
    """Runs a graph as rank ``rank`` of ``world`` without any process group.

    Rank ``k`` is taken to hold ``(1 + k)`` times this rank's input of each collective,
    so the results depend on every element's position: an all-gather returns the full
    (concatenated) tensor, a reduce-scatter returns this rank's chunk of the sum (or
    mean) over ranks, an all-reduce the sum (or mean). Merging collectives only
    concatenates, so a correct rewrite gives bitwise-identical outputs.
    """

    def __init__(self, gm: fx.GraphModule, rank: int = 0, world: int = 2):
        super().__init__(gm)
        self.rank = rank
        self.world = world

    def _scale(self, op: str) -> float:
        total = sum(1 + k for k in range(self.world))
        return total / self.world if op == "avg" else float(total)

    def call_function(self, target, args, kwargs):  # noqa: D401 - Interpreter hook
        if target in (C10D.all_gather_into_tensor.default, C10D.all_gather_into_tensor_out.default):
            x = args[0]
            return torch.cat([x * (1 + k) for k in range(args[1])])
        if target is C10D.reduce_scatter_tensor.default:
            y, op, size = args[0], args[1], args[2]
            return y.chunk(size)[self.rank] * self._scale(op)
        if target is C10D.all_reduce.default:
            return args[0] * self._scale(args[1])
        if target is C10D.all_to_all_single.default:
            # block j of the output comes from rank j: its copy of this rank's block
            x, size = args[0], len(args[1])
            mine = x.chunk(size)[self.rank]
            return torch.cat([mine * (1 + j) for j in range(size)])
        if target is C10D.wait_tensor.default:
            return args[0]
        if is_control_deps_target(target):
            subgraph = args[1]
            return SimulatedRank(subgraph, self.rank, self.world).run(*args[2:])
        return super().call_function(target, args, kwargs)


def is_control_deps_target(target: Any) -> bool:
    control_deps = control_deps_op()
    return control_deps is not None and target is control_deps
