"""Registration of ``"fsdp_overlap"`` (and ``"npu"``) in every installed Lightning registry.

Lightning has no entry-point discovery for strategies, so ``import fsdp_overlap_plugin``
registers: in ``lightning``'s registries right after ``lightning`` is imported (now, if it
already is), in the standalone ones after ``pytorch_lightning``/``lightning_fabric`` are
(``_AfterImport`` in the package's ``__init__``). ``lightning.pytorch``/``lightning.fabric``
and the standalone ``pytorch_lightning``/``lightning_fabric`` keep separate registries;
each installed one gets its own classes. Calling ``register()`` again is harmless (it
re-registers the same classes), e.g. after ``torch_npu`` became importable.
"""

from __future__ import annotations

import importlib.util

from ..core import devices

__all__ = ["STRATEGY_NAME", "register", "register_family"]

STRATEGY_NAME = "fsdp_overlap"
_DESCRIPTION = "FSDP2 sharding visible to torch.compile, with communication-overlap passes (fsdp-overlap)"


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def register() -> dict[str, list[str]]:
    """Register the names in every installed registry (importing them); returns
    ``{package: [names registered there]}``."""
    done = register_family("lightning")
    if _installed("pytorch_lightning") and _installed("lightning_fabric"):
        done |= register_family("standalone")
    return done


def register_family(family: str) -> dict[str, list[str]]:
    """Register in one family of registries: ``"lightning"`` (``lightning.pytorch`` and
    ``lightning.fabric``) or ``"standalone"`` (``pytorch_lightning`` and ``lightning_fabric``).
    ``import fsdp_overlap_plugin`` calls it for each installed family once its package is
    imported, so a process that never imports the standalone packages never loads them."""
    if family not in _FAMILIES:
        raise ValueError(f"register_family: unknown family {family!r}; use one of {', '.join(_FAMILIES)}")
    done: dict[str, list[str]] = {}
    _FAMILIES[family](done, devices.npu_module() is not None)
    return done


def _lightning(done: dict, has_npu: bool) -> None:
    # ``lightning`` is a dependency of the package; the standalone packages are optional.
    from lightning.fabric.accelerators import ACCELERATOR_REGISTRY as fabric_accelerators
    from lightning.fabric.strategies import STRATEGY_REGISTRY as fabric_strategies
    from lightning.pytorch.accelerators import AcceleratorRegistry as trainer_accelerators
    from lightning.pytorch.strategies import StrategyRegistry as trainer_strategies

    from . import fabric, trainer
    from . import npu as npu_classes

    _strategies(trainer_strategies, trainer.FSDPOverlapStrategy, done, "lightning.pytorch")
    _strategies(fabric_strategies, fabric.FSDPOverlapFabricStrategy, done, "lightning.fabric")
    if has_npu:
        _accelerator(trainer_accelerators, npu_classes.NPUAccelerator, done, "lightning.pytorch")
        _accelerator(fabric_accelerators, npu_classes.NPUFabricAccelerator, done, "lightning.fabric")


def _standalone(done: dict, has_npu: bool) -> None:
    from lightning_fabric.accelerators import ACCELERATOR_REGISTRY as fabric_accelerators
    from lightning_fabric.strategies import STRATEGY_REGISTRY as fabric_strategies
    from pytorch_lightning.accelerators import AcceleratorRegistry as trainer_accelerators
    from pytorch_lightning.strategies import StrategyRegistry as trainer_strategies

    from . import standalone

    _strategies(trainer_strategies, standalone.FSDPOverlapStrategy, done, "pytorch_lightning")
    _strategies(fabric_strategies, standalone.FSDPOverlapFabricStrategy, done, "lightning_fabric")
    if has_npu:
        _accelerator(trainer_accelerators, standalone.NPUAccelerator, done, "pytorch_lightning")
        _accelerator(fabric_accelerators, standalone.NPUFabricAccelerator, done, "lightning_fabric")


_FAMILIES = {"lightning": _lightning, "standalone": _standalone}


def _strategies(registry, cls: type, done: dict, package: str) -> None:
    registry.register(STRATEGY_NAME, cls, description=_DESCRIPTION, override=True)
    done.setdefault(package, []).append(STRATEGY_NAME)


def _accelerator(registry, cls: type, done: dict, package: str) -> None:
    cls.register_accelerators(registry)
    done.setdefault(package, []).append("npu")
