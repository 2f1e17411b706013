"""``export``: a training checkpoint on disk -> a ``save_pretrained`` folder, offline, in one
process, whatever world size wrote it.

The checkpoint is read tensor by tensor (``checkpoint_reader``) and written tensor by tensor
by the writer the run's ``save_pretrained`` uses (``export.write_folder``), so the two give
the same files and memory stays near the largest tensor. With ``--model`` (an ``hf:`` config
or a factory, built on meta as for ``check``) the folder is a transformers one: tied copies
left out, the original checkpoint format, ``config.json``; the model's state dict is found
in the checkpoint by its names (``--prefix`` names where it starts). Without ``--model`` the
tensors are written under their checkpoint names, minus the format's container prefix."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from ..config.parse import format_bytes, parse_dtype
from ..shard.checkpoint_reader import model_names, open_checkpoint
from ..shard.export import export_root, tied_groups
from ..shard.export_files import Group, plan_export, write_folder
from .errors import CliError
from .models import load_model

__all__ = ["cmd_export"]


def cmd_export(args: argparse.Namespace) -> tuple[int, dict[str, Any], list[str]]:
    reader = open_checkpoint(args.checkpoint)
    model = info = None
    if args.model is not None:
        built, info = load_model(args.model, args.model_arg)
        model, inner = export_root(built)
        if inner:
            info["exported"] = inner
    meta = model.state_dict(keep_vars=True) if model is not None else None
    names, prefix, left_out = model_names(reader, list(meta) if meta is not None else None, args.prefix)
    entries = {key: reader.entries[name] for key, name in names.items()}
    if meta is not None:
        wrong = [k for k, t in meta.items() if tuple(t.shape) != entries[k][0]]
        if wrong:
            k = wrong[0]
            raise CliError(
                f"{args.checkpoint}: {names[k]} is {list(entries[k][0])} in the checkpoint but {k} is "
                f"{list(meta[k].shape)} in the model of {args.model} ({len(wrong)} such tensors): a checkpoint of "
                "another model size? Match the config (--model-arg) to the run's."
            )
    dtype = parse_dtype(args.dtype, "--dtype") if args.dtype is not None else None
    tied = tied_groups(meta) if meta is not None else []
    plan = plan_export(model, entries, tied, dtype=dtype, original_format=not args.model_format)

    def fetch(group: Group) -> dict[str, torch.Tensor]:
        read = reader.read([names[k] for k in group.sources])
        return {k: read[names[k]] for k in group.sources}

    try:
        written = write_folder(args.out, plan, fetch, max_shard_size=args.max_shard_size)
    except OSError as exc:
        raise CliError(f"{args.out}: {exc}") from None
    out = {
        "command": "export",
        "ok": True,
        "checkpoint": {
            "path": str(reader.path),
            "kind": reader.kind,
            "tensors": len(reader.entries),
            "notes": list(reader.notes),
        },
        "prefix": prefix,
        "model": info,
        "left_out": left_out,
        **written,
    }
    return 0, out, _lines(out, plan.config_model is not None)


def _lines(out: dict[str, Any], has_config: bool) -> list[str]:
    cp = out["checkpoint"]
    lines = [f"read   {cp['kind']} at {cp['path']} ({cp['tensors']} tensors)"]
    lines += [f"       {note}" for note in cp["notes"]]
    if out["model"] is not None:
        inner = f", its {out['model']['exported']}" if out["model"].get("exported") else ""
        lines.append(
            f"model  {out['model']['class']} from {out['model']['spec']}{inner}; its state dict at {out['prefix']!r}"
        )
    elif out["prefix"]:
        lines.append(f"names  under {out['prefix']!r} (the format's container), written without it")
    lines.append(
        f"wrote  {out['directory']}: {out['tensors']} tensors, {format_bytes(out['bytes'])} in "
        f"{', '.join(out['files'])}"
    )
    if out["dropped"]:
        lines.append(f"       left out as transformers does (tied copies): {', '.join(out['dropped'])}")
    if out["left_out"]:
        lines.append(f"       not in the model, not written: {', '.join(out['left_out'][:8])}")
    lines += [f"       {note}" for note in out["notes"]]
    if has_config:
        lines.append(f"load   AutoModelForCausalLM.from_pretrained({out['directory']!r})")
    else:
        lines.append("note   weights only: from_pretrained also needs config.json; pass --model hf:path/to/config.json")
    return lines
