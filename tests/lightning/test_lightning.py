"""The Lightning adapter without training: registration in every registry, how the
strategy is configured (kwargs, YAML, precision), which module it parallelizes, and the
NPU accelerator with a fake ``torch_npu``. Training numbers are in
test_lightning_trainer.py and test_lightning_fabric.py."""

from __future__ import annotations

import inspect
from pathlib import Path

import lightning.fabric as lf
import lightning.pytorch as lp
import lightning_fabric
import pytest
import pytorch_lightning
import torch
import torch.nn as nn
from _dist import run_isolated

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin import OverlapConfig, OverlapConfigError
from fsdp_overlap_plugin.lightning import (
    PRECISION_DTYPES,
    FSDPOverlapFabricStrategy,
    FSDPOverlapStrategy,
    config_for_precision,
    standalone,
)
from fsdp_overlap_plugin.lightning._common import report_metrics, select_target

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------- registration
@pytest.mark.parametrize(
    "registry, cls, base",
    [
        (lp.strategies.StrategyRegistry, FSDPOverlapStrategy, lp.strategies.ModelParallelStrategy),
        (lf.strategies.STRATEGY_REGISTRY, FSDPOverlapFabricStrategy, lf.strategies.ModelParallelStrategy),
        (
            pytorch_lightning.strategies.StrategyRegistry,
            standalone.FSDPOverlapStrategy,
            pytorch_lightning.strategies.ModelParallelStrategy,
        ),
        (
            lightning_fabric.strategies.STRATEGY_REGISTRY,
            standalone.FSDPOverlapFabricStrategy,
            lightning_fabric.strategies.ModelParallelStrategy,
        ),
    ],
    ids=["lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric"],
)
def test_importing_the_plugin_registers_fsdp_overlap_everywhere(registry, cls, base):
    assert "fsdp_overlap" in registry.available_strategies()
    strategy = registry.get("fsdp_overlap")
    assert type(strategy) is cls and isinstance(strategy, base)
    assert strategy.overlap_config == OverlapConfig()  # the plain string: auto plans, all passes on


def test_register_is_idempotent_and_reports_what_it_did():
    done = fo.lightning.register()
    assert done == {
        "lightning.pytorch": ["fsdp_overlap"],
        "lightning.fabric": ["fsdp_overlap"],
        "pytorch_lightning": ["fsdp_overlap"],
        "lightning_fabric": ["fsdp_overlap"],
    }
    assert "npu" not in lp.accelerators.AcceleratorRegistry.available_accelerators()  # no torch_npu here


