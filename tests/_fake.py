"""Single-process graph tests: a fake process group of any world size, and a hook that
keeps a copy of each compiled graph before and after our passes."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
import torch._dynamo
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_overlap_plugin.compile.backends as fo_compile
from fsdp_overlap_plugin.passes.graph import collective_of_wait, group_name, is_collective, is_wait


@contextlib.contextmanager
def process_group(backend: str, store: dist.Store, world: int = 1) -> Iterator[None]:
    """A default process group (this process is rank 0) and a clean Dynamo cache, both
    torn down on exit."""
    dist.init_process_group(backend, store=store, rank=0, world_size=world)
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


def fake_world(world: int = 2) -> contextlib.AbstractContextManager[None]:
    return process_group("fake", FakeStore(), world)


class GraphCapture:
    """Monkeypatches ``compile.backends.run_passes`` to keep ``(kind, before, after)`` graph copies."""

    def __init__(self, monkeypatch):
        self.graphs: list[tuple[str, torch.fx.GraphModule, torch.fx.GraphModule]] = []
        original = fo_compile.run_passes

        def capturing(gm, kind, state, **kwargs):
            before = copy.deepcopy(gm)
            record = original(gm, kind, state, **kwargs)
            self.graphs.append((kind, before, copy.deepcopy(gm)))
            return record

        monkeypatch.setattr(fo_compile, "run_passes", capturing)

    def get(self, kind: str, which: str = "before") -> torch.fx.GraphModule:
        for k, before, after in self.graphs:
            if k == kind:
                return before if which == "before" else after
        raise KeyError(f"no {kind} graph captured; got {[k for k, _, _ in self.graphs]}")


def collectives_by_group(gm, groups: dict) -> dict:
    """How many of each collective a graph holds, by group (``groups``: process group name -> label)."""
    out: dict = {}
    for n in gm.graph.nodes:
        if is_collective(n):
            key = (groups.get(group_name(n), "other"), str(n.target).split(".")[1])
            out[key] = out.get(key, 0) + 1
    return out


def tensor_parallel_order(gm, tp_group: str) -> list[str]:
    """The tensor-parallel collectives, their waits and every matmul, in graph order:
    the passes may move neither kind across the other."""
    order = []
    for n in gm.graph.nodes:
        launch = collective_of_wait(n) if is_wait(n) else n if is_collective(n) else None
        if launch is not None and group_name(launch) == tp_group:
            order.append(("wait " if is_wait(n) else "launch ") + launch.name)
        elif n.op == "call_function" and n.target in (
            torch.ops.aten.mm.default,
            torch.ops.aten.addmm.default,
            torch.ops.aten.bmm.default,
        ):
            order.append(n.name)
    return order
