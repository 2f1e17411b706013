"""Every private Lightning name fsdp-overlap uses, in one place.

Each function imports Lightning when it is called, never when this module is imported.
Checked on lightning 2.6.6. Our strategies subclass ``ModelParallelStrategy``: the private
hooks they override are listed in ``PRIVATE_HOOKS`` (each with why) and marked with
``private_hook``; Lightning's own version of a hook and the private attributes they set or
read are reached through the functions below, never spelt in the strategies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from typing_extensions import override

__all__ = [
    "PRIVATE_HOOKS",
    "accelerator_connector",
    "base_configure_launcher",
    "base_setup_distributed",
    "current_hook_name",
    "private_hook",
    "process_group_backend",
    "process_group_timeout",
    "set_backward_sync_control",
    "set_module_device_mesh",
    "set_strategy_device_mesh",
    "unified_precision",
]

_F = TypeVar("_F", bound=Callable[..., Any])

#: The private methods of Lightning's strategies that ours override, and why (checked on
#: lightning 2.6.6, in both ``lightning.pytorch`` and ``lightning.fabric``).
PRIVATE_HOOKS = {
    "_configure_launcher": "the last hook Trainer(...) / Fabric(...) calls, with the precision plugin, devices and "
    "node count attached: the config is completed and checked there, before any process is launched",
    "_setup_distributed": "sets up the process group: a job torchrun restarted gets it on a store namespace of its "
    "own (devices.init_process_group)",
    "_get_process_group_backend": "the backend of the device type (nccl, hccl, gloo) unless process_group_backend= "
    "is given",
}


def private_hook(method: _F) -> _F:
    """Mark ``method`` as our override of the private Lightning hook of the same name (one of
    ``PRIVATE_HOOKS``): ``typing_extensions.override``, which type checkers and
    ``tests/core/test_adapter_once.py`` read. A name not in the table is a ``TypeError`` at import."""
    if method.__name__ not in PRIVATE_HOOKS:
        raise TypeError(f"{method.__qualname__}: not a private Lightning hook listed in PRIVATE_HOOKS")
    return override(method)


def base_configure_launcher(cls: type, strategy: Any) -> None:
    """Lightning's ``_configure_launcher`` of ``strategy``, past ``cls`` in its MRO (``super(cls, strategy)``)."""
    super(cls, strategy)._configure_launcher()


def base_setup_distributed(cls: type, strategy: Any) -> None:
    """Lightning's ``_setup_distributed`` of ``strategy`` (seed, ranks, process group), past ``cls`` in its MRO."""
    super(cls, strategy)._setup_distributed()


def process_group_backend(strategy: Any) -> str | None:
    """``ModelParallelStrategy._process_group_backend``: the ``process_group_backend=`` argument, or None."""
    return strategy._process_group_backend


def process_group_timeout(strategy: Any) -> Any:
    """``ModelParallelStrategy._timeout``: the ``timeout=`` argument (a ``timedelta``)."""
    return strategy._timeout


def set_strategy_device_mesh(strategy: Any, mesh: Any) -> None:
    """Set ``ModelParallelStrategy._device_mesh``, which its ``device_mesh`` property returns."""
    strategy._device_mesh = mesh


def set_backward_sync_control(strategy: Any, control: Any) -> None:
    """Set Fabric's ``Strategy._backward_sync_control``, whose ``no_backward_sync`` Fabric's
    ``no_backward_sync`` calls."""
    strategy._backward_sync_control = control


def current_hook_name(module: Any) -> str | None:
    """``LightningModule._current_fx_name``: the hook the module runs now (``self.log`` works
    only inside one), or None."""
    return getattr(module, "_current_fx_name", None)


def accelerator_connector(**kwargs: Any) -> Any:
    """``lightning.pytorch.trainer.connectors.accelerator_connector._AcceleratorConnector(**kwargs)``, what ``Trainer(...)`` builds (checked on lightning 2.6.6)."""
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    return _AcceleratorConnector(**kwargs)


def unified_precision(precision: Any) -> Any:
    """``lightning.fabric.connector._convert_precision_to_unified_args``: a precision flag in its unified spelling (checked on lightning 2.6.6)."""
    from lightning.fabric.connector import _convert_precision_to_unified_args

    return _convert_precision_to_unified_args(precision)


def set_module_device_mesh(module: Any, mesh: Any) -> None:
    """Set ``LightningModule._device_mesh`` (its ``device_mesh`` property), as ``ModelParallelStrategy.setup_environment`` does (checked on lightning 2.6.6)."""
    module._device_mesh = mesh
