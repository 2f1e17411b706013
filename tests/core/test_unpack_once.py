"""``parallelize`` reads the config once (issue 58): it is validated once, the preflight
checks (with the auto-plan walk) run once, and which passes run is decided once; the
stages below get plain typed values (``ShardSettings``, ``OverlapState.passes``)."""

from __future__ import annotations

import importlib

import pytest
import torch
from _fake import fake_world

import fsdp_overlap_plugin.runtime.state as state_module
from fsdp_overlap_plugin.config.schema import OverlapConfig
from fsdp_overlap_plugin.core import get_state
from fsdp_overlap_plugin.models import gpt_small

# the module (the package's ``parallelize`` attribute is the function)
orchestrator = importlib.import_module("fsdp_overlap_plugin.parallelize")


@pytest.fixture
def counts(monkeypatch):
    """How often each of validate, preflight and the pass decision ran."""
    seen = {"coerce": 0, "validate": 0, "preflight": 0, "decide_passes": 0}

    def counting(name, original):
        def wrapper(*args, **kwargs):
            seen[name] += 1
            return original(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(OverlapConfig, "coerce", classmethod(counting("coerce", OverlapConfig.coerce.__func__)))
    monkeypatch.setattr(OverlapConfig, "validate", counting("validate", OverlapConfig.validate))
    monkeypatch.setattr(orchestrator, "preflight", counting("preflight", orchestrator.preflight))
    # both where it lives and where parallelize looks it up
    decide = counting("decide_passes", state_module.decide_passes)
    monkeypatch.setattr(state_module, "decide_passes", decide)
    monkeypatch.setattr(orchestrator, "decide_passes", decide, raising=False)
    return seen


def _parallelize(config, **overrides):
    torch.manual_seed(0)
    with fake_world(2):
        model = orchestrator.parallelize(gpt_small(), config, **overrides)
        return get_state(model)


def test_a_dict_with_keyword_overrides_and_an_auto_plan_is_read_once(counts):
    state = _parallelize({"backend": "aot_eager", "bucket_plans": "auto"}, prefetch_depth=2, reduce_dtype="fp32")
    assert counts == {"coerce": 1, "validate": 1, "preflight": 1, "decide_passes": 1}
    assert state.config.prefetch_depth == 2 and state.config.bucket_plans == "auto"
    assert state.passes.backend == "aot_eager" and state.passes.manual_bucketing


def test_a_config_object_is_read_once(counts):
    config = OverlapConfig(backend="aot_eager", compile=False)
    counts["validate"] = 0  # building it above validated it; parallelize must not again
    state = _parallelize(config)
    assert counts == {"coerce": 1, "validate": 0, "preflight": 1, "decide_passes": 1}
    assert state.passes.backend is None and not state.passes.manual_bucketing


def test_keyword_overrides_validate_once_and_still_name_the_key():
    from fsdp_overlap_plugin.config.schema import OverlapConfigError

    assert OverlapConfig.coerce({"prefetch_depth": 2}, reduce_dtype="fp32").prefetch_depth == 2
    with pytest.raises(OverlapConfigError, match="config"):
        OverlapConfig.coerce({"prefetch_dept": 2}, reduce_dtype="fp32")
    with pytest.raises(OverlapConfigError, match="keyword arguments"):
        OverlapConfig.coerce({"prefetch_depth": 2}, reduce_dtyp="fp32")


def test_the_report_and_the_check_read_the_one_decision():
    from fsdp_overlap_plugin.runtime.state import decide_passes

    on = decide_passes(OverlapConfig(backend="inductor"))
    assert on.names == ["manual_bucketing", "overlap_grad_reduce"] and on.pin_order and on.reorders
    off = decide_passes(OverlapConfig(backend="inductor", compile=False))
    assert off.names == [] and off.backend is None and not off.pin_order
    eager = decide_passes(OverlapConfig(backend="aot_eager", overlap_grad_reduce=False))
    assert eager.names == ["manual_bucketing"] and not eager.pin_order
