"""``fsdp-overlap``: look at a model's buckets, check a config against a model, and explain
what the passes did, all before (or after) a job runs and without a GPU.

    fsdp-overlap inspect MODEL [--config CONFIG] [--model-arg KEY=VALUE ...] [--depth N] [--world N] [--json]
                         [--hardware SPEC] [--profile PATH] [--batch N] [--seq N]
    fsdp-overlap check CONFIG [--model MODEL] [--model-arg KEY=VALUE ...] [--world N] [--strict] [--json]
                       [--hardware SPEC] [--profile PATH] [--batch N] [--seq N]
    fsdp-overlap suggest MODEL [--config CONFIG] [--world N] [--hardware SPEC] [--profile PATH] [--batch N]
                         [--seq N] [--memory-budget SIZE] [--json]
    fsdp-overlap profile MODEL [--out compute_profile.json] [--batch N] [--seq N] [--device cpu|cuda] [--json]
    fsdp-overlap explain REPORT.json [--graph forward|backward] [--sequence] [--png OUT.png] [--json]
    fsdp-overlap timeline REPORT.json [--out timeline.png] [--link 300mbit] [--json]
    fsdp-overlap export CHECKPOINT OUT [--model MODEL] [--dtype bf16] [--max-shard-size 5GB] [--prefix P] [--json]
    fsdp-overlap launch --config CONFIG [--model MODEL] [accelerate launch arguments] SCRIPT [ARGS]

``MODEL`` is ``package.module:factory`` (or ``path/to/file.py:factory``), a callable that
returns an ``nn.Module``. It is always called under ``torch.device("meta")``, so a 70B model
costs no memory for its weights. Factory arguments come from ``--model-arg n_layer=48``
(values read as YAML: ``48``, ``true``, ``bf16``) or inline: ``pkg.mod:factory(n_layer=48)``.
``MODEL`` may also be ``hf:path/to/config.json`` (or ``hf:path/to/folder`` holding one): the
``transformers`` model that config describes, built on meta by ``hf.model_from_config``,
never downloading anything; ``--model-arg num_hidden_layers=48`` then overrides a config field.

``CONFIG`` is a plain plugin YAML (the keys of ``OverlapConfig``), a LightningCLI YAML (the
keys under ``trainer.strategy.init_args``, optionally with a ``config:`` path to a plugin
YAML), or an Accelerate YAML (the keys under ``fsdp_config`` as ``fsdp_overlap_<key>``).
Each is read by the runtime's own reader for that format (``configs.py``), so ``check``
gives the verdict the run would give.

The package, one module per job: ``main`` (the command line), ``options`` (what ``--help``
shows beside ``main``: the ``export``/``profile`` options, defaults, value readers), ``commands`` (``inspect``,
``check``, ``suggest``), ``predict`` (each bucket's bytes and FLOPs, the predicted step and
``suggest``'s search, through ``costmodel``), ``profile`` (this machine's compute rate), ``configs`` (reading a config the runtime's way), ``models`` (``MODEL`` specs),
``analysis`` (plan, bytes, memory, one function per warning), ``text`` (formatting),
``explain`` (``explain``, ``timeline``), ``export`` (a checkpoint into a ``save_pretrained``
folder, offline), ``launch`` (``accelerate launch`` after a check).

Exit codes: 0 fine (warnings are printed), 1 ``--strict`` and a warning, or nothing to
explain / draw, 2 a bad config, model spec or report (the message names the key or module).
Nothing here initialises a process group or allocates parameter memory; ``--help``,
``--version`` and ``COMMAND --help`` import no torch (``main`` and ``options`` are free of it;
a command's module is imported to run it, and this package's other names on first use).
"""

from __future__ import annotations

import importlib

from .errors import CliError
from .main import build_parser, main

#: The names imported on first use (they import torch); ``main`` and ``build_parser`` do not.
_LAZY = {
    "LoadedConfig": ".configs",
    "analyze": ".analysis",
    "explain_report": ".explain",
    "load_config": ".configs",
    "load_model": ".models",
    "summarize_schedule": ".explain",
}

__all__ = [
    "CliError",
    "LoadedConfig",
    "analyze",
    "build_parser",
    "explain_report",
    "load_config",
    "load_model",
    "main",
    "summarize_schedule",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
