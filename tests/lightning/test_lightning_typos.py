"""A misspelt strategy keyword, ``FSDPOverlapStrategy(reduce_dtpye="fp32")``: an
``OverlapConfigError`` naming the class the user wrote, the keyword, the nearest valid one
and docs/config.md (not Python's ``TypeError`` naming our mixin), printed once under
torchrun; the signature LightningCLI reads is unchanged.

Under LightningCLI jsonargparse checks ``init_args`` against that signature before the
strategy is built, so it names the key (``Option 'reduce_dtpye' is not accepted``) with no
suggestion; ``fsdp-overlap check`` on the same YAML names the nearest key.
"""

from __future__ import annotations

import inspect
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from _accelerate import _launch, output

from fsdp_overlap_plugin.cli import main as fsdp_overlap
from fsdp_overlap_plugin.config.schema import OverlapConfigError
from fsdp_overlap_plugin.lightning import FSDPOverlapFabricStrategy, FSDPOverlapStrategy, standalone
from fsdp_overlap_plugin.report.messages import CONFIG_ERROR_EXIT

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
STRATEGIES = [FSDPOverlapStrategy, FSDPOverlapFabricStrategy, standalone.FSDPOverlapStrategy]
MESSAGE = "unknown argument 'reduce_dtpye'. Did you mean 'reduce_dtype'"


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_a_misspelt_keyword_names_the_class_the_keyword_and_the_nearest_one(cls):
    with pytest.raises(OverlapConfigError) as caught:
        cls(reduce_dtpye="fp32")
    text = str(caught.value)
    assert text.startswith(f"{cls.__name__}: {MESSAGE}"), text
    assert "docs/config.md" in text and "Mixin" not in text
    assert "sharding_strategy" in text  # the strategy's own arguments are listed beside the config keys


def test_lightnings_own_keywords_and_every_config_key_stay_valid():
    strategy = FSDPOverlapStrategy(
        {"backend": "aot_eager"},  # config, positional
        module="model",
        save_distributed_checkpoint=None,
        state_dict_type="full",
        process_group_backend="gloo",
        timeout=timedelta(minutes=5),
        sharding_strategy="FULL_SHARD",
        reduce_dtype="fp32",
    )
    assert strategy.overlap_config.reduce_dtype == "fp32" and strategy.overlap_config.backend == "aot_eager"
    FSDPOverlapFabricStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(1, 2), state_dict_type="sharded")


@pytest.mark.parametrize("cls", STRATEGIES, ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_the_signature_lightningcli_reads_is_the_strict_one(cls):
    parameters = inspect.signature(cls).parameters
    assert "reduce_dtype" in parameters and "sharding_strategy" in parameters
    assert not any(p.kind is p.VAR_KEYWORD for p in parameters.values())  # jsonargparse rejects unknown keys


def test_lightningcli_names_the_key_and_fsdp_overlap_check_the_nearest_one(tmp_path, capsys):
    """LightningCLI (the user's own, examples/lightning_gpt.py's here) exits naming the key;
    ``fsdp-overlap check`` on the same file names the nearest valid one."""
    text = (ROOT / "configs" / "lightning.yaml").read_text()
    assert "      overlap_grad_reduce: true\n" in text
    bad = tmp_path / "lightning.yaml"
    bad.write_text(text.replace("      overlap_grad_reduce: true\n", "      reduce_dtpye: fp32\n"))
    sys.path.insert(0, str(ROOT / "examples"))
    import lightning_gpt

    with pytest.raises(SystemExit):
        lightning_gpt.cli_main(["--config", str(bad)], run=False)
    assert "Option 'reduce_dtpye' is not accepted" in capsys.readouterr().err

    assert fsdp_overlap(["check", str(bad)]) == CONFIG_ERROR_EXIT
    err = capsys.readouterr().err
    assert "unknown key 'trainer.strategy.init_args.reduce_dtpye'. Did you mean 'reduce_dtype'" in err, err
    assert "docs/config.md" in err and "sharding_strategy" in err


TYPO_SCRIPT = """
import fsdp_overlap_plugin
from lightning.pytorch import Trainer
from fsdp_overlap_plugin.lightning import FSDPOverlapStrategy
Trainer(strategy=FSDPOverlapStrategy(reduce_dtpye="fp32"), accelerator="cpu", devices=2, logger=False)
"""


@pytest.mark.slow
def test_torchrun_prints_a_misspelt_keyword_once(tmp_path):
    """2 ranks each build the strategy and raise before any process group: rank 0 prints
    the two lines (messages.py, through torchrun's store), rank 1 stays quiet; before,
    each rank printed Python's traceback (54 lines in all, 47 now: the rest is torchrun's)."""
    script = tmp_path / "train.py"
    script.write_text(TYPO_SCRIPT)
    proc = _launch([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(script)], tmp_path, timeout=300)
    text = output(proc)
    assert proc.returncode != 0
    assert text.count(MESSAGE) == 1, text[-6000:]
    assert text.count("fsdp-overlap: configuration error: FSDPOverlapStrategy: ") == 1, text[-6000:]
    assert "TypeError" not in text and f'File "{script}"' not in text  # no traceback of the user's script
    assert "[rank0]" not in text and "[rank1]" not in text
    root = text.split("Root Cause (first observed failure):", 1)[1]
    assert "exitcode  : 2" in root and "printed above by rank 0" in root, text[-3000:]
