"""``MODEL`` specs: ``package.module:factory`` (or ``path/to/file.py:factory``) called under
``torch.device("meta")``, or ``hf:path/to/config.json``, the transformers model a local
config describes, built on meta, nothing downloaded. Every problem is a ``CliError``
naming the spec, file or field."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from ..config.keys import suggest
from ..config.parse import dtype_name
from .errors import CliError

__all__ = [
    "HF_PREFIX",
    "SequenceLimit",
    "load_hf_model",
    "load_model",
    "max_sequence_length",
    "parse_model_spec",
    "sequence_length",
    "unaccepted_kwargs",
]


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


def _factory(module_name: str, attr: str) -> Any:
    mod = _import(module_name)
    factory: Any = mod
    for part in attr.split("."):
        if not hasattr(factory, part):
            names = [n for n in dir(factory) if not n.startswith("_") and callable(getattr(factory, n, None))]
            raise CliError(f"model: {module_name!r} has no attribute {attr!r}.{suggest(part, names)}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise CliError(f"model: {module_name}:{attr} is not callable.")
    return factory


def unaccepted_kwargs(spec: str, names: list[str]) -> list[str] | None:
    """Which of ``names`` the factory (or class) ``spec`` names takes no keyword argument
    for; ``[]`` when it takes them all, None when that cannot be told (an ``hf:`` spec, no
    signature, ``**kwargs``). Imports the module, calls nothing."""
    if spec.startswith(HF_PREFIX):
        return None
    module_name, attr, _, _ = parse_model_spec(spec)
    try:
        params = inspect.signature(_factory(module_name, attr)).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None  # **kwargs: only a call tells
    takes = {
        p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return [n for n in names if n not in takes]


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
    factory = _factory(module_name, attr)
    with torch.device("meta"):
        try:
            model = factory(*args, **kwargs)
        except TypeError as exc:
            hint = ""
            try:
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
    from ..shard import hf

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
        "factory": "fsdp_overlap_plugin.shard.hf:model_from_config",
        "args": [],
        "kwargs": overrides,
        "config": str(file),
        "model_type": data["model_type"],
        "architecture": names[0] if names else None,
        "notes": notes,
    }
    return model, _describe(model, info)


class SequenceLimit(NamedTuple):
    """The most tokens per sequence a model takes, what sets it (for messages), the
    ``--model-arg`` key that raises it, and whether a longer sequence cannot run at all (a
    learned position table indexed past its rows: an out-of-bounds index in a kernel) or
    only leaves what the model was built for (rotary positions are computed for any length)."""

    tokens: int
    source: str
    key: str
    hard: bool = True


# transformers configs spell the longest sequence one of these ways (GPT-2: n_positions,
# which its attribute_map also answers as max_position_embeddings)
_HF_POSITION_KEYS = ("max_position_embeddings", "n_positions")


def max_sequence_length(model: nn.Module) -> SequenceLimit | None:
    """The most tokens per sequence ``model`` takes: the repo GPT's ``block_size`` (the rows
    of its position table), a transformers config's ``max_position_embeddings`` or
    ``n_positions``; None when the model says neither. The first module (in
    ``model.modules()`` order) that says decides, so a LightningModule holding a GPT gives
    the GPT's."""
    from ..models.gpt import GPT

    for module in model.modules():
        if isinstance(module, GPT):
            return SequenceLimit(module.cfg.block_size, "its block_size, the rows of its position table", "block_size")
        config = getattr(module, "config", None)
        for key in _HF_POSITION_KEYS:
            value = getattr(config, key, None) if config is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                if _position_table(module, value):
                    return SequenceLimit(value, f"{key} in its config, the rows of its position table", key)
                return SequenceLimit(value, f"{key} in its config", key, hard=False)
    return None


def _position_table(model: nn.Module, positions: int) -> bool:
    """``model`` holds a learned position embedding of ``positions`` rows (OPT's has 2 more)."""
    return any(
        isinstance(m, nn.Embedding) and m.num_embeddings in (positions, positions + 2) and ("pos" in n or "wpe" in n)
        for n, m in model.named_modules()
    )


def sequence_length(seq: int | None, model: nn.Module, spec: str, default: int) -> tuple[int, str | None]:
    """The tokens per sequence a command runs or predicts with, and a line saying why when
    it is not what the user asked for: ``seq`` (``--seq``) as given, a ``CliError`` naming
    the model's limit when it is longer; without ``--seq``, ``default`` cut to the model's
    limit."""
    limit = max_sequence_length(model)
    if seq is not None:
        if limit is not None and seq > limit.tokens and not limit.hard:
            return seq, (
                f"seq     {seq} tokens per sequence, more than the {limit.tokens} of {limit.source}: its positions "
                "are computed, not a table, so it runs; what it learnt past that length depends on the model"
            )
        if limit is not None and seq > limit.tokens:
            raise CliError(
                f"--seq {seq}: model {spec} takes at most {limit.tokens} tokens per sequence ({limit.source}); "
                f"pass --seq {limit.tokens} or less, or build it longer with --model-arg {limit.key}={seq}"
            )
        return seq, None
    if limit is not None and limit.tokens < default:
        return limit.tokens, (
            f"seq     {limit.tokens} tokens per sequence, the model's most ({limit.source}), not the default "
            f"{default} (--seq sets it)"
        )
    return default, None
