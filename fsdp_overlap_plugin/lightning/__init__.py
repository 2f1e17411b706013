"""Lightning adapter: ``Trainer(strategy="fsdp_overlap")`` and ``Fabric(strategy="fsdp_overlap")``.

Importing ``fsdp_overlap_plugin`` registers the name in every installed registry
(``lightning.pytorch``, ``lightning.fabric``, and ``pytorch_lightning`` /
``lightning_fabric`` when installed), and ``accelerator="npu"`` when ``torch_npu``
imports. The classes here are for the ``lightning`` package; those for the standalone
packages are in ``fsdp_overlap_plugin.lightning.standalone``.

    from lightning.pytorch import Trainer
    import fsdp_overlap_plugin  # registers "fsdp_overlap"

    Trainer(strategy="fsdp_overlap", accelerator="cpu", devices=2, precision="bf16-mixed")
    Trainer(strategy=FSDPOverlapStrategy(config="overlap.yaml", bucket_plans=["blocks.*"]))

The adapter is thin: it translates Lightning's lifecycle into ``parallelize``,
``materialize`` and ``schedule_report`` calls (see docs/architecture.md).
"""

from __future__ import annotations

from ._common import PRECISION_DTYPES, config_for_precision
from .fabric import FSDPOverlapFabricStrategy
from .npu import NPUAccelerator, NPUFabricAccelerator
from .register import STRATEGY_NAME, register
from .trainer import FSDPOverlapStrategy

__all__ = [
    "FSDPOverlapFabricStrategy",
    "FSDPOverlapStrategy",
    "NPUAccelerator",
    "NPUFabricAccelerator",
    "PRECISION_DTYPES",
    "STRATEGY_NAME",
    "config_for_precision",
    "register",
]
