"""fsdp-overlap: FSDP2 sharding that torch.compile can see, plus passes that hide its
communication behind compute. Public API only; see docs/architecture.md.

Importing the package imports neither torch nor Lightning: ``fsdp-overlap --help`` runs in
a fraction of a second. Each name in ``__all__`` is imported on first use (PEP 562), and
what used to happen at import happens as soon as the module it needs is imported, in
whichever order (``_AfterImport``):

- ``"fsdp_overlap"`` (and ``"npu"`` when ``torch_npu`` imports) is registered in
  ``lightning``'s registries right after ``lightning`` finishes importing, and in the
  standalone ``pytorch_lightning``/``lightning_fabric`` ones after those: Lightning has no
  entry-point discovery for strategies. Already imported: registered now.
- A torch outside the supported range warns right after torch is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
from collections.abc import Callable, Iterable, Sequence
from importlib.machinery import ModuleSpec

from ._lazy import lazy_names
from ._version import __version__, check_torch_version

#: Each public name and the module that defines it.
_PUBLIC = {
    "IncompleteCheckpointError": ".shard.atomic_checkpoint",
    "MeshConfig": ".config.schema",
    "OverlapConfig": ".config.schema",
    "OverlapConfigError": ".config.schema",
    "PlanWarning": ".config.plan",
    "UninitializedWarning": ".shard.initialize",
    "auto_plan": ".config.plan",
    "build_mesh": ".shard.sharding",
    "format_report": ".report.schedule_text",
    "full_state_dict": ".shard.export",
    "gather_disabled": ".shard.sharding",
    "init_process_group": ".runtime.devices",
    "load_pretrained": ".shard.weights",
    "materialize": ".shard.initialize",
    "parallelize": ".parallelize",
    "resolve_plan": ".config.plan",
    "save_pretrained": ".shard.export",
    "schedule_report": ".report.schedule",
}

__all__ = ["__version__", *sorted(_PUBLIC, key=str.lower)]


__getattr__, __dir__ = lazy_names(__name__, _PUBLIC)


class _Package(types.ModuleType):
    """Keeps ``fsdp_overlap_plugin.parallelize`` the function.

    Importing a submodule binds it on its package (``setattr(package, "parallelize",
    module)``); the eager ``__init__`` rebound the name to the function right after, a lazy
    one must do it here, or the first internal ``from ..parallelize import ...`` would hand
    users the module.
    """

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}" and name in _PUBLIC:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


# ----------------------------------------------------------------------------- after import
#: Each family of Lightning registries and the packages that hold it (all installed, or the
#: family is skipped); ``register_family`` registers in it once any of them is imported.
_FAMILIES = {"lightning": ("lightning",), "standalone": ("pytorch_lightning", "lightning_fabric")}
#: Registering imports our strategy classes, which import Lightning: it waits while any of
#: these (or a family's package) is half-imported, and runs when the outermost one is done.
_ADAPTER = ("fsdp_overlap_plugin.lightning", "fsdp_overlap_plugin.lightning.standalone")


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then(name)`` right after a watched module's code finished executing.

    A meta-path finder that finds nothing itself: for a watched name it asks the other
    finders for the spec and wraps its loader, for that one load, in ``_ThenLoader``. The
    real loader is back on the module and its spec as soon as the code ran, so the module
    looks as if this finder never existed (``importlib.reload``, ``inspect.getsource``,
    ``importlib.resources``, pickling); the finder leaves ``sys.meta_path`` once nothing is
    watched. A module whose import fails stays watched: the next import tries again.
    """

    def __init__(self, names: set[str], then: Callable[[str], None]) -> None:
        self.watched = set(names)
        self.executing: set[str] = set()
        self.then = then

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in self.watched:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if finder is self or find is None else find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenLoader(spec.loader, self)
                return spec
        return None

    def unwatch(self, names: Iterable[str]) -> None:
        self.watched.difference_update(names)
        if not self.watched and self in sys.meta_path:
            sys.meta_path.remove(self)


class _ThenLoader(importlib.abc.Loader):
    """One load of a watched module: the real loader's, then the finder's ``then``."""

    def __init__(self, loader: importlib.abc.Loader, finder: _AfterImport) -> None:
        self.loader = loader
        self.finder = finder

    def create_module(self, spec: ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__
        self.finder.executing.add(name)
        try:
            self.loader.exec_module(module)
        finally:
            self.finder.executing.discard(name)
            module.__loader__ = self.loader
            if module.__spec__ is not None:
                module.__spec__.loader = self.loader
        self.finder.then(name)

    def __getattr__(self, name: str) -> object:  # get_source, get_resource_reader, is_package, ...
        return getattr(self.loader, name)


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


_pending = {family: packages for family, packages in _FAMILIES.items() if all(map(_installed, packages))}
_registering: set[str] = set()


def _register_ready(after: str | None = None) -> None:
    """Register in each pending family one of whose packages is imported; nested calls (the
    registration imports watched modules itself) skip the family being registered."""
    for family, packages in list(_pending.items()):
        if family not in _pending or family in _registering or not any(p in sys.modules for p in packages):
            continue
        _registering.add(family)
        try:
            from .lightning.register import register_family  # here: it imports torch and Lightning

            register_family(family)
        except Exception as exc:
            note = f"fsdp-overlap: registering 'fsdp_overlap' in the {family} registries failed"
            if not any(n.startswith(note) for n in getattr(exc, "__notes__", ())):
                exc.add_note(f"{note} ({f'after `import {after}`' if after else 'on `import fsdp_overlap_plugin`'}).")
            raise
        finally:
            _registering.discard(family)
        _pending.pop(family, None)
    if not _pending:
        _hook.unwatch([*_ADAPTER, *(p for packages in _FAMILIES.values() for p in packages)])


def _after_import(name: str) -> None:
    if name == "torch":
        _hook.unwatch(["torch"])
        check_torch_version()
    elif not _hook.executing:  # the outermost watched import finished: nothing is half-imported
        _register_ready(name)


_hook = _AfterImport(
    {"torch", *(_ADAPTER if _pending else ()), *(p for ps in _pending.values() for p in ps)}, _after_import
)
for _old in [f for f in sys.meta_path if type(f).__module__ == __name__ and type(f).__name__ == "_AfterImport"]:
    sys.meta_path.remove(_old)  # importlib.reload(fsdp_overlap_plugin): the new hook only
sys.meta_path.insert(0, _hook)
# A configuration error that nothing catches is printed short and once, exit code 2
# (report/messages.py; torch-free): from import on, as before the package was lazy.
from .report.messages import install_excepthook  # noqa: E402

install_excepthook()
if "torch" in sys.modules:
    _after_import("torch")
_register_ready()
