"""``fsdp-overlap launch``: check an Accelerate YAML, then run ``accelerate launch`` with it.

    fsdp-overlap launch --config configs/overlap.yaml [--model MODEL] [--num_processes 2 ...] train.py [ARGS]

Why: users type ``accelerate launch --config overlap.yaml train.py``, which Accelerate 1.15
refuses (``allow_abbrev=False``: ``unrecognized arguments: --config``). Here ``--config``
(or ``--config_file`` / ``--config-file``), ``--model`` and ``--model-arg`` are taken from
before the training script, found with Accelerate's own parser (which of its options take a
value); everything else, in order, goes to ``accelerate launch`` unchanged, the script's own
arguments included (its own ``--config`` too).

First ``fsdp-overlap check`` runs on the YAML (and ``--model``) as the workers will see it:
world size from ``--num_processes`` if given, and the variables the launcher exports for its
flags (``--mixed_precision bf16`` -> ``ACCELERATE_MIXED_PRECISION``, ``--fsdp_*`` ->
``FSDP_*``), computed by Accelerate's own ``_validate_launch_command`` and
``prepare_multi_gpu_env`` / ``prepare_simple_launcher_cmd_env``. Where those raise (a YAML
Accelerate cannot load; the check then names the key) the flags that matter are mapped here:
``--mixed_precision`` -> ``ACCELERATE_MIXED_PRECISION``, ``--fsdp_<x>`` -> ``FSDP_<X>`` and
``ACCELERATE_USE_FSDP=true``. A bad config, model or launcher argument exits 2, nothing started.

The plan is checked against a model when there is one: ``--model``, else the training
script's module-level ``FSDP_OVERLAP_MODEL = "package.module:factory"`` (a string literal,
read from the file without running it; a relative ``file.py:factory`` is relative to the
script). Without either, one line says the plan was not checked against a model.

Then ``python -m accelerate.commands.launch --config_file CONFIG ...`` runs (a form the
workers' config discovery recognises), with ``FSDP_OVERLAP_CONFIG`` set to the absolute
path so every worker reads this file whatever its directory, and the training script started
by ``python -m fsdp_overlap_plugin.accelerate`` (``through_plugin``: the adapter is imported
before the script runs, so a transformers ``Trainer`` script needs no change); its exit code is ours (128 + N
for signal N). SIGTERM is forwarded to it, and SIGINT unless it came from the terminal
(Ctrl-C reaches the launcher's process group already; twice would cut its worker shutdown).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import os
import shlex
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from accelerate.commands.launch import launch_command_parser

from .._accelerate_compat import launch_parser_actions, validate_launch_command
from ..config.schema import OverlapConfigError
from .analysis import SMALL_BUCKET_BYTES
from .errors import CliError

__all__ = ["RUNNER", "LaunchArgs", "launcher_command", "launcher_environ", "main", "split_args", "through_plugin"]

CONFIG_FLAGS = ("--config", "--config_file", "--config-file")
#: A training script names its model for the check with ``FSDP_OVERLAP_MODEL = "pkg.mod:factory"``.
SCRIPT_MODEL = "FSDP_OVERLAP_MODEL"
NOT_CHECKED = "plan not checked against a model (pass --model pkg.mod:factory to check it before launching)"
MODEL_ARG_FLAGS = ("--model-arg", "--model_arg")

USAGE = """\
usage: fsdp-overlap launch --config CONFIG [--model MODEL [--model-arg KEY=VALUE ...]]
                           [accelerate launch options] SCRIPT [SCRIPT ARGS]

Check an Accelerate YAML (fsdp-overlap check, with --num_processes and the launcher's
flags applied), then run `accelerate launch --config_file CONFIG` with it.

