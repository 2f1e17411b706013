"""Bucket plans: from the configured ``bucket_plans`` to explicit module FQN lists.

``resolve_plan(model, config)`` needs no process group and allocates nothing, so a YAML
can be checked against a meta-device model before a job is launched. The result is a
list of buckets, each a list of module FQNs relative to the model root, in module order
where patterns were expanded. It is a pure function of the model's structure and the
config, hence identical on every rank.

Pattern syntax (per dot-separated segment):
  ``*``, ``?``, ``[abc]``  shell-style glob on one segment (``layers.*``)
  ``[0-3]``                an inclusive numeric range (``layers.[0-3]``, ``layers.[8-11]``)
"""

from __future__ import annotations

import fnmatch
import re
import statistics
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..contract import check_disjoint
from .keys import suggest
from .schema import OverlapConfig, OverlapConfigError

__all__ = [
    "AutoPlan",
    "PlanWarning",
    "auto_plan",
    "auto_plan_buckets",
    "auto_plan_info",
    "expand_pattern",
    "find_repeated_blocks",
    "gather_bytes",
    "plan_buckets",
    "resolve_module_names",
    "resolve_plan",
]

_RANGE = re.compile(r"^\[(\d+)-(\d+)\]$")
_GLOB_CHARS = set("*?[")


class PlanWarning(UserWarning):
    """A plan that works but probably is not what the user meant (e.g. a bucket with no parameters)."""


def _is_pattern(text: str) -> bool:
    return any(c in _GLOB_CHARS for c in text)


def _segment_matches(pattern: str, name: str) -> bool:
    m = _RANGE.match(pattern)
    if m:
        lo, hi = int(m.group(1)), int(m.group(2))
        return name.isdigit() and lo <= int(name) <= hi
    return fnmatch.fnmatchcase(name, pattern)


def expand_pattern(pattern: str, module_names: Iterable[str]) -> list[str]:
    """The module FQNs matching ``pattern`` segment by segment, in module order."""
    parts = pattern.split(".")
    for part in parts:
        m = _RANGE.match(part)
        if m and int(m.group(1)) > int(m.group(2)):
            raise OverlapConfigError(f"pattern {pattern!r}: empty range {part} (start > end).")
    out = []
    for name in module_names:
        segs = name.split(".") if name else []
        if len(segs) == len(parts) and all(_segment_matches(p, s) for p, s in zip(parts, segs)):
            out.append(name)
    return out


def _module_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_modules(remove_duplicate=False) if name]


def _resolve_name(text: str, names: list[str], name_set: set[str], where: str) -> list[str]:
    if _is_pattern(text):
        found = expand_pattern(text, names)
        if not found:
            # suggest patterns, not modules: each module of the same depth with the user's
            # glob segments put back ("model.layer.*" -> "model.layers.*", not "model.layers.0")
            parts = text.split(".")
            candidates = sorted(
                {
                    ".".join(p if _is_pattern(p) else seg for p, seg in zip(parts, n.split(".")))
                    for n in names
                    if n.count(".") + 1 == len(parts)
                }
            )
            hint = suggest(text, candidates)
            raise OverlapConfigError(f"{where}: pattern {text!r} matches no module.{hint}")
        return found
    if text not in name_set:
        hint = suggest(text, names)
        raise OverlapConfigError(
            f"{where}: no module named {text!r} in {_model_label(names)}.{hint or ' Run fsdp-overlap inspect to list them.'}"
        )
    return [text]


def resolve_module_names(text: str, names: list[str], *, where: str) -> list[str]:
    """The module FQNs ``text`` (a name or a pattern) means among ``names``; an error
    naming ``where`` and the nearest names when it means none."""
    return _resolve_name(text, names, set(names), where)


def _model_label(names: list[str]) -> str:
    top = sorted({n.split(".")[0] for n in names})
    return "the model (top-level modules: " + ", ".join(top[:8]) + (", ..." if len(top) > 8 else "") + ")"


def _owns_params(model: nn.Module, fqn: str) -> bool:
    module = model.get_submodule(fqn)
    return any(True for _ in module.parameters())


def resolve_plan(model: nn.Module, config: OverlapConfig | dict | None = None) -> list[list[str]]:
    """Turn ``config.bucket_plans`` into explicit buckets of module FQNs for ``model``.

    Raises ``OverlapConfigError`` for an unknown FQN (naming the nearest existing ones), a
    pattern that matches nothing, or two entries that share a module. Warns
    (``PlanWarning``) for a bucket whose modules own no parameters.
    """
    return plan_buckets(model, OverlapConfig.coerce(config), stacklevel=3)


