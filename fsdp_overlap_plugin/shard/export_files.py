"""The export plan and the folder it writes: which tensors a ``save_pretrained`` folder
holds (``plan_export``: tied weights once, transformers' original checkpoint names and
layout) and the safetensors files, index and config written one group of tensors at a
time (``write_folder``). No process group: ``shard/export.py`` feeds it gathered tensors
in a run, ``fsdp-overlap export`` tensors read from a checkpoint on disk.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..config.parse import parse_bytes
from ..config.schema import OverlapConfigError
from ..config.sizes import DEFAULT_MAX_SHARD_SIZE
from . import hf

__all__ = ["INDEX_FILE", "SINGLE_FILE", "ExportPlan", "Group", "plan_export", "write_folder"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

# torch dtype -> safetensors' name (the format's spec)
_DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    **{
        getattr(torch, n): c for n, c in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")) if hasattr(torch, n)
    },
    **{getattr(torch, n): c for n, c in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")) if hasattr(torch, n)},
}

Shape = tuple[int, ...]


# ------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class Group:
    """State-dict entries read together (``sources``), and the tensors written from them
    (``outputs``: name, shape, dtype): one entry to itself, a tied tensor to each of its
    names, or a fused entry to the tensors of the original checkpoint format."""

    sources: tuple[str, ...]
    outputs: tuple[tuple[str, Shape, torch.dtype], ...]

    @property
    def nbytes(self) -> int:
        return sum(_numel(shape) * dtype.itemsize for _, shape, dtype in self.outputs)


@dataclass
class ExportPlan:
    """What ``write_folder`` writes: the groups in state-dict order, what was left out and
    why, and the transformers model whose config goes with the weights (if any)."""

    groups: list[Group]
    dropped: list[str] = field(default_factory=list)  # tied copies transformers leaves out
    notes: list[str] = field(default_factory=list)
    config_model: nn.Module | None = None
    dtype: torch.dtype | None = None  # the cast applied to floating-point tensors
    revert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None

    def transform(self, group: Group, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors of ``group.outputs`` from its sources' full tensors."""
        if self.revert is not None:
            produced = self.revert(tensors)
        else:
            source = tensors[group.sources[0]]
            produced = {name: source for name, _, _ in group.outputs}
        out = {}
        for name, shape, dtype in group.outputs:
            tensor = produced[name]
            if tensor.is_floating_point() and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise RuntimeError(
                    f"export: {name} came out {list(tensor.shape)} {tensor.dtype}, planned {list(shape)} {dtype}"
                )
            out[name] = tensor
        return out

    @property
    def tensors(self) -> int:
        return sum(len(g.outputs) for g in self.groups)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)


def plan_export(
    model: nn.Module | None,
    entries: Mapping[str, tuple[Shape, torch.dtype]],
    tied: list[list[str]],
    *,
    dtype: torch.dtype | None = None,
    original_format: bool = True,
) -> ExportPlan:
    """The groups to write for the state-dict ``entries`` (name -> global shape, dtype, in
    state-dict order) of ``model`` (a live or meta-device module, or None: every entry to
    itself). ``tied``: groups of entry names that hold one tensor. ``dtype``: cast
    floating-point tensors to it. ``original_format``: a transformers model's entries in
    the names and layout of its original checkpoint format (see the module doc)."""
    transformers_model = model is not None and hf.is_transformers_model(model)
    dropped = hf.tied_copies(model, tied) if transformers_model else set()
    copies = {} if transformers_model else {names[0]: names for names in tied}
    in_tied = {name for names in tied for name in names[1:]}
    cast = lambda d: dtype if dtype is not None and d.is_floating_point else d  # noqa: E731
    plan = ExportPlan(groups=[], dtype=dtype, config_model=model if transformers_model else None)
    plan.dropped = [name for name in entries if name in dropped]
    kept = [name for name in entries if name not in dropped and (transformers_model or name not in in_tied)]

    revert = hf.original_format(model) if transformers_model and original_format else None
    outputs_of = _reverted_outputs(revert, kept, entries, plan) if revert is not None else None
    if outputs_of is not None:
        plan.revert = revert
    for name in kept:
        shape, source_dtype = entries[name]
        if outputs_of is not None:
            outputs = tuple((n, s, cast(d)) for n, (s, d) in outputs_of[name].items())
        else:
            outputs = tuple((n, tuple(shape), cast(source_dtype)) for n in copies.get(name, [name]))
        plan.groups.append(Group((name,), outputs))
    names = [n for g in plan.groups for n, _, _ in g.outputs]
    if len(set(names)) != len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise OverlapConfigError(f"export: two tensors would be written as {repeated[:8]}")
    return plan


def _reverted_outputs(revert, kept: list[str], entries, plan: ExportPlan) -> dict[str, dict] | None:
    """Per kept entry, the tensors transformers' reverse conversions make of it alone
    (name -> (shape, dtype)), worked out on meta tensors; None when the model has no
    conversions, or when entries cannot be converted one at a time (then the model's
    own names are written, which ``from_pretrained`` reads as well)."""
    metas = {name: torch.empty(entries[name][0], dtype=entries[name][1], device="meta") for name in kept}
    whole = revert(metas)
    if len(whole) == len(metas) and all(whole.get(n) is metas[n] for n in metas):
        return None
    outputs: dict[str, dict] = {}
    for name in kept:
        outputs[name] = {n: (tuple(t.shape), t.dtype) for n, t in revert({name: metas[name]}).items()}
    merged = {n: v for out in outputs.values() for n, v in out.items()}
    if merged != {n: (tuple(t.shape), t.dtype) for n, t in whole.items()}:
        plan.notes.append(
            "the model's weight conversions join several entries into one checkpoint tensor, which an "
            "export one tensor at a time cannot do: written in the model's own names (from_pretrained reads them)"
        )
        return None
    plan.notes.append(f"{len(metas)} entries written as {len(whole)} tensors of the original checkpoint format")
    return outputs


