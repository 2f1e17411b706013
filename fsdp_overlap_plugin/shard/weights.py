"""Loading a local ``safetensors`` checkpoint (what ``save_pretrained`` writes) into a
sharded model, each rank reading only the rows of its own shards.

Why not ``from_pretrained`` on every rank: it builds the whole model in every rank's memory
before anything is sharded. Why not Accelerate's ``fsdp_cpu_ram_efficient_loading`` (one
full copy on rank 0, broadcast to the others): rank 0 still needs the whole model's memory,
and every byte crosses the network once per rank. A ``safetensors`` file is memory-mapped
and ``get_slice(...)[start:stop]`` reads just those rows, so with ``Shard(0)`` each rank
reads ``1/world`` of every parameter from disk and nothing is sent between ranks.

Checkpoint keys are matched to the model's parameter and buffer names the way
``from_pretrained`` matches them: transformers' key renamings for the model's family
(``GPT-NeoX``'s ``embed_out`` -> ``lm_head``, legacy ``gamma``/``beta`` names, the base
model prefix). A checkpoint that needs one of transformers' *converters* (several tensors
merged into one, e.g. Mixtral's per-expert weights into fused expert tensors) is refused
with the keys named: slicing a merged tensor per shard is not implemented yet.

A parameter shared by several modules (tied embeddings) is one tensor: it is loaded once,
from whichever of its names the checkpoint holds (``lm_head.weight`` is not saved when tied).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..config.schema import OverlapConfigError
from . import hf
from .initialize import check_finite, slots
from .sharding import local_box

__all__ = ["load_pretrained"]

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_MAX_NAMES = 12


def load_pretrained(model: nn.Module, path: str | Path, *, strict: bool = True) -> dict:
    """Copy the checkpoint at ``path`` (a ``save_pretrained`` folder, its index file, or one
    ``.safetensors`` file) into ``model``'s parameters and persistent buffers in place; on a
    sharded model each rank reads and writes only its shards (module doc). The model must be
    materialized already (``materialize``, or a strategy that ran it), so the tensors a
    checkpoint does not hold (non-persistent buffers such as rotary ``inv_freq``) keep their
    initialisation.

    ``strict``: a model tensor the checkpoint lacks, or a checkpoint key the model does not
    have, is an error naming them (else they are listed in the result). Returns
    ``{"loaded": [...], "missing": [...], "unexpected": [...], "files": n}``.
    """
    from safetensors import safe_open

    files = _checkpoint_files(Path(path))
    targets = _targets(model)
    rename = _renamer(model, targets)
    loaded: dict[int, str] = {}  # id(tensor) -> the checkpoint key it came from
    unexpected: list[str] = []
    refused: list[str] = []
    for file, keys in files.items():
        with safe_open(str(file), framework="pt") as handle:
            for key in keys if keys is not None else handle.keys():
                name, converter = rename(key)
                if converter:
                    refused.append(key)
                    continue
                tensor = targets.get(name)
                if tensor is None:
                    unexpected.append(key)
                    continue
                if id(tensor) in loaded:  # a tied tensor saved under two names
                    continue
                _copy_rows(handle.get_slice(key), key, name, tensor)
                loaded[id(tensor)] = key
    if refused:
        raise OverlapConfigError(
            f"load_pretrained: {path}: these checkpoint keys need one of transformers' weight "
            f"converters (tensors merged on load), which sharded loading does not do yet: {_names(refused)}. "
            "Load this model with from_pretrained before parallelize instead."
        )
    missing = sorted(name for name, t in targets.items() if id(t) not in loaded)
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"the checkpoint has no tensor for {_names(missing)}")
        if unexpected:
            parts.append(f"the model has no tensor named {_names(unexpected)}")
        raise OverlapConfigError(
            f"load_pretrained: {path}: {'; '.join(parts)}. Pass strict=False to load what matches."
        )
    check_finite(model)
    return {
        "loaded": sorted(loaded.values()),
        "missing": missing,
        "unexpected": sorted(unexpected),
        "files": len(files),
    }


def _names(names: list[str]) -> str:
    more = f" and {len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else ""
    return ", ".join(names[:_MAX_NAMES]) + more


def index_files(path: Path, what: str) -> dict[Path, list[str]]:
    """``{file: its keys}`` from the ``weight_map`` of a safetensors index (``path``); an
    ``OverlapConfigError`` (a ``ValueError``) starting with ``what`` when it has none."""
    index = json.loads(path.read_text())
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise OverlapConfigError(f"{what}: {path}: not a safetensors index (no 'weight_map')")
    files: dict[Path, list[str]] = {}
    for key, name in weight_map.items():
        files.setdefault(path.parent / name, []).append(key)
    return files


def _checkpoint_files(path: Path) -> dict[Path, list[str] | None]:
    """``{file: its keys (None: all)}``, from an index's ``weight_map`` or a single file."""
    if path.is_dir():
        if (path / _INDEX).is_file():
            path = path / _INDEX
        elif (path / _SINGLE).is_file():
            path = path / _SINGLE
        else:
            found = sorted(p.name for p in path.iterdir())
            raise FileNotFoundError(
                f"load_pretrained: {path} holds neither {_INDEX} nor {_SINGLE} (it holds {found[:8]}); "
                "only safetensors checkpoints are read (save_pretrained writes them by default)."
            )
    if not path.is_file():
        raise FileNotFoundError(f"load_pretrained: no checkpoint at {str(path)!r}")
    if path.name.endswith(".json"):
        return index_files(path, "load_pretrained")
    if not path.name.endswith(".safetensors"):
        raise ValueError(f"load_pretrained: {path}: expected a .safetensors file or its index .json")
    return {path: None}


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every name a checkpoint may use for a parameter or persistent buffer (tied tensors
    under each of their names), to the tensor itself (a DTensor when sharded)."""
    return {
        slot.fqn: slot.get()
        for slot in slots(model)
        if not (slot.kind == "_buffers" and slot.name in slot.module._non_persistent_buffers_set)
    }


def _renamer(model: nn.Module, targets: dict[str, torch.Tensor]):
    """``key -> (model name, converter pattern or None)``: transformers' own renaming for a
    transformers model (as ``from_pretrained``), the identity otherwise."""
    if not hf.is_transformers_model(model):
        return lambda key: (key, None)
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # pragma: no cover - a transformers without the v5 loading API
        return lambda key: (key, None)
    with hf.library_classes(model):
        transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(key: str) -> tuple[str, str | None]:
        if key in targets:
            return key, None
        name, converter = rename_source_key(key, renamings, converters, prefix, targets)
        return name, converter

    return rename


def _copy_rows(source, key: str, name: str, tensor: torch.Tensor) -> None:
    """Copy the part of the checkpoint tensor ``source`` (a safetensors slice) that this
    rank holds into ``tensor`` (a DTensor: its local block, ``sharding.local_box``; else the
    whole tensor)."""
    shape = tuple(source.get_shape())
    if shape != tuple(tensor.shape):
        raise OverlapConfigError(
            f"load_pretrained: checkpoint tensor {key!r} has shape {list(shape)}, the model's {name} "
            f"has {list(tensor.shape)} (a checkpoint of another model size?)."
        )
    with torch.no_grad():
        if not isinstance(tensor, DTensor):
            tensor.copy_(source[:] if shape else source[...])
            return
        local = tensor.to_local()
        box = local_box(tensor)
        if local.numel() == 0:
            return
        local.copy_(source[box] if shape else source[...])
