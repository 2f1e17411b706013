"""The adapters do each thing once and in one place (issue 58): the config is completed and
checked once per prepare (counted through a Lightning Trainer fit, a Fabric set-up and an
Accelerate ``prepare``), FSDP1's strategy names are one table, and every Lightning method
our classes override says so (``@override``), private hooks through ``_lightning_compat``."""

from __future__ import annotations

import ast
import collections
import sys
from pathlib import Path

import pytest
from _dist import run_ranks

from fsdp_overlap_plugin import OverlapConfigError
from fsdp_overlap_plugin.config import fsdp1

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_overlap_plugin"

#: The functions counted, by where they are defined; every module of the package that
#: holds the same function object under that name is patched (the adapters bind them by import).
COUNTED = {
    "preflight": "fsdp_overlap_plugin.shard.preflight",
    "config_for_precision": "fsdp_overlap_plugin.lightning._common",
    "check_mesh_arguments": "fsdp_overlap_plugin.lightning._common",
    "build_config": "fsdp_overlap_plugin.accelerate.config",
}


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """Wrap each ``COUNTED`` function, wherever the package bound it, with a counter."""
    import importlib

    counts: collections.Counter = collections.Counter()
    for name, where in COUNTED.items():
        original = getattr(importlib.import_module(where), name)

        def counting(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("fsdp_overlap_plugin") and vars(module).get(name) is original:
                monkeypatch.setattr(module, name, counting)
    return counts


# ------------------------------------------------------ one prepare, each step once
def _prepare_through_each_adapter(rank: int, world: int, root: str) -> dict:
    """One rank: a Trainer fit of one step, a Fabric set-up and an Accelerate ``prepare``
    (one of a ``torch.compile`` wrapper too), each counted on its own."""
    import lightning.fabric as lf
    import torch
    from _lightning import LitGPT, dataset, loader, trainer
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    import fsdp_overlap_plugin.accelerate.adapter  # noqa: F401  (bound names to patch)
    import fsdp_overlap_plugin.lightning.fabric  # noqa: F401
    import fsdp_overlap_plugin.lightning.trainer  # noqa: F401
    import fsdp_overlap_plugin.parallelize  # noqa: F401
    from fsdp_overlap_plugin.accelerate import prepare
    from fsdp_overlap_plugin.core import get_state
    from fsdp_overlap_plugin.lightning import FSDPOverlapFabricStrategy, FSDPOverlapStrategy
    from fsdp_overlap_plugin.models import gpt_small

    out: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        counts = _count_calls(mp)
        strategy = FSDPOverlapStrategy(compile=False, sharding_strategy="FULL_SHARD", device_mesh=(1, world))
        fit = trainer(root, strategy=strategy, devices=world, max_steps=1, precision="bf16-mixed")
        fit.fit(LitGPT(n_layer=2), loader(dataset(2 * world)))
        out["trainer"] = dict(counts)
        out["trainer_dtype"] = strategy.overlap_config.param_dtype

    with pytest.MonkeyPatch.context() as mp:
        counts = _count_calls(mp)
        fabric = lf.Fabric(
            strategy=FSDPOverlapFabricStrategy(compile=False, sharding_strategy="HYBRID_SHARD"),
            accelerator="cpu",
            devices=world,
        )
        fabric.launch()
        fabric.setup_module(gpt_small(n_layer=2))
        out["fabric"] = dict(counts)

    for wrapped in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            counts = _count_calls(mp)
            model = gpt_small(n_layer=2)
            given = torch.compile(model) if wrapped else model
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
            prepared, _ = prepare(Accelerator(cpu=True), given, optimizer, config={"compile": False})
            out["accelerate_compiled" if wrapped else "accelerate"] = dict(counts)
            out[f"prepared_inner_{wrapped}"] = prepared is model and get_state(model) is not None
    return out


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict:
    return run_ranks(_prepare_through_each_adapter, str(tmp_path_factory.mktemp("once")), world=1, timeout=600)[0]


def test_a_trainer_fit_completes_and_checks_the_config_once(counted):
    assert counted["trainer"] == {"preflight": 1, "config_for_precision": 1, "check_mesh_arguments": 1}
    assert counted["trainer_dtype"] == "bf16"  # the config completed from the precision is the one in force


def test_a_fabric_setup_completes_and_checks_the_config_once(counted):
    assert counted["fabric"] == {"preflight": 1, "config_for_precision": 1, "check_mesh_arguments": 1}


@pytest.mark.parametrize("key", ["accelerate", "accelerate_compiled"])
def test_accelerate_prepare_runs_preflight_once(counted, key):
    """``configure`` checks the model and hands its result to ``parallelize(checked=...)``;
    a ``torch.compile`` wrapper is taken off first, so the checked module is the prepared one."""
    assert counted[key] == {"preflight": 1, "build_config": 1}
    assert counted[f"prepared_inner_{key == 'accelerate_compiled'}"]


def test_a_strategy_coerces_its_config_once(monkeypatch, tmp_path):
    """The file (or dict) and the keyword arguments are one ``OverlapConfig.coerce``; a bad
    value is still named as the ``config`` argument's or the keyword's."""
    from fsdp_overlap_plugin.config.schema import OverlapConfig
    from fsdp_overlap_plugin.lightning import FSDPOverlapFabricStrategy, FSDPOverlapStrategy

    calls = []
    coerce = OverlapConfig.coerce.__func__
    monkeypatch.setattr(
        OverlapConfig, "coerce", classmethod(lambda cls, *a, **k: calls.append(1) or coerce(cls, *a, **k))
    )
    for cls in (FSDPOverlapStrategy, FSDPOverlapFabricStrategy):
        calls.clear()
        config = cls(config={"backend": "aot_eager"}, bucket_plans=["blocks.*"], reduce_dtype="fp32").overlap_config
        assert (config.backend, config.bucket_plans, config.reduce_dtype) == ("aot_eager", ["blocks.*"], "fp32")
        assert len(calls) == 1
    with pytest.raises(OverlapConfigError, match=r"^config: backend: unknown backend 'x'"):
        FSDPOverlapStrategy(config={"backend": "x"}, reduce_dtype="fp32")
    with pytest.raises(OverlapConfigError, match=r"^backend: unknown backend 'y'"):
        FSDPOverlapStrategy(config={"backend": "aot_eager"}, backend="y")


# ------------------------------------------------------------ FSDP1 strategy names
def test_the_fsdp1_table_is_torchs_and_accelerates():
    from accelerate.utils.constants import FSDP_SHARDING_STRATEGY
    from torch.distributed.fsdp import ShardingStrategy

    assert list(fsdp1.FSDP1_STRATEGIES) == list(FSDP_SHARDING_STRATEGY)
    assert [fsdp1.strategy_name(s) for s in ShardingStrategy] == list(fsdp1.FSDP1_STRATEGIES)
    assert set(fsdp1.SUPPORTED) | set(fsdp1.UNSUPPORTED) == set(fsdp1.FSDP1_STRATEGIES)
    assert not set(fsdp1.SUPPORTED) & set(fsdp1.UNSUPPORTED)


@pytest.mark.parametrize(
    "value, numbered, name",
    [
        ("full_shard", False, "FULL_SHARD"),
        (" HYBRID_SHARD ", False, "HYBRID_SHARD"),
        ("_HYBRID_SHARD_ZERO2", False, "HYBRID_SHARD_ZERO2"),
        ("4", True, "HYBRID_SHARD"),
        (5, True, "HYBRID_SHARD_ZERO2"),
        ("4", False, "4"),  # Lightning takes names only
        ("6", True, "6"),
        ("hybrid", True, "HYBRID"),
    ],
)
def test_strategy_name_normalises_each_spelling(value, numbered, name):
    assert fsdp1.strategy_name(value, numbered=numbered) == name


def test_each_adapter_points_every_unsupported_mode_somewhere():
    from fsdp_overlap_plugin.accelerate import settings
    from fsdp_overlap_plugin.lightning import _mesh

    for table in (settings._OTHER_STRATEGIES, _mesh._OTHER_STRATEGIES):
        assert set(table) == set(fsdp1.UNSUPPORTED)
    assert settings.SHARDING_STRATEGIES == _mesh.SHARDING_STRATEGIES == fsdp1.SUPPORTED


# ---------------------------------------------------------- @override, private hooks
def _ours(cls: type) -> bool:
    return cls.__module__.startswith("fsdp_overlap_plugin.")


def _overrides_without_decorator(cls: type, ours=_ours) -> tuple[list[str], list[str]]:
    """``(overriding, missing)``: the methods (and property getters) our classes in ``cls``'s
    MRO define that a Lightning class of the MRO defines too, and those of them without
    ``typing_extensions.override`` (which sets ``__override__``). Dunders are left out."""
    theirs = [k for k in cls.__mro__ if not ours(k) and k is not object]
    overriding, missing = [], []
    for klass in (k for k in cls.__mro__ if ours(k)):
        for name, value in vars(klass).items():
            if name.startswith("__") and name.endswith("__"):
                continue
            func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if not callable(func) or not any(name in vars(base) for base in theirs):
                continue
            overriding.append(f"{klass.__name__}.{name}")
            if not getattr(func, "__override__", False):
                missing.append(f"{klass.__name__}.{name}")
    return overriding, missing


def _lightning_classes() -> list[type]:
    from fsdp_overlap_plugin.lightning import fabric, npu, standalone, trainer

    return [
        trainer.FSDPOverlapStrategy,
        fabric.FSDPOverlapFabricStrategy,
        npu.NPUAccelerator,
        npu.NPUFabricAccelerator,
        standalone.FSDPOverlapStrategy,
        standalone.FSDPOverlapFabricStrategy,
        standalone.NPUAccelerator,
        standalone.NPUFabricAccelerator,
    ]


@pytest.mark.parametrize("cls", _lightning_classes(), ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_every_overridden_lightning_method_says_override(cls):
    overriding, missing = _overrides_without_decorator(cls)
    assert overriding, "the walk found no overriding method"
    assert not missing, f"add @override (typing_extensions) to: {missing}"


def test_the_override_walk_sees_a_missing_decorator():
    from fsdp_overlap_plugin.lightning import FSDPOverlapStrategy

    class Forgot(FSDPOverlapStrategy):
        def teardown(self) -> None:  # Lightning's Strategy.teardown, no @override
            super().teardown()

    _, missing = _overrides_without_decorator(Forgot, ours=lambda k: _ours(k) or k is Forgot)
    assert missing == ["Forgot.teardown"]


def test_private_hooks_are_the_compat_modules():
    """Each private Lightning method our strategies override is one of
    ``_lightning_compat.PRIVATE_HOOKS`` (with its reason), and none of the adapter's
    modules reaches Lightning's own through ``super()._name``: the compat module does."""
    from fsdp_overlap_plugin import _lightning_compat

    for cls in _lightning_classes():
        overriding, _ = _overrides_without_decorator(cls)
        private = {name.split(".", 1)[1] for name in overriding if name.split(".", 1)[1].startswith("_")}
        assert private <= set(_lightning_compat.PRIVATE_HOOKS), cls
    with pytest.raises(TypeError, match="PRIVATE_HOOKS"):

        @_lightning_compat.private_hook
        def _not_a_hook(self) -> None: ...

    for path in sorted((PACKAGE / "lightning").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.endswith("__")
                and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "super"
            ):
                pytest.fail(f"{path.name}:{node.lineno}: super().{node.attr}: go through _lightning_compat")


def test_fabric_does_not_import_the_trainer_strategy():
    tree = ast.parse((PACKAGE / "lightning" / "fabric.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 1}
    assert "trainer" not in imported, "shared Trainer/Fabric helpers live in lightning/_common.py"
