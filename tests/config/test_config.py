"""OverlapConfig: defaults, loading, and an error naming the culprit for each bad input."""

from __future__ import annotations

import pytest
import torch
import yaml

from fsdp_overlap_plugin import MeshConfig, OverlapConfig, OverlapConfigError


def test_defaults():
    c = OverlapConfig()
    assert c.bucket_plans == "auto"
    assert c.manual_bucketing and c.overlap_grad_reduce and c.reshard_after_forward
    assert c.compile and c.fullgraph and c.backend == "inductor"
    assert c.mesh == MeshConfig(shard=-1, replicate=1)
    assert c.param_dtype is None and c.reduce_dtype is None
    assert c.activation_checkpointing == []


def test_from_dict_and_yaml_roundtrip(tmp_path):
    data = {
        "bucket_plans": ["embed", ["norm", "head"]],
        "param_dtype": "bfloat16",
        "reduce_dtype": "fp32",
        "mesh": {"replicate": 2},
        "backend": "aot_eager",
    }
    c = OverlapConfig.from_dict(data)
    assert c.param_dtype == "bf16" and c.torch_param_dtype is torch.bfloat16
    assert c.torch_reduce_dtype is torch.float32
    assert c.mesh.replicate == 2 and c.mesh.sizes(4) == (2, 2)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(c.to_dict()))
    assert OverlapConfig.from_yaml(path) == c


def test_reduce_dtype_defaults_to_param_dtype():
    assert OverlapConfig(param_dtype="bf16").torch_reduce_dtype is torch.bfloat16


@pytest.mark.parametrize(
    "data, culprit, hint",
    [
        ({"bucket_plan": "auto"}, "bucket_plan", "bucket_plans"),
        ({"overlap_grad_reduction": True}, "overlap_grad_reduction", "overlap_grad_reduce"),
        ({"manual_bucketing": "yes"}, "manual_bucketing", "true or false"),
        ({"param_dtype": "bf61"}, "param_dtype", "bf16"),
        ({"reduce_dtype": "int8"}, "reduce_dtype", "bf16, fp16, fp32"),
        ({"backend": "inductr"}, "backend", "inductor"),
        ({"bucket_plans": []}, "bucket_plans", "empty"),
        ({"bucket_plans": "layers.0"}, "bucket_plans", "['layers.0']"),
        ({"bucket_plans": [["a", 3]]}, "bucket_plans[0]", "FQN"),
        ({"mesh": {"shards": 2}}, "mesh.shards", "mesh.shard"),
        ({"mesh": {"replicate": 0}}, "mesh.replicate", ">= 1"),
        ({"mesh": {"shard": 0}}, "mesh.shard", ">= 1"),
        ({"mesh": [2, 1]}, "mesh", "shard"),
        ({"activation_checkpointing": [1]}, "activation_checkpointing", "list of module"),
        ({"fullgraph": None}, "fullgraph", "true or false"),
    ],
)
def test_bad_input_names_the_key(data, culprit, hint):
    with pytest.raises(OverlapConfigError) as info:
        OverlapConfig.from_dict(data)
    message = str(info.value)
    assert culprit in message and hint in message, message


def test_unknown_key_lists_valid_keys():
    with pytest.raises(OverlapConfigError, match="Valid keys: bucket_plans, bucket_bytes, manual_bucketing"):
        OverlapConfig.from_dict({"nonsense": 1})


def test_mesh_sizes_must_divide_world():
    with pytest.raises(
        OverlapConfigError, match=r"mesh.replicate=3 does not divide the world size 4; valid values: \[1, 2, 4\]"
    ):
        MeshConfig(replicate=3).sizes(4)
    with pytest.raises(OverlapConfigError, match="world size is 4"):
        MeshConfig(replicate=2, shard=4).sizes(4)


def test_missing_and_invalid_yaml(tmp_path):
    with pytest.raises(OverlapConfigError, match="does not exist"):
        OverlapConfig.from_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("bucket_plans: [unclosed\n")
    with pytest.raises(OverlapConfigError, match="not valid YAML"):
        OverlapConfig.from_yaml(bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("- a\n- b\n")
    with pytest.raises(OverlapConfigError, match="expected a mapping"):
        OverlapConfig.from_yaml(wrong)


def test_is_a_value_error():
    assert issubclass(OverlapConfigError, ValueError)


def test_coerce_applies_overrides_and_validates():
    c = OverlapConfig.coerce({"backend": "aot_eager"}, manual_bucketing=False)
    assert c.backend == "aot_eager" and not c.manual_bucketing
    with pytest.raises(OverlapConfigError, match="unknown key 'bakend'"):
        OverlapConfig.coerce(None, bakend="x")


def test_every_field_is_documented():
    docs = OverlapConfig.field_docs()
    fields = list(OverlapConfig().to_dict())
    assert list(docs) == fields
    assert all(len(d) > 30 for d in docs.values())
    assert "bucket_plans (default: 'auto')" in OverlapConfig.describe()


def test_docs_config_md_is_current():
    from pathlib import Path

    from fsdp_overlap_plugin.config.docs import config_markdown

    path = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert path.read_text() == config_markdown(), "docs/config.md is stale: run `make docs`"


def test_shipped_plugin_yaml_loads():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / "plugin.yaml"
    assert OverlapConfig.from_yaml(path) == OverlapConfig()
