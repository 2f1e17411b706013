"""What one YAML file says: an Accelerate config (the plugin's keys under ``fsdp_config``,
checked by Accelerate's own loader first) or a plain plugin YAML, split into the plugin's
values and the Accelerate keys the plugin also reads. An unknown key is an error, never
dropped (the launcher would drop it silently)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from .._accelerate_compat import launch_parser_actions
from ..config.keys import unknown_key_message
from ..config.parse import read_yaml
from ..config.schema import OverlapConfig, OverlapConfigError
from .keys import PREFIX, field_for, key_for, plugin_keys

__all__ = [
    "ACCELERATE_KEYS",
    "FileSettings",
    "check_with_accelerate",
    "file_settings",
    "is_accelerate_yaml",
    "read_config_file",
    "split_accelerate_yaml",
]


@dataclass
class FileSettings:
    """What one YAML file says: the plugin's values (unprefixed keys) and Accelerate's
    keys that the plugin also reads. ``accelerate_format`` is False for a plain plugin
    YAML (``configs/plugin.yaml``: the ``OverlapConfig`` keys at top level)."""

    plugin: dict[str, Any]
    accelerate: dict[str, Any]
    source: str
    accelerate_format: bool
    world: int | None = None
    """``num_processes``: the ranks ``accelerate launch`` starts (unless its command line says otherwise)."""
    machines: int | None = None
    """``num_machines``, when the file has it."""


def _known_accelerate_fsdp_keys() -> set[str]:
    keys = {a.dest for a in launch_parser_actions() if a.dest.startswith("fsdp_")}
    return keys | {"fsdp_ignored_modules"}  # read by the launcher through getattr, not an option


#: The keys of Accelerate's ``parallelism_config`` YAML section (the launcher's options).
_PARALLELISM_KEYS = (
    "parallelism_config_dp_replicate_size",
    "parallelism_config_dp_shard_size",
    "parallelism_config_tp_size",
    "parallelism_config_cp_size",
    "parallelism_config_cp_backend",
    "parallelism_config_cp_comm_strategy",
    "parallelism_config_sp_size",
    "parallelism_config_sp_backend",
    "parallelism_config_sp_seq_length",
    "parallelism_config_sp_seq_length_is_variable",
    "parallelism_config_sp_attn_implementation",
)

#: Top-level keys that make a YAML an Accelerate config (else it is a plain plugin YAML).
ACCELERATE_KEYS = ("distributed_type", "fsdp_config", "compute_environment")


def is_accelerate_yaml(data: dict) -> bool:
    return bool(set(data) & set(ACCELERATE_KEYS))


def check_with_accelerate(data: dict, source: str) -> None:
    """Accelerate's own verdict on the file, before any worker starts: what
    ``accelerate launch --config_file`` does with it (``load_config_from_file``: the config
    class for its ``compute_environment``, ``process_config``, unknown top-level keys, the
    enum values), run on a copy, with its refusals turned into errors that name the key."""
    import copy

    from accelerate.commands.config.config_args import ClusterConfig, SageMakerConfig
    from accelerate.utils import ComputeEnvironment

    names = [f.name for f in dataclasses.fields(OverlapConfig)]
    misplaced = [k for k in data if str(k).startswith(PREFIX) or k in names]
    if misplaced:
        raise OverlapConfigError(
            f"{source}: {misplaced[0]!r} is a top-level key; fsdp-overlap keys go under fsdp_config as "
            f"fsdp_overlap_<name> (accelerate launch rejects unknown top-level keys)."
        )
    environment = data.get("compute_environment", ComputeEnvironment.LOCAL_MACHINE)
    cls = ClusterConfig if environment == ComputeEnvironment.LOCAL_MACHINE else SageMakerConfig
    if "distributed_type" not in data:
        raise OverlapConfigError(f"{source}: distributed_type: missing; accelerate launch requires it (use FSDP).")
    processed = cls.process_config(copy.deepcopy(data))
    known = sorted(cls.__dataclass_fields__)
    unknown = sorted(set(processed) - set(known), key=str)
    if unknown:
        key = str(unknown[0])
        raise OverlapConfigError(
            unknown_key_message(
                key,
                known,
                source=source,
                what="top-level key",
                reason=" (accelerate launch rejects it)",
                tail="Plugin keys go under fsdp_config as fsdp_overlap_<key>.",
            )
        )
    mixed = data.get("mixed_precision")
    if mixed is not None and not isinstance(mixed, str):
        hint = " (an unquoted no is YAML for false: write 'no' in quotes)" if mixed is False else ""
        raise OverlapConfigError(
            f"{source}: mixed_precision: {mixed!r} is not a string{hint}; accelerate launch crashes on it "
            "('bool' object has no attribute 'lower'). Valid: 'no', bf16, fp16."
        )
    try:
        cls(**processed)  # its __post_init__ reads the enums
    except (ValueError, TypeError) as exc:
        key = next((k for k in ("distributed_type", "compute_environment") if repr(str(data.get(k))) in str(exc)), "")
        raise OverlapConfigError(f"{source}: {key + ': ' if key else ''}accelerate launch rejects it: {exc}") from None


def split_accelerate_yaml(data: dict, source: str) -> FileSettings:
    """Separate an Accelerate config mapping into the plugin's keys and Accelerate's, after
    Accelerate's own checks (``check_with_accelerate``)."""
    check_with_accelerate(data, source)
    fsdp = data.get("fsdp_config") or {}
    if not isinstance(fsdp, dict):
        raise OverlapConfigError(f"{source}: fsdp_config: expected a mapping, got {type(fsdp).__name__}.")
    known = _known_accelerate_fsdp_keys()
    plugin: dict[str, Any] = {}
    accelerate: dict[str, Any] = {}
    for raw_key, value in fsdp.items():
        key = str(raw_key)
        if not key.startswith("fsdp"):  # the launcher reads `foo` in fsdp_config as `fsdp_foo`
            key = "fsdp_" + key
        if key.startswith(PREFIX):
            name = field_for(key)
            if name is None:
                raise OverlapConfigError(
                    unknown_key_message(
                        key,
                        plugin_keys(),
                        source=source,
                        where=f"fsdp_config.{raw_key}: ",
                        shown="",
                        what="fsdp-overlap key",
                        tail=f"Valid keys: {', '.join(plugin_keys())}.",
                    )
                )
            if name in plugin:
                raise OverlapConfigError(f"{source}: fsdp_config.{raw_key}: {key_for(name)} is set twice; keep one.")
            plugin[name] = value
        elif key in known:
            accelerate[key] = value
        else:
            # Accelerate would drop it silently, and so would we: say so instead.
            raise OverlapConfigError(
                unknown_key_message(
                    key,
                    sorted(known) + plugin_keys(),
                    source=source,
                    where=f"fsdp_config.{raw_key}: ",
                    shown="",
                    reason=" (neither an Accelerate FSDP key nor an fsdp-overlap key; accelerate launch would drop "
                    "it silently)",
                )
            )
    if "mixed_precision" in data:
        accelerate["mixed_precision"] = data["mixed_precision"]
    dynamo = data.get("dynamo_config") or {}
    if isinstance(dynamo, dict) and dynamo.get("dynamo_backend") is not None:
        accelerate["dynamo_backend"] = dynamo["dynamo_backend"]
    elif data.get("dynamo_backend") is not None:  # the older spelling Accelerate still reads
        accelerate["dynamo_backend"] = data["dynamo_backend"]
    if "distributed_type" in data:
        accelerate["distributed_type"] = data["distributed_type"]
    parallelism = data.get("parallelism_config") or {}
    if not isinstance(parallelism, dict):
        raise OverlapConfigError(f"{source}: parallelism_config: expected a mapping, got {type(parallelism).__name__}.")
    for raw_key, value in parallelism.items():
        key = str(raw_key)
        if key not in _PARALLELISM_KEYS:
            # the launcher copies these keys onto its arguments as they are: any other is dropped
            raise OverlapConfigError(
                unknown_key_message(
                    key,
                    _PARALLELISM_KEYS,
                    source=source,
                    where=f"parallelism_config.{key}: ",
                    shown="",
                    reason=" (accelerate launch would drop it silently)",
                    lookup=key if key.startswith("parallelism_config_") else "parallelism_config_" + key,
                    tail=f"Valid keys: {', '.join(_PARALLELISM_KEYS)}.",
                )
            )
        accelerate[key] = value
    processes = data.get("num_processes")
    world = processes if isinstance(processes, int) and not isinstance(processes, bool) and processes > 0 else None
    machines = data.get("num_machines")
    machines = machines if isinstance(machines, int) and not isinstance(machines, bool) and machines > 0 else None
    return FileSettings(plugin, accelerate, source, accelerate_format=True, world=world, machines=machines)


def file_settings(data: dict, source: str) -> FileSettings:
    """What a config mapping read from ``source`` says: an Accelerate YAML (plugin keys
    under ``fsdp_config``) or a plain plugin YAML."""
    if is_accelerate_yaml(data):
        return split_accelerate_yaml(data, source)
    return FileSettings(dict(data), {}, source, accelerate_format=False)


def read_config_file(path: str | os.PathLike) -> FileSettings:
    """Read an Accelerate YAML (plugin keys under ``fsdp_config``) or a plain plugin YAML."""
    return file_settings(read_yaml(path), str(path))
