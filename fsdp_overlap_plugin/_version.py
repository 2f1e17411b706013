"""Package version, and the torch releases this one supports.

The supported torch range is stated once, in pyproject.toml's ``dependencies``; this
module reads it back (from the installed metadata, or from pyproject.toml in a source
checkout that was never installed), for the warning at import and for
``benchmarks/gpu_check.py``.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

__version__ = "0.2.0.dev0"  # the work since 0.1 (the docs' "0.1: ..." notes), released as 0.2.0: CHANGELOG [Unreleased]

_DISTRIBUTION = "fsdp-overlap-plugin"
_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# a requirement "torch>=2.11,<2.16" (in either order, spaces allowed), as metadata or pyproject write it
_TORCH_REQUIREMENT = re.compile(r"^\s*torch\s*(?P<spec>[<>=!~][^;\"]*?)\s*(?:;|$)")
_BOUND = re.compile(r"(>=|<)\s*(\d+)\.(\d+)")

Version = tuple[int, int]


def _torch_requirement() -> str | None:
    """The version specifier of the torch requirement, e.g. ``>=2.11,<2.16``."""
    from importlib import metadata

    lines: list[str] = []
    text = _PYPROJECT.read_text(encoding="utf-8") if _PYPROJECT.is_file() else ""
    if re.search(rf'^name\s*=\s*"{_DISTRIBUTION}"', text, re.M):  # our source checkout (or editable install)
        block = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.S | re.M)
        lines = re.findall(r"\"([^\"]+)\"", block.group(1)) if block else []
    else:
        try:
            lines = metadata.requires(_DISTRIBUTION) or []
        except metadata.PackageNotFoundError:
            lines = []
    for line in lines:
        match = _TORCH_REQUIREMENT.match(line)
        if match and "extra" not in line:
            return match.group("spec").replace(" ", "")
    return None


def supported_torch() -> tuple[Version, Version] | None:
    """(oldest supported minor, first unsupported minor), e.g. ((2, 11), (2, 16))."""
    spec = _torch_requirement()
    if spec is None:
        return None
    bounds = {op: (int(major), int(minor)) for op, major, minor in _BOUND.findall(spec)}
    if ">=" not in bounds or "<" not in bounds:
        return None
    return bounds[">="], bounds["<"]


def supported_range() -> str:
    """The range in words, e.g. ``2.11 <= torch < 2.16``."""
    versions = supported_torch()
    if versions is None:
        return "unknown (no torch requirement found in the package metadata)"
    low, high = (f"{v[0]}.{v[1]}" for v in versions)
    return f"{low} <= torch < {high}"


def torch_supported(version: str) -> bool:
    """Whether a torch version string (``2.15.0+cu132``) is inside the supported range."""
    versions = supported_torch()
    match = re.match(r"(\d+)\.(\d+)", version)
    if versions is None or match is None:
        return True  # nothing to compare against: no warning
    low, high = versions
    return low <= (int(match.group(1)), int(match.group(2))) < high


def check_torch_version(version: str | None = None) -> None:
    """Warn (once, at import) when torch (``version``, default the installed one) is outside
    the supported range. Reads ``torch.__version__`` itself: this runs just after torch's
    import finishes, which may be from inside ``_torch_compat``'s own import (importing it
    imports torch), so that module is only half there."""
    import torch

    TORCH_VERSION = version or torch.__version__
    if not torch_supported(TORCH_VERSION):
        warnings.warn(
            f"fsdp-overlap {__version__} supports {supported_range()} (the releases CI tests); found torch "
            f"{TORCH_VERSION}. The passes read inductor and FX internals that move between releases: "
            "expect errors naming a missing torch feature, or install a supported torch.",
            stacklevel=3,
        )
