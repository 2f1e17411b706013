"""The NPU registration check, run in a fresh process (``run_isolated``).

It installs a fake ``torch_npu`` *before* ``fsdp_overlap_plugin`` is first imported, so
what it checks is what a user with Ascend software gets from ``import
fsdp_overlap_plugin``. This module must not import the plugin at the top.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
from _fake_npu import install_fake_torch_npu


def npu_registration() -> dict:
    npu = install_fake_torch_npu(count=4)
    assert "fsdp_overlap_plugin" not in sys.modules, "the plugin must be imported after the fake torch_npu"
    from lightning.fabric import Fabric
    from lightning.fabric.accelerators import ACCELERATOR_REGISTRY
    from lightning.pytorch import Trainer
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning_utilities.core.rank_zero import rank_zero_only
    from pytorch_lightning import Trainer as StandaloneTrainer
    from pytorch_lightning.accelerators import AcceleratorRegistry as StandaloneRegistry

    import fsdp_overlap_plugin  # noqa: F401  (registers "npu" now that torch_npu imports)
    from fsdp_overlap_plugin.lightning import NPUAccelerator, NPUFabricAccelerator, standalone
    from fsdp_overlap_plugin.lightning._common import warn_if_npu_unused

    out: dict = {
        "registered": (
            AcceleratorRegistry.get("npu").__class__.__name__,
            ACCELERATOR_REGISTRY.get("npu").__class__.__name__,
            StandaloneRegistry.get("npu").__class__.__name__,
        )
    }
    rank_zero_only.rank = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_npu_unused(torch.device("cpu"))
    out["cpu_warning"] = [str(w.message) for w in caught]

    os.environ.update(LOCAL_RANK="1", RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    trainer = Trainer(accelerator="npu", devices=2, strategy="fsdp_overlap", precision="bf16-mixed", logger=False)
    strategy = trainer.strategy
    strategy._align_precision_device()
    trainer.accelerator.setup_device(strategy.root_device)
    out["trainer"] = {
        "accelerator": type(trainer.accelerator) is NPUAccelerator,
        "devices": [str(d) for d in strategy.parallel_devices],
        "root": str(strategy.root_device),
        "backend": strategy._get_process_group_backend(),
        "autocast": trainer.precision_plugin.device,
        "current": str(npu.current),
        "launcher": strategy.launcher,
    }
    fabric = Fabric(accelerator="npu", devices=2, strategy="fsdp_overlap")
    out["fabric"] = {
        "accelerator": type(fabric.accelerator) is NPUFabricAccelerator,
        "root": str(fabric.device),
        "backend": fabric.strategy._get_process_group_backend(),
    }
    standalone_trainer = StandaloneTrainer(accelerator="npu", devices=[0, 3], strategy="fsdp_overlap", logger=False)
    out["standalone"] = {
        "accelerator": type(standalone_trainer.accelerator) is standalone.NPUAccelerator,
        "devices": [str(d) for d in standalone_trainer.strategy.parallel_devices],
        "backend": standalone_trainer.strategy._get_process_group_backend(),
    }
    parse = NPUAccelerator.parse_devices
    out["parse"] = [parse(2), parse(-1), parse("1,3"), parse("2"), parse([0, 2]), parse(0)]
    try:
        parse(5)
    except ValueError as exc:
        out["too_many"] = str(exc)
    npu.count = 0
    out["available_without_devices"] = NPUAccelerator.is_available()
    return out
