"""Issue 55, item 7: ``fsdp-overlap --help`` starts without torch, and the lazy package keeps
the import-time contract.

A. ``--help``, ``--version`` and ``COMMAND --help`` import neither torch, Lightning nor
   transformers (read from ``python -X importtime``; never timed).
B. ``"fsdp_overlap"`` is in every Lightning registry whichever is imported first: Lightning,
   the plugin, or the plugin's own adapter (which imports Lightning while it is half-imported
   itself), and the Trainer and Fabric resolve the string to our classes.
C. Every name in ``__all__`` resolves, ``import *`` included; ``parallelize`` stays the
   function when its module was imported first.
D. An error inside the registration reaches the import that triggered it.
E. A torch outside the supported range still warns, once torch is imported.

Every check runs in a fresh interpreter: what it checks is what a first import does.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: What the parser must never need.
HEAVY = {"torch", "lightning", "pytorch_lightning", "lightning_fabric", "transformers", "accelerate"}


def _python(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _run(code: str) -> subprocess.CompletedProcess:
    result = _python("-c", textwrap.dedent(code))
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def _imported(importtime_stderr: str) -> set[str]:
    """The top-level packages ``-X importtime`` lists (``import time: self | cumulative | name``)."""
    lines = [line for line in importtime_stderr.splitlines() if line.startswith("import time:")]
    return {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in lines[1:]}


# ------------------------------------------------------------------------- A. startup
@pytest.mark.parametrize(
    "entry, argv",
    [
        ("fsdp_overlap_plugin.cli", ["--help"]),
        ("fsdp_overlap_plugin.cli", ["--version"]),
        ("fsdp_overlap_plugin", ["--help"]),
        *(("fsdp_overlap_plugin.cli", [command, "--help"]) for command in ("inspect", "check", "suggest")),
        *(("fsdp_overlap_plugin.cli", [command, "--help"]) for command in ("profile", "explain", "timeline", "export")),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else v,
)
def test_help_and_version_import_no_torch(entry, argv):
    result = _python("-X", "importtime", "-m", entry, *argv)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("fsdp-overlap 0." in result.stdout) if argv == ["--version"] else ("usage: fsdp-overlap" in result.stdout)
    imported = _imported(result.stderr)
    assert "fsdp_overlap_plugin" in imported  # the check reads the right output
    assert not imported & HEAVY, sorted(imported & HEAVY)


def test_importing_the_package_imports_no_torch_nor_lightning():
    result = _python("-X", "importtime", "-c", "import fsdp_overlap_plugin, fsdp_overlap_plugin.cli")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not _imported(result.stderr) & HEAVY, sorted(_imported(result.stderr) & HEAVY)


# ------------------------------------------------------------------------- B. registration
_REGISTERED = """
    def registered():
        from lightning.fabric.strategies import STRATEGY_REGISTRY as fabric
        from lightning.pytorch.strategies import StrategyRegistry as trainer
        from lightning_fabric.strategies import STRATEGY_REGISTRY as standalone_fabric
        from pytorch_lightning.strategies import StrategyRegistry as standalone_trainer
        registries = (trainer, fabric, standalone_trainer, standalone_fabric)
        return ["fsdp_overlap" in r.available_strategies() for r in registries]
"""
_RESOLVES = """
    import importlib.machinery, lightning, lightning.pytorch as lp, lightning.fabric as lf
    from fsdp_overlap_plugin.lightning import FSDPOverlapFabricStrategy, FSDPOverlapStrategy
    assert registered() == [True] * 4, registered()
    assert type(lp.Trainer(strategy="fsdp_overlap", accelerator="cpu", devices=1, logger=False).strategy) is FSDPOverlapStrategy
    assert type(lf.Fabric(strategy="fsdp_overlap", accelerator="cpu", devices=1)._strategy) is FSDPOverlapFabricStrategy
    # the hook is gone and left the modules as it found them
    assert not [f for f in sys.meta_path if type(f).__name__ == "_AfterImport"], sys.meta_path
    assert isinstance(lightning.__spec__.loader, importlib.machinery.SourceFileLoader), lightning.__spec__.loader
    assert lightning.__loader__ is lightning.__spec__.loader
    importlib.reload(lightning)
    print("REGISTERED")
