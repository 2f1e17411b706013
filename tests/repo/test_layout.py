"""The package's layout rules: private torch, Lightning and Accelerate names are reached
only through the compat modules, and one helper words every "unknown key" message."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_overlap_plugin"
MODULES = sorted(PACKAGE.rglob("*.py"))

#: Private torch names used outside ``_torch_compat.py``, each with its reason.
TORCH_ALLOWED: set[tuple[str, str]] = set()

FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "accelerate")


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def _torch_chain(node: ast.Attribute) -> str | None:
    parts = []
    value: ast.expr = node
    while isinstance(value, ast.Attribute):
        parts.append(value.attr)
        value = value.value
    if isinstance(value, ast.Name) and value.id == "torch":
        return ".".join(["torch", *reversed(parts)])
    return None


def _private_torch_uses(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "torch" and (
                _private(node.module) or any(a.name.startswith("_") for a in node.names)
            ):
                found.add(f"from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            found |= {f"import {a.name}" for a in node.names if a.name.split(".")[0] == "torch" and _private(a.name)}
        elif isinstance(node, ast.Attribute):
            chain = _torch_chain(node)
            # torch.ops.<namespace>.<op>: op names (aten._to_copy), the public way to reach ops
            if chain and not chain.startswith("torch.ops.") and _private(chain):
                # report the shortest private prefix (torch._C, not torch._C._distributed_c10d)
                parts = chain.split(".")
                first = next(i for i, p in enumerate(parts) if p.startswith("_") and not p.startswith("__"))
                found.add(".".join(parts[: first + 1]))
    return found


#: where private torch names live: ``_torch_compat.py`` and the part split off it by job
TORCH_COMPAT = ("_torch_compat.py", "_torch_compat_dynamo.py")


@pytest.mark.parametrize("path", [p for p in MODULES if p.name not in TORCH_COMPAT], ids=_rel)
def test_private_torch_names_only_in_torch_compat(path):
    uses = {(_rel(path), use) for use in _private_torch_uses(ast.parse(path.read_text()))}
    assert uses <= TORCH_ALLOWED, f"route through _torch_compat.py: {sorted(uses - TORCH_ALLOWED)}"


def test_torch_allow_list_is_current():
    used = {(_rel(p), u) for p in MODULES for u in _private_torch_uses(ast.parse(p.read_text()))}
    assert used >= TORCH_ALLOWED, f"no longer used, drop from TORCH_ALLOWED: {sorted(TORCH_ALLOWED - used)}"


@pytest.mark.parametrize(
    "path", [p for p in MODULES if p.name not in ("_lightning_compat.py", "_accelerate_compat.py")], ids=_rel
)
def test_private_framework_names_only_in_compat_modules(path):
    bad = [
        f"{node.lineno}: from {node.module} import {alias.name}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        and node.level == 0
        and node.module
        and node.module.split(".")[0] in FRAMEWORKS
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert not bad, f"route through _lightning_compat.py / _accelerate_compat.py: {bad}"


#: Modules that word an "unknown key" message without the helper, with the reason.
UNKNOWN_KEY_ALLOWED = {
    "config/keys.py": "the helper itself",
    # "hardware: unknown key 'x'; valid: ..." (a ValueError, no suggestion, tested in
    # test_costmodel): a --hardware spec's key=value pairs, not a config file's keys.
    "config/hardware.py": "the --hardware spec's own wording",
}


def test_unknown_key_messages_come_from_the_helper():
    """No string in the package words "unknown key" (or "unknown top-level key", ...)
    except in the modules above: every reader calls ``config.keys``."""
    wording = re.compile(r"unknown (top-level |fsdp-overlap )?key\b")
    found = set()
    for path in MODULES:
        tree = ast.parse(path.read_text())
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if wording.search(node.value):
                    found.add(_rel(path))
    assert found <= set(UNKNOWN_KEY_ALLOWED), (
        f"use config.keys.unknown_key_message: {sorted(found - set(UNKNOWN_KEY_ALLOWED))}"
    )


def test_the_helper_words_each_reader_s_message():
    from fsdp_overlap_plugin.config.keys import check_keys, unknown_key_message
    from fsdp_overlap_plugin.contract import OverlapConfigError

    with pytest.raises(OverlapConfigError) as info:
        check_keys({"bakend": 1}, ["backend", "mesh"], source="c.yaml")
    assert str(info.value) == "c.yaml: unknown key 'bakend'. Did you mean 'backend'? Valid keys: backend, mesh."
    assert (
        unknown_key_message("x", ["y"], source="s", where="fsdp_config.x: ", shown="", reason=" (dropped)")
        == "s: fsdp_config.x: unknown key (dropped)."
    )


# ----------------------------------------------------------------------------- layers
#: The pipeline's layers, lowest first (docs/architecture.md, "Where things live"): a
#: module imports only from its own folder and the layers below it.
LAYERS = {
    "_torch_compat_dynamo": -1,  # split off _torch_compat, which re-exports it
    "_torch_compat": 0,
    "_lazy": 0,
    "_lightning_compat": 1,
    "_accelerate_compat": 1,
    "_version": 1,
    "contract": 1,
    "config": 2,
    "runtime": 3,
    "passes": 4,
    "shard": 5,
    "report": 6,
    "compile": 7,
    "parallelize": 8,
    "testing": 8,
    "models": 8,
    "core": 9,
    "lightning": 10,
    "accelerate": 10,
    "cli": 11,
}
#: The package's entry points, above everything.
ENTRY = {"__init__.py", "__main__.py"}
#: What a pass may import from the package: passes work on any FX graph, without a
#: process group, a config or a runtime.
PASSES_MAY_IMPORT = {"contract", "_torch_compat", "passes"}
#: What an adapter may import from the package: the core interface (``core.py``), what the
#: user wrote (``config/``), its own folder and its framework's compat module.
ADAPTERS_MAY_IMPORT = {
    "lightning": {"core", "config", "lightning", "_lightning_compat"},
    "accelerate": {"core", "config", "accelerate", "_accelerate_compat"},
}


def _folder(module: str) -> str:
    """``fsdp_overlap_plugin.config.plan`` -> ``config``."""
    return module.split(".")[1]


def _package_imports(path: Path, source: str | None = None) -> list[tuple[str, int]]:
    """The package modules ``path`` imports (lazy imports included), with line numbers."""
    package = ("fsdp_overlap_plugin", *path.relative_to(PACKAGE).parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join((*base, node.module) if node.module else base)
            else:
                target = node.module or ""
            if not target.startswith("fsdp_overlap_plugin"):
                continue
            if target == "fsdp_overlap_plugin":  # from . import x: x is the module
                found += [(f"{target}.{alias.name}", node.lineno) for alias in node.names]
            else:
                found.append((target, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("fsdp_overlap_plugin.")]
    return found


LAYERED = [p for p in MODULES if p.relative_to(PACKAGE).as_posix() not in ENTRY]


def test_every_folder_has_a_layer():
    folders = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in LAYERED}
    assert folders == set(LAYERS), "give each new folder or root module a layer in LAYERS and the docs"


@pytest.mark.parametrize("path", LAYERED, ids=_rel)
def test_nothing_imports_upward(path):
    own = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
    upward = [
        f"line {line}: {target}"
        for target, line in _package_imports(path)
        if _folder(target) != own and LAYERS[_folder(target)] >= LAYERS[own]
    ]
    assert not upward, f"{_rel(path)} (layer {LAYERS[own]}) imports its own layer or above: {upward}"


@pytest.mark.parametrize("path", sorted((PACKAGE / "passes").glob("*.py")), ids=_rel)
def test_passes_import_only_the_contract_and_torch_compat(path):
    outside = [f"line {line}: {t}" for t, line in _package_imports(path) if _folder(t) not in PASSES_MAY_IMPORT]
    assert not outside, f"{_rel(path)}: a pass imports {outside}"


ADAPTER_MODULES = [p for folder in ADAPTERS_MAY_IMPORT for p in sorted((PACKAGE / folder).glob("*.py"))]


@pytest.mark.parametrize("path", ADAPTER_MODULES, ids=_rel)
def test_adapters_import_only_the_core_interface_and_config(path):
    """An adapter translates its framework's lifecycle into calls of ``core.py``: anything
    else it needs from the package goes into the core interface first."""
    folder = path.relative_to(PACKAGE).parts[0]
    allowed = ADAPTERS_MAY_IMPORT[folder]
    outside = [f"line {line}: {t}" for t, line in _package_imports(path) if _folder(t) not in allowed]
    assert not outside, f"{_rel(path)}: an adapter imports {outside}; expose it in fsdp_overlap_plugin/core.py"


def test_the_adapter_check_sees_a_lazy_import_past_the_core():
    source = "from ..core import parallelize\ndef f():\n    from ..shard.sharding import build_mesh\n"
    found = _package_imports(PACKAGE / "accelerate" / "adapter.py", source)
    assert [_folder(t) for t, _ in found] == ["core", "shard"]
    assert "shard" not in ADAPTERS_MAY_IMPORT["accelerate"]


def test_the_core_interface_names_only_the_layers_below_it():
    """core.py imports its names by string (on first use), which the import check cannot
    see: each module its table names must lie below core's layer, as an import would."""
    import fsdp_overlap_plugin.core as core

    above = {
        name: where
        for name, where in core._WHERE.items()
        if LAYERS[_folder("fsdp_overlap_plugin" + where)] >= LAYERS["core"]
    }
    assert not above, f"core.py names modules at or above its own layer: {above}"


