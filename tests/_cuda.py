"""CUDA-only tests: the marker that runs them on a GPU and skips them elsewhere with the
reason, a 1-rank NCCL process group, and the GPU check script as a module.

    from _cuda import requires_cuda, nccl_world_of_one
    pytestmark = requires_cuda          # every test of the module: marked `cuda`, skipped without CUDA

`benchmarks/gpu_check.py` runs `pytest -m cuda tests/**/test_*_cuda.py` on a GPU machine.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest
import torch

NO_CUDA_REASON = (
    "needs a CUDA GPU (torch.cuda.is_available() is False on this machine); "
    "`python benchmarks/gpu_check.py` runs these tests on a GPU machine"
)

requires_cuda = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA_REASON),
]


def nccl_world_of_one() -> contextlib.AbstractContextManager[None]:
    """A default process group of one NCCL rank on cuda:0 (a FileStore: no network)."""
    import torch.distributed as dist
    from _fake import process_group

    torch.cuda.set_device(0)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="fsdp_overlap_store_"), "store"), 1)
    return process_group("nccl", store)


def gpu_check() -> ModuleType:
    """``benchmarks/gpu_check.py`` as a module."""
    benchmarks = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    return importlib.import_module("gpu_check")


def code_order() -> ModuleType:
    """``benchmarks/_harness/code_order.py``: gpu_check's code-order checker, shared with tests."""
    return harness("code_order")


def harness(name: str) -> ModuleType:
    """``benchmarks/_harness/<name>.py``: a module gpu_check.py takes its library parts from."""
    gpu_check()  # benchmarks/ on sys.path
    return importlib.import_module(f"_harness.{name}")
