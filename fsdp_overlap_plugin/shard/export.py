"""Weights out: a model's trained weights as a ``save_pretrained`` folder, one tensor at a time.

``save_pretrained(model, directory)`` works on a model sharded by the plugin (or by
``fully_shard``, or not at all). Each state-dict entry is gathered in turn
(``DTensor.full_tensor()``) and rank 0 streams it into safetensors files, so the memory it
costs is about one full tensor per rank, never the model. For a transformers model the
folder is what transformers' own ``save_pretrained`` writes:

* tied weights once, under the name ``from_pretrained`` expects (a tied Llama's
  ``lm_head.weight`` is left out);
* the checkpoint's original names and layout (transformers' reverse weight conversions,
  entry by entry: a Mixtral's fused experts back to one tensor per expert, GPT-NeoX's
  ``lm_head`` back to ``embed_out``);
* ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus
  ``model.safetensors.index.json`` past ``max_shard_size``;
* ``config.json`` (the library class in ``architectures``, the saved dtype) and
  ``generation_config.json``.

Any other module is written under its state-dict names, a tied tensor under each of its
names, so ``load_state_dict`` takes the file back as it is.

``full_state_dict(model)``: every entry as a full CPU tensor on rank 0 and ``{}`` on the
other ranks, the contract of Accelerate's FSDP2 ``get_state_dict``; for a model the
plugin prepared, ``accelerator.get_state_dict`` returns it.

**Every rank must call both.** A gather one rank starts alone waits for the others
forever (gloo and NCCL give up after the process group's timeout, 30 minutes by default):
that was the silent hang of ``save_pretrained`` under ``if accelerator.is_main_process``.
So both first count, through the store, the ranks that called them; a rank still alone
after ``timeout`` seconds (``rank_check_timeout``) stops with an error naming the fix. An
error while writing on rank 0 does not leave the others in the next gather: rank 0 keeps
gathering, writes nothing more, and its error is raised on every rank at the end.

The writer (``write_folder``) reads each group of tensors through a ``fetch`` function, so
``fsdp-overlap export`` writes the same files from a checkpoint on disk, in one process.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..config.parse import parse_bytes, parse_dtype
from ..config.schema import OverlapConfigError
from ..config.sizes import DEFAULT_MAX_SHARD_SIZE
from . import hf

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "ExportPlan",
    "Group",
    "export_root",
    "full_state_dict",
    "install_save_pretrained",
    "plan_export",
    "save_pretrained",
    "tied_groups",
    "write_folder",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# The store-based checks of one call: every rank makes its calls in the same order.
_CALLS = itertools.count()
_DEFAULT_TIMEOUT_S = 300.0

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


# ---------------------------------------------------------------------- in a run
class _AllRanks:
    """One collective export call: every rank must arrive (within ``timeout`` seconds),
    and rank 0's outcome (done, or the error that stopped it) reaches every rank."""

    def __init__(self, what: str, timeout: float | None, model: nn.Module):
        from ..runtime.ranks import RankAgreement

        self.what = what
        self.timeout = _timeout(model) if timeout is None else float(timeout)
        self.agreement = RankAgreement.default(f"fsdp_overlap/export/{next(_CALLS)}", self.timeout)
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def arrive(self) -> None:
        if self.agreement is None:
            return
        self.agreement.all_arrived(
            "arrive",
            f"{self.what} call",
            f"{self.what} gathers every parameter from all ranks, so every rank must call it, and only rank 0 "
            "writes: call it outside `if accelerator.is_main_process:` / `if trainer.is_global_zero:` / "
            "`if rank == 0:`.",
        )

    def finish(self, error: BaseException | None) -> None:
        """Share rank 0's outcome: raise rank 0's error (or this rank's own) on every rank.
        The other ranks wait for rank 0 to write its last tensor, at least 10 minutes."""
        if self.agreement is not None and (self.rank == 0 or error is None):
            text = None if error is None else f"{type(error).__name__}: {error}"
            failure = self.agreement.rank0_outcome("outcome", text, max(self.timeout, 600.0))
            if self.rank != 0 and failure:
                raise RuntimeError(f"fsdp-overlap: {self.what} failed on rank 0 (the writer): {failure}")
        if error is not None:
            raise error