def _numel(shape: Shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# --------------------------------------------------------------- safetensors files
class _SafetensorsFile:
    """One safetensors file written tensor by tensor: the header (every name, dtype,
    shape and offset) first, then each tensor's bytes in header order. Written to a
    temporary name and renamed when complete, so a file with this name is never partial."""

    def __init__(self, path: Path, layout: list[tuple[str, Shape, torch.dtype]]):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype in layout:
            if dtype not in _DTYPE_CODES:
                raise OverlapConfigError(f"export: {name} has dtype {dtype}, which safetensors cannot store")
            size = _numel(shape) * dtype.itemsize
            header[name] = {"dtype": _DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # tensor data starts 8-byte aligned
        self.path = path
        self.tmp = path.with_name(f".{path.name}.partial")
        self.expected = list(layout)
        self.handle = open(self.tmp, "wb")  # noqa: SIM115 - closed in close()/abort()
        self.handle.write(len(text).to_bytes(8, "little"))
        self.handle.write(text)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want, shape, dtype = self.expected.pop(0)
        assert name == want and tuple(tensor.shape) == shape and tensor.dtype == dtype, (name, want)
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        if data.numel():
            self.handle.write(data.view(torch.uint8).numpy().data)

    def close(self) -> None:
        assert not self.expected, f"export: {len(self.expected)} tensors were never written"
        self.handle.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.handle.close()
        self.tmp.unlink(missing_ok=True)


def _file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _split(groups: list[Group], max_bytes: int) -> list[list[Group]]:
    """Groups into files in order, a new file when the next group would pass
    ``max_bytes`` (a group larger than it gets a file of its own), as the hub's
    ``split_torch_state_dict_into_shards`` splits; within a file, the tensors of larger
    elements first, so each tensor starts aligned to its element size."""
    files: list[list[Group]] = [[]]
    size = 0
    for group in groups:
        if files[-1] and size + group.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(group)
        size += group.nbytes
    return [sorted(f, key=lambda g: -max((d.itemsize for _, _, d in g.outputs), default=1)) for f in files]


def write_folder(
    directory: str | os.PathLike,
    plan: ExportPlan,
    fetch: Callable[[Group], dict[str, torch.Tensor]],
    *,
    writer: bool = True,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> dict[str, Any]:
    """Write ``plan`` into ``directory`` as a ``save_pretrained`` folder. ``fetch(group)``
    returns the full tensors of ``group.sources``; it is called once per group, in the
    same order on every rank (a collective gather in a run). Only the ``writer`` writes
    files; an error while writing is raised after every group was fetched, so the other
    ranks are never left in a gather. Returns what was written."""
    max_bytes = parse_bytes(max_shard_size, "max_shard_size")
    assert max_bytes is not None
    directory = Path(directory)
    files = _split(plan.groups, max_bytes)
    names = _file_names(len(files))
    error: BaseException | None = None
    extra: list[str] = []
    if writer:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            _remove_stale(directory, names)
        except OSError as exc:
            error = exc
    for name, groups in zip(names, files):
        out = None
        if writer and error is None:
            try:
                out = _SafetensorsFile(directory / name, [o for g in groups for o in g.outputs])
            except (OSError, OverlapConfigError) as exc:
                error = exc
        for group in groups:
            tensors = fetch(group)
            if out is None:
                continue
            try:
                for tensor_name, tensor in plan.transform(group, tensors).items():
                    out.write(tensor_name, tensor)
            except Exception as exc:  # noqa: BLE001 - raised below, once every rank is past its gathers
                error = exc
                out.abort()
                out = None
            del tensors
        if out is not None:
            try:
                out.close()
            except OSError as exc:
                error = exc
    if writer and error is None:
        try:
            extra = _write_index_and_config(directory, plan, files, names)
        except Exception as exc:  # noqa: BLE001
            error = exc
    if error is not None:
        raise error
    return {
        "directory": str(directory),
        "files": names + extra,
        "tensors": plan.tensors,
        "bytes": plan.nbytes,
        "dropped": plan.dropped,
        "notes": plan.notes,
    }


def _remove_stale(directory: Path, names: list[str]) -> None:
    """Weight files of an earlier save that this one will not overwrite (a different
    shard count), as transformers removes them."""
    for path in directory.iterdir():
        stale = path.name == SINGLE_FILE or _SHARD_FILE.fullmatch(path.name) or path.name == INDEX_FILE
        if stale and path.name not in names and path.is_file():
            path.unlink()


def _write_index_and_config(directory: Path, plan: ExportPlan, files: list[list[Group]], names: list[str]) -> list[str]:
    written = []
    if len(names) > 1:
        weight_map = {n: file for file, groups in zip(names, files) for g in groups for n, _, _ in g.outputs}
        metadata: dict[str, Any] = {"total_size": plan.nbytes}
        if plan.config_model is not None:
            metadata["total_parameters"] = sum(p.numel() for p in plan.config_model.parameters())
        index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(INDEX_FILE)
    if plan.config_model is not None:
        floating = [d for g in plan.groups for _, _, d in g.outputs if d.is_floating_point]
        dtype = plan.dtype or (floating[0] if floating else torch.float32)
        written += hf.save_config(plan.config_model, directory, dtype)
    return written


if sys.byteorder != "little":  # pragma: no cover - safetensors stores little-endian bytes
    raise ImportError("fsdp_overlap_plugin.shard.export_files writes safetensors, which needs a little-endian machine")
