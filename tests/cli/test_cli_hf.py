"""``fsdp-overlap inspect`` / ``check`` with ``--model hf:path/to/config.json``: a transformers
model built on the meta device from a local config, offline, whose plan is the one
``auto_plan`` gives the same model built here with transformers directly."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import _hf
import pytest
import torch
from test_cli import run, run_json

from fsdp_overlap_plugin import auto_plan
from fsdp_overlap_plugin.cli import load_model

T = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_YAML = str(ROOT / "configs" / "plugin.yaml")
VOCAB = _hf.VOCAB


def llama_config(**overrides):
    return _hf.config("llama", **overrides)


def gpt2_config(**overrides):
    return _hf.config("gpt2", architectures=["GPT2LMHeadModel"], **overrides)


def on_meta(config):
    """The model of ``config`` as transformers builds it, on meta: the reference."""
    with torch.device("meta"):
        if config.architectures:
            return getattr(T, config.architectures[0])(config)
        return T.AutoModelForCausalLM.from_config(config)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No hub and no network at all: any connection attempt fails the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def llama_dir(tmp_path) -> Path:
    folder = tmp_path / "llama"
    llama_config().save_pretrained(folder)  # writes folder/config.json
    return folder


@pytest.fixture
def gpt2_file(tmp_path) -> Path:
    file = tmp_path / "gpt2.json"
    gpt2_config().to_json_file(file)
    return file


def n_params(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# --------------------------------------------------------------------------------- inspect
@pytest.mark.parametrize("where", ["file", "folder"])
def test_inspect_llama_config_shows_the_auto_plan(capsys, llama_dir, where):
    path = llama_dir / "config.json" if where == "file" else llama_dir
    reference = on_meta(llama_config())
    code, out = run_json(capsys, "inspect", f"hf:{path}")
    assert code == 0
    expected = auto_plan(reference)
    assert [r["modules"] for r in out["auto_plan"]["buckets"]] == expected
    assert [r["modules"] for r in out["plan"]["buckets"]] == expected
    assert out["plan"]["source"] == "auto"
    assert out["auto_plan"]["blocks"] == ["model.layers.0", "model.layers.1"]
    info = out["model"]
    assert info["class"] == "LlamaForCausalLM"
    assert info["config"] == str(llama_dir / "config.json")
    assert info["model_type"] == "llama"
    assert info["params"] == n_params(reference)  # the tied lm_head counted once
    assert info["storage_bytes"] == 4 * n_params(reference)
    assert info["non_meta_params"] == 0


def test_inspect_gpt2_config_by_its_architecture(capsys, gpt2_file):
    reference = on_meta(gpt2_config())
    code, out = run_json(capsys, "inspect", f"hf:{gpt2_file}")
    assert code == 0
    assert [r["modules"] for r in out["auto_plan"]["buckets"]] == auto_plan(reference)
    assert out["auto_plan"]["blocks"] == ["transformer.h.0", "transformer.h.1"]
    assert out["model"]["class"] == "GPT2LMHeadModel" and out["model"]["architecture"] == "GPT2LMHeadModel"
    assert out["model"]["model_type"] == "gpt2" and out["model"]["params"] == n_params(reference)


def test_inspect_text_names_the_config(capsys, llama_dir):
    code, text, _ = run(capsys, "inspect", f"hf:{llama_dir}")
    assert code == 0
    assert f"model   hf:{llama_dir} -> LlamaForCausalLM (on meta, no memory allocated for weights)" in text
    assert f"transformers config {llama_dir / 'config.json'}, model_type llama" in text
    assert "auto plan: 4 buckets; repeated blocks model.layers.0, model.layers.1, one bucket each" in text


def test_nothing_is_materialised(llama_dir):
    model, info = load_model(f"hf:{llama_dir}", ["num_hidden_layers=3"])
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    assert info["non_meta_params"] == 0 and info["kwargs"] == {"num_hidden_layers": 3}
    assert len(model.model.layers) == 3


# -------------------------------------------------------------------------- --model-arg
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_model_arg_overrides_a_config_field(capsys, llama_dir, gpt2_file, family):
    path, make, blocks = (
        (llama_dir, llama_config, "model.layers") if family == "llama" else (gpt2_file, gpt2_config, "transformer.h")
    )
    # GPT-2 spells it n_layer; transformers' attribute_map makes num_hidden_layers an alias
    code, out = run_json(capsys, "inspect", f"hf:{path}", "--model-arg", "num_hidden_layers=4")
    assert code == 0
    assert out["auto_plan"]["blocks"] == [f"{blocks}.{i}" for i in range(4)]
    block_buckets = [r for r in out["auto_plan"]["buckets"] if r["modules"][0].startswith(blocks + ".")]
    assert len(block_buckets) == 4
    reference = on_meta(make(num_hidden_layers=4))
    assert [r["modules"] for r in out["auto_plan"]["buckets"]] == auto_plan(reference)
    assert out["model"]["params"] == n_params(reference)
    assert out["model"]["kwargs"] == {"num_hidden_layers": 4}


def test_model_arg_resizes_uniform_layer_types(capsys, tmp_path):
    T.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    ).save_pretrained(tmp_path)
    assert len(json.loads((tmp_path / "config.json").read_text())["layer_types"]) == 2
    code, out = run_json(capsys, "inspect", f"hf:{tmp_path}", "--model-arg", "num_hidden_layers=4")
    assert code == 0 and len(out["auto_plan"]["blocks"]) == 4
    assert out["model"]["notes"] == ["layer_types: 2 x 'full_attention' -> 4 x 'full_attention'"]


@pytest.mark.parametrize(
    "arg, culprit",
    [
        ("num_hidden_layer=4", "LlamaConfig has no field 'num_hidden_layer'"),
        ("num_hidden_layers=many", "num_hidden_layers='many': LlamaConfig rejects it"),
        ("hidden_size=30", "is not consistent any more"),
    ],
)
def test_bad_model_arg_exits_2(capsys, llama_dir, arg, culprit):
    code, _, err = run(capsys, "inspect", f"hf:{llama_dir}", "--model-arg", arg)
    assert code == 2 and culprit in err, err
    if arg.startswith("num_hidden_layer="):
        assert "Did you mean 'num_hidden_layers'" in err


# --------------------------------------------------------------------------------- check
def test_check_shipped_plugin_yaml(capsys, llama_dir, gpt2_file):
    for path in (llama_dir, gpt2_file):
        code, out = run_json(capsys, "check", PLUGIN_YAML, "--model", f"hf:{path}")
        assert code == 0 and out["ok"] is True
        assert out["model"]["non_meta_params"] == 0
        assert [r["modules"] for r in out["plan"]["buckets"]] == out["auto_plan"]["buckets"]
    code, text, _ = run(capsys, "check", PLUGIN_YAML, "--model", f"hf:{llama_dir}")
    assert code == 0 and "OK: 4 buckets" in text


def test_check_plan_naming_a_missing_module_exits_2(capsys, tmp_path, llama_dir):
    cfg = tmp_path / "plan.yaml"
    cfg.write_text('bucket_plans: [[model.embed_tokens], "model.layer.*", [model.norm, lm_head]]\n')
    code, _, err = run(capsys, "check", str(cfg), "--model", f"hf:{llama_dir}")
    assert code == 2, err
    assert "'model.layer.*'" in err and "Did you mean 'model.layers" in err
    good = tmp_path / "good.yaml"
    good.write_text('bucket_plans: [[model.embed_tokens], "model.layers.*", [model.norm, lm_head]]\n')
    code, out = run_json(capsys, "check", str(good), "--model", f"hf:{llama_dir}")
    assert code == 0 and out["plan"]["source"] == "config"
    assert [r["modules"] for r in out["plan"]["buckets"]][1:3] == [["model.layers.0"], ["model.layers.1"]]


# -------------------------------------------------------------------------------- errors
def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "make, culprit",
    [
        (lambda d: d / "missing.json", "missing.json' does not exist"),
        (lambda d: d, "has no config.json"),
        (lambda d: write(d / "bad.json", '{"model_type": "llama",'), "bad.json' is not valid JSON"),
        (lambda d: write(d / "plain.json", '{"vocab_size": 97}'), "has no 'model_type' key"),
        (lambda d: write(d / "list.json", "[1, 2]"), "has no 'model_type' key"),
        (lambda d: write(d / "typo.json", '{"model_type": "lama"}'), "model_type 'lama'"),
        (
            lambda d: write(d / "arch.json", '{"model_type": "llama", "architectures": ["LlamaForCausalLLM"]}'),
            "architectures[0] 'LlamaForCausalLLM'",
        ),
    ],
)
def test_bad_hf_config_exits_2(capsys, tmp_path, make, culprit):
    path = make(tmp_path)
    for argv in (["inspect", f"hf:{path}"], ["check", PLUGIN_YAML, "--model", f"hf:{path}"]):
        code, _, err = run(capsys, *argv)
        assert code == 2 and culprit in err and str(path) in err, err
    if culprit == "model_type 'lama'":
        assert "Did you mean 'llama'" in err
    if "LLM" in culprit:
        assert "Did you mean 'LlamaForCausalLM'" in err


def test_json_error_object(capsys, tmp_path):
    code, out = run_json(capsys, "inspect", f"hf:{tmp_path / 'nope.json'}")
    assert code == 2 and out["ok"] is False and "does not exist" in out["error"]


def test_without_transformers_exits_2(capsys, monkeypatch, llama_dir):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    code, _, err = run(capsys, "inspect", f"hf:{llama_dir}")
    assert code == 2 and "needs transformers" in err and "pip install transformers" in err, err


def test_a_config_path_without_the_prefix_is_not_guessed(capsys, llama_dir):
    code, _, err = run(capsys, "inspect", str(llama_dir / "config.json"))
    assert code == 2 and "expected package.module:factory" in err
    assert f"prefix it: hf:{llama_dir / 'config.json'}" in err


# ------------------------------------------------------ the model's longest sequence (issue 55)
def test_max_sequence_length_reads_the_transformers_config(capsys, llama_dir, gpt2_file):
    from fsdp_overlap_plugin.cli.models import max_sequence_length

    llama, _ = load_model(f"hf:{llama_dir}")
    # rotary positions: a longer sequence runs, so the limit only says what the model was built for
    assert max_sequence_length(llama) == (64, "max_position_embeddings in its config", "max_position_embeddings", False)
    gpt2, _ = load_model(f"hf:{gpt2_file}")
    limit = max_sequence_length(gpt2)  # n_positions (GPT-2), also read as max_position_embeddings
    assert limit.tokens == 64 and limit.hard and "the rows of its position table" in limit.source  # wpe
    with torch.device("meta"):
        assert max_sequence_length(torch.nn.Sequential(torch.nn.Linear(4, 4))) is None  # unknown: no limit

    code, _, err = run(capsys, "inspect", f"hf:{gpt2_file}", "--seq", "65")
    assert code == 2
    assert "--seq 65: model hf:" in err and "takes at most 64 tokens per sequence (max_position_embeddings" in err
    assert "--model-arg max_position_embeddings=65" in err  # GPT-2 maps it to n_positions
    code, out = run_json(capsys, "inspect", f"hf:{llama_dir}", "--seq", "65")
    assert code == 0 and out["prediction"]["seq"] == 65
    assert "more than the 64 of max_position_embeddings" in out["prediction"]["seq_note"]
    code, out = run_json(capsys, "inspect", f"hf:{llama_dir}", "--model-arg", "max_position_embeddings=128")
    assert out["prediction"]["seq"] == 128 and "the model's most" in out["prediction"]["seq_note"]
