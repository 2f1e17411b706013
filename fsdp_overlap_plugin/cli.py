"""``fsdp-overlap``: look at a model's buckets, check a config against a model, and explain
what the passes did, all before (or after) a job runs and without a GPU.

    fsdp-overlap inspect MODEL [--config CONFIG] [--model-arg KEY=VALUE ...] [--depth N] [--world N] [--json]
    fsdp-overlap check CONFIG [--model MODEL] [--model-arg KEY=VALUE ...] [--world N] [--strict] [--json]
    fsdp-overlap explain REPORT.json [--graph forward|backward] [--sequence] [--png OUT.png] [--json]

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

Exit codes: 0 fine (warnings are printed), 1 ``--strict`` and a warning, or nothing to
explain / draw, 2 a bad config, model spec or report (the message names the key or module).
Nothing here initialises a process group or allocates parameter memory.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import json
import os
import statistics
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ._version import __version__
from .config import OverlapConfig, OverlapConfigError, dtype_name, read_yaml, suggest
from .plan import PlanWarning, auto_plan_info, gather_bytes, resolve_plan

__all__ = ["main", "load_model", "load_config", "analyze", "explain_report", "LoadedConfig", "CliError"]

#: Below this many bytes a bucket's fixed collective latency costs more than moving its
#: bytes (alpha * beta with alpha ~ 20 us, beta ~ 50 GB/s; see docs/tuning.md).
SMALL_BUCKET_BYTES = 2**20
#: A bucket this many times the median bucket sets the prefetch memory peak on its own.
LARGE_BUCKET_FACTOR = 4

_COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
_GRAPHS = ("forward", "backward")


class CliError(Exception):
    """A user error: bad model spec, unreadable file, not a report. Exit code 2."""


# ---------------------------------------------------------------------------- formatting
def format_bytes(n: int | float) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units, as memory is reported."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_count(n: int) -> str:
    """``207232`` -> ``"207.2K"``; exact below 10,000."""
    if n < 10_000:
        return f"{n:,}"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def format_flops(n: int | float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} FLOP"


def _table(rows: list[list[str]], right: set[int] = frozenset(), indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        out.append((indent + "  ".join(cells)).rstrip())
    return out


# ---------------------------------------------------------------------------- the model
def _literal(text: str) -> Any:
    """A ``--model-arg`` value, read as YAML (``48`` -> int, ``true`` -> bool, ``bf16`` -> str)."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


#: ``MODEL`` specs with this prefix name a transformers config.json (or its folder).
HF_PREFIX = "hf:"


def _parse_model_args(model_args: list[str] | None) -> dict[str, Any]:
    """``["n_layer=48", "bias=false"]`` -> ``{"n_layer": 48, "bias": False}`` (values read as YAML)."""
    kwargs: dict[str, Any] = {}
    for item in model_args or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise CliError(f"--model-arg {item!r}: expected KEY=VALUE, e.g. --model-arg n_layer=48.")
        kwargs[key.strip()] = _literal(value)
    return kwargs


def parse_model_spec(spec: str, model_args: list[str] | None = None) -> tuple[str, str, list, dict]:
    """``"pkg.mod:factory(n_layer=48)"`` -> ``("pkg.mod", "factory", [], {"n_layer": 48})``."""
    module, sep, rest = spec.partition(":")
    if not sep or not module or not rest:
        hint = ""
        if spec.endswith(".json") or (Path(spec) / "config.json").is_file():
            hint = f" For a transformers config, prefix it: hf:{spec}."
        raise CliError(
            f"model {spec!r}: expected package.module:factory (a callable returning an nn.Module), "
            "e.g. fsdp_overlap_plugin.models.gpt:gpt_small, or hf:path/to/config.json (a transformers "
            f"config, built on meta).{hint}"
        )
    args: list = []
    kwargs: dict = {}
    attr = rest
    if "(" in rest:
        if not rest.endswith(")"):
            raise CliError(f"model {spec!r}: unbalanced parentheses in the factory call.")
        attr = rest[: rest.index("(")]
        try:
            call = ast.parse("f" + rest[rest.index("(") :], mode="eval").body
            assert isinstance(call, ast.Call)
            args = [ast.literal_eval(a) for a in call.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}
        except (SyntaxError, ValueError, AssertionError):
            raise CliError(
                f"model {spec!r}: factory arguments must be Python literals, e.g. {attr}(n_layer=48, d_model=1024)."
            ) from None
    kwargs.update(_parse_model_args(model_args))
    return module, attr.strip(), args, kwargs


def _import(module: str) -> Any:
    if module.endswith(".py") or os.sep in module:
        path = Path(module)
        if not path.is_file():
            raise CliError(f"model: file {module!r} does not exist.")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(path.stem, mod)
        spec.loader.exec_module(mod)
        return mod
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: local packages resolve
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise CliError(f"model: cannot import module {module!r} ({exc}).") from None