def plan_buckets(model: nn.Module, config: OverlapConfig, *, stacklevel: int = 2) -> list[list[str]]:
    """``resolve_plan`` for a config already checked (no second coerce: ``preflight``).
    ``stacklevel``: the frame a ``PlanWarning`` names (the caller's, through ``resolve_plan``)."""
    if config.bucket_plans == "auto":
        return auto_plan_buckets(model, config).buckets
    names = _module_names(model)
    name_set = set(names)
    buckets: list[list[str]] = []
    for i, entry in enumerate(config.bucket_plans):
        where = f"bucket_plans[{i}]"
        if isinstance(entry, str):
            expanded = _resolve_name(entry, names, name_set, where)
            if _is_pattern(entry):
                buckets.extend([fqn] for fqn in expanded)
            else:
                buckets.append(expanded)
        else:
            bucket: list[str] = []
            for j, text in enumerate(entry):
                for fqn in _resolve_name(text, names, name_set, f"{where}[{j}]"):
                    if fqn not in bucket:
                        bucket.append(fqn)
            buckets.append(bucket)
    check_disjoint(buckets)
    for bucket in buckets:
        if not any(_owns_params(model, fqn) for fqn in bucket):
            warnings.warn(
                f"bucket_plans: bucket {bucket} owns no parameters; it will hold no collectives.",
                PlanWarning,
                stacklevel=stacklevel,
            )
    return buckets


def find_repeated_blocks(model: nn.Module) -> tuple[str, list[str]] | None:
    """The container (ModuleList/Sequential/ModuleDict) with the most same-class children
    that own parameters: ``(container_fqn, [child_fqn, ...])``, or None.

    Ties go to the container holding more parameters, then to the one first in module
    order, so the answer depends only on the model's structure.
    """
    best: tuple[int, int, int, str, list[str]] | None = None
    for order, (name, module) in enumerate(model.named_modules()):
        if not isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            continue
        children = [(n, c) for n, c in module.named_children() if any(True for _ in c.parameters())]
        if len(children) < 2:
            continue
        by_class: dict[type, list[str]] = {}
        for n, c in children:
            by_class.setdefault(type(c), []).append(n)
        cls, members = max(by_class.items(), key=lambda kv: len(kv[1]))
        if len(members) < 2:
            continue
        numel = sum(p.numel() for p in module.parameters())
        key = (len(members), numel, -order)
        if best is None or key > best[:3]:
            prefix = f"{name}." if name else ""
            best = (*key, name, [prefix + m for m in members])
    if best is None:
        return None
    return best[3], best[4]


def _owners(module: nn.Module, prefix: str = "") -> list[str]:
    """FQNs of the modules in ``module``'s subtree that hold parameters directly."""
    return [
        f"{prefix}{name}" if name else prefix.rstrip(".")
        for name, m in module.named_modules()
        if next(m.parameters(recurse=False), None) is not None
    ]


def _covering_modules(model: nn.Module, owners: set[str]) -> list[str]:
    """The fewest module FQNs, in module order, covering exactly the parameter-holding
    modules ``owners``: a child is taken whole when every parameter-holding module in
    its subtree is in ``owners``, and descended into when only some are."""
    out: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            fqn = f"{prefix}{name}"
            inside = set(_owners(child, fqn + "."))
            if not inside:
                continue
            if inside <= owners:
                out.append(fqn)
            elif inside & owners:
                visit(fqn + ".", child)

    visit("", model)
    return out


