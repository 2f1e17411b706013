"""A checkpoint on disk is complete or absent: what Lightning's strategies, the Accelerate
adapter and ``shard/checkpoint.py`` share to write checkpoints and to read them.

Writing (``written_atomically``)::

    .last.ckpt.partial/      every rank writes its files here
          |                  every rank has written (the ranks agree)
          |                  rank 0: every DCP .metadata and each file it lists are there;
          |                          the manifest (.fsdp_overlap_complete.json) lists
          |                          every file with its size
          v
    last.ckpt/               renamed into place; an old last.ckpt is swapped for it in one
                             step (Linux renameat2 RENAME_EXCHANGE), then removed

At every moment the name holds the old complete checkpoint or the new complete one; a
kill at any point leaves at most a hidden leftover (``.<name>.partial``,
``.<name>.removing``) that the next save in that folder removes. ``retire`` removes a
checkpoint the same way (renamed out of sight, then deleted), so a deletion cut short
never leaves half a checkpoint under its name.

Reading (``check_complete``): a folder whose manifest lists a file that is gone or has
another size, or (without a manifest: written by another tool) a DCP folder without its
``.metadata`` or with a shard file missing or short, is refused with an
``IncompleteCheckpointError`` that names each missing file and the newest complete
checkpoint beside it. Rank 0 looks, and every rank raises the same error.

The ranks must share the filesystem the checkpoint is written to (as DCP and Lightning
already require to load it); with Accelerate's ``save_on_each_node`` each node's first
rank renames its own copy (``writer``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = [
    "MANIFEST",
    "IncompleteCheckpointError",
    "check_complete",
    "incomplete_message",
    "missing_files",
    "newest_complete",
    "partial_path",
    "retire",
    "written_atomically",
]

MANIFEST = ".fsdp_overlap_complete.json"
METADATA = ".metadata"  # torch.distributed.checkpoint's index of the shards
_PARTIAL, _REMOVING, _OLD = ".partial", ".removing", ".old"
_SHARD = re.compile(r"__(\d+)_\d+\.distcp")
_RANDOM_STATES = re.compile(r"random_states_(\d+)\.pkl")
_CHECKPOINT_FILES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors")
# files that say a folder is a checkpoint (ours, DCP, Lightning's, Accelerate's)
_CHECKPOINT_MARKERS = re.compile(
    r"(\.fsdp_overlap_complete\.json|\.metadata|meta\.pt|__\d+_\d+\.distcp|random_states_\d+\.pkl|"
    r"(model|pytorch_model|optimizer|scheduler)(_\d+)?\.(safetensors|bin)|pytorch_model_fsdp_\d+|optimizer_\d+)"
)


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint on disk lacks a file its save wrote (or was never completed)."""


# --------------------------------------------------------------------------- ranks
def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _agree(error: str | None) -> str | None:
    """Every rank's ``error`` (None: nothing wrong) gathered; the first one, the same on
    every rank. Also a barrier: no rank returns before every rank has called it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return error
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e is not None), None)


def _raise_agreed(error: str | None, kind: type[Exception]) -> None:
    agreed = _agree(error)
    if agreed is not None:
        raise kind(agreed)


# ------------------------------------------------------------------------- writing
def partial_path(final: str | os.PathLike) -> Path:
    """Where the ranks write a checkpoint before it is renamed to ``final``."""
    final = Path(final)
    return final.parent / f".{final.name}{_PARTIAL}"


@contextlib.contextmanager
def written_atomically(
    final: str | os.PathLike, *, writer: bool | None = None, step: int | None = None
) -> Iterator[Path]:
    """Yields the hidden path every rank writes the checkpoint ``final`` to (a folder, or
    a file written by one rank); afterwards, when every rank has finished, it is renamed
    to ``final``, replacing an existing checkpoint there in one step. Every rank must
    enter it. ``writer``: this rank renames (default: rank 0). ``step``: recorded in the
    manifest, for error messages. An exception inside leaves ``final`` as it was.

    Refused before anything is written (``FileExistsError``, on every rank): ``final`` is
    a folder that holds no checkpoint (it is never deleted to make room)."""
    final = Path(final)
    partial = partial_path(final)
    writer = _rank() == 0 if writer is None else writer
    refusal = None
    if writer:
        refusal = _replace_refusal(final)
        if refusal is None:
            final.parent.mkdir(parents=True, exist_ok=True)
            _remove_leftovers(final)
    _raise_agreed(refusal, FileExistsError)
    yield partial
    # Past the agreement below every rank has written its files: rank 0 may look at them.
    _raise_agreed(None, IncompleteCheckpointError)
    _raise_agreed(_seal(partial, step) if writer else None, IncompleteCheckpointError)
    if writer:
        _place(partial, final)
    _raise_agreed(None, IncompleteCheckpointError)  # nobody reads ``final`` before it is there


def retire(path: str | os.PathLike) -> None:
    """Delete the checkpoint ``path`` (this rank only) without ever leaving part of it
    under its name: renamed out of sight first, then deleted."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir():
        path.unlink()
        return
    hidden = path.parent / f".{path.name}{_REMOVING}"
    _remove(hidden)
    os.rename(path, hidden)
    _remove(hidden)


