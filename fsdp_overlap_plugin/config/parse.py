"""Reading what the user wrote, before the schema sees it: a YAML config file (with its size
cap and its duplicate-key check), a byte count ("64MiB"), a dtype name ("bf16"), and the
words a byte count or a dtype is printed in.

Nothing here knows the config's keys: ``config.schema`` builds on these readers, never the
other way round.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import torch

from ..contract import OverlapConfigError
from .keys import suggest
from .sizes import format_bytes

__all__ = [
    "MAX_CONFIG_BYTES",
    "dtype_name",
    "format_bytes",
    "parse_bytes",
    "parse_dtype",
    "read_yaml",
]


# Accepted spellings of each dtype; the first one is the canonical name.
_DTYPES: dict[str, tuple[torch.dtype, tuple[str, ...]]] = {
    "bf16": (torch.bfloat16, ("bf16", "bfloat16", "torch.bfloat16")),
    "fp16": (torch.float16, ("fp16", "float16", "half", "torch.float16")),
    "fp32": (torch.float32, ("fp32", "float32", "float", "torch.float32")),
}


def parse_dtype(value: Any, key: str = "dtype") -> torch.dtype | None:
    """Turn a dtype name (``"bf16"``, ``"float32"``, ...) or a ``torch.dtype`` into a dtype."""
    if value is None or isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and value not in {d for d, _ in _DTYPES.values()}:
            raise OverlapConfigError(f"{key}: unsupported dtype {value}; use one of bf16, fp16, fp32 or null.")
        return value
    if isinstance(value, str):
        lowered = value.strip().lower()
        for dtype, spellings in _DTYPES.values():
            if lowered in spellings:
                return dtype
        spellings = [s for _, names in _DTYPES.values() for s in names]
        raise OverlapConfigError(
            f"{key}: unknown dtype {value!r}; valid: bf16, fp16, fp32 or null.{suggest(lowered, spellings)}"
        )
    raise OverlapConfigError(f"{key}: expected a dtype name (bf16, fp16, fp32) or null, got {type(value).__name__}.")


_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def parse_bytes(value: Any, key: str = "bytes") -> int | None:
    """A positive byte count from an integer or a string with a unit ("64MiB", "500 KB",
    "1e6"); None stays None. KB/MB/GB are powers of 1000, KiB/MiB/GiB powers of 1024."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise OverlapConfigError(
            f'{key}: expected a number of bytes (e.g. 67108864 or "64MiB") or null, got {value!r}.'
        )
    number: float
    if isinstance(value, (int, float)):
        number = value
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", value.lower())
        if match is None or match.group(2) not in _BYTE_UNITS:
            unit = match.group(2) if match else value
            proper = {u.lower(): u for u in ("KB", "MB", "GB", "KiB", "MiB", "GiB")}
            close = difflib.get_close_matches(unit, list(proper), n=1, cutoff=0.5) if match else []
            hint = f" Did you mean {match.group(1) + proper[close[0]]!r}?" if close else ""
            raise OverlapConfigError(
                f"{key}: cannot read {value!r} as a size; write an integer number of bytes or a number with "
                f'a unit (B, KB, MB, GB, KiB, MiB, GiB), e.g. "64MiB".{hint}'
            )
        number = float(match.group(1)) * _BYTE_UNITS[match.group(2)]
    else:
        raise OverlapConfigError(
            f'{key}: expected a number of bytes or a string like "64MiB", got {type(value).__name__}.'
        )
    if number < 1 or number != int(number):
        raise OverlapConfigError(f"{key}: must be a whole number of bytes >= 1, got {value!r}.")
    return int(number)


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """The canonical short name of a dtype (``torch.bfloat16`` -> ``"bf16"``)."""
    for name, (d, _) in _DTYPES.items():
        if d == dtype:
            return name
    return None


#: A config file larger than this is refused before it is parsed: a plan for the largest
#: model fits in a few KiB, so a file this size is the wrong file (a checkpoint, a log), and
#: PyYAML would take minutes to parse it on every rank.
MAX_CONFIG_BYTES = 2**20


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int, first: int):
        self.key, self.line, self.first = key, line, first


def _loader() -> type:
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps the
    last one silently); keys brought in by a ``<<`` merge may be overridden, as YAML means."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise _DuplicateKey(key, line, seen[key])
                    seen[key] = line
                except TypeError:  # an unhashable key: PyYAML's own error follows
                    pass
            return super().construct_mapping(node, deep)

    return StrictLoader


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML config file's mapping. A missing, empty (or comments-only), oversized or
    non-UTF-8 file, invalid YAML, or anything but a mapping at the top is an
    ``OverlapConfigError`` naming the file. Every reader of a config file (the runtime's
    and ``fsdp-overlap check``) goes through here, so the same file gets the same verdict."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise OverlapConfigError(f"config file {str(path)!r} does not exist.")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise OverlapConfigError(
            f"{path}: {size / 2**20:.1f} MiB is too large for a config file (at most "
            f"{MAX_CONFIG_BYTES // 2**20} MiB); is it the right file?"
        )
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OverlapConfigError(
            f"{path}: not a text file in UTF-8 (byte {exc.start} is {exc.object[exc.start]:#04x}); save it as UTF-8."
        ) from None
    try:
        data = yaml.load(text, Loader=_loader())
    except yaml.YAMLError as exc:
        raise OverlapConfigError(f"{path}: not valid YAML: {exc}") from None
    except _DuplicateKey as exc:
        raise OverlapConfigError(
            f"{path}: line {exc.line}: {exc.key!r} is set twice in one mapping (also on line {exc.first}); YAML "
            "would keep the last one without a word. Keep one."
        ) from None
    if data is None:
        raise OverlapConfigError(
            f"{path}: the file holds no keys (it is empty or only comments); is it the right file? "
            "For every default, write {} in it."
        )
    if not isinstance(data, dict):
        raise OverlapConfigError(f"{path}: expected a mapping of config keys, got {type(data).__name__}.")
    return data
