"""The command line: the parser, the subcommands, the exit codes (0 ok; 1 ``--strict`` and a
warning, nothing to explain or draw, or nothing ``suggest`` tries fits its memory budget; 2 a
bad config, model spec, report or hardware setting)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from typing import Any

# Only torch-free modules here: building the parser (--help, --version, COMMAND --help) must
# not import torch; a command's module is imported when it runs (_COMMANDS).
from .._version import __version__
from ..config.hardware import HARDWARE
from ..config.sizes import format_bytes
from .errors import CliError
from .options import GRAPHS, SMALL_BUCKET_BYTES, add_export_parser, add_model_arg, add_profile_parser, rate_arg

__all__ = ["build_parser", "main"]

_LAUNCH = "launch"


def _size(option: str) -> Callable[[str], int]:
    """An argparse type reading a size (``2GiB``, ``512MiB``, bytes) for ``option``."""

    def read(text: str) -> int:
        from ..config.parse import parse_bytes
        from ..contract import OverlapConfigError

        try:
            value = parse_bytes(text, option)
        except OverlapConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        assert value is not None
        return value

    return read


_size_arg = _size("--small-bytes")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _add_predict_args(p: argparse.ArgumentParser) -> None:
    """The options of the predicted step (``check``, ``inspect``, ``suggest``)."""
    p.add_argument(
        "--hardware",
        default=None,
        metavar="SPEC",
        help=f"the machine the prediction assumes: a preset ({', '.join(HARDWARE)}), your own numbers "
        "(link=100GB/s,flops=300TFLOP/s), or both (h100-ib400,link=300GB/s); replaces the config's hardware "
        "setting (default: it, else the preset of this machine's GPU or NPU, as a run here assumes; h100-nvlink on a "
        "machine with neither)",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="PATH",
        help="a measured compute profile JSON (achieved_flops_per_s) whose rate replaces the compute rate; "
        "overrides the config's compute_profile",
    )
    p.add_argument("--batch", type=_positive, default=1, metavar="N", help="sequences per rank per step (default 1)")
    p.add_argument(
        "--seq",
        type=_positive,
        default=None,
        metavar="N",
        help="tokens per sequence (default 2048, or the model's maximum when it takes fewer; more than it is an error)",
    )


def _add_model_args(p: argparse.ArgumentParser) -> None:
    add_model_arg(p)
    p.add_argument(
        "--world",
        type=int,
        default=None,
        help="world size, to check the mesh, show memory per rank and predict the step (the prediction assumes "
        "8 ranks per replica without it)",
    )
    p.add_argument(
        "--small-bytes",
        type=_size_arg,
        default=SMALL_BUCKET_BYTES,
        metavar="SIZE",
        help=f"warn on buckets gathering less than this (default {format_bytes(SMALL_BUCKET_BYTES)}; see docs/tuning.md)",
    )
    p.add_argument("--expand", action="store_true", help="one line per block (text only; --json always has all)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-overlap",
        description="Inspect, check and explain fsdp-overlap bucket plans, on the meta device, with no GPU; "
        "launch an Accelerate job after checking its config.",
        epilog="Exit codes: 0 ok, 1 --strict with warnings, nothing to explain/draw or nothing within suggest's "
        "--memory-budget, 2 bad config, model, report or --hardware "
        "(launch: 2 before any worker starts, else accelerate launch's own exit code).",
    )
    parser.add_argument("--version", action="version", version=f"fsdp-overlap {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{inspect,check,suggest,profile,explain,timeline,export,launch}"
    )

    p = sub.add_parser("inspect", help="module tree with bytes per bucket candidate, and the auto plan")
    p.add_argument(
        "model",
        metavar="MODEL",
        help="package.module:factory (e.g. fsdp_overlap_plugin.models.gpt:gpt_1b) or hf:path/to/config.json",
    )
    p.add_argument("--config", default=None, help="a plugin, LightningCLI or Accelerate YAML (dtypes, bucket_bytes)")
    p.add_argument("--depth", type=int, default=0, help="also show N levels inside each bucketed module")
    _add_model_args(p)
    _add_predict_args(p)

    p = sub.add_parser("check", help="validate a YAML as the run would, and resolve its plan against a model")
    p.add_argument("config", metavar="CONFIG", help="a plugin, LightningCLI or Accelerate YAML")
    p.add_argument(
        "--model",
        default=None,
        help="package.module:factory or hf:path/to/config.json (default: model.class_path of a LightningCLI YAML)",
    )
    p.add_argument("--strict", action="store_true", help="exit 1 when there is any warning")
    _add_model_args(p)
    _add_predict_args(p)

    p = sub.add_parser(
        "suggest",
        help="the bucket plan and prefetch depth with the fastest predicted step, within a memory budget",
        description="Try the auto plan and plans of 2, 3, 4, 6 and 8 repeated blocks per bucket, each at "
        "prefetch_depth 1, 2 and 3, on the cost model; print the fastest whose gathered-ahead peak fits "
        "--memory-budget and the config lines that select it. Exit 1 when none fits.",
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help="package.module:factory (e.g. fsdp_overlap_plugin.models.gpt:gpt_1b) or hf:path/to/config.json",
    )
    p.add_argument("--config", default=None, help="a plugin, LightningCLI or Accelerate YAML: the settings now")
    add_model_arg(p)
    p.add_argument("--world", type=int, default=None, help="world size (default: the config's, else 8 per replica)")
    p.add_argument(
        "--memory-budget",
        type=_size("--memory-budget"),
        default=None,
        metavar="SIZE",
        help="most parameter bytes prefetching may hold gathered at once, e.g. 2GiB (default: no budget)",
    )
    _add_predict_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    p = sub.add_parser("explain", help="per-bucket launches and waits before/after the passes, from a report JSON")
    p.add_argument("report", metavar="REPORT.json", help="json.dump(schedule_report(model)) output")
    p.add_argument("--graph", action="append", choices=GRAPHS, help="only this graph (repeatable)")
    p.add_argument("--sequence", action="store_true", help="also print every item in graph order")
    p.add_argument("--png", default=None, metavar="OUT.png", help="also draw the timeline (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    p = sub.add_parser("timeline", help="draw predicted compute/communication lanes before/after the passes (PNG)")
    p.add_argument("report", metavar="REPORT.json", help="json.dump(schedule_report(model)) output")
    p.add_argument("--out", default="timeline.png", help="PNG to write (default timeline.png)")
    p.add_argument("--flops", type=float, default=None, help="compute FLOP/s (default: by the report's device type)")
    p.add_argument("--mem", type=float, default=None, help="memory bytes/s")
    p.add_argument("--link", type=rate_arg, default=None, help="link rate per rank: 300mbit, 1gbit, 25gb (bytes)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    add_export_parser(sub)
    add_profile_parser(sub)

    # `launch` parses its own arguments (everything it does not know goes to accelerate
    # launch unchanged, the training script's arguments included): listed here for --help.
    sub.add_parser(
        _LAUNCH,
        help="check an Accelerate YAML (--config or --config_file), then run accelerate launch with it",
        add_help=False,
    )
    return parser


#: Each command's ``module:function`` (in this package), imported only to run it.
_COMMANDS = {
    "inspect": "commands:cmd_inspect",
    "check": "commands:cmd_check",
    "suggest": "commands:cmd_suggest",
    "profile": "profile:cmd_profile",
    "explain": "explain:cmd_explain",
    "timeline": "explain:cmd_timeline",
    "export": "export:cmd_export",
}


def _command(name: str) -> Callable[[argparse.Namespace], tuple[int, dict[str, Any], list[str]]]:
    module, function = _COMMANDS[name].split(":")
    return getattr(importlib.import_module(f".{module}", __package__), function)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [_LAUNCH]:
        from .launch import main as launch_main

        return launch_main(argv[1:])
    args = build_parser().parse_args(argv)
    command = _command(args.command)
    from ..contract import OverlapConfigError  # imports torch, as the command does

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
