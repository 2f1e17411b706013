"""Find the plugin's settings in an Accelerate job and turn them into an ``OverlapConfig``.

The settings live in the same YAML that is given to ``accelerate launch``, under
``fsdp_config`` as ``fsdp_overlap_<field>`` keys (one per ``OverlapConfig`` field). Two
facts about Accelerate 1.15 shape this module: the launcher drops unknown ``fsdp_config``
keys without a word (they never reach the workers), and it does not tell the workers
which file it read. So each worker reads the file itself, found in this order:

1. the ``config=`` argument given in code (``prepare(accelerator, ..., config=...)``);
2. the ``FSDP_OVERLAP_CONFIG`` environment variable;
3. the ``--config_file`` (or ``--config-file``) of the ``accelerate launch`` process that
   started this one, read from its command line (``/proc/<pid>/cmdline``; ``psutil``
   where there is no ``/proc``), relative to that process's working directory; if that
   launcher was given no ``--config_file``, Accelerate's default config file, as the
   launcher itself does.

If none applies (``python train.py``, ``torchrun``), the plugin runs with its defaults and
says so once. Accelerate's own keys that mean the same thing are read too, from what
Accelerate applies in the worker (the ``Accelerator``, the ``FSDP_*`` variables the
launcher exports, which include command-line overrides), or else from the YAML:

    mixed_precision               -> param_dtype (bf16, fp16; "no" leaves dtypes alone)
    fsdp_reshard_after_forward    -> reshard_after_forward
    fsdp_activation_checkpointing -> activation_checkpointing (true: each repeated block)
    fsdp_sharding_strategy        -> mesh: HYBRID_SHARD replicates over the machines
                                     ($WORLD_SIZE / $LOCAL_WORLD_SIZE, else num_machines)
                                     and shards within each; FULL_SHARD (the launcher's
                                     default) changes nothing; the other FSDP1 values
                                     are an error saying what to write instead
    parallelism_config            -> mesh: {replicate: parallelism_config_dp_replicate_size,
                                     shard: parallelism_config_dp_shard_size} (both 1:
                                     nothing); tp/cp/sp sizes above 1 are an error

Accelerate's key decides; an ``fsdp_overlap_*`` key that contradicts it is an error
naming both, so the two can never disagree. Everything here is pure (no process
group), so every rank raises the same error before any collective.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._accelerate_compat import launch_parser_actions
from ..config.keys import suggest, unknown_key_message
from ..config.parse import dtype_name, parse_dtype, read_yaml
from ..config.schema import OverlapConfig, OverlapConfigError, respell

__all__ = [
    "ENV_VAR",
    "PREFIX",
    "AccelerateSettings",
    "ConfigSource",
    "accelerate_settings",
    "build_config",
    "field_for",
    "find_config_file",
    "fsdp_launch",
    "key_for",
    "launch_args",
    "launcher_config_file",
    "plugin_keys",
    "load_config",
    "read_config_file",
    "Resolved",
]

PREFIX = "fsdp_overlap_"
ENV_VAR = "FSDP_OVERLAP_CONFIG"

# How many ancestors to look through for the `accelerate launch` process (the workers are
# its direct children; a wrapper such as `bash -c` or `srun` adds a level or two).
_MAX_ANCESTORS = 6


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


# ------------------------------------------------------------------ finding the file
@dataclass(frozen=True)
class ConfigSource:
    """Where the plugin's settings came from: a file (or None) and how it was found."""

    path: Path | None
    found_by: str

    def __str__(self) -> str:
        return f"{self.path} ({self.found_by})" if self.path else self.found_by


def launch_args(argv: list[str]) -> list[str] | None:
    """The arguments after ``launch`` if ``argv`` is an ``accelerate launch`` command line
    (``accelerate launch``, ``accelerate-launch``, ``python -m accelerate.commands.launch``
    or ``python -m accelerate.commands.accelerate_cli launch``), else None."""
    for i, token in enumerate(argv):
        base = os.path.basename(token)
        if base in ("accelerate", "accelerate_cli.py") or token == "accelerate.commands.accelerate_cli":
            if i + 1 < len(argv) and argv[i + 1] == "launch":
                return argv[i + 2 :]
            return None
        if base in ("accelerate-launch",) or token == "accelerate.commands.launch":
            return argv[i + 1 :]
    return None


