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
