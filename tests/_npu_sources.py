"""The real Python passes of a ``torch-npu`` wheel, loaded without its C extension.

torch-npu cannot import here (no Ascend libraries), but its wheel holds the Python source
of the inductor passes it installs. ``load_ascend_passes`` extracts ``torch_npu/_inductor``
from the wheel, registers the packages above the modules it needs without running their
``__init__`` (which loads the C extension), fakes only the device queries those modules
make at import (``torch_npu.npu._backends.get_soc_version``, ``torch.npu`` device
properties, the operators its C extension registers), and imports the pass modules themselves, unchanged.

This module must not import ``fsdp_overlap_plugin``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
import zipfile
from pathlib import Path

import torch

ASCEND_910B1 = 220  # torch_npu/_inductor/config.py's SoC number for an Ascend 910B


class _DeviceProperties:
    cube_core_num = 24
    vector_core_num = 48
    name = "Ascend910B1 (fake)"


def _fake_device_module() -> None:
    """What the pass modules ask the device about at import, and nothing else."""
    backends = types.ModuleType("torch_npu.npu._backends")
    backends.get_soc_version = lambda: ASCEND_910B1
    utils = types.ModuleType("torch_npu.npu.utils")
    utils._is_gte_cann_version = lambda *args, **kwargs: True
    npu = types.ModuleType("torch_npu.npu")
    npu.__path__ = []
    npu._backends, npu.utils = backends, utils
    sys.modules.update({"torch_npu.npu": npu, "torch_npu.npu._backends": backends, "torch_npu.npu.utils": utils})
    device = types.ModuleType("torch.npu")
    device.is_available = lambda: False
    device.current_device = lambda: 0
    device.get_device_properties = lambda index=0: _DeviceProperties()
    torch.npu = device
    torch.ops.npu = _NpuOperators("torch.ops.npu")


class _NpuOperator:
    """A stand-in for an operator the C extension registers (``torch.ops.npu.<name>``):
    the passes only compare graph nodes' targets with them, and no CPU graph holds one."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, overload: str) -> _NpuOperator:
        if overload.startswith("__"):
            raise AttributeError(overload)
        return _NpuOperator(f"{self.name}.{overload}")

    def __repr__(self) -> str:
        return f"torch.ops.npu.{self.name} (fake)"


class _NpuOperators(types.ModuleType):
    def __getattr__(self, name: str) -> _NpuOperator:
        if name.startswith("__"):
            raise AttributeError(name)
        return _NpuOperator(name)


def _package(name: str, path: Path) -> None:
    module = types.ModuleType(name)
    module.__path__ = [str(path)]
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    sys.modules[name] = module


def extract(wheel: str | Path, into: Path) -> Path:
    """The wheel's ``torch_npu/_inductor`` Python files under ``into``; returns ``into``."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.startswith("torch_npu/_inductor/") and n.endswith(".py")]
        archive.extractall(into, names)
    return into


def load_ascend_passes(root: Path) -> types.ModuleType:
    """Import the real ``graph_match_pass`` module (the one torch_npu's ``_inductor``
    package calls at import to install ``AscendCustomPostPass``) from an extracted wheel."""
    _fake_device_module()
    _package("torch_npu", root / "torch_npu")
    _package("torch_npu._inductor", root / "torch_npu" / "_inductor")
    _package("torch_npu._inductor.fx_passes", root / "torch_npu" / "_inductor" / "fx_passes")
    return importlib.import_module("torch_npu._inductor.fx_passes.graph_match_pass")