options (only before SCRIPT; after it every argument is the script's):
  --config CONFIG       the Accelerate YAML (also --config_file, --config-file)
  --model MODEL         also resolve the plan on this model (package.module:factory or hf:path);
                        default: the script's FSDP_OVERLAP_MODEL = "package.module:factory", if any
  --model-arg KEY=VALUE model factory argument (repeatable)
  -h, --help            this message

Every other argument goes to accelerate launch unchanged (see `accelerate launch --help`).
Exit code: 2 for a bad config, model or argument (nothing started), else accelerate launch's."""


@dataclass
class LaunchArgs:
    """The command line, split: our options, and what goes to ``accelerate launch``."""

    config: str | None = None
    model: str | None = None
    model_args: list[str] = field(default_factory=list)
    passthrough: list[str] = field(default_factory=list)
    script_at: int | None = None
    """Where the training script (or ``--`` before it) starts in ``passthrough``."""
    help: bool = False


def split_args(argv: list[str]) -> LaunchArgs:
    """Take our options from before the training script; keep everything else, in order."""
    # Accelerate's option strings that take a value (``--num_processes 2``)
    takes_value = {s for a in launch_parser_actions() if a.nargs != 0 for s in a.option_strings}
    out, configs = LaunchArgs(), []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--" or not token.startswith("-"):  # the training script starts here
            out.script_at = len(out.passthrough)
            out.passthrough += argv[i:]
            break
        name, eq, value = token.partition("=")
        if name in ("-h", "--help") and not eq:
            out.help = True
        elif name in (*CONFIG_FLAGS, "--model", *MODEL_ARG_FLAGS):
            if not eq:
                if i + 1 >= len(argv):
                    raise CliError(f"{name} needs a value")
                i += 1
                value = argv[i]
            if name in CONFIG_FLAGS:
                configs.append((name, value))
            elif name == "--model":
                out.model = value
            else:
                out.model_args.append(value)
        else:
            out.passthrough.append(token)
            if not eq and name in takes_value and i + 1 < len(argv):
                i += 1
                out.passthrough.append(argv[i])
        i += 1
    if len(configs) > 1:
        given = " and ".join(f"{n} {v}" for n, v in configs)
        raise CliError(f"give the config once: {given} (--config, --config_file and --config-file are one option)")
    if configs:
        out.config = configs[0][1]
    if out.model_args and out.model is None:
        raise CliError("--model-arg needs --model")
    return out


def _parse_launcher(config: str, passthrough: list[str]) -> argparse.Namespace:
    """``accelerate launch --config_file CONFIG ...`` as Accelerate parses it; its refusal is a CliError."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return launch_command_parser().parse_args(["--config_file", config, *passthrough])
    except SystemExit:
        reason = err.getvalue().strip().splitlines()[-1:] or ["refused"]
        raise CliError(f"accelerate launch would refuse these arguments: {reason[0]}") from None


def launcher_environ(config: str, passthrough: list[str]) -> dict[str, str]:
    """The ``ACCELERATE_*`` / ``FSDP_*`` variables the workers will see: what ``accelerate
    launch --config_file CONFIG ...`` exports (Accelerate's own functions), else a mapping of
    ``--mixed_precision`` and ``--fsdp_*`` (see the module doc)."""
    args = _parse_launcher(config, passthrough)
    try:
        env = _accelerate_environ(args)
    except Exception:  # a YAML Accelerate cannot load, a device it lacks: the check decides
        args = _parse_launcher(config, passthrough)
        env = dict(os.environ)
        if args.mixed_precision is not None:
            env["ACCELERATE_MIXED_PRECISION"] = str(args.mixed_precision)
        for dest in sorted(getattr(args, "nondefault", ())):
            if dest.startswith("fsdp_"):
                env["ACCELERATE_USE_FSDP"] = "true"
                env[dest.upper()] = str(getattr(args, dest)).lower()
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}


def _accelerate_environ(args: argparse.Namespace) -> dict[str, str]:
    from accelerate.utils import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")  # "port in use": the launcher will say it, if still true
        args, _, _ = validate_launch_command(args)
        if (args.use_fsdp or args.use_megatron_lm or args.multi_gpu) and not args.cpu:
            return prepare_multi_gpu_env(args)  # launch_command's multi_gpu_launcher
        return prepare_simple_launcher_cmd_env(args)[1]


def launcher_command(config: str, passthrough: list[str]) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, *passthrough]


#: What starts the training script in each worker: ``python -m fsdp_overlap_plugin.accelerate SCRIPT``.
RUNNER = "fsdp_overlap_plugin.accelerate"


def through_plugin(passthrough: list[str], script_at: int | None) -> list[str]:
    """``passthrough`` with the training script started by ``python -m
    fsdp_overlap_plugin.accelerate`` (the launcher's ``-m``), which imports the Accelerate
    adapter first: a script that never imports the plugin (a transformers ``Trainer``
    script) trains through it. ``SCRIPT ARGS`` -> ``-m fsdp_overlap_plugin.accelerate SCRIPT
    ARGS``; with ``-m MODULE ARGS`` -> ``-m fsdp_overlap_plugin.accelerate -m MODULE ARGS``.
    Unchanged without a script or with ``--no_python`` (not a Python script)."""
    if script_at is None or script_at >= len(passthrough):
        return list(passthrough)
    options, rest = passthrough[:script_at], passthrough[script_at:]
    if any(o in ("--no_python", "--no-python") for o in options):
        return list(passthrough)
    dashes = ["--"] if rest[0] == "--" else []
    rest = rest[len(dashes) :]
    if any(o in ("-m", "--module") for o in options):
        return [*options, *dashes, RUNNER, "-m", *rest]
    return [*options, "-m", *dashes, RUNNER, *rest]


def _script_file(launcher: argparse.Namespace) -> Path | None:
    """The training script's file: the script, or ``-m``'s module found on the path (not imported)."""
    script = getattr(launcher, "training_script", None)
    if not script or getattr(launcher, "no_python", False):
        return None
    if not getattr(launcher, "module", False):
        return Path(script)
    parts = script.split(".")
    for base in [os.getcwd(), *sys.path]:
        for candidate in (Path(base, *parts).with_suffix(".py"), Path(base, *parts, "__main__.py")):
            if candidate.is_file():
                return candidate
    return None


def script_model(script: Path | None) -> str | None:
    """The ``FSDP_OVERLAP_MODEL = "package.module:factory"`` a training script sets at module
    level (a string literal, read with ``ast``: the script is not run), or None. A relative
    ``path/file.py:factory`` is made relative to the script's folder."""
    if script is None or script.suffix != ".py" or not script.is_file():
        return None
    try:
        tree = ast.parse(script.read_text(encoding="utf-8"), filename=str(script))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if not any(isinstance(t, ast.Name) and t.id == SCRIPT_MODEL for t in targets):
            continue
        value = node.value
        if not (isinstance(value, ast.Constant) and isinstance(value.value, str)):
            raise CliError(
                f'{script}:{node.lineno}: {SCRIPT_MODEL} must be a string, e.g. {SCRIPT_MODEL} = "pkg.mod:factory"'
            )
        spec = value.value
        module, sep, rest = spec.partition(":")
        if sep and module.endswith(".py") and not Path(module).is_absolute():
            spec = f"{script.parent / module}:{rest}"
        return spec
    return None


def _check(args: LaunchArgs) -> None:
    """``fsdp-overlap check`` on the YAML as the workers will see it; raises on a bad one."""
    from .commands import cmd_check

    assert args.config is not None
    launcher = _parse_launcher(args.config, args.passthrough)
    world = launcher.num_processes
    environ = launcher_environ(args.config, args.passthrough)
    model, source = args.model, "--model"
    if model is None:
        script = _script_file(launcher)
        model = script_model(script)
        source = f"{script}: {SCRIPT_MODEL}"
    ns = argparse.Namespace(config=args.config, model=model, model_arg=list(args.model_args), world=world)
    ns.__dict__.update(small_bytes=SMALL_BUCKET_BYTES, expand=False, strict=False, json=False, environ=environ)
    try:
        _, out, lines = cmd_check(ns)
    except CliError as exc:
        if args.model is not None or model is None:
            raise
        raise CliError(f"{source} = {model!r}: {exc}") from None
    shape = out["config"]["shape"]
    if shape != "accelerate":
        raise CliError(
            f"{args.config}: a {shape} YAML, not an Accelerate YAML (accelerate launch --config_file needs one: "
            "compute_environment, distributed_type: FSDP, plugin keys under fsdp_config as fsdp_overlap_<key>)"
        )
    if out.get("plan") is not None:
        print(f"fsdp-overlap launch: {args.config}: {lines[-1]}")
        if args.model is None:
            print(f"  model: {model} (from {source})")
    else:
        print(f"fsdp-overlap launch: {args.config}: keys valid; {NOT_CHECKED}")
    for note in out["config"]["notes"]:
        print(f"  note: {note}")
    for w in out["warnings"]:
        print(f"  warning [{w['kind']}] {w['message']}")


def _terminal_sent(signum: int) -> bool:
    """A SIGINT from the terminal: it reached our whole process group, the launcher too."""
    if signum != signal.SIGINT:
        return False
    for fd in (0, 1, 2):
        try:
            return os.tcgetpgrp(fd) == os.getpgrp()
        except (OSError, AttributeError):
            continue
    return False


def _run(cmd: list[str], env: dict[str, str]) -> int:
    """Run the launcher to the end, forwarding SIGINT / SIGTERM; its exit code (128 + N: signal N)."""
    proc: subprocess.Popen | None = None
    early: list[int] = []  # arrived before the launcher existed: sent to it once it does

    def forward(signum, _frame):
        if proc is None:
            early.append(signum)
        elif proc.poll() is None and not _terminal_sent(signum):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

    previous = {}
    with contextlib.suppress(ValueError):  # not the main thread: no handlers, plain wait
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, forward)
    try:
        proc = subprocess.Popen(cmd, env=env)
        for sig in early:
            proc.send_signal(sig)
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code if code >= 0 else 128 - code


def main(argv: list[str]) -> int:
    """``fsdp-overlap launch ARGS``; returns the exit code."""
    try:
        args = split_args(list(argv))
        if args.help:
            print(USAGE)
            return 0
        if args.config is None:
            hint = " (a --config after the training script is the script's own)" if "--config" in argv else ""
            raise CliError(f"the Accelerate YAML is needed: --config CONFIG (or --config_file CONFIG){hint}")
        _check(args)
    except (OverlapConfigError, CliError) as exc:
        print(f"fsdp-overlap launch: error: {exc}", file=sys.stderr)
        return 2
    passthrough = through_plugin(args.passthrough, args.script_at)
    cmd = launcher_command(args.config, passthrough)
    print(f"fsdp-overlap launch: accelerate launch --config_file {shlex.join([args.config, *passthrough])}")
    sys.stdout.flush()
    env = dict(os.environ, FSDP_OVERLAP_CONFIG=str(Path(args.config).expanduser().resolve()))
    return _run(cmd, env)
