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

The work is split by job: ``keys.py`` (how the keys are spelled), this module (where the
file is, and one job's configuration: ``load_config``), ``reading.py`` (what one file
says), ``settings.py`` (what Accelerate applies in this worker) and ``translate.py``
(``build_config``: the settings turned into ``OverlapConfig`` fields). The names of each
are importable from here, as before.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config.schema import OverlapConfig, OverlapConfigError
from .keys import ENV_VAR, PREFIX, field_for, fsdp_launch, key_for, plugin_keys
from .reading import (
    ACCELERATE_KEYS,
    FileSettings,
    check_with_accelerate,
    file_settings,
    is_accelerate_yaml,
    read_config_file,
    split_accelerate_yaml,
)
from .settings import SHARDING_STRATEGIES, AccelerateSettings, accelerate_settings
from .translate import build_config, rename_error

if TYPE_CHECKING:
    from ..core import Preflight

__all__ = [
    "ACCELERATE_KEYS",
    "ENV_VAR",
    "PREFIX",
    "SHARDING_STRATEGIES",
    "AccelerateSettings",
    "ConfigSource",
    "FileSettings",
    "Resolved",
    "accelerate_settings",
    "build_config",
    "check_with_accelerate",
    "field_for",
    "file_settings",
    "find_config_file",
    "fsdp_launch",
    "is_accelerate_yaml",
    "key_for",
    "launch_args",
    "launcher_config_file",
    "load_config",
    "plugin_keys",
    "read_config_file",
    "rename_error",
    "split_accelerate_yaml",
]

# How many ancestors to look through for the `accelerate launch` process (the workers are
# its direct children; a wrapper such as `bash -c` or `srun` adds a level or two).
_MAX_ANCESTORS = 6


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
    checked: Preflight | None = None
    """What ``preflight`` found for the model (``adapter.configure``), handed on to
    ``parallelize(..., checked=...)`` so that the checks run once per ``prepare``."""

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
