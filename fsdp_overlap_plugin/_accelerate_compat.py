"""Every private Accelerate name fsdp-overlap uses, in one place.

Each function imports Accelerate when it is called, never when this module is imported
(``import fsdp_overlap_plugin`` does not import Accelerate). Checked on accelerate 1.15.0.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = [
    "clip_grad_norm",
    "deferred_parallelism_check",
    "launch_parser_actions",
    "mark_prepared",
    "prepared_models",
    "prepared_objects",
    "set_fsdp_distributed_type",
    "validate_launch_command",
]


def launch_parser_actions() -> list[argparse.Action]:
    """The actions (options) of ``accelerate.commands.launch.launch_command_parser()``, its argparse ``_actions`` (checked on accelerate 1.15.0)."""
    from accelerate.commands.launch import launch_command_parser

    return list(launch_command_parser()._actions)


def validate_launch_command(args: argparse.Namespace) -> tuple[argparse.Namespace, Any, Any]:
    """``accelerate.commands.launch._validate_launch_command(args)``: the launcher's arguments completed from its config file (checked on accelerate 1.15.0)."""
    from accelerate.commands.launch import _validate_launch_command

    return _validate_launch_command(args)


def prepared_objects(accelerator: Any) -> tuple:
    """What ``accelerator`` has prepared: its ``_dataloaders``, ``_optimizers`` and ``_schedulers`` (checked on accelerate 1.15.0)."""
    return (*accelerator._dataloaders, *accelerator._optimizers, *accelerator._schedulers)


def prepared_models(accelerator: Any) -> list:
    """The models ``accelerator`` has prepared, its ``_models`` (checked on accelerate 1.15.0)."""
    return list(accelerator._models)


def mark_prepared(obj: Any) -> None:
    """Set Accelerate's ``_is_accelerate_prepared`` flag, by which ``Accelerator.prepare`` registers an object without wrapping it again (checked on accelerate 1.15.0)."""
    obj._is_accelerate_prepared = True


def set_fsdp_distributed_type(accelerator: Any, fsdp_plugin: Any) -> None:
    """Make ``accelerator``'s state say ``distributed_type: FSDP`` with ``fsdp_plugin``, as
    ``AcceleratorState.__init__`` does for an FSDP launch on GPUs (it skips ``MULTI_CPU``).
    ``PartialState`` and ``AcceleratorState`` keep their attributes in class-wide shared
    dicts, and every ``AcceleratorState()`` copies ``PartialState``'s over its own, so the
    type is set in ``PartialState``; the process group and the device stay as they are
    (checked on accelerate 1.15.0)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = fsdp_plugin


def clip_grad_norm(accelerator: Any, parameters: list, max_norm: float, norm_type: float = 2) -> Any:
    """``accelerator._clip_grad_norm_dtensor_aware``: ``torch.nn.utils.clip_grad_norm_`` with
    the norm taken per device mesh when the gradients live on several (checked on
    accelerate 1.15.0); torch's own where Accelerate has no such method."""
    import torch

    method = getattr(accelerator, "_clip_grad_norm_dtensor_aware", None)
    if method is None:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
    return method(parameters, max_norm, norm_type=norm_type)


@contextlib.contextmanager
def deferred_parallelism_check() -> Iterator[list]:
    """Inside it, ``ParallelismConfig._validate_accelerator`` (which ``Accelerator.__init__``
    calls last) only records its call; the list it yields gets ``(config, accelerator)``
    to run after. On a CPU-only FSDP launch the state says ``MULTI_CPU`` until adoption
    sets ``FSDP``, and that check refuses a tensor-parallel ``ParallelismConfig`` on
    ``MULTI_CPU`` (checked on accelerate 1.15.0)."""
    from accelerate.parallelism_config import ParallelismConfig

    calls: list = []
    original = ParallelismConfig._validate_accelerator

    def record(self: Any, accelerator: Any) -> None:
        calls.append((self, accelerator))

    ParallelismConfig._validate_accelerator = record
    try:
        yield calls
    finally:
        ParallelismConfig._validate_accelerator = original
