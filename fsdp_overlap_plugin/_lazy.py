"""Names a module imports on first use (PEP 562): the package root's public API and the
core interface (``core.py``) both list each name with the module that defines it, and
neither imports those modules until a name is asked for. Imports nothing but the standard
library, so ``import fsdp_overlap_plugin`` stays torch-free."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Collection, Mapping

__all__ = ["lazy_names"]


def lazy_names(
    module: str, where: Mapping[str, str], *, modules: Collection[str] = ()
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the module named ``module``: each name of ``where``
    imported from its module (relative to the package) when first asked for, then kept on
    ``module`` so it is found directly from then on. A name in ``modules`` is that module
    itself (``"devices": ".runtime.devices"``), not an attribute of it."""
    package = module.rpartition(".")[0] or module  # the root module is its own package

    def __getattr__(name: str) -> object:
        source = where.get(name)
        if source is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        found = importlib.import_module(source, package)
        value = found if name in modules else getattr(found, name)
        setattr(sys.modules[module], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[module])) | set(where))

    return __getattr__, __dir__
