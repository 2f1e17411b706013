"""One place that decides the device and the communication backend.

    cuda -> nccl      (NVIDIA GPUs)
    npu  -> hccl      (Ascend NPUs, through ``torch_npu``)
    cpu  -> gloo      (development and CI)

This is the only module that imports ``torch_npu``; everything else asks here. Tests
replace ``torch_npu`` with a small fake module in ``sys.modules`` to check the NPU
decisions on a CPU-only machine.
"""

from __future__ import annotations

import atexit
import importlib
import os
import time
from dataclasses import dataclass
from types import ModuleType

import torch

__all__ = [
    "BACKENDS",
    "DeviceInfo",
    "backend_for",
    "detect_device_type",
    "device_for_rank",
    "device_module",
    "init_process_group",
    "local_rank",
    "npu_module",
    "reduce_scatter_choice",
    "settle_gloo_workers_at_exit",
]

BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


@dataclass(frozen=True)
class DeviceInfo:
    """What a rank runs on: the device type, its backend, and this rank's device."""

    device_type: str
    backend: str
    device: torch.device


def npu_module() -> ModuleType | None:
    """``torch_npu`` if it imports, else None (no Ascend software installed)."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError:
        return None


def device_module(device_type: str) -> ModuleType | None:
    """The ``torch.<device>`` module (``torch.cuda``, ``torch.npu``) or None for cpu."""
    if device_type == "cpu":
        return None
    if device_type == "npu":
        npu_module()  # importing torch_npu registers torch.npu
    return getattr(torch, device_type, None)


def _available(device_type: str) -> bool:
    if device_type == "cpu":
        return True
    if device_type == "npu" and npu_module() is None:
        return False
    module = device_module(device_type)
    try:
        return bool(module is not None and module.is_available() and module.device_count() > 0)
    except Exception:  # a broken driver reads as "not available", not as a crash
        return False


def detect_device_type(preferred: str | None = None) -> str:
    """The device type to use: ``preferred`` if given (checked), else cuda, npu, cpu in order."""
    if preferred is not None:
        if preferred not in BACKENDS:
            raise ValueError(f"device type {preferred!r} is not supported; valid: {', '.join(BACKENDS)}.")
        if not _available(preferred):
            raise RuntimeError(f"device type {preferred!r} was requested but is not available on this machine.")
        return preferred
    for device_type in ("cuda", "npu"):
        if _available(device_type):
            return device_type
    return "cpu"


def backend_for(device_type: str) -> str:
    """The process-group backend for a device type: cuda -> nccl, npu -> hccl, cpu -> gloo."""
    try:
        return BACKENDS[device_type]
    except KeyError:
        raise ValueError(f"device type {device_type!r} is not supported; valid: {', '.join(BACKENDS)}.") from None


# Shard-group sizes on which gloo's reduce_scatter_tensor (a clone plus a ring all-reduce)
# and all_to_all_single plus a local sum give bitwise equal results: on 2 ranks each output
# element is one addition of two numbers either way. On 3 and 4 ranks the ring adds in
# another order than the local sum (measured: 0-3 of 20 random fp32/bf16/fp16 tensors
# equal), so there the all-to-all is only equal up to rounding. tests/runtime/test_reduce_scatter_impl.py
# checks both claims on real gloo ranks.
GLOO_ALL_TO_ALL_BITWISE = (2,)


def reduce_scatter_choice(
    requested: str, backend: str, shard_size: int | None, *, compiled: bool = True
) -> tuple[str, str]:
    """The gradient reduce-scatter implementation ``reduce_scatter_impl: requested`` runs on
    ``backend`` with ``shard_size`` ranks per shard group, and why: ``(impl, reason)``.

    ``auto`` picks, per backend, the implementation that moves the fewest bytes among those
    bitwise equal to the backend's own reduce-scatter: on gloo with 2 ranks per shard group
    all-to-all plus a local sum (half the bytes of gloo's clone plus all-reduce), run as
    ``receive_first`` (on a group that posts every receive before any send, ``runtime/exchange.py``:
    the same bytes and results as gloo's all-to-all, both link directions busy at once);
    native everywhere else. An explicit value is kept as it is; ``receive_first`` exists
    for gloo only, elsewhere it is an error."""
    if not compiled:
        return "native", "compile: false runs eager fully_shard, which reduce-scatters natively"
    if requested == "receive_first" and backend != "gloo":
        from ..config.schema import OverlapConfigError

        raise OverlapConfigError(
            f"reduce_scatter_impl: receive_first reorders gloo's point-to-point sends and receives; "
            f"{backend} has no such mode. Valid on {backend}: auto, native, all_to_all."
        )
    if requested != "auto":
        return requested, "set in the config"
    if shard_size is None or shard_size < 2:
        return "native", "one rank per shard group: there is nothing to scatter"
    if backend != "gloo":
        return "native", f"{backend}'s reduce-scatter already sends each rank only its chunk"
    if shard_size in GLOO_ALL_TO_ALL_BITWISE:
        return "receive_first", (
            "gloo's reduce-scatter is a clone plus a full all-reduce; all-to-all plus a local sum "
            "sends half the bytes and is bitwise equal on 2 ranks per shard group; each all-to-all "
            "posts its receives before its sends (gloo's own sends first, one link direction at a time)"
        )
    return "native", (
        f"on gloo with {shard_size} ranks per shard group all-to-all plus a local sum adds in "
        "another order than gloo's ring (equal only up to rounding), so the native reduce-scatter runs"
    )


def local_rank() -> int:
    """This process's rank on its node, from the launcher's environment (0 if unset)."""
    for var in ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def device_for_rank(device_type: str, rank_on_node: int | None = None) -> torch.device:
    """The device a rank uses: one accelerator per rank on a node, or the CPU."""
    if device_type == "cpu":
        return torch.device("cpu")
    rank_on_node = local_rank() if rank_on_node is None else rank_on_node
    module = device_module(device_type)
    count = module.device_count() if module is not None else 0
    if count == 0:
        raise RuntimeError(f"no {device_type} device is visible to this process.")
    return torch.device(device_type, rank_on_node % count)


def set_device(device: torch.device) -> None:
    """Make ``device`` the current device of its type (a no-op on CPU)."""
    if device.type == "cpu":
        return
    module = device_module(device.type)
    if module is not None:
        module.set_device(device)


def current(preferred: str | None = None, rank_on_node: int | None = None) -> DeviceInfo:
    """Everything a rank needs to know: device type, backend and device."""
    device_type = detect_device_type(preferred)
    return DeviceInfo(device_type, backend_for(device_type), device_for_rank(device_type, rank_on_node))


def init_process_group(backend: str | None = None, **kwargs) -> None:
    """``torch.distributed.init_process_group`` for a training script: the backend this
    machine needs (cuda -> nccl, npu -> hccl, cpu -> gloo) unless given, and under
    ``torchrun`` a store namespace per restart.

    Why the namespace: under torchrun (torch 2.13), restarted workers reuse the agent's
    store on the same ``MASTER_PORT``, and the default process group's keys carry no
    attempt number, so a restarted rank can read a peer's address from the failed attempt
    and fail with ``Gloo connectFullMesh failed ... Connection refused`` (seen here in about
    half of the restarts). Prefixing the store with ``TORCHELASTIC_RESTART_COUNT`` gives
    every attempt fresh keys. Does nothing if a default group exists already.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = backend or backend_for(detect_device_type())
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is not None and "store" not in kwargs and "init_method" not in kwargs:
        from datetime import timedelta

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world,
            is_master=not agent_hosts_store and rank == 0,
            timeout=kwargs.get("timeout") or timedelta(minutes=10),
            multi_tenant=not agent_hosts_store,
        )
        kwargs.update(store=dist.PrefixStore(f"fsdp_overlap/attempt_{restart}", store), rank=rank, world_size=world)
    dist.init_process_group(backend, **kwargs)


_SETTLE_HOOK: list[bool] = []  # the exit hook, once per process


def settle_gloo_workers_at_exit() -> None:
    """Register, once per process, an exit hook that lets gloo's worker threads finish
    releasing their last works before the interpreter finalizes.

    A torch bug (seen on 2.13, reproduced with torch's own ``fully_shard`` and no
    fsdp-overlap code, docs/troubleshooting.md): a gloo worker thread
    (``ProcessGroupGloo::runLoop``) drops its reference to a finished work after the
    caller's ``wait()`` has returned. The work's tensors then release their Python
    objects, which needs the GIL. When the main thread keeps the GIL from that wait until
    the interpreter starts finalizing, CPython ends the worker inside ``take_gil``
    (``PyThread_exit_thread``), the unwind crosses the work's ``noexcept`` destructor, and
    the process aborts after its last step: "terminate called without an active
    exception", SIGABRT, a non-zero exit code for the launcher. The hook runs at exit,
    before finalization, and sleeps a few milliseconds, releasing the GIL, so that any
    worker waiting for it takes it first.
    """
    if not _SETTLE_HOOK:
        _SETTLE_HOOK.append(True)
        atexit.register(_let_gloo_workers_finish)


def _let_gloo_workers_finish() -> None:
    for _ in range(5):
        time.sleep(0.002)  # each sleep releases the GIL to a thread waiting for it
