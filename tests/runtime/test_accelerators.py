"""One place decides device and backend; NPU decisions checked with a fake torch_npu."""

from __future__ import annotations

import sys

import pytest
import torch
from _dist import free_port, run_isolated
from _fake_npu import install_fake_torch_npu

from fsdp_overlap_plugin.runtime import devices


def test_backend_map():
    assert devices.backend_for("cuda") == "nccl"
    assert devices.backend_for("npu") == "hccl"
    assert devices.backend_for("cpu") == "gloo"
    with pytest.raises(ValueError, match="valid: cuda, npu, cpu"):
        devices.backend_for("tpu")


def test_cpu_machine_detects_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails
    assert devices.detect_device_type() == "cpu"
    info = devices.current()
    assert (info.device_type, info.backend, info.device) == ("cpu", "gloo", torch.device("cpu"))


def test_requested_but_missing_device_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="'cuda' was requested but is not available"):
        devices.detect_device_type("cuda")


def _npu_decisions() -> dict:
    import os

    npu = install_fake_torch_npu(count=4)
    os.environ["LOCAL_RANK"] = "5"
    info = devices.current()
    devices.set_device(info.device)
    chosen = (info.device_type, info.backend, str(info.device), str(npu.current))
    npu.count = 0
    return {"chosen": chosen, "without_devices": devices.detect_device_type()}


def test_npu_selects_hccl_and_device_per_local_rank():
    result = run_isolated(_npu_decisions)
    assert result["chosen"] == ("npu", "hccl", "npu:1", "npu:1")  # local rank 5 % 4 devices
    assert result["without_devices"] == "cpu"


def _exit_hooks_after_parallelize() -> tuple[int, int, int]:
    """atexit callbacks: before, after the first gloo parallelize, after a second one
    and a direct call (a fresh process: atexit is process-wide)."""
    import atexit
    import os

    import torch.distributed as dist

    from fsdp_overlap_plugin import parallelize
    from fsdp_overlap_plugin.models import gpt_small

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    before = atexit._ncallbacks()
    parallelize(gpt_small(n_layer=1), compile=False)
    first = atexit._ncallbacks()
    parallelize(gpt_small(n_layer=1), compile=False)
    devices.settle_gloo_workers_at_exit()
    again = atexit._ncallbacks()
    dist.destroy_process_group()
    return before, first, again


def test_gloo_parallelize_registers_the_exit_hook_once():
    """The hook that lets gloo's worker threads take the GIL before the interpreter
    finalizes (a torch abort at exit, docs/troubleshooting.md): one per process."""
    before, first, again = run_isolated(_exit_hooks_after_parallelize)
    assert first == before + 1 and again == first


def test_the_exit_hook_lets_a_thread_waiting_for_the_gil_run():
    """While the hook runs, the main thread gives up the GIL: a thread that needs it gets
    it (the gloo worker's case: releasing a finished work's tensors)."""
    import threading
    import time

    ran = threading.Event()
    started = threading.Event()

    def worker() -> None:
        started.set()
        time.sleep(0.001)
        ran.set()  # Python code: needs the GIL

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait()
    devices._let_gloo_workers_finish()
    assert ran.is_set()
    thread.join()