#: ``bucket_bytes`` when it is null and the model has no repeated blocks (docs/tuning.md).
DEFAULT_BUCKET_BYTES = 16 * 2**20


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def gather_bytes(module: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes the all-gathers of ``module``'s subtree move, unsharded, in ``dtype`` (None: each
    parameter's own dtype). A parameter registered in two modules (tied weights) counts once
    per module, because each module gathers it under its own name. Reads shapes only, so it
    is free on the meta device and the same on every rank (DTensor numel is global)."""
    total = 0
    for sub in module.modules():
        for p in sub._parameters.values():
            if p is not None:
                total += p.numel() * _itemsize(dtype or p.dtype)
    return total


@dataclass
class AutoPlan:
    """What ``auto_plan`` decided and why (``fsdp-overlap inspect`` prints it)."""

    buckets: list[list[str]]
    """The plan: lists of module FQNs."""
    target_bytes: int
    """The ``bucket_bytes`` target the non-block modules were grouped to."""
    target_source: str
    """Where the target came from: "bucket_bytes", "median block" or "default (no repeated blocks)"."""
    container: str | None
    """FQN of the container holding the repeated blocks ("" for the root), None if none."""
    blocks: list[str] = field(default_factory=list)
    """FQNs of the repeated blocks, each one bucket."""
    bucket_bytes: list[int] = field(default_factory=list)
    """Gathered bytes of each bucket (in param_dtype)."""


def auto_plan(model: nn.Module, config: OverlapConfig | dict | None = None) -> list[list[str]]:
    """The ``bucket_plans: auto`` plan; see ``auto_plan_info`` for the rules."""
    return auto_plan_buckets(model, OverlapConfig.coerce(config)).buckets


def auto_plan_info(model: nn.Module, config: OverlapConfig | dict | None = None) -> AutoPlan:
    """One bucket per repeated block; the modules before and after the blocks in buckets of
    about ``config.bucket_bytes``.

    Rules, applied separately to the modules registered before the blocks and to those
    after them (registration order; for the usual embed -> blocks -> norm -> head layout
    that is also execution order):

    * units: the fewest whole modules covering those modules' parameters, in module order;
      a unit larger than the target that holds no parameters itself is replaced by its
      children (recursively), so a large non-block subtree is not one giant bucket;
    * units merge in order into a bucket until it reaches the target; the unit that
      reaches it stays in that bucket (so each bucket but a run's last is >= the target,
      and none exceeds the target by more than one unit);
    * a repeated block is always one bucket on its own, however large.

    The target (``bucket_bytes``, null by default) is the median block size, so grouping
    never makes a bucket much larger than a block; ``DEFAULT_BUCKET_BYTES`` without blocks.
    Bytes are counted as gathered (``param_dtype``, else each parameter's dtype).

    A module that reuses a parameter of another (tied weights) gathers it again under its
    own name, so it is placed by its own position. Parameters held directly by a module
    that also contains the blocks (for example a positional embedding held as a bare
    ``nn.Parameter`` on the root) cannot be named by a module FQN without overlapping the
    blocks; they stay unbucketed and the schedule report lists them. A model without
    repeated blocks has one run: its top-level children with parameters.

    The result is a pure function of the module tree, parameter shapes and dtypes and the
    config: identical on every rank, and free on a meta-device model.
    """
    return auto_plan_buckets(model, OverlapConfig.coerce(config))


def auto_plan_buckets(model: nn.Module, config: OverlapConfig) -> AutoPlan:
    """``auto_plan_info`` for a config already checked (no second coerce)."""
    dtype = config.torch_param_dtype
    found = find_repeated_blocks(model)
    if found is None:
        container, blocks = None, []
        runs = [[name for name, child in model.named_children() if next(child.parameters(), None) is not None]]
        default, source = DEFAULT_BUCKET_BYTES, "default (no repeated blocks)"
    else:
        container, blocks = found
        ancestors = _ancestor_names(blocks)
        before: set[str] = set()
        after: set[str] = set()
        seen_blocks = False
        for name, module in model.named_modules():
            if name == blocks[0]:
                seen_blocks = True
            if name in ancestors or any(name == b or name.startswith(b + ".") for b in blocks):
                continue
            if next(module.parameters(recurse=False), None) is not None:
                (after if seen_blocks else before).add(name)
        runs = [_covering_modules(model, before), _covering_modules(model, after)]
        default = statistics.median_low(gather_bytes(model.get_submodule(b), dtype) for b in blocks)
        source = "median block"
    if config.bucket_bytes is not None:
        target, source = config.bucket_bytes, "bucket_bytes"
    else:
        target = max(int(default), 1)

    def size(fqn: str) -> int:
        return gather_bytes(model.get_submodule(fqn), dtype)

    groups = [_fill(_split_units(model, run, target, size), target, size) for run in runs]
    plan: list[list[str]] = groups[0] + [[b] for b in blocks] + (groups[1] if len(groups) > 1 else [])
    check_disjoint(plan)
    return AutoPlan(
        buckets=plan,
        target_bytes=target,
        target_source=source,
        container=container,
        blocks=list(blocks),
        bucket_bytes=[sum(size(f) for f in bucket) for bucket in plan],
    )


def _split_units(model: nn.Module, units: list[str], target: int, size) -> list[str]:
    """Replace each unit larger than ``target`` that holds no parameters itself by its
    parameter-holding children, recursively (its own parameters could not be named
    without overlapping the children)."""
    out: list[str] = []
    for fqn in units:
        module = model.get_submodule(fqn)
        children = [f"{fqn}.{n}" for n, c in module.named_children() if next(c.parameters(), None) is not None]
        if size(fqn) > target and children and next(module.parameters(recurse=False), None) is None:
            out.extend(_split_units(model, children, target, size))
        else:
            out.append(fqn)
    return out


def _fill(units: list[str], target: int, size) -> list[list[str]]:
    """Consecutive units into buckets: a bucket closes once it holds ``target`` bytes."""
    groups: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for fqn in units:
        current.append(fqn)
        current_bytes += size(fqn)
        if current_bytes >= target:
            groups.append(current)
            current, current_bytes = [], 0
    if current:
        groups.append(current)
    return groups


def _ancestor_names(fqns: list[str]) -> set[str]:
    out = {""}
    for fqn in fqns:
        parts = fqn.split(".")
        for i in range(1, len(parts)):
            out.add(".".join(parts[:i]))
    return out
