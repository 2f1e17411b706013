"""One place decides device and backend; NPU decisions checked with a fake torch_npu."""

from __future__ import annotations

import sys

import pytest
import torch
from _dist import run_isolated
from _fake_npu import install_fake_torch_npu

from fsdp_overlap_plugin import accelerators


def test_backend_map():
    assert accelerators.backend_for("cuda") == "nccl"
    assert accelerators.backend_for("npu") == "hccl"
    assert accelerators.backend_for("cpu") == "gloo"
    with pytest.raises(ValueError, match="valid: cuda, npu, cpu"):
        accelerators.backend_for("tpu")


def test_cpu_machine_detects_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails
    assert accelerators.detect_device_type() == "cpu"
    info = accelerators.current()
    assert (info.device_type, info.backend, info.device) == ("cpu", "gloo", torch.device("cpu"))


def test_requested_but_missing_device_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="'cuda' was requested but is not available"):
        accelerators.detect_device_type("cuda")


def _npu_decisions() -> dict:
    import os

    npu = install_fake_torch_npu(count=4)
    os.environ["LOCAL_RANK"] = "5"
    info = accelerators.current()
    accelerators.set_device(info.device)
    chosen = (info.device_type, info.backend, str(info.device), str(npu.current))
    npu.count = 0
    return {"chosen": chosen, "without_devices": accelerators.detect_device_type()}


def test_npu_selects_hccl_and_device_per_local_rank():
    result = run_isolated(_npu_decisions)
    assert result["chosen"] == ("npu", "hccl", "npu:1", "npu:1")  # local rank 5 % 4 devices
    assert result["without_devices"] == "cpu"