"""
ORDERS = {
    "plugin first": """
        import sys
        import fsdp_overlap_plugin
        assert not {"torch", "lightning", "pytorch_lightning"} & set(sys.modules)
        import pytorch_lightning  # imports lightning_fabric while it is itself half-imported
        assert "fsdp_overlap" in pytorch_lightning.strategies.StrategyRegistry.available_strategies()
    """,
    "lightning first": """
        import sys
        import lightning.pytorch, pytorch_lightning
        import fsdp_overlap_plugin
    """,
    "the adapter first": """
        import sys
        from fsdp_overlap_plugin.lightning.standalone import FSDPOverlapStrategy  # imports both Lightnings itself
    """,
    "lightning only, standalone later": """
        import sys
        import fsdp_overlap_plugin
        import lightning.fabric
        from lightning.fabric.strategies import STRATEGY_REGISTRY
        assert "fsdp_overlap" in STRATEGY_REGISTRY.available_strategies()
        assert "pytorch_lightning" not in sys.modules  # registering in lightning's left the standalone alone
    """,
}


@pytest.mark.parametrize("order", ORDERS)
def test_fsdp_overlap_is_registered_whichever_is_imported_first(order):
    result = _run("".join(textwrap.dedent(part) for part in (ORDERS[order], _REGISTERED, _RESOLVES)))
    assert "REGISTERED" in result.stdout, result.stderr[-3000:]


def test_the_accelerate_runner_sees_the_registration(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "print('fsdp_overlap' in StrategyRegistry.available_strategies())\n"
    )
    result = _python("-m", "fsdp_overlap_plugin.accelerate", str(script))
    assert result.returncode == 0 and result.stdout.strip().splitlines()[-1] == "True", result.stderr[-3000:]


# ------------------------------------------------------------------------- C. public names
def test_every_public_name_resolves_and_parallelize_stays_the_function():
    _run(
        """
        import sys, types
        import fsdp_overlap_plugin.parallelize  # the submodule first: it is bound on the package
        import fsdp_overlap_plugin as fo
        assert isinstance(sys.modules["fsdp_overlap_plugin.parallelize"], types.ModuleType)
        from fsdp_overlap_plugin import parallelize
        assert parallelize is fo.parallelize is sys.modules["fsdp_overlap_plugin.parallelize"].parallelize

        namespace = {}
        exec("from fsdp_overlap_plugin import *", namespace)
        assert sorted(n for n in namespace if n != "__builtins__") == sorted(fo.__all__)
        for name in fo.__all__:
            value = getattr(fo, name)
            assert not isinstance(value, types.ModuleType), name
            assert name == "__version__" or value.__name__ == name, name
        assert set(fo.__all__) <= set(dir(fo))
        from fsdp_overlap_plugin.config.schema import OverlapConfig
        assert fo.OverlapConfig is OverlapConfig
        try:
            fo.no_such_name
        except AttributeError as exc:
            assert "no_such_name" in str(exc)
        else:
            raise AssertionError("an unknown name resolved")
        """
    )


# ------------------------------------------------------------------------- D. errors surface
def test_an_error_in_the_registration_reaches_the_lightning_import():
    result = _run(
        """
        import fsdp_overlap_plugin
        from fsdp_overlap_plugin.runtime import devices

        def broken():
            raise RuntimeError("registration broke")

        devices.npu_module = broken
        for attempt in range(2):  # not once and forgotten: every import of lightning says so
            try:
                import lightning.pytorch
            except RuntimeError as exc:
                assert "registration broke" in str(exc)
                notes = getattr(exc, "__notes__", [])
                assert len(notes) == 1 and "after `import lightning`" in notes[0], notes
            else:
                raise AssertionError("the registration error was swallowed")
        print("SURFACED")
        """
    )
    assert "SURFACED" in result.stdout


def test_an_error_in_the_registration_reaches_the_plugin_import():
    result = _python(
        "-c",
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "def broken(*args, **kwargs):\n"
        "    raise RuntimeError('registration broke')\n"
        "StrategyRegistry.register = broken\n"
        "import fsdp_overlap_plugin\n",
    )
    assert result.returncode == 1
    assert "RuntimeError: registration broke" in result.stderr and "on `import fsdp_overlap_plugin`" in result.stderr


# ------------------------------------------------------------------------- E. torch version
def test_an_unsupported_torch_warns_once_torch_is_imported():
    result = _run(
        """
        import sys, warnings
        import fsdp_overlap_plugin
        from fsdp_overlap_plugin import _version
        assert "torch" not in sys.modules
        _version.torch_supported = lambda version: False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch
        messages = [str(w.message) for w in caught if "supports" in str(w.message)]
        assert len(messages) == 1 and torch.__version__ in messages[0], messages
        print("WARNED")
        """
    )
    assert "WARNED" in result.stdout


@pytest.mark.parametrize("module", ["_torch_compat"])
def test_a_submodule_imported_first_imports_cleanly(module):
    """Importing a submodule that imports torch, with nothing imported before: the torch
    version check runs while that module is half-imported (it imported torch), so it must
    not import from it (it did: an ImportError, which every later uncaught error then
    printed as "Error in sys.excepthook")."""
    result = _python("-c", f"import fsdp_overlap_plugin.{module}; raise SystemExit(3)")
    assert result.returncode == 3 and result.stderr == "", result.stderr


def test_the_version_is_after_the_0_1_the_docs_speak_of():
    """The docs compare with "0.1" as an earlier release (``(0.1: 20 -> 20)``); the package
    is the unreleased work after it (CHANGELOG's [Unreleased]), so it must not say 0.1.x."""
    import re
    from pathlib import Path

    from packaging.version import Version

    import fsdp_overlap_plugin

    root = Path(__file__).resolve().parents[2]
    version = Version(fsdp_overlap_plugin.__version__)
    docs = " ".join(p.read_text() for p in (root / "docs").glob("*.md"))
    assert re.search(r"\(0\.1: ", docs), "the docs no longer speak of 0.1 as earlier: revisit this test"
    assert version > Version("0.1.99") and version.is_prerelease, version
    assert "## [Unreleased]" in (root / "CHANGELOG.md").read_text()
