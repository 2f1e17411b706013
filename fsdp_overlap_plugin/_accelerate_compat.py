"""Every private Accelerate name fsdp-overlap uses, in one place.

Each function imports Accelerate when it is called, never when this module is imported
(``import fsdp_overlap_plugin`` does not import Accelerate). Checked on accelerate 1.15.0.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["launch_parser_actions", "mark_prepared", "prepared_objects", "validate_launch_command"]


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


def mark_prepared(obj: Any) -> None:
    """Set Accelerate's ``_is_accelerate_prepared`` flag, by which ``Accelerator.prepare`` registers an object without wrapping it again (checked on accelerate 1.15.0)."""
    obj._is_accelerate_prepared = True
