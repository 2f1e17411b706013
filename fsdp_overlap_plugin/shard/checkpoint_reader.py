"""Training checkpoints read from disk one tensor at a time, in one process, whatever the
world size that wrote them: what ``fsdp-overlap export`` turns into a ``save_pretrained``
folder.

``open_checkpoint(path)`` recognises:

* a ``torch.distributed.checkpoint`` directory (``.metadata`` and ``*.distcp`` files):
  ``fsdp_overlap_plugin.shard.checkpoint.save``'s ``step_*`` (or the folder holding them and
  ``latest``), Lightning's sharded checkpoint, Accelerate's ``save_state`` folder on GPUs
  (``pytorch_model_fsdp_0/``), ``dcp.save(model.state_dict())`` of torch's ``fully_shard``.
  A tensor is read by asking DCP for that key alone: it reads just the byte ranges of its
  shards, from every rank's file, so memory stays at about one tensor;
* a ``torch.save`` file: Lightning's full checkpoint (``state_dict_type="full"``),
  Accelerate's ``FULL_STATE_DICT`` ``pytorch_model_fsdp.bin``, ``pytorch_model.bin``.
  Memory-mapped (``mmap=True``), so tensors are read from the page cache as they are used;
* safetensors: Accelerate's ``save_state`` folder on a CPU launch (``model.safetensors``),
  or a ``save_pretrained`` folder (re-exported, e.g. in another dtype).

``CheckpointReader.entries`` lists the tensors by their flat names (``model.lm_head.weight``
in a ``checkpoint.save`` folder, ``state_dict.model.lm_head.weight`` in Lightning's);
``model_names`` finds where a model's state dict sits among them.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..config.schema import OverlapConfigError
from .atomic_checkpoint import incomplete_message
from .weights import index_files

__all__ = ["CheckpointReader", "model_names", "open_checkpoint"]

Shape = tuple[int, ...]

# Accelerate's save_state files, model 0 (accelerate.utils.constants), in the order tried
_ACCELERATE_FILES = ("pytorch_model_fsdp.bin", "model.safetensors.index.json", "model.safetensors", "pytorch_model.bin")
_ACCELERATE_DCP = "pytorch_model_fsdp_0"
_TORCH_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
_OTHER_MODELS = re.compile(
    r"(pytorch_model_fsdp_[1-9]\d*|(model|pytorch_model|pytorch_model_fsdp)_[1-9]\d*\.(safetensors|bin))"
)
_MAX_NAMES = 8


class CheckpointReader:
    """The tensors of one checkpoint: ``entries`` (flat name -> shape, dtype) and
    ``read(names)``. ``kind`` and ``path`` say what was found where; ``container`` is the
    prefix under which the model's state dict sits when the format says so
    (``"state_dict."`` for Lightning, ``"model."`` for ``checkpoint.save`` and Accelerate's
    sharded files), else ``""``."""

    kind: str
    path: Path
    container: str = ""
    entries: dict[str, tuple[Shape, torch.dtype]]
    notes: tuple[str, ...] = ()

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class _DistributedCheckpoint(CheckpointReader):
    def __init__(self, path: Path, kind: str):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.kind = kind
        self.path = path
        metadata = FileSystemReader(str(path)).read_metadata()
        self.entries = {
            key: (tuple(md.size), md.properties.dtype)
            for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }
        names = list(self.entries)
        if any(n.startswith("state_dict.") for n in names):
            self.container = "state_dict."  # Lightning: {"state_dict": ..., "optimizer_0": ...}
        elif names and all(n.startswith(("model.", "optim.")) for n in names):
            self.container = "model."  # checkpoint.save: {"model", "optim", "meta"}; Accelerate: {"model"}

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        out = {name: torch.empty(self.entries[name][0], dtype=self.entries[name][1]) for name in names}
        with warnings.catch_warnings():
            # "torch.distributed is ... uninitialized, assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(out, storage_reader=FileSystemReader(str(self.path)))
        return out


class _TorchFile(CheckpointReader):
    def __init__(self, path: Path, kind: str):
        self.kind = kind
        self.path = path
        try:
            data = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:
            raise OverlapConfigError(
                f"{path}: cannot read it as a torch.save file with weights_only=True ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''})."
            ) from None
        if isinstance(data, dict) and isinstance(data.get("state_dict"), dict):
            self.container = "state_dict."  # Lightning's full checkpoint
        self.tensors = dict(_flatten(data))
        self.entries = {name: (tuple(t.shape), t.dtype) for name, t in self.tensors.items()}

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return {name: self.tensors[name] for name in names}


class _Safetensors(CheckpointReader):
    def __init__(self, files: dict[Path, list[str] | None], path: Path, kind: str):
        from safetensors import safe_open

        self.kind = kind
        self.path = path
        self.files: dict[str, Path] = {}
        self.entries = {}
        for file, keys in files.items():
            with safe_open(str(file), framework="pt") as handle:
                for key in keys if keys is not None else handle.keys():
                    piece = handle.get_slice(key)
                    self.entries[key] = (tuple(piece.get_shape()), _SAFETENSORS_DTYPES[piece.get_dtype()])
                    self.files[key] = file

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        out = {}
        for name in names:
            with safe_open(str(self.files[name]), framework="pt") as handle:
                out[name] = handle.get_tensor(name)
        return out


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    **{
        c: getattr(torch, n) for n, c in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")) if hasattr(torch, n)
    },
}


def _flatten(data: Any, prefix: str = "") -> Iterable[tuple[str, torch.Tensor]]:
    """The tensors of nested dicts, by dotted name (as DCP flattens them)."""
    if isinstance(data, torch.Tensor):
        yield prefix.removesuffix("."), data
    elif isinstance(data, dict):
        for key, value in data.items():
            yield from _flatten(value, f"{prefix}{key}.")


def _safetensors_files(path: Path) -> dict[Path, list[str] | None]:
    if path.name.endswith(".json"):
        return dict(index_files(path, "export"))
    return {path: None}


def open_checkpoint(path: str | Path) -> CheckpointReader:
    """The reader for the checkpoint at ``path`` (module doc); an error that lists what
    the folder holds when it is none of them."""
    path = Path(path)
    if not path.exists():
        raise OverlapConfigError(f"no checkpoint at {str(path)!r}")
    if path.is_file():
        if path.name.endswith((".safetensors", ".safetensors.index.json")):
            return _Safetensors(_safetensors_files(path), path, "safetensors")
        if path.suffix in _TORCH_SUFFIXES:
            return _TorchFile(path, "torch.save file")
        raise OverlapConfigError(
            f"{path}: expected a checkpoint folder, a .safetensors file (or its index .json) or a torch.save file "
            f"({', '.join(_TORCH_SUFFIXES)})."
        )
    latest = path / "latest"
    if latest.is_file() and (path / latest.read_text().strip()).is_dir():
        step = path / latest.read_text().strip()
        _refuse_incomplete(step)
        return _DistributedCheckpoint(step, "fsdp_overlap_plugin.shard.checkpoint step")
    _refuse_incomplete(path)
    if (path / ".metadata").is_file():
        kind = "Lightning sharded checkpoint" if (path / "meta.pt").is_file() else "distributed checkpoint (DCP)"
        if path.name.startswith("step_"):
            kind = "fsdp_overlap_plugin.shard.checkpoint step"
        return _DistributedCheckpoint(path, kind)
    reader: CheckpointReader | None = None
    if (path / _ACCELERATE_DCP / ".metadata").is_file():
        reader = _DistributedCheckpoint(path / _ACCELERATE_DCP, "Accelerate save_state (sharded)")
    for name in _ACCELERATE_FILES if reader is None else ():
        file = path / name
        if file.is_file():
            if name.endswith(".bin"):
                reader = _TorchFile(file, "Accelerate save_state (full)")
            else:
                reader = _Safetensors(_safetensors_files(file), file, "safetensors")
            break
    if reader is not None:
        # save_state writes every prepared model: model_1.safetensors, pytorch_model_fsdp_1/, ...
        others = sorted(p.name for p in path.iterdir() if _OTHER_MODELS.fullmatch(p.name))
        if others:
            reader.notes = (
                f"{path} holds {len(others) + 1} models' weights; this is model 0 ({reader.path.name}). "
                f"To export another, pass its file or folder: {', '.join(others)}",
            )
        return reader
    held = sorted(p.name for p in path.iterdir())
    raise OverlapConfigError(
        f"{path}: not a checkpoint this tool reads (it holds {held[:_MAX_NAMES]}). Expected a "
        "torch.distributed.checkpoint folder (.metadata: checkpoint.save's step_*, Lightning's sharded checkpoint), "
        f"Accelerate's save_state folder ({_ACCELERATE_DCP}/ or one of {', '.join(_ACCELERATE_FILES)}), a "
        "save_pretrained folder, or a torch.save / .safetensors file."
    )


def _refuse_incomplete(folder: Path) -> None:
    """A folder that lacks a file its save wrote (``atomic_checkpoint.missing_files``) is
    named as such, with the newest complete checkpoint beside it, before DCP fails on it."""
    message = incomplete_message(folder)
    if message is not None:
        raise OverlapConfigError(message)


def model_names(
    reader: CheckpointReader, model_keys: list[str] | None, prefix: str | None = None
) -> tuple[dict[str, str], str, list[str]]:
    """``({model key: checkpoint name}, prefix, left out)``: where the model's state dict
    sits in the checkpoint. ``prefix`` given: the names under it. Else with ``model_keys``
    (the model's state-dict keys): the prefix under which most of them are found
    (``state_dict.model.`` for a LightningModule's ``self.model``); every key must be
    there. Without either: the format's ``container``. ``left out``: checkpoint names under
    the prefix that the model does not have."""
    names = list(reader.entries)
    if prefix is None and model_keys:
        candidates = {""}
        for name in names:
            parts = name.split(".")
            candidates.update(".".join(parts[:i]) + "." for i in range(1, min(len(parts), 5)))
        present = set(names)
        prefix = max(sorted(candidates, key=len), key=lambda p: sum(p + k in present for k in model_keys))
    if prefix is None:
        prefix = reader.container
    under = {name[len(prefix) :]: name for name in names if name.startswith(prefix)}
    if not under:
        raise OverlapConfigError(
            f"{reader.path}: no tensor under the prefix {prefix!r}; its tensors start {names[:_MAX_NAMES]}."
        )
    if model_keys is None:
        return under, prefix, []
    missing = [k for k in model_keys if k not in under]
    if missing:
        more = f" and {len(missing) - _MAX_NAMES} more" if len(missing) > _MAX_NAMES else ""
        raise OverlapConfigError(
            f"{reader.path}: the model's {', '.join(missing[:_MAX_NAMES])}{more} are not in the checkpoint "
            f"(looked under {prefix!r}; its tensors start {names[:4]}). Is it a checkpoint of this model? "
            "--prefix names where the model's state dict starts."
        )
    wanted = set(model_keys)
    return {k: under[k] for k in model_keys}, prefix, [k for k in under if k not in wanted]