def test_trainer_and_fabric_accept_the_string():
    trainer = lp.Trainer(strategy="fsdp_overlap", accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is FSDPOverlapStrategy
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert trainer.strategy._get_process_group_backend() == "gloo"
    standalone_trainer = pytorch_lightning.Trainer(strategy="fsdp_overlap", accelerator="cpu", devices=2, logger=False)
    assert type(standalone_trainer.strategy) is standalone.FSDPOverlapStrategy
    fabric = lf.Fabric(strategy="fsdp_overlap", accelerator="cpu", devices=2)
    assert type(fabric.strategy) is FSDPOverlapFabricStrategy
    assert type(lightning_fabric.Fabric(strategy="fsdp_overlap", devices=2).strategy) is (
        standalone.FSDPOverlapFabricStrategy
    )


# -------------------------------------------------------------------------- config
@pytest.mark.parametrize("cls", [FSDPOverlapStrategy, FSDPOverlapFabricStrategy])
def test_every_config_key_is_a_keyword_argument(cls):
    """LightningCLI builds the strategy from init_args: each OverlapConfig key must be a
    named parameter (jsonargparse rejects unknown keys)."""
    params = inspect.signature(cls.__init__).parameters
    missing = [name for name in OverlapConfig.field_docs() if name not in params]
    assert not missing, f"add {missing} to {cls.__name__}.__init__"


def test_config_file_and_keyword_overrides():
    strategy = FSDPOverlapStrategy(
        config=str(ROOT / "configs/plugin.yaml"), bucket_plans=["blocks.*"], reduce_dtype="fp32", mesh={"replicate": 2}
    )
    config = strategy.overlap_config
    assert config.bucket_plans == ["blocks.*"]
    assert config.reduce_dtype == "fp32"
    assert config.mesh.replicate == 2
    assert config.backend == "inductor"  # from the file
    dict_config = FSDPOverlapFabricStrategy(config={"backend": "aot_eager"}, compile=True).overlap_config
    assert dict_config.backend == "aot_eager"


def test_bad_config_fails_at_construction_naming_the_key():
    with pytest.raises(OverlapConfigError, match="unknown key 'bucket_plan'.*Did you mean 'bucket_plans'"):
        FSDPOverlapStrategy(config={"bucket_plan": "auto"})
    with pytest.raises(OverlapConfigError, match="backend: unknown backend 'indcutor'.*Did you mean 'inductor'"):
        FSDPOverlapStrategy(backend="indcutor")
    with pytest.raises(OverlapConfigError, match="param_dtype: unknown dtype 'bf61'"):
        FSDPOverlapFabricStrategy(param_dtype="bf61")


# ------------------------------------------------------------------------ precision
@pytest.mark.parametrize(
    "precision, expected",
    [
        ("32-true", (None, None)),
        ("bf16-mixed", ("bf16", "fp32")),
        ("bf16-true", ("bf16", "bf16")),
        ("16-true", ("fp16", "fp16")),
    ],
)
def test_precision_sets_param_and_reduce_dtype(precision, expected):
    config = config_for_precision(OverlapConfig(), precision)
    assert (config.param_dtype, config.reduce_dtype) == expected
    assert set(PRECISION_DTYPES) == {"32-true", "bf16-mixed", "bf16-true", "16-true"}  # ModelParallelStrategy's


def test_compatible_explicit_dtype_wins_over_the_precision_default():
    config = config_for_precision(OverlapConfig(reduce_dtype="bf16"), "bf16-mixed")
    assert (config.param_dtype, config.reduce_dtype) == ("bf16", "bf16")
    config = config_for_precision(OverlapConfig(param_dtype="fp32"), "bf16-mixed")  # gather fp32, autocast computes
    assert (config.param_dtype, config.reduce_dtype) == ("fp32", "fp32")
    config = config_for_precision(OverlapConfig(reduce_dtype="bf16"), "32-true")  # compressed gradient reduction
    assert (config.param_dtype, config.reduce_dtype) == (None, "bf16")


def test_conflicting_dtype_is_an_error_naming_key_and_precision():
    with pytest.raises(
        OverlapConfigError, match=r"param_dtype: 'bf16' conflicts with precision='32-true'.*precision='bf16-mixed'"
    ):
        config_for_precision(OverlapConfig(param_dtype="bf16"), "32-true")
    with pytest.raises(OverlapConfigError, match=r"param_dtype: 'fp32' conflicts with precision='bf16-true'"):
        config_for_precision(OverlapConfig(param_dtype="fp32"), "bf16-true")
    with pytest.raises(OverlapConfigError, match=r"reduce_dtype: 'fp16' conflicts with precision='bf16-mixed'"):
        config_for_precision(OverlapConfig(reduce_dtype="fp16"), "bf16-mixed")
    with pytest.raises(OverlapConfigError, match=r"precision='64-true' is not supported.*valid: 32-true"):
        config_for_precision(OverlapConfig(), "64-true")
    with pytest.raises(OverlapConfigError, match=r"precision='16-mixed' is not supported"):
        config_for_precision(OverlapConfig(), "16-mixed")


def test_precision_conflict_fails_when_the_trainer_is_built():
    """Before Lightning launches any process (its launcher would start one per device)."""
    with pytest.raises(OverlapConfigError, match="param_dtype: 'bf16' conflicts with precision='32-true'"):
        lp.Trainer(strategy=FSDPOverlapStrategy(param_dtype="bf16"), accelerator="cpu", devices=2, logger=False)
    with pytest.raises(OverlapConfigError, match="param_dtype: 'fp32' conflicts with precision='bf16-true'"):
        lf.Fabric(strategy=FSDPOverlapFabricStrategy(param_dtype="fp32"), devices=2, precision="bf16-true")
    trainer = lp.Trainer(
        strategy=FSDPOverlapStrategy(param_dtype="bf16"), precision="bf16-mixed", devices=2, logger=False
    )
    assert trainer.strategy.overlap_config.param_dtype == "bf16"


# ------------------------------------------------------------------ module selection
class _Wrapper(nn.Module):
    def __init__(self, extra: bool = False, own: bool = False):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.loss = nn.CrossEntropyLoss()  # no parameters: does not count
        if extra:
            self.other = nn.Linear(4, 4)
        if own:
            self.scale = nn.Parameter(torch.ones(()))


def test_auto_selects_the_single_child_holding_parameters():
    root = _Wrapper()
    assert select_target(root, "auto") == ("model", root.model)
    assert select_target(_Wrapper(extra=True), "auto")[0] == ""  # two children hold parameters
    assert select_target(_Wrapper(own=True), "auto")[0] == ""  # the root holds one itself
    assert select_target(root, "") == ("", root)
    assert select_target(root, "model.1") == ("model.1", root.model[1])
    with pytest.raises(OverlapConfigError, match="module: _Wrapper has no submodule 'modle'.*Did you mean 'model'"):
        select_target(root, "modle")


def test_a_compiled_lightning_module_given_to_fit_is_refused_by_lightning():
    """Trainer.fit(torch.compile(lit)): Lightning itself refuses a compiled LightningModule
    under any strategy but its own single-device, DDP and FSDP ones, before anything runs
    (docs/lightning.md). A compiled model *inside* the LightningModule is taken over instead
    (test_lightning_trainer.py)."""
    from _lightning import LitGPT

    trainer = lp.Trainer(strategy="fsdp_overlap", accelerator="cpu", devices=2, logger=False)
    lit = LitGPT(seed=0, n_layer=1)
    with pytest.raises(
        RuntimeError,
        match="Using a compiled model is incompatible with the current strategy: "
        "`FSDPOverlapStrategy`.*avoid passing in compiled model",
    ):
        trainer.fit(torch.compile(lit))


def test_report_metrics_flatten_the_schedule_report():
    report = {
        "plan": [["a"], ["b"]],
        "world_size": 2,
        "unbucketed_params": ["c.w"],
        "forward": {"before": {"all_gather": 5}, "after": {"all_gather": 2}},
        "backward": None,
    }
    metrics = report_metrics(report)
    assert metrics["fsdp_overlap/buckets"] == 2.0
    assert metrics["fsdp_overlap/unbucketed_params"] == 1.0
    assert metrics["fsdp_overlap/forward_all_gathers_before"] == 5.0
    assert metrics["fsdp_overlap/forward_all_gathers_after"] == 2.0
    assert not any(k.startswith("fsdp_overlap/backward") for k in metrics)


# ------------------------------------------------------------------------------ NPU
def test_npu_accelerator_registered_with_fake_torch_npu_selects_hccl():
    from _lightning_npu import npu_registration

    result = run_isolated(npu_registration)
    assert result["registered"] == ("NPUAccelerator", "NPUFabricAccelerator", "NPUAccelerator")
    trainer = result["trainer"]
    assert trainer["accelerator"]
    assert trainer["devices"] == ["npu:0", "npu:1"]
    assert trainer["root"] == "npu:1"  # LOCAL_RANK=1
    assert trainer["backend"] == "hccl"
    assert trainer["autocast"] == "npu"  # Lightning had chosen "cuda" for an unknown accelerator
    assert trainer["current"] == "npu:1"  # setup_device made it current
    assert trainer["launcher"] is None  # LOCAL_RANK set: processes started outside
    assert result["fabric"] == {"accelerator": True, "root": "npu:1", "backend": "hccl"}
    assert result["standalone"] == {"accelerator": True, "devices": ["npu:0", "npu:3"], "backend": "hccl"}
    assert result["parse"] == [[0, 1], [0, 1, 2, 3], [1, 3], [0, 1], [0, 2], None]
    assert "this machine has 4" in result["too_many"]
    assert result["available_without_devices"] is False
    assert any("accelerator='npu'" in w for w in result["cpu_warning"])


# ----------------------------------------------------------------------- LightningCLI
def test_lightning_cli_builds_the_strategy_from_yaml(tmp_path):
    """configs/lightning.yaml parses (jsonargparse checks every init_arg against the
    strategy's signature) and a plugin YAML given as init_args.config is merged under
    the YAML's own keys. Training under the CLI is in test_lightning_trainer.py."""
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    import lightning_gpt

    cli = lightning_gpt.cli_main(
        [
            "--config",
            str(ROOT / "configs/lightning.yaml"),
            f"--trainer.strategy.init_args.config={ROOT / 'configs/plugin.yaml'}",
            "--trainer.strategy.init_args.reduce_dtype=fp32",
            "--seed_everything=false",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        run=False,
    )
    strategy = cli.trainer.strategy
    assert type(strategy) is FSDPOverlapStrategy
    config = strategy.overlap_config
    assert config.bucket_plans == [["tok_emb", "pos_emb"], "blocks.*", ["norm", "head"]]  # lightning.yaml
    assert config.reduce_dtype == "fp32"  # command line
    assert config.mesh.replicate == 1 and config.activation_checkpointing == []  # plugin.yaml
    assert strategy._module_spec == "auto"
    assert cli.trainer.gradient_clip_val == 1.0
    with pytest.raises(SystemExit):  # jsonargparse names the bad key and exits, as for any CLI typo
        lightning_gpt.cli_main(
            ["--config", str(ROOT / "configs/lightning.yaml"), "--trainer.strategy.init_args.bucket_plan=auto"],
            run=False,
        )


# ------------------------------------------------------------------------ checkpoints
def test_checkpoint_state_dicts_read_shards_without_gathering(monkeypatch):
    """torch's DCP helpers resolve parameter names with getattr, which on a sharded module
    is the gathering property: all-gathers of every parameter on each save. The strategy reads
    the shards instead."""
    from _fake import fake_world
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    from fsdp_overlap_plugin.models import gpt_small

    calls = []
    original = DTensor.redistribute
    monkeypatch.setattr(DTensor, "redistribute", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    with fake_world(2):
        torch.manual_seed(0)
        model = fo.parallelize(gpt_small(n_layer=1), backend="aot_eager")
        strategy = FSDPOverlapStrategy()
        strategy.model = model
        state = strategy.lightning_module_state_dict()
        assert calls == [] and isinstance(state["tok_emb.weight"], DTensor)
        get_model_state_dict(model)  # what happens without the strategy's guard
        assert len(calls) >= len(list(model.parameters()))  # at least one all-gather per parameter (2 in torch 2.13)