def _replace_refusal(final: Path) -> str | None:
    if not os.path.lexists(final) or final.is_symlink() or not final.is_dir():
        return None
    held = sorted(p.name for p in final.iterdir())
    if not held or _holds_checkpoint(final):
        return None
    return (
        f"{final} exists and holds no checkpoint ({', '.join(held[:5])}{', ...' if len(held) > 5 else ''}). "
        "A checkpoint is written beside it and then takes its place, so the folder and everything in it would be "
        "deleted: save to another path, or move that folder away."
    )


def _remove_leftovers(final: Path) -> None:
    """What a kill left beside ``final``: an unfinished save or removal of that name,
    and of other names the hidden folders that hold checkpoint files (never anything
    else a user keeps there). A ``.<name>.old`` (a kill between the two renames of
    ``_place``'s fallback) goes only once ``<name>`` is back."""
    ours = {f".{final.name}{_PARTIAL}", f".{final.name}{_REMOVING}"}
    for entry in final.parent.iterdir():
        name = entry.name
        if name in ours:
            _remove(entry)
        elif name.startswith(".") and name.endswith((_PARTIAL, _REMOVING, _OLD)) and _holds_checkpoint(entry):
            if not name.endswith(_OLD) or (final.parent / name[1 : -len(_OLD)]).exists():
                _remove(entry)


def _holds_checkpoint(folder: Path) -> bool:
    return (
        folder.is_dir()
        and not folder.is_symlink()
        and any(_CHECKPOINT_MARKERS.fullmatch(p.name) for p in folder.iterdir())
    )


