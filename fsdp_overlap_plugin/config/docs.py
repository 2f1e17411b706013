"""``docs/config.md``, generated from the field docstrings of ``OverlapConfig`` (``make docs``;
``tests/config/test_config.py`` keeps the file current)."""

from __future__ import annotations

from .schema import OverlapConfig

__all__ = ["config_markdown"]


def config_markdown() -> str:
    """``docs/config.md``: every key, its default and its documentation."""
    defaults = OverlapConfig().to_dict()
    lines = [
        "# Configuration reference",
        "",
        "Generated from the field docstrings of `OverlapConfig` (regenerate with `make docs`). The same keys work as",
        "YAML (`OverlapConfig.from_yaml`), as keyword arguments of `parallelize()` and of the",
        "Lightning strategy, and, prefixed `fsdp_overlap_`, in an Accelerate `fsdp_config`",
        "(one exception there: `overlap_grad_reduce` is spelt `fsdp_overlap_grad_reduce`).",
        "",
        "| key | default | meaning |",
        "| --- | --- | --- |",
    ]
    for name, doc in OverlapConfig.field_docs().items():
        default = defaults[name]
        shown = "null" if default is None else (str(default).lower() if isinstance(default, bool) else default)
        lines.append(f"| `{name}` | `{shown}` | {doc} |")
    return "\n".join(lines) + "\n"