def _config_file_in(args: list[str]) -> tuple[str | None, bool]:
    """``(--config_file value or None, --cpu given)`` as Accelerate's own parser reads
    ``args``: it knows which options take values and where the training script starts."""
    import contextlib
    import io

    from accelerate.commands.launch import launch_command_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parsed, _ = launch_command_parser().parse_known_args(args)
    except SystemExit:  # not something the launcher would have accepted either
        return None, False
    return parsed.config_file, bool(getattr(parsed, "cpu", False))


def _default_accelerate_config() -> Path | None:
    from accelerate.commands.config import default_config_file

    path = Path(default_config_file)
    return path if path.is_file() else None


@dataclass(frozen=True)
class _Process:
    argv: list[str]
    cwd: Path | None
    ppid: int


def _read_process(pid: int) -> _Process | None:
    """A process's command line, working directory and parent, from /proc, else psutil."""
    proc = Path("/proc") / str(pid)
    if proc.is_dir():
        try:
            argv = [a for a in (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")]
            while argv and argv[-1] == "":
                argv.pop()
            stat = (proc / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
            try:
                cwd: Path | None = Path(os.readlink(proc / "cwd"))
            except OSError:
                cwd = None
            return _Process(argv, cwd, ppid)
        except (OSError, ValueError, IndexError):
            return None
    try:
        import psutil

        p = psutil.Process(pid)
        try:
            cwd = Path(p.cwd())
        except psutil.Error:
            cwd = None
        return _Process(p.cmdline(), cwd, p.ppid())
    except Exception:  # psutil missing, or the process is gone / not ours to read
        return None


def launcher_config_file(pid: int | None = None, *, read_process=_read_process) -> ConfigSource | None:
    """The config file of the ``accelerate launch`` process that started this one (looking
    through up to six ancestors), or None if no ancestor is an ``accelerate launch``."""
    pid = os.getppid() if pid is None else pid
    for _ in range(_MAX_ANCESTORS):
        if pid <= 1:
            return None
        info = read_process(pid)
        if info is None:
            return None
        args = launch_args(info.argv)
        if args is not None:
            value, cpu = _config_file_in(args)
            if value is None:
                # What the launcher did: Accelerate's default config file, unless --cpu.
                default = None if cpu else _default_accelerate_config()
                if default is None:
                    return ConfigSource(None, f"accelerate launch (pid {pid}) was given no --config_file")
                return ConfigSource(default, f"Accelerate's default config, used by accelerate launch (pid {pid})")
            path = Path(os.path.expanduser(value))
            if not path.is_absolute() and info.cwd is not None:
                path = info.cwd / path
            return ConfigSource(path, f"--config_file of accelerate launch (pid {pid})")
        pid = info.ppid
    return None


def find_config_file(explicit: str | os.PathLike | None = None, *, read_process=_read_process) -> ConfigSource:
    """The plugin's config file, in the documented order: ``explicit``, then
    ``$FSDP_OVERLAP_CONFIG``, then the ``--config_file`` of the ``accelerate launch`` that
    started this process. ``ConfigSource(None, reason)`` when there is none."""
    if explicit is not None:
        return ConfigSource(Path(explicit), "config= argument")
    env = os.environ.get(ENV_VAR)
    if env:
        return ConfigSource(Path(os.path.expanduser(env)), f"${ENV_VAR}")
    found = launcher_config_file(read_process=read_process)
    if found is not None and found.path is not None:
        return found
    reason = found.found_by if found is not None else "not started by accelerate launch"
    return ConfigSource(None, f"no config file ({reason}; no config= argument, ${ENV_VAR} unset)")


# ----------------------------------------------------------------- reading the file
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


# --------------------------------------------------- what Accelerate applies in this worker
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


#: ``fsdp_sharding_strategy`` values (FSDP1's key, which Accelerate's FSDP2 path ignores):
#: what each means here. FULL_SHARD is what the launcher exports when nothing is set.
SHARDING_STRATEGIES = ("FULL_SHARD", "HYBRID_SHARD")
_OTHER_STRATEGIES = {
    "SHARD_GRAD_OP": "write fsdp_reshard_after_forward: false (FSDP2's spelling of it)",
    "HYBRID_SHARD_ZERO2": "write fsdp_sharding_strategy: HYBRID_SHARD with fsdp_reshard_after_forward: false",
    "NO_SHARD": (
        "to replicate every parameter, set parallelism_config_dp_replicate_size to the number of processes "
        "(parallelism_config_dp_shard_size: 1)"
    ),
}


def _strategy_name(value: Any, key: str) -> str:
    from accelerate.utils.constants import FSDP_SHARDING_STRATEGY

    text = str(getattr(value, "name", value)).strip().upper().lstrip("_")
    if text.isdigit() and 1 <= int(text) <= len(FSDP_SHARDING_STRATEGY):  # the launcher's 1-based numbers
        text = FSDP_SHARDING_STRATEGY[int(text) - 1]
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
    """``parallelism_config``'s data-parallel sizes, from the Accelerator, else what the
    launcher exported, else the file. Tensor/context/sequence parallel sizes above 1 are
    an error (the plugin shards over data-parallel ranks only)."""
    keys = ("parallelism_config_dp_replicate_size", "parallelism_config_dp_shard_size")
    others = ("tp", "cp", "sp")
    live = getattr(accelerator, "parallelism_config", None) if accelerator is not None else None
    if live is not None:
        sizes = {"dp_replicate": live.dp_replicate_size, "dp_shard": live.dp_shard_size}
        sizes.update({k: getattr(live, f"{k}_size", 1) for k in others})
        where = "parallelism_config of the Accelerator"
    elif env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() == "true":
        sizes = {k: env.get(f"PARALLELISM_CONFIG_{k.upper()}_SIZE", "1") for k in ("dp_replicate", "dp_shard", *others)}
        where = "as accelerate launch passed it ($PARALLELISM_CONFIG_*)"
    elif any(f"parallelism_config_{k}_size" in yaml_values for k in ("dp_replicate", "dp_shard", *others)):
        sizes = {k: yaml_values.get(f"parallelism_config_{k}_size", 1) for k in ("dp_replicate", "dp_shard", *others)}
        where = f"parallelism_config in {yaml_where}"
    else:
        return
    sizes = {k: _size(v, f"parallelism_config.parallelism_config_{k}_size") for k, v in sizes.items()}
    extra = [k for k in others if sizes[k] > 1]
    if extra:
        raise OverlapConfigError(
            f"parallelism_config.parallelism_config_{extra[0]}_size is {sizes[extra[0]]} ({where}); fsdp-overlap "
            f"shards over data-parallel ranks only: set it to 1 (valid: {', '.join(keys)})."
        )
    if (sizes["dp_replicate"], sizes["dp_shard"]) == (1, 1):
        return  # no sizes set: nothing asked of the mesh
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


# ------------------------------------------------------------- building the config
_MIXED_PRECISION = {"no": None, "bf16": "bf16", "fp16": "fp16"}


def _key(name: str, prefixed: bool) -> str:
    return f"fsdp_config.{key_for(name)}" if prefixed else name


def rename_error(exc: OverlapConfigError, source: str, prefixed: bool) -> OverlapConfigError:
    """The same error, with the key spelled as the user wrote it (core messages start with
    the field name, ``bucket_plans[2]: ...``; the YAML says ``fsdp_overlap_bucket_plans``)
    and the file named."""
    message = respell(str(exc), lambda name: _key(name, prefixed))
    if source and not message.startswith(source):
        message = f"{source}: {message}"
    return OverlapConfigError(message)


def build_config(
    values: dict[str, Any],
    given: set[str],
    settings: AccelerateSettings,
    *,
    model: Any = None,
    source: str = "",
    prefixed: bool = True,
    model_later: bool = False,
) -> OverlapConfig:
    """The ``OverlapConfig`` for this job: ``values`` (plugin keys, unprefixed), with
    Accelerate's shared keys applied. ``given`` are the keys the user actually set (only
    those can contradict Accelerate). ``model`` is needed only to turn
    ``fsdp_activation_checkpointing: true`` into the model's repeated blocks;
    ``model_later`` (``fsdp-overlap check`` without a model) leaves that step out."""
    values = dict(values)

    def conflict(name: str, ours: Any, theirs: str, fix: str) -> OverlapConfigError:
        return OverlapConfigError(
            f"{source + ': ' if source else ''}{_key(name, prefixed)} is {ours!r} but Accelerate's {theirs}; "
            f"the two must agree. {fix}"
        )

    if settings.fsdp_version is not None and settings.fsdp_version != 2:
        raise OverlapConfigError(
            f"{source + ': ' if source else ''}fsdp_config.fsdp_version is {settings.fsdp_version} "
            f"({settings.where.get('fsdp_version')}); fsdp-overlap keeps FSDP2's parameter layout: set fsdp_version: 2."
        )
    if settings.offload_params:
        raise OverlapConfigError(
            f"{source + ': ' if source else ''}fsdp_config.fsdp_offload_params is true "
            f"({settings.where.get('offload_params')}); fsdp-overlap does not offload parameters to the CPU: "
            "set fsdp_offload_params: false."
        )
    if settings.dynamo_backend is not None and settings.dynamo_backend.upper() != "NO":
        raise OverlapConfigError(
            f"{source + ': ' if source else ''}dynamo_config.dynamo_backend is {settings.dynamo_backend!r} "
            f"({settings.where.get('dynamo_backend')}); fsdp-overlap compiles the model itself "
            f"({_key('compile', prefixed)}, {_key('backend', prefixed)}): remove dynamo_config or set "
            "dynamo_backend: 'NO' (with transformers' Trainer: leave TrainingArguments' torch_compile off)."
        )

    # mixed_precision -> param_dtype
    mp = settings.mixed_precision
    if mp is not None:
        if mp not in _MIXED_PRECISION:
            raise OverlapConfigError(
                f"{source + ': ' if source else ''}mixed_precision {mp!r} ({settings.where.get('mixed_precision')}) "
                f"is not supported by fsdp-overlap; valid: {', '.join(_MIXED_PRECISION)}."
                f"{suggest(mp, list(_MIXED_PRECISION))}"
            )
        wanted = _MIXED_PRECISION[mp]
        ours = values.get("param_dtype")
        if "param_dtype" in given and ours is not None:
            try:
                ours_name = dtype_name(parse_dtype(ours, _key("param_dtype", prefixed)))
            except OverlapConfigError as exc:
                raise rename_error(exc, source, False) from None
            agrees = ours_name == wanted if wanted is not None else ours_name == "fp32"
            if not agrees:
                raise conflict(
                    "param_dtype",
                    ours,
                    f"mixed_precision is {mp!r} ({settings.where.get('mixed_precision')})",
                    f"Set mixed_precision to {ours_name!r}, or remove {_key('param_dtype', prefixed)} "
                    "(it follows mixed_precision).",
                )
        if wanted is not None:
            values["param_dtype"] = wanted

    # fsdp_reshard_after_forward -> reshard_after_forward
    if settings.reshard_after_forward is not None:
        theirs = settings.reshard_after_forward
        if "reshard_after_forward" in given and values.get("reshard_after_forward") != theirs:
            raise conflict(
                "reshard_after_forward",
                values.get("reshard_after_forward"),
                f"fsdp_reshard_after_forward is {str(theirs).lower()} ({settings.where.get('reshard_after_forward')})",
                f"Set both to the same value (fsdp_reshard_after_forward decides; {_key('reshard_after_forward', prefixed)} "
                "may be left out).",
            )
        values["reshard_after_forward"] = theirs

    # parallelism_config dp sizes / fsdp_sharding_strategy: HYBRID_SHARD -> mesh
    theirs_mesh, theirs_where = None, ""
    if settings.dp_replicate is not None:
        theirs_mesh, theirs_where = (settings.dp_replicate, settings.dp_shard), settings.where["parallelism"]
    if settings.sharding_strategy == "HYBRID_SHARD":
        hybrid_where = (
            f"fsdp_sharding_strategy is HYBRID_SHARD ({settings.where.get('sharding_strategy')}): replicate over "
            f"{settings.machines} machine(s) ({settings.where.get('machines')})"
        )
        if theirs_mesh is not None and theirs_mesh[0] != settings.machines:
            raise OverlapConfigError(
                f"{source + ': ' if source else ''}{hybrid_where}, but {theirs_where}; the two must agree. Remove "
                "fsdp_sharding_strategy (parallelism_config decides) or make the replicate size the machine count."
            )
        if theirs_mesh is None:
            theirs_mesh, theirs_where = (settings.machines, -1), hybrid_where
    if theirs_mesh is not None:
        try:
            ours = OverlapConfig.from_dict({"mesh": values.get("mesh")}).mesh
        except OverlapConfigError as exc:
            raise rename_error(exc, source, prefixed) from None
        # the default ({replicate: 1, shard: -1}, written out in configs/overlap.yaml) asks nothing
        if "mesh" in given and ours != OverlapConfig().mesh:
            shards_agree = ours.shard == theirs_mesh[1] or -1 in (ours.shard, theirs_mesh[1])
            if ours.replicate != theirs_mesh[0] or not shards_agree:
                raise conflict(
                    "mesh",
                    {"replicate": ours.replicate, "shard": ours.shard},
                    theirs_where,
                    f"Remove {_key('mesh', prefixed)} (Accelerate's key decides) or make it say the same.",
                )
        values["mesh"] = {"replicate": theirs_mesh[0], "shard": theirs_mesh[1]}

    # fsdp_activation_checkpointing -> activation_checkpointing
    if settings.activation_checkpointing is not None:
        ours_ac = values.get("activation_checkpointing") or []
        if isinstance(ours_ac, str):
            ours_ac = [ours_ac]
        where = settings.where.get("activation_checkpointing")
        if not settings.activation_checkpointing and ours_ac:
            raise conflict(
                "activation_checkpointing",
                ours_ac,
                f"fsdp_activation_checkpointing is false ({where})",
                "Set fsdp_activation_checkpointing: true to checkpoint these modules.",
            )
        if settings.activation_checkpointing and not ours_ac and not (model is None and model_later):
            if model is None:
                raise OverlapConfigError(
                    "fsdp_activation_checkpointing: true needs the model to find its repeated blocks."
                )
            from ..config.plan import find_repeated_blocks

            blocks = find_repeated_blocks(model)
            if blocks is None:
                raise OverlapConfigError(
                    f"{source + ': ' if source else ''}fsdp_activation_checkpointing is true ({where}) but the model "
                    f"has no repeated blocks to checkpoint; list the modules in {_key('activation_checkpointing', prefixed)}."
                )
            values["activation_checkpointing"] = blocks[1]

    try:
        where = (f"{source}: fsdp_config" if source else "fsdp_config") if prefixed else (source or "config")
        return OverlapConfig.from_dict(values, source=where)
    except OverlapConfigError as exc:
        raise rename_error(exc, source, prefixed) from None


# ---------------------------------------------------------- one job's configuration
@dataclass
class Resolved:
    """The configuration of one ``prepare`` call and where each part came from."""

    config: OverlapConfig
    source: ConfigSource
    settings: AccelerateSettings
    prefixed: bool = False
    """True when the plugin keys were read as ``fsdp_overlap_*`` keys of an Accelerate YAML
    (error messages then spell them that way)."""
    world: int | None = None
    """The file's ``num_processes``, when it has one."""

    def rename(self, exc: OverlapConfigError) -> OverlapConfigError:
        """A core error (plan, mesh, checkpointing) as this file spells the key."""
        return rename_error(exc, str(self.source.path) if self.source.path else "", self.prefixed)


def _plain_values(config: OverlapConfig | dict) -> tuple[dict[str, Any], set[str]]:
    """Values and the keys the user set, for a config given in code."""
    if isinstance(config, OverlapConfig):
        defaults = OverlapConfig().to_dict()
        values = config.to_dict()
        return values, {k for k, v in values.items() if v != defaults[k]}
    values = {(field_for(str(k)) or k): v for k, v in config.items()}
    return values, {k for k, v in values.items() if v is not None}


def load_config(
    accelerator: Any = None,
    config: OverlapConfig | dict | str | os.PathLike | None = None,
    *,
    model: Any = None,
    environ: Mapping[str, str] | None = None,
    model_later: bool = False,
    **overrides: Any,
) -> Resolved:
    """The plugin's configuration for this worker (see this module's doc for where it is
    looked for), with Accelerate's shared keys applied. Pure: every rank reads the same
    file and raises the same ``OverlapConfigError``. ``prepare`` calls it in each worker;
    ``fsdp-overlap check`` calls it on the file it is given, with ``environ={}`` (the
    launcher exports what the file says) and ``model_later`` when no model was given.

    ``config`` may be an ``OverlapConfig`` or a dict (used as they are), or a path to an
    Accelerate YAML (plugin keys under ``fsdp_config``) or a plain plugin YAML."""
    file = None
    if isinstance(config, (OverlapConfig, dict)):
        source = ConfigSource(None, "config= argument")
        values, given = _plain_values(config)
        prefixed = False
    else:
        source = find_config_file(config)
        if source.path is not None:
            file = read_config_file(source.path)
            values = dict(file.plugin)
            prefixed = file.accelerate_format
        else:
            values, prefixed = {}, False
        given = {k for k, v in values.items() if v is not None}
    values.update(overrides)
    given |= set(overrides)
    settings = accelerate_settings(accelerator, file, environ=environ)
    where = str(source.path) if source.path else ""
    config_obj = build_config(
        values, given, settings, model=model, source=where, prefixed=prefixed, model_later=model_later
    )
    return Resolved(config_obj, source, settings, prefixed, world=file.world if file is not None else None)
