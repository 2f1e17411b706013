"""The parts of the command line that ``--help`` shows and that live outside ``main.py``: the
``export`` and ``profile`` subparsers, the option defaults and the value readers argparse
calls. Free of torch (as is ``main.py``), so ``fsdp-overlap --help``, ``--version`` and every
``fsdp-overlap COMMAND --help`` start without importing it; the command's own module, which
does, is imported only to run it."""

from __future__ import annotations

import argparse
from typing import Any

from ..config.sizes import DEFAULT_MAX_SHARD_SIZE

__all__ = [
    "GRAPHS",
    "PROFILE_SEQ",
    "SMALL_BUCKET_BYTES",
    "add_export_parser",
    "add_model_arg",
    "add_profile_parser",
    "rate_arg",
]

#: Below this many bytes a bucket's fixed collective latency costs more than moving its
#: bytes (alpha * beta with alpha ~ 20 us, beta ~ 50 GB/s; see docs/tuning.md).
SMALL_BUCKET_BYTES = 2**20
#: Tokens per sequence ``profile`` times without --seq (fewer when the model takes fewer).
PROFILE_SEQ = 128
#: The graphs of a ``schedule_report``, as ``explain --graph`` names them.
GRAPHS = ("forward", "backward")


def rate_arg(text: str) -> float:
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


def add_model_arg(p: argparse.ArgumentParser) -> None:
    """``--model-arg KEY=VALUE`` (repeatable), for every command that builds ``MODEL``."""
    p.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for the model factory, or a config field for hf:, value read as YAML "
        "(repeatable): --model-arg n_layer=48",
    )


def add_export_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="turn a training checkpoint (any world size) into a save_pretrained folder, offline",
        description="Read a checkpoint written by a run (checkpoint.save's step_* or its folder, Lightning's "
        "checkpoint, Accelerate's save_state folder, a DCP folder, a torch.save or safetensors file) one tensor "
        "at a time and write a folder that from_pretrained loads.",
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint folder or file")
    p.add_argument("out", metavar="OUT", help="folder to write (created; earlier weight files in it are replaced)")
    p.add_argument(
        "--model",
        default=None,
        help="hf:path/to/config.json or package.module:factory: writes config.json and transformers' names "
        "(without it: the checkpoint's names, weights only)",
    )
    add_model_arg(p)
    p.add_argument("--prefix", default=None, help="where the model's state dict starts in the checkpoint's names")
    p.add_argument("--dtype", default=None, help="cast floating-point tensors: bf16 | fp16 | fp32 (default: as saved)")
    p.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help=f"largest file before splitting with an index (default {DEFAULT_MAX_SHARD_SIZE})",
    )
    p.add_argument(
        "--model-format",
        action="store_true",
        help="keep the model's own names and layout (skip transformers' reverse weight conversions)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def add_profile_parser(sub: Any) -> None:
    p = sub.add_parser(
        "profile",
        help="measure this machine's compute rate on a model (a JSON for compute_profile / --profile)",
        description="Time a few unsharded, compiled training steps of MODEL on one device and write the "
        "achieved FLOP/s that predictions (the report, check, inspect, suggest) can use instead of a preset's.",
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help="package.module:factory (e.g. fsdp_overlap_plugin.models.gpt:gpt_1b) or hf:path/to/config.json",
    )
    p.add_argument("--out", default="compute_profile.json", help="JSON to write (default compute_profile.json)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument(
        "--seq",
        type=int,
        default=None,
        help=f"tokens per sequence (default {PROFILE_SEQ}, or the model's maximum when it takes fewer; more than it "
        "is an error)",
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first; the first compiles (default 2)")
    p.add_argument("--device", default=None, help="cpu, cuda or npu (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="parameter dtype (default fp32)")
    p.add_argument("--no-compile", action="store_true", help="time the eager model (what compile: false runs)")
    p.add_argument("--threads", type=int, default=None, help="torch threads on cpu (default: torch's)")
    add_model_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