def _timeout(model: nn.Module) -> float:
    from ..runtime.state import get_state

    for module in model.modules():
        state = get_state(module)
        if state is not None:
            return float(state.config.rank_check_timeout)
    return _DEFAULT_TIMEOUT_S


def export_root(model: nn.Module) -> tuple[nn.Module, str]:
    """The module whose weights are exported, and its FQN in ``model``: a LightningModule
    (or any wrapper) holding one transformers model and nothing else is exported as that
    model, with its names and its config."""
    if hf.is_transformers_model(model):
        return model, ""
    found = hf.outermost_transformers_models(model)
    if len(found) == 1:
        fqn, inner = found[0]
        if {id(p) for p in model.parameters()} <= {id(p) for p in inner.parameters()}:
            return inner, fqn
    return model, ""


def _local_entries(model: nn.Module, state_dict: Mapping[str, Any] | None) -> dict[str, torch.Tensor]:
    """The tensors to export by name: ``state_dict``'s, or ``model``'s own (the sharded
    parameters themselves, so tied names hold one object; never gathered here)."""
    from .sharding import gather_disabled

    if state_dict is None:
        with gather_disabled():
            state_dict = model.state_dict(keep_vars=True)
    return {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}


def _identity(tensor: torch.Tensor) -> tuple:
    """Equal for two entries that hold the same data (a tied weight read twice)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if local.device.type == "meta" or local.numel() == 0:
        return ("object", id(tensor))
    return (local.device.type, local.data_ptr(), tuple(tensor.shape), local.stride(), tensor.dtype)


def tied_groups(tensors: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Names (in state-dict order) of entries that hold one tensor, groups of two or more."""
    groups: dict[tuple, list[str]] = {}
    for name, tensor in tensors.items():
        groups.setdefault(_identity(tensor), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _gather(tensor: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """``tensor`` whole, on the CPU where ``keep`` (every rank joins a DTensor's gather)."""
    with torch.no_grad():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        return full.detach().to("cpu") if keep else None


def save_pretrained(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    state_dict: Mapping[str, Any] | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | str | None = None,
    original_format: bool = True,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Write ``model``'s weights to ``directory`` as a ``save_pretrained`` folder that plain
    ``from_pretrained`` loads (module doc). **Collective**: every rank calls it; only rank
    0 writes; memory is about one full tensor per rank.

    Args:
        model: a model sharded by the plugin (or ``fully_shard``, or unsharded). A module
            holding one transformers model and nothing else (a LightningModule's
            ``self.model``) saves that model.
        state_dict: the entries to write instead of the model's own (sharded or full).
        max_shard_size: a file holds at most this much ("5GB", "500MiB", bytes); past it
            the weights are split into several files with an index.
        dtype: cast floating-point tensors (``"bf16"``, ``torch.bfloat16``); default: as
            trained (the master weights' dtype).
        original_format: a transformers model's tensors in its original checkpoint
            format, as transformers' ``save_original_format`` (default True).
        timeout: seconds to wait for every rank to call it (default: the model's
            ``rank_check_timeout``, else 300).

    Returns (on every rank) the files, tensor count and bytes written, the names left out
    (tied copies) and notes.
    """
    together = _AllRanks("save_pretrained", timeout, model)
    together.arrive()
    root, prefix = export_root(model) if state_dict is None else (model, "")
    tensors = _local_entries(root, state_dict)
    cast = parse_dtype(dtype, "dtype") if dtype is not None else None
    entries = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    error: BaseException | None = None
    summary: dict[str, Any] = {}
    try:
        plan = plan_export(root, entries, tied_groups(tensors), dtype=cast, original_format=original_format)
        if prefix:
            plan.notes.insert(
                0, f"saved {prefix} ({type(root).__name__}), the transformers model {type(model).__name__} holds"
            )
        writer = together.rank == 0

        def fetch(group: Group) -> dict[str, torch.Tensor]:
            return {name: _gather(tensors[name], writer) for name in group.sources}

        summary = write_folder(directory, plan, fetch, writer=writer, max_shard_size=max_shard_size)
    except BaseException as exc:  # noqa: BLE001 - shared with every rank by finish()
        error = exc
    together.finish(error)
    return summary


def full_state_dict(model: nn.Module, *, timeout: float | None = None) -> dict[str, torch.Tensor]:
    """Every state-dict entry of ``model`` as a full CPU tensor on rank 0 (tied names hold
    one tensor, as in the model), ``{}`` on the other ranks. **Collective**, like
    ``save_pretrained``; Accelerate's FSDP2 ``get_state_dict`` returns the same."""
    together = _AllRanks("get_state_dict", timeout, model)
    together.arrive()
    keep = together.rank == 0
    tensors = _local_entries(model, None)
    out: dict[str, torch.Tensor] = {}
    error: BaseException | None = None
    try:
        gathered: dict[tuple, torch.Tensor | None] = {}
        for name, tensor in tensors.items():
            key = _identity(tensor)
            if key not in gathered:
                gathered[key] = _gather(tensor, keep)
            if keep:
                out[name] = gathered[key]
    except BaseException as exc:  # noqa: BLE001
        error = exc
    together.finish(error)
    return out


# ------------------------------------------- transformers' save_pretrained, in a run
_NOT_SHARDED_ARGS = {
    "push_to_hub": (False, "save, then upload the folder (huggingface_hub.upload_folder)"),
    "variant": (None, "rename the files after saving"),
    "distributed_checkpoint": (False, "use fsdp_overlap_plugin.shard.checkpoint.save for sharded checkpoints"),
}


def _transformers_save_pretrained(
    self: nn.Module,
    save_directory: str | os.PathLike,
    is_main_process: bool = True,
    state_dict: dict | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    save_original_format: bool = True,
    **kwargs: Any,
) -> None:
    """``model.save_pretrained(...)`` of a transformers model the plugin sharded.

    With full tensors in ``state_dict`` (``accelerator.get_state_dict(model)`` on rank 0,
    ``{}`` elsewhere) it is transformers' own. Otherwise (no ``state_dict``, or a sharded
    one) it is ``export.save_pretrained``: collective, so every rank calls it, and rank 0
    writes (``is_main_process`` is not needed; transformers' ``save_function`` and
    ``token`` have nothing to do)."""
    if state_dict is not None and not any(isinstance(v, DTensor) for v in state_dict.values()):
        with hf.library_classes(self):
            return type(self).save_pretrained(
                self,
                save_directory,
                is_main_process=is_main_process,
                state_dict=state_dict,
                max_shard_size=max_shard_size,
                save_original_format=save_original_format,
                **kwargs,
            )
    for key, (default, instead) in _NOT_SHARDED_ARGS.items():
        if kwargs.get(key, default) != default:
            raise OverlapConfigError(
                f"save_pretrained({key}={kwargs[key]!r}) is not supported on a model sharded by fsdp-overlap: {instead}."
            )
    if getattr(self, "_hf_peft_config_loaded", False):
        raise OverlapConfigError(
            "save_pretrained of a PEFT model sharded by fsdp-overlap is not supported: merge the adapters first."
        )
    save_pretrained(
        self, save_directory, state_dict=state_dict, max_shard_size=max_shard_size, original_format=save_original_format
    )
    return None


def install_save_pretrained(model: nn.Module) -> None:
    """Give every transformers model in ``model`` the ``save_pretrained`` above (an
    instance attribute: the class and its other methods are unchanged)."""
    for _, module in hf.outermost_transformers_models(model):
        module.save_pretrained = types.MethodType(_transformers_save_pretrained, module)


if sys.byteorder != "little":  # pragma: no cover - safetensors stores little-endian bytes
    raise ImportError("fsdp_overlap_plugin.shard.export writes safetensors, which needs a little-endian machine")
