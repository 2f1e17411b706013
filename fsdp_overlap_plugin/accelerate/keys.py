"""How the plugin's keys are spelled in an Accelerate job: ``fsdp_overlap_<field>`` under
``fsdp_config``, the ``FSDP_OVERLAP_CONFIG`` variable, and whether this process runs in an
FSDP launch. Shared by the modules that find, read and translate the settings."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from ..config.schema import OverlapConfig

__all__ = ["ENV_VAR", "PREFIX", "field_for", "fsdp_launch", "key_for", "plugin_keys"]

PREFIX = "fsdp_overlap_"
ENV_VAR = "FSDP_OVERLAP_CONFIG"


def fsdp_launch(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs in an FSDP launch: ``ACCELERATE_USE_FSDP=true`` (default
    ``os.environ``), what ``accelerate launch`` exports for ``distributed_type: FSDP`` and
    what ``Accelerator(fsdp_plugin=...)`` sets."""
    env = os.environ if environ is None else environ
    return env.get("ACCELERATE_USE_FSDP", "").lower() == "true"


def key_for(name: str) -> str:
    """The ``fsdp_config`` key of an ``OverlapConfig`` field: ``fsdp_overlap_<field>``,
    without saying "overlap" twice (``overlap_grad_reduce`` -> ``fsdp_overlap_grad_reduce``)."""
    return "fsdp_" + name if name.startswith("overlap_") else PREFIX + name


def plugin_keys() -> list[str]:
    """The ``fsdp_config`` keys of the plugin, one per ``OverlapConfig`` field, in field order."""
    return [key_for(f.name) for f in dataclasses.fields(OverlapConfig)]


def field_for(key: str) -> str | None:
    """The ``OverlapConfig`` field a ``fsdp_config`` key sets, or None."""
    return {key_for(f.name): f.name for f in dataclasses.fields(OverlapConfig)}.get(key)
