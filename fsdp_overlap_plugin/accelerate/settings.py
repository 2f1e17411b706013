"""What Accelerate applies in this worker, for the keys the plugin shares with it: the
live ``Accelerator`` (its FSDP plugin, mixed precision, dynamo backend), else the
``FSDP_*`` / ``ACCELERATE_*`` variables the launcher exported, else the YAML file; each
value with where it came from, for the messages. Pure: no process group."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config.fsdp1 import SUPPORTED, strategy_name
from ..config.keys import suggest
from ..config.schema import OverlapConfigError
from .keys import fsdp_launch
from .reading import FileSettings

__all__ = ["SHARDING_STRATEGIES", "AccelerateSettings", "accelerate_settings"]


@dataclass
class AccelerateSettings:
    """Accelerate's settings that the plugin also reads, each with where it came from.
    None means Accelerate has no opinion (not launched with an FSDP config, no YAML)."""

    mixed_precision: str | None = None
    reshard_after_forward: bool | None = None
    activation_checkpointing: bool | None = None
    sync_module_states: bool | None = None
    fsdp_version: int | None = None
    offload_params: bool | None = None
    dynamo_backend: str | None = None
    sharding_strategy: str | None = None
    """FSDP1's ``fsdp_sharding_strategy``, upper case (``HYBRID_SHARD``)."""
    dp_replicate: int | None = None
    """``parallelism_config``'s ``dp_replicate_size`` (with ``dp_shard``); None when it
    has none or both sizes are 1."""
    dp_shard: int | None = None
    tensor: int | None = None
    """``parallelism_config``'s ``tp_size`` where it is above 1 (the tensor-parallel group
    size: ``mesh.tensor``); None otherwise."""
    machines: int = 1
    """Machines of the launch: ``$WORLD_SIZE / $LOCAL_WORLD_SIZE`` (torchrun exports both),
    else the file's ``num_machines``, else 1."""
    where: dict[str, str] = field(default_factory=dict)


def _as_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(getattr(value, "name", value)).strip().lower()  # FSDP1 ShardingStrategy enums too
    if text in ("true", "1", "yes", "y", "on"):
        return True
    if text in ("false", "0", "no", "n", "off"):
        return False
    # FSDP1 spellings of fsdp_reshard_after_forward
    if key == "fsdp_reshard_after_forward" and text == "full_shard":
        return True
    if key == "fsdp_reshard_after_forward" and text in ("shard_grad_op", "no_shard", "no_reshard"):
        return False
    if key == "fsdp_reshard_after_forward" and text.lstrip("_") in ("hybrid_shard", "hybrid_shard_zero2"):
        # Accelerate's FSDP2 plugin refuses a sharding strategy here too (it wants a bool)
        reshard = "true" if text.lstrip("_") == "hybrid_shard" else "false"
        raise OverlapConfigError(
            f"{key}: {value!r} is a sharding strategy; with fsdp_version: 2 it takes true or false (Accelerate's "
            f"FSDP2 plugin refuses it too). Write fsdp_sharding_strategy: HYBRID_SHARD and {key}: {reshard}."
        )
    raise OverlapConfigError(f"{key}: expected true or false, got {value!r}.")


#: ``fsdp_sharding_strategy`` values (FSDP1's key, which Accelerate's FSDP2 path ignores) that
#: mean something here (the table is ``config/fsdp1.py``, shared with Lightning); FULL_SHARD
#: is what the launcher exports when nothing is set. The other FSDP1 values, each with what
#: to write instead, in Accelerate's keys:
SHARDING_STRATEGIES = SUPPORTED
_OTHER_STRATEGIES = {
    "SHARD_GRAD_OP": "write fsdp_reshard_after_forward: false (FSDP2's spelling of it)",
    "HYBRID_SHARD_ZERO2": "write fsdp_sharding_strategy: HYBRID_SHARD with fsdp_reshard_after_forward: false",
    "NO_SHARD": (
        "to replicate every parameter, set parallelism_config_dp_replicate_size to the number of processes "
        "(parallelism_config_dp_shard_size: 1)"
    ),
}


