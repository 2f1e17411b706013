"""Hugging Face Accelerate adapter: one YAML for ``accelerate launch``, one extra line.

    accelerate launch --config_file configs/overlap.yaml --num_processes 2 train.py

    from fsdp_overlap_plugin.accelerate import prepare   # import before creating the Accelerator

    accelerator = Accelerator()
    model, optimizer, loader = prepare(accelerator, model, optimizer, loader)

The plugin's settings are the ``fsdp_overlap_*`` keys under ``fsdp_config`` in that YAML
(see ``configs/overlap.yaml``); ``prepare`` finds the file in each worker (``config=``,
then ``$FSDP_OVERLAP_CONFIG``, then the launcher's ``--config_file``), shards and compiles
the model with the core, and gives everything else to Accelerate. Importing this module
also lets an FSDP launch on a CPU-only machine start real gloo ranks
(``use_gloo_on_cpu_only_launch``).
"""

from __future__ import annotations

from .adapter import (
    Resolved,
    config_source,
    load_config,
    own_store_for_restarted_attempt,
    prepare,
    use_gloo_on_cpu_only_launch,
)
from .adopt import install, is_adopted
from .config import ENV_VAR, PREFIX, ConfigSource, find_config_file, plugin_keys

use_gloo_on_cpu_only_launch()
own_store_for_restarted_attempt()  # accelerate launch --max_restarts on CPUs
install()  # Accelerators of an FSDP launch prepare models through the plugin (adopt.py)

__all__ = [
    "ENV_VAR",
    "PREFIX",
    "ConfigSource",
    "Resolved",
    "config_source",
    "find_config_file",
    "install",
    "is_adopted",
    "load_config",
    "plugin_keys",
    "prepare",
    "use_gloo_on_cpu_only_launch",
]