def test_the_core_interface_resolves_every_name():
    import fsdp_overlap_plugin.core as core

    missing = [name for name in core.__all__ if getattr(core, name, None) is None]
    assert not missing
    assert core.devices.__name__ == "fsdp_overlap_plugin.runtime.devices"
    assert callable(core.parallelize) and callable(core.materialize)


def test_the_layer_check_sees_an_upward_import():
    """The check itself: a lazy relative import inside a function is found and resolved."""
    source = "def f():\n    from ..report.costmodel import simulate\n    from . import plan\n"
    found = _package_imports(PACKAGE / "config" / "schema.py", source)
    assert found == [("fsdp_overlap_plugin.report.costmodel", 2), ("fsdp_overlap_plugin.config", 3)]
    assert LAYERS[_folder(found[0][0])] > LAYERS["config"]


def test_the_private_torch_check_sees_each_spelling():
    """The detector itself: an import, a from-import and an attribute chain."""
    source = "import torch._dynamo\nfrom torch._inductor import config\nx = torch._C._get_tracing_state\n"
    assert len(_private_torch_uses(ast.parse(source))) >= 3
    assert not _private_torch_uses(ast.parse("import torch.distributed as dist\ny = torch.ops.aten._to_copy\n"))


# ----------------------------------------------------------------------------- the drawing
DOC = PACKAGE.parent / "docs" / "architecture.md"
#: Folders the drawing lists file by file; the others (adapters, cli, models) by name.
ENUMERATED = {"", "config", "runtime", "passes", "shard", "report", "compile"}