def _strategy_name(value: Any, key: str) -> str:
    text = strategy_name(value, numbered=True)  # the launcher's 1-based numbers too
    if text in _OTHER_STRATEGIES:
        raise OverlapConfigError(
            f"{key}: {value!r} is not supported by fsdp-overlap (with fsdp_version: 2 Accelerate ignores this FSDP1 "
            f"key); valid: {', '.join(SHARDING_STRATEGIES)}. To get it, {_OTHER_STRATEGIES[text]}."
        )
    if text not in SHARDING_STRATEGIES:
        raise OverlapConfigError(
            f"{key}: {value!r} is not a sharding strategy; valid: {', '.join(SHARDING_STRATEGIES)}."
            f"{suggest(text, SHARDING_STRATEGIES)}"
        )
    return text


def _size(value: Any, key: str) -> int:
    try:
        number = int(str(value))
    except ValueError:
        number = 0
    if number < 1 or isinstance(value, bool):
        raise OverlapConfigError(f"{key}: expected an integer >= 1, got {value!r}.")
    return number


def _parallelism(s: AccelerateSettings, accelerator: Any, env: Mapping[str, str], yaml_values: dict, yaml_where: str):
    """``parallelism_config``'s data-parallel and tensor-parallel sizes, from the
    Accelerator, else what the launcher exported, else the file. Context/sequence parallel
    sizes above 1 are an error (the plugin does not split sequences)."""
    keys = ("parallelism_config_dp_replicate_size", "parallelism_config_dp_shard_size", "parallelism_config_tp_size")
    others = ("cp", "sp")
    live = getattr(accelerator, "parallelism_config", None) if accelerator is not None else None
    if live is not None:
        sizes = {"dp_replicate": live.dp_replicate_size, "dp_shard": live.dp_shard_size, "tp": live.tp_size}
        sizes.update({k: getattr(live, f"{k}_size", 1) for k in others})
        where = "parallelism_config of the Accelerator"
    elif env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() == "true":
        sizes = {
            k: env.get(f"PARALLELISM_CONFIG_{k.upper()}_SIZE", "1") for k in ("dp_replicate", "dp_shard", "tp", *others)
        }
        where = "as accelerate launch passed it ($PARALLELISM_CONFIG_*)"
    elif any(f"parallelism_config_{k}_size" in yaml_values for k in ("dp_replicate", "dp_shard", "tp", *others)):
        sizes = {
            k: yaml_values.get(f"parallelism_config_{k}_size", 1) for k in ("dp_replicate", "dp_shard", "tp", *others)
        }
        where = f"parallelism_config in {yaml_where}"
    else:
        return
    sizes = {k: _size(v, f"parallelism_config.parallelism_config_{k}_size") for k, v in sizes.items()}
    extra = [k for k in others if sizes[k] > 1]
    if extra:
        raise OverlapConfigError(
            f"parallelism_config.parallelism_config_{extra[0]}_size is {sizes[extra[0]]} ({where}); fsdp-overlap "
            f"does not split sequences: set it to 1 (valid: {', '.join(keys)})."
        )
    if sizes["tp"] > 1:
        s.tensor = sizes["tp"]
        s.where["tensor"] = f"parallelism_config_tp_size={s.tensor} ({where})"
    if (sizes["dp_replicate"], sizes["dp_shard"]) == (1, 1):
        return  # no data-parallel sizes set: nothing asked of the data-parallel mesh
    s.dp_replicate, s.dp_shard = sizes["dp_replicate"], sizes["dp_shard"]
    s.where["parallelism"] = (
        f"parallelism_config_dp_replicate_size={s.dp_replicate}, parallelism_config_dp_shard_size={s.dp_shard} "
        f"({where})"
    )


def _machines(s: AccelerateSettings, env: Mapping[str, str], file: FileSettings | None) -> None:
    world, local = env.get("WORLD_SIZE", ""), env.get("LOCAL_WORLD_SIZE", "")
    if world.isdigit() and local.isdigit() and int(local) > 0 and int(world) % int(local) == 0:
        s.machines = int(world) // int(local)
        s.where["machines"] = f"$WORLD_SIZE={world} / $LOCAL_WORLD_SIZE={local}"
    elif file is not None and file.machines is not None:
        s.machines = file.machines
        s.where["machines"] = f"num_machines in {file.source}"
    else:
        s.where["machines"] = "no $LOCAL_WORLD_SIZE, no num_machines"


