"""Every private Lightning name fsdp-overlap uses, in one place.

Each function imports Lightning when it is called, never when this module is imported.
Checked on lightning 2.6.6. Methods our strategies override or call on themselves as
subclasses of ``ModelParallelStrategy`` (``_configure_launcher``, ``_setup_distributed``,
``_device_mesh``, ``_backward_sync_control``, ``_process_group_backend``) are part of
that subclassing and stay in the strategies.
"""

from __future__ import annotations

from typing import Any

__all__ = ["accelerator_connector", "set_module_device_mesh", "unified_precision"]


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
