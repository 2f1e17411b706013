"""The same strategies and NPU accelerators for the standalone ``pytorch_lightning`` and
``lightning_fabric`` packages.

They are separate installs with their own class hierarchies and registries:
``pytorch_lightning.Trainer`` only accepts ``pytorch_lightning`` strategies. The
behaviour is the mixins of ``trainer.py``, ``fabric.py`` and ``npu.py``; only the base
classes differ. Import this module only where those packages are installed.
"""

from __future__ import annotations

from lightning_fabric.accelerators import Accelerator as _FabricAccelerator
from lightning_fabric.strategies import ModelParallelStrategy as _FabricModelParallel
from pytorch_lightning.accelerators import Accelerator as _TrainerAccelerator
from pytorch_lightning.strategies import ModelParallelStrategy as _TrainerModelParallel
from typing_extensions import override

from .fabric import FabricStrategyMixin
from .npu import NPUAcceleratorMixin, _npu
from .trainer import TrainerStrategyMixin

__all__ = ["FSDPOverlapFabricStrategy", "FSDPOverlapStrategy", "NPUAccelerator", "NPUFabricAccelerator"]


class FSDPOverlapStrategy(TrainerStrategyMixin, _TrainerModelParallel):
    __doc__ = TrainerStrategyMixin.__doc__
    _lightning_package = "pytorch_lightning"


class FSDPOverlapFabricStrategy(FabricStrategyMixin, _FabricModelParallel):
    __doc__ = FabricStrategyMixin.__doc__
    _lightning_package = "lightning_fabric"


class NPUAccelerator(NPUAcceleratorMixin, _TrainerAccelerator):
    """``pytorch_lightning.Trainer(accelerator="npu")``."""

    @override
    def get_device_stats(self, device):
        stats = getattr(_npu(), "memory_stats", None)
        return dict(stats(device)) if callable(stats) else {}


class NPUFabricAccelerator(NPUAcceleratorMixin, _FabricAccelerator):
    """``lightning_fabric.Fabric(accelerator="npu")``."""