def accelerate_settings(
    accelerator: Any = None, file: FileSettings | None = None, *, environ: Mapping[str, str] | None = None
) -> AccelerateSettings:
    """Accelerate's view of the keys the plugin shares with it, most authoritative first:
    the live ``Accelerator`` (its mixed precision, its FSDP plugin where it made one), then
    the ``FSDP_*`` / ``ACCELERATE_*`` variables ``accelerate launch`` exported to this
    worker (they include command-line overrides; ``environ``, default ``os.environ``), then
    the YAML file. ``fsdp-overlap check`` passes ``environ={}``: what the file says is what
    the launcher exports."""
    s = AccelerateSettings()
    env = os.environ if environ is None else environ
    fsdp_env = fsdp_launch(env)
    state = getattr(accelerator, "state", None) if accelerator is not None else None
    fsdp_plugin = getattr(state, "fsdp_plugin", None) if state is not None and hasattr(state, "fsdp_plugin") else None
    yaml_values = file.accelerate if file is not None else {}
    yaml_where = file.source if file is not None else ""

    def pick(attr: str, yaml_key: str, env_key: str, plugin_attr: str | None, convert) -> None:
        if fsdp_plugin is not None and plugin_attr is not None and getattr(fsdp_plugin, plugin_attr, None) is not None:
            setattr(s, attr, convert(getattr(fsdp_plugin, plugin_attr), yaml_key))
            s.where[attr] = f"Accelerate's FSDP plugin ({yaml_key})"
        elif fsdp_env and env_key in env:
            setattr(s, attr, convert(env[env_key], yaml_key))
            s.where[attr] = f"{yaml_key}, as accelerate launch passed it (${env_key})"
        elif yaml_key in yaml_values:
            setattr(s, attr, convert(yaml_values[yaml_key], yaml_key))
            s.where[attr] = f"{yaml_key} in {yaml_where}"

    pick(
        "reshard_after_forward",
        "fsdp_reshard_after_forward",
        "FSDP_RESHARD_AFTER_FORWARD",
        "reshard_after_forward",
        _as_bool,
    )
    pick(
        "activation_checkpointing",
        "fsdp_activation_checkpointing",
        "FSDP_ACTIVATION_CHECKPOINTING",
        "activation_checkpointing",
        _as_bool,
    )
    pick("sync_module_states", "fsdp_sync_module_states", "FSDP_SYNC_MODULE_STATES", "sync_module_states", _as_bool)
    pick("fsdp_version", "fsdp_version", "FSDP_VERSION", "fsdp_version", lambda v, k: int(v))
    pick("offload_params", "fsdp_offload_params", "FSDP_OFFLOAD_PARAMS", None, _as_bool)
    pick("sharding_strategy", "fsdp_sharding_strategy", "FSDP_SHARDING_STRATEGY", "sharding_strategy", _strategy_name)
    _parallelism(s, accelerator, env, yaml_values, yaml_where)
    _machines(s, env, file)

    if accelerator is not None:
        s.mixed_precision = str(accelerator.mixed_precision)
        s.where["mixed_precision"] = "mixed_precision of the Accelerator"
        backend = getattr(getattr(state, "dynamo_plugin", None), "backend", None)
        if backend is not None:
            s.dynamo_backend = str(getattr(backend, "value", backend))
            s.where["dynamo_backend"] = (
                "the Accelerator's dynamo_plugin: dynamo_config in the launch config, Accelerator(dynamo_backend=...), "
                "or transformers' TrainingArguments(torch_compile=True)"
            )
    else:
        for attr, env_key, yaml_label in (
            ("mixed_precision", "ACCELERATE_MIXED_PRECISION", "mixed_precision"),
            ("dynamo_backend", "ACCELERATE_DYNAMO_BACKEND", "dynamo_config.dynamo_backend"),
        ):
            if env_key in env:
                setattr(s, attr, env[env_key])
                s.where[attr] = f"{attr}, as accelerate launch passed it"
            elif attr in yaml_values:
                setattr(s, attr, str(yaml_values[attr]))
                s.where[attr] = f"{yaml_label} in {yaml_where}"
    if s.mixed_precision is not None:
        s.mixed_precision = s.mixed_precision.strip().lower()
    return s