def load_model(spec: str, model_args: list[str] | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """Build the model of ``spec`` on the meta device; return it and a description.

    A LightningModule that builds its layers in ``configure_model`` gets that called too
    (still on meta). The description counts parameters that are *not* on the meta device
    (a factory that places tensors on a device explicitly); they are the only ones that
    cost memory here.
    """
    if spec.startswith(HF_PREFIX):
        return load_hf_model(spec, model_args)
    module_name, attr, args, kwargs = parse_model_spec(spec, model_args)
    mod = _import(module_name)
    factory: Any = mod
    for part in attr.split("."):
        if not hasattr(factory, part):
            names = [n for n in dir(factory) if not n.startswith("_") and callable(getattr(factory, n, None))]
            raise CliError(f"model: {module_name!r} has no attribute {attr!r}.{suggest(part, names)}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise CliError(f"model: {module_name}:{attr} is not callable.")
    with torch.device("meta"):
        try:
            model = factory(*args, **kwargs)
        except TypeError as exc:
            hint = ""
            try:
                import inspect

                params = list(inspect.signature(factory).parameters)
                bad = [k for k in kwargs if k not in params]
                hint = suggest(bad[0], params) if bad else ""
            except (TypeError, ValueError):
                pass
            raise CliError(f"model: {module_name}:{attr}(...) failed: {exc}.{hint}") from None
        except Exception as exc:  # the user's constructor: report it as theirs, with the meta-device hint
            raise CliError(
                f"model: {module_name}:{attr}(...) raised {type(exc).__name__}: {exc}. It runs under "
                'torch.device("meta"), where a constructor cannot read tensor values.'
            ) from None
        if isinstance(model, nn.Module) and next(model.parameters(), None) is None:
            configure = getattr(model, "configure_model", None)
            if callable(configure):
                configure()
    if not isinstance(model, nn.Module):
        raise CliError(f"model: {module_name}:{attr} returned {type(model).__name__}, not an nn.Module.")
    info = {"spec": spec, "factory": f"{module_name}:{attr}", "args": list(args), "kwargs": kwargs}
    return model, _describe(model, info)


def _describe(model: nn.Module, info: dict[str, Any]) -> dict[str, Any]:
    """``info`` plus the model's class, parameter count and storage (tied parameters once)."""
    params = {id(p): p for p in model.parameters()}.values()
    return {
        **info,
        "class": type(model).__name__,
        "params": sum(p.numel() for p in params),
        "storage_bytes": sum(p.numel() * p.element_size() for p in params),
        "storage_dtypes": sorted({dtype_name(p.dtype) or str(p.dtype) for p in params}),
        "non_meta_params": sum(1 for p in params if p.device.type != "meta"),
    }


def _hf_config_file(spec: str) -> Path:
    """The ``config.json`` an ``hf:`` spec names (the file, or the one in the folder)."""
    text = spec[len(HF_PREFIX) :].strip()
    if not text:
        raise CliError(f"model {spec!r}: expected hf:path/to/config.json (or hf:path/to/folder holding one).")
    path = Path(text).expanduser()
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        where = f"the folder {str(path)!r} has no config.json" if path.is_dir() else f"{str(file)!r} does not exist"
        raise CliError(
            f"model {spec!r}: {where}. Give a local transformers config.json or the folder holding it "
            "(nothing is downloaded: save a hub model's config.json first)."
        )
    return file


def _hf_read(spec: str, file: Path) -> dict[str, Any]:
    """The JSON of ``file``, checked to be a transformers config of a known ``model_type``."""
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"model {spec!r}: cannot read {str(file)!r} ({exc}).") from None
    except ValueError as exc:
        raise CliError(f"model {spec!r}: {str(file)!r} is not valid JSON ({exc}); fix the file.") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise CliError(
            f"model {spec!r}: {str(file)!r} is not a transformers config.json: it has no 'model_type' key "
            '(e.g. "model_type": "llama"); add it, or point hf: at the model\'s config.json.'
        )
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError as exc:
        raise CliError(
            f"model {spec!r}: building a model from {str(file)!r} needs transformers ({exc}); pip install transformers."
        ) from None
    model_type = data["model_type"]
    known = list(CONFIG_MAPPING.keys())
    if not isinstance(model_type, str) or model_type not in known:
        raise CliError(
            f"model {spec!r}: {str(file)!r} has model_type {model_type!r}, which transformers "
            f"{transformers.__version__} does not know.{suggest(str(model_type), known)} Fix model_type, or "
            "install a transformers that has this model (remote code is not run)."
        )
    return data


def _hf_override(spec: str, config: Any, overrides: dict[str, Any]) -> list[str]:
    """Set ``--model-arg`` fields on ``config`` (unknown fields are errors); returns notes."""
    notes: list[str] = []
    if not overrides:
        return notes
    cls = type(config).__name__
    aliases = dict(getattr(config, "attribute_map", None) or {})
    fields = set(config.to_dict()) | set(aliases)
    if dataclasses.is_dataclass(config):
        fields |= {f.name for f in dataclasses.fields(config)}
    valid = sorted(f for f in fields if not f.startswith("_") and f not in ("model_type", "transformers_version"))
    for key, value in overrides.items():
        if key == "model_type":
            raise CliError("--model-arg model_type: cannot change a config's model_type; use another config.json.")
        if key not in valid:
            close = suggest(key, valid)
            listed = close or f" Fields of {cls}: {', '.join(valid)}."
            raise CliError(f"--model-arg {key}: {cls} has no field {key!r} (model {spec!r}).{listed}")
        try:
            setattr(config, key, value)
        except Exception as exc:  # transformers' strict dataclass validation
            raise CliError(f"--model-arg {key}={value!r}: {cls} rejects it: {exc}".rstrip(".") + ".") from None
    layers = aliases.get("num_hidden_layers", "num_hidden_layers")
    types = getattr(config, "layer_types", None)
    n = getattr(config, layers, None)
    if (
        {"num_hidden_layers", layers} & set(overrides)
        and "layer_types" not in overrides
        and isinstance(types, list)
        and isinstance(n, int)
        and len(types) != n
        and len(set(types)) == 1
    ):
        config.layer_types = types[:1] * n  # every layer the same kind: the new depth has the same kind
        notes.append(f"layer_types: {len(types)} x {types[0]!r} -> {n} x {types[0]!r}")
    validate = getattr(config, "validate", None)
    if callable(validate):
        try:
            validate()
        except Exception as exc:
            raise CliError(
                f"--model-arg {', '.join(f'{k}={v!r}' for k, v in overrides.items())}: {cls} is not consistent "
                f"any more: {exc}. Override the fields that depend on it too (e.g. --model-arg layer_types=[...])."
            ) from None
    return notes


def load_hf_model(spec: str, model_args: list[str] | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """``hf:path/to/config.json`` (or ``hf:folder``): the transformers model that config
    describes, built on the meta device with ``hf.model_from_config``, nothing downloaded.
    ``model_args`` override config fields (``num_hidden_layers=48``); every problem is a
    ``CliError`` naming the file or field."""
    from . import hf

    overrides = _parse_model_args(model_args)
    file = _hf_config_file(spec)
    data = _hf_read(spec, file)
    try:
        config = hf.load_config(file)
    except Exception as exc:  # transformers' own validation of the file's values
        raise CliError(f"model {spec!r}: transformers rejects {str(file)!r}: {type(exc).__name__}: {exc}") from None
    notes = _hf_override(spec, config, overrides)
    import transformers

    names = getattr(config, "architectures", None) or []
    if names:
        cls = getattr(transformers, str(names[0]), None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            candidates = [n for n in dir(transformers) if "For" in n or n.endswith("Model")]
            raise CliError(
                f"model {spec!r}: {str(file)!r} names architectures[0] {names[0]!r}, which transformers "
                f"{transformers.__version__} does not have.{suggest(str(names[0]), candidates)} Fix the name, or "
                f"remove 'architectures' to build the causal LM of model_type {data['model_type']!r}."
            )
    try:
        model = hf.model_from_config(config, device="meta")
    except Exception as exc:
        what = names[0] if names else f"the causal LM of model_type {data['model_type']!r}"
        hint = " Check the --model-arg values against the config's other fields." if overrides else ""
        raise CliError(
            f"model {spec!r}: building {what} from {str(file)!r} failed: {type(exc).__name__}: {exc}.{hint}"
        ) from None
    info = {
        "spec": spec,
        "factory": "fsdp_overlap_plugin.hf:model_from_config",
        "args": [],
        "kwargs": overrides,
        "config": str(file),
        "model_type": data["model_type"],
        "architecture": names[0] if names else None,
        "notes": notes,
    }
    return model, _describe(model, info)


# --------------------------------------------------------------------------- the config
@dataclass
class LoadedConfig:
    """A config read from one of the three YAML shapes, and where its keys live."""

    config: OverlapConfig
    path: str | None = None
    shape: str = "default"
    """"plugin", "lightning", "accelerate", or "default" (no file)."""
    section: str = ""
    """Where the plugin keys live in the file ("", "trainer.strategy.init_args", "fsdp_config")."""
    prefix: str = ""
    """What each key is prefixed with there ("fsdp_overlap_" for Accelerate)."""
    world: int | None = None
    """World size the file implies (Accelerate num_processes, Lightning devices x num_nodes)."""
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    model_spec: str | None = None
    """A model the file names (LightningCLI ``model.class_path``), used when --model is absent."""
    model_kwargs: dict[str, Any] = field(default_factory=dict)

    def spell(self, name: str) -> str:
        """How the file spells the key ``name`` inside its section (``fsdp_overlap_grad_reduce``)."""
        return self.prefix + ("grad_reduce" if self.prefix and name == "overlap_grad_reduce" else name)

    def key(self, name: str) -> str:
        """The full path of the key ``name`` in the file, for messages."""
        return f"{self.section}.{self.spell(name)}" if self.section else self.spell(name)

    def rename(self, message: str) -> str:
        """Rewrite a core error's leading key (``bucket_plans[1]: ...``) to the user's spelling."""
        names = sorted((f.name for f in dataclasses.fields(OverlapConfig)), key=len, reverse=True)
        for name in names:
            if message.startswith(name) and message[len(name) : len(name) + 1] in (":", "[", "."):
                message = self.key(name) + message[len(name) :]
                break
        return f"{self.path}: {message}" if self.path else message


_ACCELERATE_MP = {"no": None, "bf16": "bf16", "fp16": "fp16"}
_LIGHTNING_PRECISION = {
    "16-mixed": "fp16",
    "16-true": "fp16",
    "16": "fp16",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "bf16": "bf16",
    "32-true": "fp32",
    "32": "fp32",
}
_STRATEGY_NAMES = ("fsdp_overlap", "FSDPOverlapStrategy")


def load_config(path: str | Path | None) -> LoadedConfig:
    """Read ``path`` as a plain plugin YAML, a LightningCLI YAML or an Accelerate YAML.

    The shape is decided by the top-level keys: ``trainer`` (or ``strategy``) means
    LightningCLI, ``fsdp_config`` / ``distributed_type`` / ``compute_environment`` means
    Accelerate, anything else is a plugin YAML. Every problem raises ``OverlapConfigError``
    naming the key as the file spells it.
    """
    if path is None:
        return LoadedConfig(OverlapConfig())
    path = Path(path)
    data = read_yaml(path)
    if "trainer" in data or ("strategy" in data and isinstance(data.get("strategy"), (dict, str))):
        return _load_lightning(path, data)
    if {"fsdp_config", "distributed_type", "compute_environment"} & set(data):
        return _load_accelerate(path, data)
    loaded = LoadedConfig(OverlapConfig(), path=str(path), shape="plugin")
    loaded.config = _build(loaded, data)
    return loaded


def _build(loaded: LoadedConfig, data: dict, defaults: dict | None = None) -> OverlapConfig:
    """``OverlapConfig`` from ``data`` (already in field names), errors in the user's spelling."""
    names = [f.name for f in dataclasses.fields(OverlapConfig)]
    for key in data:
        if key not in names:
            spelled = [loaded.spell(n) for n in names]
            where = f" under {loaded.section}" if loaded.section else ""
            raise OverlapConfigError(
                f"{loaded.path}: unknown key {loaded.key(str(key))!r}.{suggest(loaded.spell(str(key)), spelled)}"
                f" Valid keys{where}: {', '.join(spelled)}."
            )
    merged = dict(defaults or {})
    merged.update(data)
    try:
        return OverlapConfig.from_dict(merged, source=f"{loaded.path}")
    except OverlapConfigError as exc:
        raise OverlapConfigError(loaded.rename(str(exc))) from None


def _load_lightning(path: Path, data: dict) -> LoadedConfig:
    trainer = data.get("trainer", data)
    section = "trainer" if "trainer" in data else ""
    if not isinstance(trainer, dict):
        raise OverlapConfigError(f"{path}: trainer: expected a mapping, got {type(trainer).__name__}.")
    where = f"{section}.strategy" if section else "strategy"
    loaded = LoadedConfig(OverlapConfig(), path=str(path), shape="lightning", section=f"{where}.init_args")
    strategy = trainer.get("strategy")
    init_args: dict = {}
    if strategy is None:
        raise OverlapConfigError(f"{path}: {where} is not set; use strategy: fsdp_overlap (or its class_path).")
    if isinstance(strategy, str):
        if strategy not in _STRATEGY_NAMES:
            raise OverlapConfigError(
                f"{path}: {where}: {strategy!r} is not fsdp-overlap's strategy; use 'fsdp_overlap'."
                f"{suggest(strategy, list(_STRATEGY_NAMES))}"
            )
        loaded.notes.append(f"{where}: {strategy} with every key at its default")
    elif isinstance(strategy, dict):
        class_path = strategy.get("class_path", "")
        if not isinstance(class_path, str) or not (
            class_path.startswith("fsdp_overlap_plugin") or class_path.rsplit(".", 1)[-1] == "FSDPOverlapStrategy"
        ):
            raise OverlapConfigError(
                f"{path}: {where}.class_path: {class_path!r} is not fsdp-overlap's strategy; "
                "use fsdp_overlap_plugin.lightning.FSDPOverlapStrategy."
            )
        init_args = strategy.get("init_args") or {}
        if not isinstance(init_args, dict):
            raise OverlapConfigError(f"{path}: {where}.init_args: expected a mapping, got {init_args!r}.")
    else:
        raise OverlapConfigError(f"{path}: {where}: expected 'fsdp_overlap' or a class_path mapping.")
    init_args = dict(init_args)
    base: dict = {}
    config_path = init_args.pop("config", None)
    if config_path is not None:
        candidates = [Path(config_path), path.parent / config_path]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise OverlapConfigError(
                f"{path}: {where}.init_args.config: file {str(config_path)!r} does not exist "
                f"(looked in the working directory and next to {path.name})."
            )
        base = read_yaml(found)
        inner = LoadedConfig(OverlapConfig(), path=str(found), shape="plugin")
        _build(inner, base)  # errors name the included file's own keys
        loaded.notes.append(f"plugin keys from {found}, overridden by {where}.init_args")
    names = {f.name for f in dataclasses.fields(OverlapConfig)}
    strategy_args = _strategy_arguments()
    for key in list(init_args):
        if key not in names and key in strategy_args:
            init_args.pop(key)  # a Lightning strategy argument (timeout, ...), not a plugin key
    if "param_dtype" not in init_args and "param_dtype" not in base:
        precision = trainer.get("precision")
        implied = _LIGHTNING_PRECISION.get(str(precision)) if precision is not None else None
        if implied in ("bf16", "fp16"):
            init_args["param_dtype"] = implied
            loaded.notes.append(f"param_dtype = {implied} from {section + '.' if section else ''}precision={precision}")
    else:
        precision = trainer.get("precision")
        implied = _LIGHTNING_PRECISION.get(str(precision)) if precision is not None else None
        explicit = init_args.get("param_dtype", base.get("param_dtype"))
        if implied and explicit and _canonical_dtype(explicit) != implied:
            loaded.warnings.append(
                f"{loaded.key('param_dtype')}={explicit} disagrees with {section + '.' if section else ''}"
                f"precision={precision} ({implied}); the strategy may reject this, align them."
            )
    loaded.config = _build(loaded, init_args, defaults=base)
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
    if isinstance(devices, int) and isinstance(nodes, int) and devices > 0:
        loaded.world = devices * nodes
    model = data.get("model")
    if isinstance(model, dict) and isinstance(model.get("class_path"), str):
        module, _, attr = model["class_path"].rpartition(".")
        loaded.model_spec = f"{module}:{attr}"
        loaded.model_kwargs = dict(model.get("init_args") or {})
    return loaded


def _strategy_arguments() -> set[str]:
    """Argument names of the Lightning strategy that are not plugin keys."""
    import inspect

    try:
        from fsdp_overlap_plugin.lightning import FSDPOverlapStrategy  # type: ignore[attr-defined]

        cls: Any = FSDPOverlapStrategy
    except ImportError:
        try:
            from lightning.pytorch.strategies import ModelParallelStrategy
        except ImportError:
            return set()
        cls = ModelParallelStrategy
    return {n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "kwargs")}


def _canonical_dtype(value: Any) -> str | None:
    from .config import parse_dtype

    try:
        return dtype_name(parse_dtype(value))
    except OverlapConfigError:
        return None


def _load_accelerate(path: Path, data: dict) -> LoadedConfig:
    loaded = LoadedConfig(OverlapConfig(), path=str(path), shape="accelerate", section="fsdp_config")
    loaded.prefix = "fsdp_overlap_"
    try:
        from accelerate.commands.config.config_args import ClusterConfig

        top = {f.name for f in dataclasses.fields(ClusterConfig)} | {"fp16", "dynamo_backend"}
    except ImportError:  # pragma: no cover - accelerate is a dependency
        top = set(data)
    for key in data:
        if key not in top:
            raise OverlapConfigError(
                f"{path}: unknown top-level key {key!r} (accelerate launch rejects it).{suggest(str(key), sorted(top))}"
                " Plugin keys go under fsdp_config as fsdp_overlap_<key>."
            )
    if "distributed_type" not in data:
        raise OverlapConfigError(f"{path}: distributed_type: missing (accelerate launch requires it; use FSDP).")
    fsdp = data.get("fsdp_config") or {}
    if not isinstance(fsdp, dict):
        raise OverlapConfigError(f"{path}: fsdp_config: expected a mapping, got {type(fsdp).__name__}.")
    names = [f.name for f in dataclasses.fields(OverlapConfig)]
    known_fsdp = _accelerate_fsdp_keys()
    plugin: dict[str, Any] = {}
    for key, value in fsdp.items():
        key = str(key)
        if key.startswith("fsdp_overlap_"):
            name = key[len("fsdp_overlap_") :]
            name = "overlap_grad_reduce" if name == "grad_reduce" else name
            if name not in names:
                spelled = [loaded.spell(n) for n in names]
                raise OverlapConfigError(
                    f"{path}: unknown key 'fsdp_config.{key}'.{suggest(key, spelled)} "
                    f"Valid plugin keys under fsdp_config: {', '.join(spelled)}."
                )
            if name in plugin:
                raise OverlapConfigError(
                    f"{path}: fsdp_config.{key}: {name} is set twice (fsdp_overlap_grad_reduce and "
                    "fsdp_overlap_overlap_grad_reduce are the same key); keep one."
                )
            plugin[name] = value
        else:
            spelled = key if key.startswith("fsdp") else "fsdp_" + key
            if known_fsdp and spelled not in known_fsdp:
                loaded.warnings.append(
                    f"fsdp_config.{key}: not an Accelerate FSDP key; accelerate launch drops it silently."
                    f"{suggest(spelled, sorted(known_fsdp))}"
                )
    mixed = data.get("mixed_precision")
    if mixed is False:  # an unquoted `no` is YAML 1.1 for false
        mixed = "no"
    if mixed is not None:
        mixed = str(mixed).lower()
        if mixed not in _ACCELERATE_MP:
            raise OverlapConfigError(
                f"{path}: mixed_precision: {data['mixed_precision']!r} is not supported by fsdp-overlap; "
                f"valid: no, bf16, fp16.{suggest(mixed, list(_ACCELERATE_MP))}"
            )
        implied = _ACCELERATE_MP[mixed]
        if implied is not None:
            if "param_dtype" not in plugin:
                plugin["param_dtype"] = implied
                loaded.notes.append(f"param_dtype = {implied} from mixed_precision: {mixed}")
            elif _canonical_dtype(plugin["param_dtype"]) != implied:
                loaded.warnings.append(
                    f"{loaded.key('param_dtype')}={plugin['param_dtype']} disagrees with mixed_precision: {mixed}; "
                    "align them."
                )
    reshard = fsdp.get("fsdp_reshard_after_forward", fsdp.get("reshard_after_forward"))
    if reshard is not None and "reshard_after_forward" not in plugin:
        value = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True}.get(str(reshard).upper(), reshard)
        if isinstance(value, bool):
            plugin["reshard_after_forward"] = value
            loaded.notes.append(f"reshard_after_forward = {str(value).lower()} from fsdp_reshard_after_forward")
    if fsdp.get("fsdp_activation_checkpointing") and "activation_checkpointing" not in plugin:
        loaded.notes.append(
            "fsdp_activation_checkpointing is on: which modules is decided at run time; "
            "set fsdp_overlap_activation_checkpointing to check them here"
        )
    loaded.config = _build(loaded, plugin)
    processes = data.get("num_processes")
    if isinstance(processes, int) and processes > 0:
        loaded.world = processes
    return loaded


def _accelerate_fsdp_keys() -> set[str]:
    try:
        from accelerate.commands.launch import launch_command_parser
    except ImportError:  # pragma: no cover
        return set()
    return {a.dest for a in launch_command_parser()._actions if a.dest.startswith("fsdp_")}


# ---------------------------------------------------------------------------- analysis
def _param_rows(module: nn.Module, config: OverlapConfig) -> dict[str, int]:
    """Counts and bytes of ``module``'s subtree: storage in each parameter's own dtype
    (distinct parameters), all-gather in param_dtype and reduce-scatter in reduce_dtype
    (per registration: a tied parameter is gathered once per module using it)."""
    distinct = {id(p): p for p in module.parameters()}.values()
    return {
        "params": sum(p.numel() for p in distinct),
        "storage_bytes": sum(p.numel() * p.element_size() for p in distinct),
        "gather_bytes": gather_bytes(module, config.torch_param_dtype),
        "reduce_bytes": gather_bytes(module, config.torch_reduce_dtype),
    }


def _bucket_rows(model: nn.Module, config: OverlapConfig, plan: list[list[str]]) -> list[dict[str, Any]]:
    rows = []
    for i, bucket in enumerate(plan):
        totals = {"params": 0, "storage_bytes": 0, "gather_bytes": 0, "reduce_bytes": 0}
        seen: set[int] = set()
        for fqn in bucket:
            sub = model.get_submodule(fqn)
            for p in sub.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    totals["params"] += p.numel()
                    totals["storage_bytes"] += p.numel() * p.element_size()
            totals["gather_bytes"] += gather_bytes(sub, config.torch_param_dtype)
            totals["reduce_bytes"] += gather_bytes(sub, config.torch_reduce_dtype)
        rows.append({"index": i, "modules": list(bucket), **totals})
    return rows


def analyze(
    model: nn.Module,
    config: OverlapConfig,
    *,
    world: int | None = None,
    small_bytes: int = SMALL_BUCKET_BYTES,
    loaded: LoadedConfig | None = None,
) -> dict[str, Any]:
    """Resolve the plan of ``config`` against ``model`` and say what it will move.

    Returns a JSON-serialisable dict: ``plan`` (source, buckets with modules, parameter
    count, storage / all-gather / reduce-scatter bytes), ``auto`` (the auto plan and its
    target), ``memory``, ``unbucketed`` parameters, and ``warnings`` (each with a
    ``kind``: unbucketed, large, small, no_params, ignored, config). Raises
    ``OverlapConfigError`` (plan, mesh or activation-checkpointing problems).
    """
    from .activation_checkpointing import checkpointed_modules
    from .parallelize import unbucketed_parameters

    loaded = loaded or LoadedConfig(config)
    warn_list: list[dict[str, Any]] = [{"kind": "config", "buckets": [], "message": m} for m in loaded.warnings]
    auto = auto_plan_info(model, config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PlanWarning)
        try:
            plan = resolve_plan(model, config)
        except OverlapConfigError as exc:
            raise OverlapConfigError(loaded.rename(str(exc))) from None
    for w in caught:
        if issubclass(w.category, PlanWarning):
            warn_list.append({"kind": "no_params", "buckets": [], "message": loaded.rename(str(w.message))})
    if config.bucket_plans != "auto" and config.bucket_bytes is not None:
        warn_list.append(
            {
                "kind": "ignored",
                "buckets": [],
                "message": f"{loaded.key('bucket_bytes')} is set but only read when bucket_plans is auto; it is ignored.",
            }
        )
    # The same resolver parallelize() uses (the listed modules, transformers' own switch, the policy).
    try:
        checkpointed, _ = checkpointed_modules(model, config)
    except OverlapConfigError as exc:
        raise OverlapConfigError(loaded.rename(str(exc))) from None
    rows = _bucket_rows(model, config, plan)
    sizes = [r["gather_bytes"] for r in rows]
    median = statistics.median(sizes) if sizes else 0
    for r in rows:
        if median and r["gather_bytes"] > LARGE_BUCKET_FACTOR * median:
            warn_list.append(
                {
                    "kind": "large",
                    "buckets": [r["index"]],
                    "message": (
                        f"bucket {r['index']} {r['modules']} gathers {format_bytes(r['gather_bytes'])}, "
                        f"{r['gather_bytes'] / median:.1f}x the median bucket ({format_bytes(median)}): it alone sets "
                        "the prefetch memory peak and its all-gather is the hardest to hide; split it."
                    ),
                }
            )
    small = [r for r in rows if r["gather_bytes"] < small_bytes]
    if small:
        listed = ", ".join(f"{r['index']} ({format_bytes(r['gather_bytes'])})" for r in small)
        warn_list.append(
            {
                "kind": "small",
                "buckets": [r["index"] for r in small],
                "message": (
                    f"{len(small)} of {len(rows)} buckets gather less than {format_bytes(small_bytes)}, where a "
                    f"collective's fixed latency outweighs its transfer time: {listed}. Merge neighbours "
                    "(a list entry, or bucket_bytes for auto) unless the model is a toy."
                ),
            }
        )
    unbucketed = unbucketed_parameters(model, plan)
    if unbucketed:
        params = dict(model.named_parameters(remove_duplicate=False))
        n = sum(params[name].numel() for name in unbucketed if name in params)
        warn_list.append(
            {
                "kind": "unbucketed",
                "buckets": [],
                "params": unbucketed,
                "message": (
                    f"{len(unbucketed)} parameters ({format_count(n)} elements) belong to no bucket and are gathered "
                    f"one by one, unprefetched: {', '.join(unbucketed[:6])}{', ...' if len(unbucketed) > 6 else ''}."
                ),
            }
        )
    shard = None
    replicate = config.mesh.replicate
    if world is not None:
        try:
            replicate, shard = config.mesh.sizes(world)
        except OverlapConfigError as exc:
            raise OverlapConfigError(loaded.rename(str(exc))) from None
    pairs = [(sizes[i] + sizes[i + 1], i) for i in range(len(sizes) - 1)]
    # the first pair wins a tie, so the answer does not move when identical blocks follow
    peak, first = max(pairs, key=lambda t: (t[0], -t[1])) if pairs else ((sizes[0], 0) if sizes else (0, 0))
    total_storage = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    memory = {
        "prefetch_peak_bytes": peak,
        "prefetch_peak_buckets": [first, first + 1] if pairs else [first],
        "all_gathered_bytes": sum(sizes),
        "sharded_storage_bytes_per_rank": -(-total_storage // shard) if shard else None,
        "shard_size": shard,
        "replicate": replicate if shard else None,
        "world": world,
    }
    plan_source = "auto" if config.bucket_plans == "auto" else "config"
    return {
        "plan": {"source": plan_source, "buckets": rows},
        "auto": {
            "buckets": auto.buckets,
            "bucket_bytes": auto.bucket_bytes,
            "target_bytes": auto.target_bytes,
            "target_source": auto.target_source,
            "container": auto.container,
            "blocks": auto.blocks,
        },
        "activation_checkpointing": checkpointed,
        "unbucketed": unbucketed,
        "memory": memory,
        "warnings": warn_list,
    }


def _bytes(params: list[torch.Tensor], dtype: torch.dtype | None) -> int:
    return sum(p.numel() * torch.empty((), dtype=dtype or p.dtype, device="meta").element_size() for p in params)


def module_tree(model: nn.Module, config: OverlapConfig, plan: list[list[str]], depth: int = 0) -> list[dict[str, Any]]:
    """Rows of the module tree down to the bucket level (and ``depth`` levels inside each
    bucket): modules containing buckets are expanded, bucketed modules are leaves.

    Each row: ``fqn``, ``type``, ``depth``, ``role`` ("container": holds buckets; "bucket":
    a plan entry; "inside": below a plan entry; "unbucketed"; "own": parameters held
    directly by a container, which no FQN can name), ``bucket`` and the byte counts.
    """
    owner = {fqn: i for i, bucket in enumerate(plan) for fqn in bucket}
    ancestors = {".".join(f.split(".")[:k]) for f in owner for k in range(1, f.count(".") + 1)} | {""}
    rows: list[dict[str, Any]] = []

    def visit(prefix: str, module: nn.Module, level: int, inherited: int | None, below: int) -> None:
        own = [p for p in module._parameters.values() if p is not None]
        if own and prefix in ancestors:
            names = ", ".join(n for n, p in module._parameters.items() if p is not None)
            rows.append(
                {
                    "fqn": f"{prefix}.({names})" if prefix else f"({names})",
                    "type": "own parameters",
                    "depth": level,
                    "role": "own",
                    "bucket": None,
                    "params": sum(p.numel() for p in own),
                    "storage_bytes": _bytes(own, None),
                    "gather_bytes": _bytes(own, config.torch_param_dtype),
                    "reduce_bytes": _bytes(own, config.torch_reduce_dtype),
                }
            )
        for name, child in module.named_children():
            if next(child.parameters(), None) is None:
                continue
            fqn = f"{prefix}.{name}" if prefix else name
            if fqn in ancestors:
                role, bucket = "container", None
            elif fqn in owner:
                role, bucket = "bucket", owner[fqn]
            elif inherited is not None:
                role, bucket = "inside", inherited
            else:
                role, bucket = "unbucketed", None
            rows.append(
                {"fqn": fqn, "type": type(child).__name__, "depth": level, "role": role, "bucket": bucket}
                | _param_rows(child, config)
            )
            if role == "container":
                visit(fqn, child, level + 1, None, 0)
            elif role in ("bucket", "inside") and below < depth:
                visit(fqn, child, level + 1, bucket, below + 1)

    visit("", model, 0, None, 0)
    return rows


def _dtype_label(dtype: torch.dtype | None, key: str, value: str | None, storage: list[str]) -> str:
    shown = dtype_name(dtype) if dtype is not None else "/".join(storage)
    if value is None:
        fallback = "param_dtype" if key == "reduce_dtype" and dtype is not None else "parameter dtype"
        return f"{shown} ({key}: null = {fallback})"
    return f"{shown} ({key}: {value})"


def _model_lines(info: dict[str, Any]) -> list[str]:
    where = (
        "on meta, no memory allocated for weights"
        if not info["non_meta_params"]
        else f"{info['non_meta_params']} parameters NOT on meta (the factory placed them on a device)"
    )
    lines = [f"model   {info['spec']} -> {info['class']} ({where})"]
    if info.get("config"):
        changed = [f"{k}={v}" for k, v in info["kwargs"].items()] + list(info.get("notes") or [])
        lines.append(
            f"        transformers config {info['config']}, model_type {info['model_type']}"
            + (f"; overrides: {', '.join(changed)}" if changed else "")
        )
    lines.append(
        f"        {info['params']:,} parameters ({format_count(info['params'])}), "
        f"{format_bytes(info['storage_bytes'])} in {'/'.join(info['storage_dtypes'])}"
    )
    return lines


def _dtype_lines(config: OverlapConfig, info: dict[str, Any]) -> list[str]:
    storage = info["storage_dtypes"]
    gather = _dtype_label(config.torch_param_dtype, "param_dtype", config.param_dtype, storage)
    reduce = _dtype_label(config.torch_reduce_dtype, "reduce_dtype", config.reduce_dtype, storage)
    return [f"bytes   storage {'/'.join(storage)} (parameter dtype) | all-gather {gather} | reduce-scatter {reduce}"]


def _runs(rows: list[dict[str, Any]], name, index, same: tuple[str, ...], expand: bool) -> list[list[dict[str, Any]]]:
    """Consecutive rows that differ only in a trailing block number (``blocks.0``, ``blocks.1``,
    ...) and their bucket index, grouped so a 80-layer model prints one line per run."""
    groups: list[list[dict[str, Any]]] = []
    for r in rows:
        prev = groups[-1][-1] if groups else None
        n, p = name(r), name(prev) if prev else None
        if (
            not expand
            and prev is not None
            and n is not None
            and p is not None
            and all(r[k] == prev[k] for k in same)
            and n.rpartition(".")[0] == p.rpartition(".")[0]
            and n.rpartition(".")[2].isdigit()
            and p.rpartition(".")[2].isdigit()
            and int(n.rpartition(".")[2]) == int(p.rpartition(".")[2]) + 1
            and index(r) is not None
            and index(prev) is not None
            and index(r) == index(prev) + 1
        ):
            groups[-1].append(r)
        else:
            groups.append([r])
    out: list[list[dict[str, Any]]] = []
    for g in groups:  # runs shorter than 4 print row by row
        out.extend([g] if len(g) >= 4 else [[r] for r in g])
    return out


def _run_label(group: list[dict[str, Any]], first: str, last: str) -> str:
    return first if len(group) == 1 else f"{first} .. {last} ({len(group)}x)"


def _bucket_lines(rows: list[dict[str, Any]], expand: bool = False) -> list[str]:
    table = [["bucket", "modules", "params", "storage", "all-gather", "reduce-scatter"]]
    one = lambda r: r["modules"][0] if len(r["modules"]) == 1 else None  # noqa: E731
    same = ("params", "storage_bytes", "gather_bytes", "reduce_bytes")
    for g in _runs(rows, one, lambda r: r["index"], same, expand):
        r = g[0]
        each = "" if len(g) == 1 else " each"
        table.append(
            [
                str(r["index"]) if len(g) == 1 else f"{r['index']}-{g[-1]['index']}",
                _run_label(g, ", ".join(r["modules"]), ", ".join(g[-1]["modules"])),
                f"{r['params']:,}",
                format_bytes(r["storage_bytes"]) + each,
                format_bytes(r["gather_bytes"]) + each,
                format_bytes(r["reduce_bytes"]) + each,
            ]
        )
    return _table(table, right={0, 2, 3, 4, 5})


def _tree_lines(tree: list[dict[str, Any]], expand: bool = False) -> list[str]:
    table = [["module", "type", "params", "storage", "all-gather", "reduce-scatter", "bucket"]]
    name = lambda r: r["fqn"] if r["role"] == "bucket" else None  # noqa: E731
    same = ("type", "depth", "params", "storage_bytes", "gather_bytes", "reduce_bytes")
    for g in _runs(tree, name, lambda r: r["bucket"], same, expand):
        r = g[0]
        bucket = {"container": "", "unbucketed": "none", "own": "none"}.get(r["role"], str(r["bucket"]))
        each = "" if len(g) == 1 else " each"
        table.append(
            [
                "  " * r["depth"] + _run_label(g, r["fqn"], g[-1]["fqn"]),
                r["type"],
                f"{r['params']:,}",
                format_bytes(r["storage_bytes"]) + each,
                format_bytes(r["gather_bytes"]) + each,
                format_bytes(r["reduce_bytes"]) + each,
                bucket if len(g) == 1 else f"{r['bucket']}-{g[-1]['bucket']}",
            ]
        )
    return _table(table, right={2, 3, 4, 5, 6}, indent="")


def _memory_lines(result: dict[str, Any], config: OverlapConfig) -> list[str]:
    m = result["memory"]
    out = []
    if m["sharded_storage_bytes_per_rank"] is not None:
        mesh = f"{m['replicate']} x {m['shard_size']}" if m["replicate"] > 1 else str(m["shard_size"])
        out.append(
            f"memory  {m['world']} ranks (mesh {mesh}): {format_bytes(m['sharded_storage_bytes_per_rank'])} of "
            "parameters per rank (sharded)"
        )
    if config.reshard_after_forward:
        pair = "-".join(str(i) for i in m["prefetch_peak_buckets"])
        out.append(
            f"{'memory' if not out else '':<8}prefetch holds at most 2 buckets gathered at once: peak "
            f"{format_bytes(m['prefetch_peak_bytes'])} (buckets {pair}), unsharded, in param_dtype"
        )
    else:
        out.append(
            f"{'memory' if not out else '':<8}reshard_after_forward is off: after forward every bucket stays "
            f"gathered, {format_bytes(m['all_gathered_bytes'])} unsharded"
        )
    return out


def _warning_lines(result: dict[str, Any]) -> list[str]:
    if not result["warnings"]:
        return ["warnings: none"]
    return [f"warnings ({len(result['warnings'])}):"] + [
        f"  - [{w['kind']}] {w['message']}" for w in result["warnings"]
    ]


def _auto_lines(result: dict[str, Any], config: OverlapConfig) -> list[str]:
    auto = result["auto"]
    source = {
        "bucket_bytes": "bucket_bytes",
        "median block": "one block, the median; bucket_bytes: null",
        "default (no repeated blocks)": "no repeated blocks; bucket_bytes: null",
    }[auto["target_source"]]
    blocks = auto["blocks"]
    shown = f"{blocks[0]} .. {blocks[-1]} ({len(blocks)})" if len(blocks) > 2 else ", ".join(blocks)
    head = f"auto plan: {len(auto['buckets'])} buckets"
    head += f"; repeated blocks {shown}, one bucket each" if blocks else "; no repeated blocks"
    head += f"; other modules grouped to {format_bytes(auto['target_bytes'])} ({source})"
    return [head]


# ---------------------------------------------------------------------------- commands
def cmd_inspect(args: argparse.Namespace) -> tuple[int, dict[str, Any], list[str]]:
    loaded = load_config(args.config)
    config = loaded.config
    model, info = load_model(args.model, args.model_arg)
    result = analyze(model, config, world=args.world or loaded.world, small_bytes=args.small_bytes, loaded=loaded)
    plan = [r["modules"] for r in result["plan"]["buckets"]]
    tree = module_tree(model, config, plan, depth=args.depth)
    auto_rows = _bucket_rows(model, config, result["auto"]["buckets"])
    out = {
        "command": "inspect",
        "model": info,
        "config": {"path": loaded.path, "shape": loaded.shape, "values": config.to_dict(), "notes": loaded.notes},
        "dtypes": {
            "storage": info["storage_dtypes"],
            "gather": dtype_name(config.torch_param_dtype),
            "reduce": dtype_name(config.torch_reduce_dtype),
        },
        "tree": tree,
        "auto_plan": dict(result["auto"], buckets=auto_rows),
        "plan": result["plan"],
        "memory": result["memory"],
        "warnings": result["warnings"],
    }
    lines = _model_lines(info)
    if loaded.path:
        lines.append(f"config  {loaded.path} ({loaded.shape})" + "".join(f"; {n}" for n in loaded.notes))
    lines += _dtype_lines(config, info)
    lines.append("")
    lines += _tree_lines(tree, args.expand)
    lines.append("")
    lines += _auto_lines(result, config)
    lines += _bucket_lines(auto_rows, args.expand)
    if result["plan"]["source"] == "config":
        lines.append(
            f"the config's own bucket_plans ({len(plan)} buckets) is in the bucket column above; "
            "fsdp-overlap check lists it"
        )
    lines += _memory_lines(result, config)
    lines += _warning_lines(result)
    return 0, out, lines


def cmd_check(args: argparse.Namespace) -> tuple[int, dict[str, Any], list[str]]:
    loaded = load_config(args.config)
    config = loaded.config
    out: dict[str, Any] = {
        "command": "check",
        "ok": True,
        "config": {
            "path": loaded.path,
            "shape": loaded.shape,
            "section": loaded.section,
            "values": config.to_dict(),
            "notes": loaded.notes,
        },
    }
    shape = {"plugin": "plugin YAML", "lightning": "LightningCLI YAML", "accelerate": "Accelerate YAML"}[loaded.shape]
    where = f", keys under {loaded.section}" + (f" as {loaded.prefix}<key>" if loaded.prefix else "")
    lines = [f"config  {loaded.path} ({shape}{where if loaded.section else ''}): keys valid"]
    lines += [f"        {n}" for n in loaded.notes]
    spec, model_args = args.model, list(args.model_arg or [])
    if spec is None and loaded.model_spec is not None:
        spec = loaded.model_spec
        model_args = [f"{k}={json.dumps(v)}" for k, v in loaded.model_kwargs.items()] + model_args
        lines.append(f"        model from model.class_path: {spec}")
    if spec is None:
        out["warnings"] = [{"kind": "config", "buckets": [], "message": m} for m in loaded.warnings]
        lines.append("model   none given (--model): keys checked, plan not resolved")
        lines += _warning_lines(out)
        return (1 if args.strict and out["warnings"] else 0), out, lines
    model, info = load_model(spec, model_args)
    result = analyze(model, config, world=args.world or loaded.world, small_bytes=args.small_bytes, loaded=loaded)
    out.update(
        {
            "model": info,
            "plan": result["plan"],
            "auto_plan": result["auto"],
            "activation_checkpointing": result["activation_checkpointing"],
            "unbucketed": result["unbucketed"],
            "memory": result["memory"],
            "warnings": result["warnings"],
        }
    )
    lines += _model_lines(info) + _dtype_lines(config, info)
    rows = result["plan"]["buckets"]
    if result["plan"]["source"] == "auto":
        lines += _auto_lines(result, config)
    else:
        lines.append(f"plan    {len(rows)} buckets from {loaded.key('bucket_plans')}")
    lines += _bucket_lines(rows, args.expand)
    if result["activation_checkpointing"]:
        lines.append(
            f"activation checkpointing ({config.activation_checkpointing_policy}): "
            f"{', '.join(result['activation_checkpointing'])}"
        )
    lines += _memory_lines(result, config)
    lines += _warning_lines(result)
    passes = [name for name in ("manual_bucketing", "overlap_grad_reduce") if getattr(config, name)]
    lines.append(
        f"OK: {len(rows)} buckets, {_plural(len(result['warnings']), 'warning')}; "
        + (
            f"passes on: {', '.join(passes) or 'none'}"
            if config.compile
            else "compile: false (eager fully_shard per bucket)"
        )
    )
    return (1 if args.strict and result["warnings"] else 0), out, lines


# ----------------------------------------------------------------------------- explain
def _bucket_label(plan: list[list[str]] | None, bucket: int | None, module: str | None) -> str:
    if bucket is None:
        return f"unbucketed ({module})" if module else "unbucketed"
    if plan and 0 <= bucket < len(plan):
        return f"bucket {bucket} [{', '.join(plan[bucket])}]"
    return f"bucket {bucket}"


def summarize_schedule(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (bucket, collective kind): launch and wait positions in graph order, and the
    compute that lies between each launch and its wait (what can hide it).

    A wait is matched to its launch by ``of`` (the launch's ``name``). Compute between
    launch and wait is summed over the union of a group's launch-wait intervals, so a
    compute item is counted once per group even when several collectives span it.
    """
    launches: dict[str, int] = {}
    waits: dict[str, int] = {}
    for i, item in enumerate(items):
        if item.get("op") in _COLLECTIVES:
            launches[str(item.get("name") or f"#{i}")] = i
        elif item.get("op") == "wait" and item.get("of") is not None:
            waits.setdefault(item["of"], i)
    groups: dict[tuple, dict[str, Any]] = {}
    for name, li in launches.items():
        item = items[li]
        key = (item.get("bucket") if item.get("bucket") is not None else ("module", item.get("module")), item["op"])
        g = groups.setdefault(
            key,
            {
                "bucket": item.get("bucket"),
                "module": item.get("module") if item.get("bucket") is None else None,
                "op": item["op"],
                "launches": [],
                "waits": [],
                "bytes": 0,
                "unwaited": [],
            },
        )
        g["launches"].append(li)
        g["bytes"] += int(item.get("bytes") or 0)
        wi = waits.get(name)
        if wi is None:
            g["unwaited"].append(name)
        else:
            g["waits"].append(wi)
    out = []
    for g in groups.values():
        covered: set[int] = set()
        for li in g["launches"]:
            wi = waits.get(str(items[li].get("name") or f"#{li}"), li)
            covered.update(range(li + 1, wi))
        between = [items[i] for i in sorted(covered) if items[i].get("op") == "compute"]
        g["compute_between_flops"] = sum(int(c.get("flops") or 0) for c in between)
        g["compute_between_items"] = len(between)
        g["overlapped"] = bool(between)
        out.append(g)
    out.sort(key=lambda g: min(g["launches"]))
    return out


def _positions(idx: list[int]) -> str:
    if not idx:
        return "-"
    if len(idx) <= 4:
        return ",".join(f"#{i}" for i in idx)
    return f"#{idx[0]}..#{idx[-1]} ({len(idx)})"


def explain_report(report: dict[str, Any], graphs: tuple[str, ...] = _GRAPHS) -> dict[str, Any]:
    """The per-bucket order of launches and waits of each graph, before and after the passes."""
    if not isinstance(report, dict) or not any(k in report for k in _GRAPHS):
        raise CliError("not a schedule report: expected a JSON object with 'forward' / 'backward' graph records.")
    out: dict[str, Any] = {"plan": report.get("plan"), "graphs": {}}
    for kind in graphs:
        record = report.get(kind)
        if record is None:
            out["graphs"][kind] = {"compiled": False, "has_schedule": False}
            continue
        schedule = record.get("schedule")
        entry: dict[str, Any] = {
            "compiled": True,
            "has_schedule": isinstance(schedule, dict),
            "counts": {"before": record.get("before"), "after": record.get("after")},
            "from_cache": bool(record.get("from_cache")),
        }
        if isinstance(schedule, dict):
            for phase in ("before", "after"):
                items = schedule.get(phase) or []
                if not isinstance(items, list) or not all(isinstance(i, dict) and "op" in i for i in items):
                    raise CliError(f"{kind}.schedule.{phase}: expected a list of items with an 'op' key.")
                entry[phase] = {"items": items, "buckets": summarize_schedule(items)}
        out["graphs"][kind] = entry
    return out


def _explain_lines(report: dict[str, Any], result: dict[str, Any], sequence: bool) -> list[str]:
    plan = result.get("plan")
    lines = []
    if "mode" in report:
        on = [n for n, v in (report.get("passes") or {}).items() if v]
        lines.append(
            f"report  {report.get('mode')}, world {report.get('world_size')}, backend {report.get('backend')}, "
            f"passes: {', '.join(on) or 'none'}"
        )
    if plan:
        lines.append(f"plan    {len(plan)} buckets: " + "  ".join(f"{i} [{', '.join(b)}]" for i, b in enumerate(plan)))
    for kind, entry in result["graphs"].items():
        lines.append("")
        if not entry["compiled"]:
            lines.append(f"{kind}: no record (not compiled yet when the report was written)")
            continue
        if not entry["has_schedule"]:
            counts = entry["counts"]
            shown = ""
            if counts.get("before") and counts.get("after"):
                shown = "; counts only: " + ", ".join(
                    f"{k} {counts['before'].get(k, 0)} -> {counts['after'].get(k, 0)}"
                    for k in ("all_gather", "reduce_scatter", "all_reduce", "wait")
                )
            lines.append(
                f"{kind}: this record has no 'schedule' (the per-node order before and after the passes); it was "
                f"written by a version of fsdp-overlap without it{shown}"
            )
            continue
        cache = " (record from the FX graph cache)" if entry["from_cache"] else ""
        lines.append(f"{kind} graph{cache}")
        for phase in ("before", "after"):
            groups = entry[phase]["buckets"]
            parts = []
            for op in _COLLECTIVES:
                mine = [g for g in groups if g["op"] == op]
                if not mine:
                    continue
                launches = sum(len(g["launches"]) for g in mine)
                exposed = sum(g["bytes"] for g in mine if not g["overlapped"])
                parts.append(
                    f"{op} {launches} launches in {len(mine)} buckets, {sum(g['overlapped'] for g in mine)} with compute "
                    f"before their wait, {format_bytes(exposed)} of {format_bytes(sum(g['bytes'] for g in mine))} exposed"
                )
            lines.append(
                f"  {phase + ' the passes:':<19}{len(entry[phase]['items'])} items; {'; '.join(parts) or 'no collectives'}"
            )
        lines.append("  per bucket (#n = position in graph order; compute between launch and wait can hide it):")
        keyed: dict[tuple, dict[str, Any]] = {}
        for phase in ("before", "after"):
            for g in entry[phase]["buckets"]:
                key = (g["bucket"] if g["bucket"] is not None else ("m", g["module"]), g["op"])
                keyed.setdefault(key, {})[phase] = g
        for (_, op), phases in keyed.items():
            any_g = phases.get("after") or phases.get("before")
            lines.append(f"    {_bucket_label(plan, any_g['bucket'], any_g['module'])}  {op}")
            for phase in ("before", "after"):
                g = phases.get(phase)
                if g is None:
                    lines.append(f"      {phase + ':':<8}none")
                    continue
                n = g["compute_between_items"]
                hidden = (
                    f"{format_flops(g['compute_between_flops'])} of compute in between ({n} item{'s' if n != 1 else ''})"
                    if g["overlapped"]
                    else "nothing in between: exposed"
                )
                unwaited = f"; never waited in this graph: {len(g['unwaited'])}" if g["unwaited"] else ""
                lines.append(
                    f"      {phase + ':':<8}{len(g['launches'])} launch{'es' if len(g['launches']) != 1 else ''} "
                    f"{_positions(g['launches'])}, wait{'s' if len(g['waits']) != 1 else ''} "
                    f"{_positions(sorted(g['waits']))}, "
                    f"{format_bytes(g['bytes'])}; {hidden}{unwaited}"
                )
        if sequence:
            for phase in ("before", "after"):
                lines.append(f"  {kind} {phase} the passes, in graph order:")
                table = [["#", "op", "name", "bucket", "module", "bytes", "flops", "waits on"]]
                for i, item in enumerate(entry[phase]["items"]):
                    table.append(
                        [
                            str(i),
                            item["op"],
                            str(item.get("name") or ""),
                            "" if item.get("bucket") is None else str(item["bucket"]),
                            str(item.get("module") or ""),
                            format_bytes(item.get("bytes") or 0) if item.get("bytes") else "",
                            format_flops(item.get("flops") or 0) if item.get("flops") else "",
                            str(item.get("of") or ""),
                        ]
                    )
                lines += _table(table, right={0, 3, 5, 6}, indent="    ")
    return lines


def _load_report(text: str) -> tuple[Path, dict]:
    path = Path(text)
    if not path.is_file():
        raise CliError(f"report {str(path)!r} does not exist.")
    try:
        return path, json.loads(path.read_text())
    except ValueError as exc:
        raise CliError(f"{path}: not valid JSON ({exc}).") from None


def cmd_explain(args: argparse.Namespace) -> tuple[int, dict[str, Any], list[str]]:
    path, report = _load_report(args.report)
    graphs = tuple(args.graph) if args.graph else _GRAPHS
    result = explain_report(report, graphs)
    out = {"command": "explain", "report": str(path), **result}
    lines = _explain_lines(report, result, args.sequence)
    code = 0
    if not any(g.get("has_schedule") for g in result["graphs"].values()):
        lines.append("")
        lines.append(
            "nothing to explain: no graph record carries a 'schedule'. Write the report with "
            "json.dump(schedule_report(model), f) from a version of fsdp-overlap that records it."
        )
        code = 1
    if args.png:
        from . import report as report_module

        draw = getattr(report_module, "draw_timeline", None)
        if draw is None:
            lines.append(
                f"--png: cannot draw {args.png}: this fsdp_overlap_plugin has no report.draw_timeline (the "
                "timeline picture comes with the evidence feature). The text above is the same schedule."
            )
            out["png"] = None
            code = 1
        else:
            try:
                draw(report, args.png)
            except ImportError as exc:
                lines.append(
                    f"--png: cannot draw {args.png}: {exc}. Install matplotlib: pip install 'fsdp-overlap-plugin[viz]'."
                )
                out["png"] = None
                code = 1
            else:
                lines.append(f"timeline written to {args.png}")
                out["png"] = str(args.png)
    return code, out, lines


def _rate_arg(text: str) -> float:
    """'300mbit' / '1gbit' (bits per second) or '25gb' / '500mb' (bytes per second) -> bytes/s."""
    lowered = text.strip().lower()
    for suffix, scale in (("gbit", 1e9 / 8), ("mbit", 1e6 / 8), ("gb", 1e9), ("mb", 1e6)):
        if lowered.endswith(suffix):
            try:
                return float(lowered[: -len(suffix)]) * scale
            except ValueError:
                break
    try:
        return float(lowered)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r} (e.g. 300mbit, 1gbit, 25gb)") from None


def cmd_timeline(args: argparse.Namespace) -> tuple[int, dict[str, Any], list[str]]:
    from .report import DEFAULT_RATES, draw_timeline, predicted

    path, report = _load_report(args.report)
    rates = dict(DEFAULT_RATES.get(report.get("device_type") or "cpu", DEFAULT_RATES["cpu"]))
    for key in ("flops", "mem", "link"):
        if getattr(args, key) is not None:
            rates[key] = getattr(args, key)
    try:
        draw_timeline(report, args.out, rates)
    except ValueError as exc:
        raise CliError(f"{path}: {exc}") from None
    except ImportError as exc:
        return 1, {"command": "timeline", "png": None, "error": str(exc)}, [f"cannot draw {args.out}: {exc}"]
    numbers = predicted(report, rates)
    lines = [
        f"rates: {rates['flops']:.3g} FLOP/s compute, {rates['mem']:.3g} B/s memory, "
        f"{rates['link'] * 8 / 1e6:.0f} Mbit/s link (a model for comparing schedules, not a measurement)"
    ]
    for kind, phases in numbers.items():
        b, a = phases["before"], phases["after"]
        lines.append(
            f"{kind}: predicted {b['total_s'] * 1e3:.1f} -> {a['total_s'] * 1e3:.1f} ms; exposed communication "
            f"{b['exposed_comm_s'] * 1e3:.1f} -> {a['exposed_comm_s'] * 1e3:.1f} ms"
        )
    lines.append(f"timeline written to {args.out}")
    return 0, {"command": "timeline", "png": str(args.out), "rates": rates, "predicted": numbers}, lines


# --------------------------------------------------------------------------------- main
def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for the model factory, or a config field for hf:, value read as YAML "
        "(repeatable): --model-arg n_layer=48",
    )
    p.add_argument("--world", type=int, default=None, help="world size, to check the mesh and show memory per rank")
    p.add_argument(
        "--small-bytes",
        type=_size_arg,
        default=SMALL_BUCKET_BYTES,
        metavar="SIZE",
        help=f"warn on buckets gathering less than this (default {format_bytes(SMALL_BUCKET_BYTES)}; see docs/tuning.md)",
    )
    p.add_argument("--expand", action="store_true", help="one line per block (text only; --json always has all)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _size_arg(text: str) -> int:
    from .config import parse_bytes

    try:
        value = parse_bytes(text, "--small-bytes")
    except OverlapConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    assert value is not None
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-overlap",
        description="Inspect, check and explain fsdp-overlap bucket plans, on the meta device, with no GPU.",
        epilog="Exit codes: 0 ok, 1 --strict with warnings or nothing to explain/draw, 2 bad config, model or report.",
    )
    parser.add_argument("--version", action="version", version=f"fsdp-overlap {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{inspect,check,explain,timeline}")

    p = sub.add_parser("inspect", help="module tree with bytes per bucket candidate, and the auto plan")
    p.add_argument(
        "model",
        metavar="MODEL",
        help="package.module:factory (e.g. fsdp_overlap_plugin.models.gpt:gpt_1b) or hf:path/to/config.json",
    )
    p.add_argument("--config", default=None, help="a plugin, LightningCLI or Accelerate YAML (dtypes, bucket_bytes)")
    p.add_argument("--depth", type=int, default=0, help="also show N levels inside each bucketed module")
    _add_model_args(p)

    p = sub.add_parser("check", help="validate a YAML and resolve its plan against a model")
    p.add_argument("config", metavar="CONFIG", help="a plugin, LightningCLI or Accelerate YAML")
    p.add_argument(
        "--model",
        default=None,
        help="package.module:factory or hf:path/to/config.json (default: model.class_path of a LightningCLI YAML)",
    )
    p.add_argument("--strict", action="store_true", help="exit 1 when there is any warning")
    _add_model_args(p)

    p = sub.add_parser("explain", help="per-bucket launches and waits before/after the passes, from a report JSON")
    p.add_argument("report", metavar="REPORT.json", help="json.dump(schedule_report(model)) output")
    p.add_argument("--graph", action="append", choices=_GRAPHS, help="only this graph (repeatable)")
    p.add_argument("--sequence", action="store_true", help="also print every item in graph order")
    p.add_argument(
        "--png", default=None, metavar="OUT.png", help="draw the timeline (needs report.draw_timeline and matplotlib)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    p = sub.add_parser("timeline", help="draw predicted compute/communication lanes before/after the passes (PNG)")
    p.add_argument("report", metavar="REPORT.json", help="json.dump(schedule_report(model)) output")
    p.add_argument("--out", default="timeline.png", help="PNG to write (default timeline.png)")
    p.add_argument("--flops", type=float, default=None, help="compute FLOP/s (default: by the report's device type)")
    p.add_argument("--mem", type=float, default=None, help="memory bytes/s")
    p.add_argument("--link", type=_rate_arg, default=None, help="link rate per rank: 300mbit, 1gbit, 25gb (bytes)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (0, 1 or 2)."""
    args = build_parser().parse_args(argv)
    command = {"inspect": cmd_inspect, "check": cmd_check, "explain": cmd_explain, "timeline": cmd_timeline}[
        args.command
    ]
    try:
        code, out, lines = command(args)
    except (OverlapConfigError, CliError) as exc:
        message = str(exc)
        if args.json:
            print(json.dumps({"command": args.command, "ok": False, "error": message}))
        print(f"fsdp-overlap {args.command}: error: {message}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, default=str))
    else:
        print("\n".join(lines))
    return code


if __name__ == "__main__":
    sys.exit(main())