def _seal(partial: Path, step: int | None) -> str | None:
    """Check what the ranks wrote to ``partial`` and write its manifest; the reason it
    cannot be sealed, or None."""
    if not os.path.lexists(partial):
        return f"the checkpoint was not written: {partial} does not exist after every rank saved."
    if not partial.is_dir():
        return None  # one file, written by one rank: complete once written
    missing = _format_gaps(partial, ())
    if missing:
        return (
            f"the checkpoint written to {partial} is incomplete after every rank saved: {'; '.join(missing)}. "
            "Do all ranks write to the same filesystem?"
        )
    files = {
        p.relative_to(partial).as_posix(): p.stat().st_size
        for p in sorted(partial.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    manifest = {"complete": True, "step": step, "ranks": ranks, "written": time.time(), "files": files}
    with open(partial / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return None


def _place(partial: Path, final: Path) -> None:
    """``partial`` becomes ``final``; an existing ``final`` is swapped out in one step and
    removed, or (where the filesystem cannot swap) kept as ``.<name>.old`` until the new
    one is in place."""
    if not os.path.lexists(final):
        os.rename(partial, final)
    elif _exchange(partial, final):
        _remove(partial)  # now the old checkpoint
    else:
        old = final.parent / f".{final.name}{_OLD}"
        _remove(old)
        os.rename(final, old)
        os.rename(partial, final)
        _remove(old)
    _fsync_folder(final.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    platform or the filesystem cannot."""
    if sys.platform != "linux":
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # glibc older than 2.28
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(code, f"renameat2(RENAME_EXCHANGE) {a} <-> {b}: {os.strerror(code)}")


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform opens folders
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ------------------------------------------------------------------------- reading
def missing_files(path: str | os.PathLike, required: Iterable[str] = ()) -> list[str]:
    """What the checkpoint folder ``path`` lacks, in words (one entry per file); empty
    when complete. A file is complete once it exists (it is renamed into place whole).
    ``required``: files the loader needs besides what the manifest or the DCP index
    lists (Lightning's ``meta.pt``)."""
    path = Path(path)
    if not path.is_dir():
        return [] if path.exists() else [f"{path.name} (the checkpoint itself)"]
    manifest = path / MANIFEST
    if manifest.is_file():
        try:
            listed: dict[str, int] = json.loads(manifest.read_text())["files"]
        except (ValueError, KeyError) as exc:
            return [f"{MANIFEST} is unreadable ({exc})"]
        gaps = [_gap(path, name, size, exact=True) for name, size in listed.items()]
        gaps += [_describe(name) for name in required if name not in listed and not (path / name).exists()]
        return [g for g in gaps if g]
    return _format_gaps(path, required)


def _format_gaps(path: Path, required: Iterable[str]) -> list[str]:
    """Without a manifest: what the formats say must be there. Each DCP folder (``path``
    and its subfolders, as Accelerate writes them) needs its ``.metadata`` and every file
    that index lists, at least as long as the bytes it points into."""
    gaps = [_describe(name) for name in required if not (path / name).exists()]
    for folder in [path, *sorted(p for p in path.iterdir() if p.is_dir())]:
        has_index = (folder / METADATA).is_file()
        if not has_index and not any(_SHARD.fullmatch(p.name) for p in folder.iterdir()):
            continue
        prefix = "" if folder == path else f"{folder.name}/"
        if not has_index:
            if METADATA not in required or folder != path:
                gaps.append(_describe(prefix + METADATA))
            continue
        try:
            needed = _dcp_file_sizes(folder)
        except Exception as exc:  # a truncated or foreign index: say so rather than guess
            gaps.append(f"{prefix}{METADATA} is unreadable ({type(exc).__name__}: {exc})")
            continue
        gaps += [g for name, size in needed.items() if (g := _gap(folder, name, size, exact=False, prefix=prefix))]
    return gaps


def _dcp_file_sizes(folder: Path) -> dict[str, int]:
    """Each file a DCP folder's ``.metadata`` points into, and the bytes it must hold."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata()
    sizes: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = info.relative_path
        sizes[name] = max(sizes.get(name, 0), info.offset + info.length)
    return sizes


def _gap(folder: Path, name: str, size: int, *, exact: bool, prefix: str = "") -> str | None:
    file = folder / name
    if not file.is_file():
        return _describe(prefix + name)
    actual = file.stat().st_size
    if actual == size or (not exact and actual >= size):
        return None
    return f"{_describe(prefix + name, missing=False)} holds {actual} bytes, not the {size} it was written with"


def _describe(name: str, *, missing: bool = True) -> str:
    """A file, with what it is where we know."""
    base = name.rsplit("/", 1)[-1]
    what = ""
    if shard := _SHARD.fullmatch(base):
        what = f" (rank {shard.group(1)}'s shard)"
    elif base == METADATA:
        what = " (the index of every rank's shards, written last)"
    elif base == "meta.pt":
        what = " (Lightning's loop and callback state)"
    elif states := _RANDOM_STATES.fullmatch(base):
        what = f" (rank {states.group(1)}'s random states)"
    return f"`{name}`{what}" + (" is missing" if missing else "")


def newest_complete(
    folder: str | os.PathLike, *, exclude: str | os.PathLike | None = None, required: Iterable[str] = ()
) -> tuple[Path, int | None] | None:
    """The checkpoint in ``folder`` (other than ``exclude``) that was completed last, and
    its step where its manifest says; None when there is none. Hidden entries (our
    leftovers, Lightning's and DCP's dotfiles) are never candidates."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    skip = Path(exclude).name if exclude is not None else None
    best: tuple[float, Path, int | None] | None = None
    for entry in folder.iterdir():
        if entry.name.startswith(".") or entry.name == skip:
            continue
        if entry.is_dir():
            if not _holds_checkpoint(entry) or missing_files(entry, required):
                continue
            written, step = _written(entry)
        elif entry.suffix in _CHECKPOINT_FILES:
            written, step = entry.stat().st_mtime, None
        else:
            continue
        if best is None or written > best[0]:
            best = (written, entry, step)
    return None if best is None else (best[1], best[2])


def _written(folder: Path) -> tuple[float, int | None]:
    manifest = folder / MANIFEST
    if manifest.is_file():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            data = json.loads(manifest.read_text())
            return float(data["written"]), data.get("step")
    return max((p.stat().st_mtime for p in folder.rglob("*") if p.is_file()), default=folder.stat().st_mtime), None


def incomplete_message(path: str | os.PathLike, required: Iterable[str] = ()) -> str | None:
    """Why the checkpoint at ``path`` cannot be loaded, naming the newest complete one
    beside it; None when it is complete."""
    path = Path(path)
    required = tuple(required)
    if not os.path.lexists(path):
        old = path.parent / f".{path.name}{_OLD}"
        if old.is_dir() and not missing_files(old, required):
            return (
                f"no checkpoint at {path}: a save was killed while replacing it; the previous one, complete, is "
                f"{old}. Rename it back to {path.name} to resume from it."
            )
        problem = f"no checkpoint at {path}."
    else:
        gaps = missing_files(path, required)
        if not gaps:
            return None
        problem = (
            f"the checkpoint {path} is incomplete: {'; '.join(gaps)}. A save that was killed before every rank "
            "had written, or files removed since; it cannot be loaded."
        )
    found = newest_complete(path.parent, exclude=path, required=required)
    if found is None:
        return f"{problem} No complete checkpoint lies beside it in {path.parent}."
    newest, step = found
    at = f" (step {step})" if step is not None else ""
    return f"{problem} The newest complete checkpoint beside it: {newest}{at}; resume from that one."


def check_complete(path: str | os.PathLike, required: Iterable[str] = ()) -> None:
    """Raise ``IncompleteCheckpointError`` on every rank when the checkpoint at ``path``
    is missing or incomplete (``incomplete_message``); rank 0 looks. Every rank must call
    it."""
    _raise_agreed(incomplete_message(path, required) if _rank() == 0 else None, IncompleteCheckpointError)