def _drawn_tree() -> tuple[set[tuple[str, str]], set[str]]:
    """``(folder, file)`` pairs and the folder names drawn in "Where things live"."""
    text = DOC.read_text()
    section = text[text.index("## Where things live") :]
    block = section[
        section.index("fsdp_overlap_plugin/\n") : section.index("```", section.index("fsdp_overlap_plugin/\n"))
    ]
    files, folders, folder = set(), set(), ""
    for line in block.splitlines()[1:]:
        if line.startswith("  ") and not line.startswith("   "):  # a new entry at the top level
            first = line.split()[0]
            folder = first.rstrip("/") if first.endswith("/") else ""
        names = re.findall(r"\b(\w+)\.py\b", line)
        folders.update(re.findall(r"(?<![\w/])(\w+)/(?=\s|$)", line))
        files.update((folder, f"{name}.py") for name in names)
    return files, folders


def test_the_layout_drawing_matches_the_tree():
    files, folders = _drawn_tree()
    actual = {
        ("" if len(p.relative_to(PACKAGE).parts) == 1 else p.relative_to(PACKAGE).parts[0], p.name)
        for p in MODULES
        if (len(p.relative_to(PACKAGE).parts) == 1 or p.relative_to(PACKAGE).parts[0] in ENUMERATED)
        and not (p.name == "__init__.py" and len(p.relative_to(PACKAGE).parts) > 1)
    }
    assert files == actual, (
        f"drawn, not in the tree: {sorted(files - actual)}; in the tree, not drawn: {sorted(actual - files)}"
    )
    subpackages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == subpackages


# ----------------------------------------------------------------------------- the tests' tree
TESTS = PACKAGE.parent / "tests"
#: Test folders that mirror no package folder: the core interface and orchestrator
#: (``core.py``, ``parallelize.py``), the benchmarks, and repository-wide checks.
TEST_FOLDERS_OF_THEIR_OWN = {"core", "bench", "repo"}


def _test_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "fixtures" not in p.relative_to(TESTS).parts)


def test_tests_mirror_the_package():
    """tests/<folder>/ is a package folder (or one of its own), tests/<folder>/integration/
    holds that folder's multi-process modules, and no test module sits at tests/ itself."""
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    wrong = []
    for path in _test_modules():
        parts = path.relative_to(TESTS).parts
        folder = parts[0] if len(parts) > 1 else None
        inner = parts[1:-1]
        if folder not in packages | TEST_FOLDERS_OF_THEIR_OWN or inner not in ((), ("integration",)):
            wrong.append(path.relative_to(TESTS).as_posix())
    assert not wrong, f"put each test module in tests/<package folder>/ or its integration/: {wrong}"


def _marked_slow_as_a_whole(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return "mark.slow" in ast.unparse(node.value)
    return False


@pytest.mark.parametrize("path", _test_modules(), ids=lambda p: p.relative_to(TESTS).as_posix())
def test_multi_process_modules_live_in_integration(path):
    """A module marked slow as a whole (``pytestmark``) starts processes in every test: it
    belongs in its folder's integration/ (tests/conftest.py holds the other direction)."""
    in_integration = "integration" in path.relative_to(TESTS).parts
    assert _marked_slow_as_a_whole(ast.parse(path.read_text())) <= in_integration, "move it to integration/"


#: The most lines a package module may have: past it, split the module by job (as
#: accelerate/config.py, report/schedule.py and shard/export.py were).
MAX_LINES = 600


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_no_package_file_over_600_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{_rel(path)} has {lines} lines: split it by job (at most {MAX_LINES})"
