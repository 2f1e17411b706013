"""``accelerator="npu"`` for the Trainer and Fabric, registered when ``torch_npu`` imports.

Lightning knows cuda, mps, xla and cpu; Ascend NPUs come through ``torch_npu``, which
renames the PrivateUse1 device to ``"npu"`` and provides ``torch.npu``. Every device
decision is asked of ``fsdp_overlap_plugin.runtime.devices`` (the one place that imports
``torch_npu``): availability, device count, the current device and the backend (hccl,
chosen by the strategies). Lightning's ``accelerator="auto"`` never picks an NPU; pass
``accelerator="npu"``.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator as FabricAccelerator
from lightning.pytorch.accelerators import Accelerator as TrainerAccelerator
from typing_extensions import override

from ..core import devices

__all__ = ["NPUAccelerator", "NPUFabricAccelerator", "NPUAcceleratorMixin", "parse_npu_devices"]


def _npu() -> Any:
    return devices.device_module("npu")


def parse_npu_devices(devices: int | str | list[int] | None) -> list[int] | None:
    """Lightning's ``devices=`` for NPUs: ``2`` -> [0, 1], ``-1``/``"auto"`` -> all,
    ``"1,3"`` or ``[1, 3]`` -> those indices; 0 / None -> None (no NPU). Indices must
    exist on this machine."""
    count = NPUAcceleratorMixin.auto_device_count()
    if devices is None or devices == 0 or devices == "0" or devices == []:
        return None
    if devices in (-1, "-1", "auto"):
        ids = list(range(count))
    elif isinstance(devices, int):
        ids = list(range(devices))
    elif isinstance(devices, str):
        text = devices.strip()
        ids = [int(x) for x in text.split(",") if x.strip()] if "," in text else list(range(int(text)))
    elif isinstance(devices, (list, tuple)):
        ids = [int(x) for x in devices]
    else:
        raise TypeError(f"devices: expected an int, a string or a list of ints for accelerator='npu', got {devices!r}.")
    if len(set(ids)) != len(ids):
        raise ValueError(f"devices: NPU indices must be unique, got {ids}.")
    missing = [i for i in ids if not 0 <= i < count]
    if missing:
        raise ValueError(f"devices: requested NPUs {ids}, but this machine has {count} (valid: 0..{count - 1}).")
    return ids


class NPUAcceleratorMixin:
    """Device set-up, device count and availability for Ascend NPUs."""

    @override
    def setup_device(self, device: torch.device) -> None:
        if device.type != "npu":
            raise ValueError(f"Device should be an NPU, got {device} instead.")
        devices.set_device(device)

    @override
    def teardown(self) -> None:
        empty_cache = getattr(_npu(), "empty_cache", None)
        if callable(empty_cache):
            empty_cache()

    @staticmethod
    @override
    def parse_devices(devices: int | str | list[int]) -> list[int] | None:
        return parse_npu_devices(devices)

    @staticmethod
    @override
    def get_parallel_devices(devices: list[int]) -> list[torch.device]:
        return [torch.device("npu", i) for i in devices]

    @staticmethod
    @override
    def auto_device_count() -> int:
        module = _npu()
        return int(module.device_count()) if module is not None and devices.npu_module() is not None else 0

    @staticmethod
    @override
    def is_available() -> bool:
        return devices.npu_module() is not None and NPUAcceleratorMixin.auto_device_count() > 0

    @staticmethod
    @override
    def name() -> str:
        return "npu"

    @classmethod
    @override
    def register_accelerators(cls, accelerator_registry: Any) -> None:
        accelerator_registry.register("npu", cls, description=cls.__name__, override=True)


class NPUAccelerator(NPUAcceleratorMixin, TrainerAccelerator):
    """``Trainer(accelerator="npu")``."""

    @override
    def get_device_stats(self, device: Any) -> dict[str, Any]:
        stats = getattr(_npu(), "memory_stats", None)
        return dict(stats(device)) if callable(stats) else {}


class NPUFabricAccelerator(NPUAcceleratorMixin, FabricAccelerator):
    """``Fabric(accelerator="npu")``."""
