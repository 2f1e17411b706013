"""A fake ``torch_npu`` for the NPU decision tests (no Ascend hardware here).

This module must not import ``fsdp_overlap_plugin``: some checks install the fake
before the plugin is first imported, as a user with Ascend software would.
"""

from __future__ import annotations

import sys
import types

import torch


class FakeNPU(types.ModuleType):
    """Just enough of torch.npu for the decisions: availability, count, current device."""

    def __init__(self, count: int):
        super().__init__("torch.npu")
        self.count = count
        self.current = None

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def set_device(self, device):
        self.current = device


def install_fake_torch_npu(count: int = 4) -> FakeNPU:
    """What importing the real torch_npu does, in miniature: name the PrivateUse1 device
    "npu" (irreversible, hence only in an isolated process) and provide ``torch.npu``."""
    torch.utils.rename_privateuse1_backend("npu")
    npu = FakeNPU(count)
    sys.modules["torch_npu"] = types.ModuleType("torch_npu")
    torch.npu = npu
    torch.cuda.is_available = lambda: False
    return npu
