"""``fsdp-overlap inspect`` / ``check``: buckets, bytes and warnings against values computed
here from the model's shapes, on the meta device, with no process group."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import yaml
from _cli import run, run_json

from fsdp_overlap_plugin.cli import load_config, load_model, main

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "cli"
GPT = "fsdp_overlap_plugin.models.gpt:"
SMALL = GPT + "gpt_small"
ME = Path(__file__).stem  # tests/ is on sys.path (conftest), so MODEL specs can name factories here


# ------------------------------------------------------------------ independent arithmetic
def gpt_sizes(vocab=256, block=64, n_layer=4, d=64) -> dict[str, int]:
    """Parameter counts of models.gpt.GPT, from its layer shapes."""
    per_block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (4 * d * d + 4 * d) + (4 * d * d + d)
    return {
        "tok_emb": vocab * d,
        "pos_emb": block * d,
        "block": per_block,
        "norm": 2 * d,
        "head": vocab * d,
        "total": vocab * d + block * d + n_layer * per_block + 2 * d + vocab * d,
    }


def kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


# --------------------------------------------------------------------------------- inspect
def test_inspect_gpt_small_tree_plan_and_bytes(capsys):
    s = gpt_sizes()
    code, out = run_json(capsys, "inspect", SMALL)
    assert code == 0
    assert out["model"]["params"] == s["total"] and out["model"]["non_meta_params"] == 0
    assert out["model"]["storage_bytes"] == 4 * s["total"]
    rows = out["auto_plan"]["buckets"]
    assert [r["modules"] for r in rows] == [
        ["tok_emb", "pos_emb"],
        ["blocks.0"],
        ["blocks.1"],
        ["blocks.2"],
        ["blocks.3"],
        ["norm", "head"],
    ]
    expected = [s["tok_emb"] + s["pos_emb"], *[s["block"]] * 4, s["norm"] + s["head"]]
    assert [r["params"] for r in rows] == expected
    assert [r["gather_bytes"] for r in rows] == [4 * n for n in expected]  # fp32 parameters, no param_dtype
    assert [r["reduce_bytes"] for r in rows] == [4 * n for n in expected]
    assert out["auto_plan"]["target_bytes"] == 4 * s["block"]
    assert out["auto_plan"]["target_source"] == "median block"
    tree = {r["fqn"]: r for r in out["tree"]}
    assert list(tree) == ["tok_emb", "pos_emb", "blocks", *[f"blocks.{i}" for i in range(4)], "norm", "head"]
    assert tree["blocks"]["role"] == "container" and tree["blocks"]["params"] == 4 * s["block"]
    assert [tree[f"blocks.{i}"]["bucket"] for i in range(4)] == [1, 2, 3, 4]
    assert tree["head"]["bucket"] == 5 and tree["head"]["params"] == s["head"]
    # prefetch: two adjacent buckets gathered in the forward (two blocks); the backward
    # starts with the head and blocks.3 kept (the head gathers less than a block) and
    # blocks.2's re-gather launched: the peak
    assert out["memory"]["prefetch_peak_bytes"] == 8 * s["block"] + 4 * (s["norm"] + s["head"])
    assert out["memory"]["prefetch_peak_buckets"] == [3, 4, 5]
    assert out["memory"]["kept_for_backward"] == [4, 5]


def test_inspect_text_shows_tree_bytes_and_auto_plan(capsys):
    s = gpt_sizes()
    code, text, _ = run(capsys, "inspect", SMALL, "--expand")
    assert code == 0
    lines = text.splitlines()
    block0 = next(line for line in lines if line.strip().startswith("blocks.0 "))
    assert f"{s['block']:,}" in block0 and block0.count(kib(4 * s["block"])) == 3 and block0.split()[-1] == "1"
    assert "auto plan: 6 buckets" in text and f"grouped to {kib(4 * s['block'])}" in text
    emb = next(line for line in lines if line.split()[:3] == ["0", "tok_emb,", "pos_emb"])
    assert kib(4 * (s["tok_emb"] + s["pos_emb"])) in emb
    assert "on meta, no memory allocated for weights" in text
    # without --expand, identical consecutive blocks print as one run
    code, text, _ = run(capsys, "inspect", SMALL)
    (run_row,) = [line for line in text.splitlines() if "blocks.0 .. blocks.3 (4x)" in line and "Block" in line]
    assert run_row.split()[-1] == "1-4" and f"{kib(4 * s['block'])} each" in run_row
    assert not [line for line in text.splitlines() if line.strip().startswith("blocks.1 ")]


def test_inspect_bytes_follow_config_dtypes(capsys, tmp_path):
    s = gpt_sizes()
    cfg = tmp_path / "c.yaml"
    cfg.write_text("param_dtype: bf16\nreduce_dtype: fp32\n")
    code, out = run_json(capsys, "inspect", SMALL, "--config", str(cfg))
    assert code == 0
    head = out["auto_plan"]["buckets"][-1]
    assert head["gather_bytes"] == 2 * (s["norm"] + s["head"])  # gathered in bf16
    assert head["reduce_bytes"] == 4 * (s["norm"] + s["head"])  # reduce-scattered in fp32
    assert head["storage_bytes"] == 4 * (s["norm"] + s["head"])  # stored in the parameter's own dtype
    assert out["dtypes"] == {"storage": ["fp32"], "gather": "bf16", "reduce": "fp32"}
    code, text, _ = run(capsys, "inspect", SMALL, "--config", str(cfg))
    assert "all-gather bf16 (param_dtype: bf16)" in text and "reduce-scatter fp32 (reduce_dtype: fp32)" in text


def test_inspect_depth_and_world(capsys):
    s = gpt_sizes()
    code, out = run_json(capsys, "inspect", SMALL, "--depth", "1", "--world", "4")
    tree = {r["fqn"]: r for r in out["tree"]}
    assert tree["blocks.2.mlp"]["role"] == "inside" and tree["blocks.2.mlp"]["bucket"] == 3
    assert tree["blocks.2.mlp"]["params"] == 8 * 64 * 64 + 5 * 64
    assert "blocks.2.mlp.fc" not in tree  # one level only
    assert out["memory"]["sharded_storage_bytes_per_rank"] == -(-4 * s["total"] // 4)


def test_inspect_billion_parameter_model_on_meta(capsys):
    s = gpt_sizes(vocab=32768, block=2048, n_layer=24, d=2048)
    assert s["total"] > 10**9
    model, info = load_model(GPT + "gpt_1b")
    assert all(p.is_meta for p in model.parameters()) and info["non_meta_params"] == 0
    code, out = run_json(capsys, "inspect", GPT + "gpt_1b", "--world", "64")
    assert code == 0
    assert out["model"]["params"] == s["total"] == 1_347_014_656
    auto = out["auto_plan"]
    target = 4 * s["block"]  # the median block, fp32
    assert auto["target_bytes"] == target
    # the token embedding alone reaches the target, so the positional one starts a new bucket;
    # the final norm is below it, so the head joins it
    assert 4 * s["tok_emb"] >= target and 4 * s["norm"] < target
    assert [r["modules"] for r in auto["buckets"]] == [
        ["tok_emb"],
        ["pos_emb"],
        *[[f"blocks.{i}"] for i in range(24)],
        ["norm", "head"],
    ]
    assert [r["gather_bytes"] for r in auto["buckets"]][:3] == [4 * s["tok_emb"], 4 * s["pos_emb"], target]
    assert out["memory"]["sharded_storage_bytes_per_rank"] == -(-4 * s["total"] // 64)
    assert not [w for w in out["warnings"] if w["kind"] in ("small", "large", "unbucketed")]
    code, text, _ = run(capsys, "inspect", GPT + "gpt_1b")
    assert "1,347,014,656 parameters" in text
    (plan_row,) = [line for line in text.splitlines() if line.split()[:1] == ["2-25"]]
    assert plan_row.split()[1:5] == ["blocks.0", "..", "blocks.23", "(24x)"]
    assert f"{s['block']:,}  {mib(4 * s['block'])} each" in plan_row


def test_billion_parameter_check_allocates_no_weights(tmp_path):
    """A fresh process (``python -m`` path) checking gpt_1b stays far below its 5 GiB of weights."""
    script = (
        "import runpy, sys, resource\n"
        "sys.argv = ['fsdp-overlap', 'check', 'configs/plugin.yaml', '--model', "
        f"'{GPT}gpt_1b', '--json']\n"
        "try:\n    runpy.run_module('fsdp_overlap_plugin.cli', run_name='__main__')\n"
        "except SystemExit as e:\n    code = e.code\n"
        "print('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, code, file=sys.stderr)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    line = next(x for x in proc.stderr.splitlines() if x.startswith("MAXRSS"))
    _, rss_kib, code = line.split()
    assert code == "0", proc.stderr
    out = json.loads(proc.stdout)
    assert out["ok"] and out["model"]["params"] == 1_347_014_656 and len(out["plan"]["buckets"]) == 27
    weights = 4 * 1_347_014_656
    assert int(rss_kib) * 1024 < weights / 5, f"peak RSS {int(rss_kib) // 1024} MiB: weights were allocated?"


# ----------------------------------------------------------------------------------- check
def _shipped_configs() -> list[Path]:
    return sorted((ROOT / "configs").glob("*.yaml"))


def test_there_are_shipped_configs():
    assert _shipped_configs(), "configs/*.yaml missing"


@pytest.mark.parametrize("path", _shipped_configs(), ids=lambda p: p.name)
def test_check_shipped_config_passes(capsys, path):
    code, out = run_json(capsys, "check", str(path), "--model", SMALL)
    assert code == 0 and out["ok"], out
    plan = [r["modules"] for r in out["plan"]["buckets"]]
    model, _ = load_model(SMALL)
    names = {n for n, _ in model.named_modules()}
    assert plan and all(m in names for bucket in plan for m in bucket)


def _plugin_section(path: Path, data: dict) -> tuple[dict, str]:
    """The mapping of ``data`` holding the plugin keys, and the prefix they carry."""
    loaded = load_config(path)
    node = data
    for part in loaded.section.split(".") if loaded.section else []:
        if part == "strategy" and isinstance(node.get(part), str):
            node[part] = {"class_path": "fsdp_overlap_plugin.lightning.FSDPOverlapStrategy"}
        node = node.setdefault(part, {})
    return node, loaded.prefix


@pytest.mark.parametrize("path", _shipped_configs(), ids=lambda p: p.name)
def test_check_broken_copy_of_shipped_config_exits_2(capsys, tmp_path, path):
    data = yaml.safe_load(path.read_text())
    section, prefix = _plugin_section(path, data)
    bad_key = tmp_path / ("key_" + path.name)
    section[prefix + "bucket_plan"] = "auto"  # typo of bucket_plans
    bad_key.write_text(yaml.safe_dump(data))
    code, _, err = run(capsys, "check", str(bad_key), "--model", SMALL)
    # the key as the file spells it, and the nearest valid one
    assert code == 2 and f"'{prefix}bucket_plans'" in err and re.search(rf"{prefix}bucket_plan['.:]", err), err

    data = yaml.safe_load(path.read_text())
    section, prefix = _plugin_section(path, data)
    section[prefix + "bucket_plans"] = [["tok_emb", "pos_emb"], "blocks.*", ["norm", "haed"]]
    bad_module = tmp_path / ("module_" + path.name)
    bad_module.write_text(yaml.safe_dump(data))
    code, out = run_json(capsys, "check", str(bad_module), "--model", SMALL)
    assert code == 2 and not out["ok"]
    assert "'haed'" in out["error"] and "'head'" in out["error"] and f"{prefix}bucket_plans[2][1]" in out["error"]


def test_check_plain_yaml_lists_buckets_and_bytes(capsys):
    s = gpt_sizes()
    code, text, _ = run(capsys, "check", str(FIXTURES / "plugin_bf16.yaml"), "--model", SMALL, "--world", "4")
    assert code == 0
    pair = 2 * s["block"]
    row = next(line for line in text.splitlines() if line.split()[:3] == ["1", "blocks.0,", "blocks.1"])
    # params, storage (fp32), all-gather (bf16), reduce-scatter (fp32)
    assert row.split()[3:] == [f"{pair:,}", *kib(4 * pair).split(), *kib(2 * pair).split(), *kib(4 * pair).split()]
    # mesh {replicate: 2} on 4 ranks: shards over 2, so each rank keeps half of the parameters
    assert f"4 ranks (mesh 2 x 2): {kib(-(-4 * s['total'] // 2))}" in text
    assert "OK: 4 buckets" in text


def test_check_warns_on_unbucketed_parameters(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("bucket_plans: ['blocks.*']\n")
    code, out = run_json(capsys, "check", str(cfg), "--model", SMALL)
    assert code == 0
    model, _ = load_model(SMALL)
    expected = [n for n, _ in model.named_parameters() if not n.startswith("blocks.")]
    assert expected == ["tok_emb.weight", "pos_emb.weight", "norm.weight", "norm.bias", "head.weight"]
    (warning,) = [w for w in out["warnings"] if w["kind"] == "unbucketed"]
    assert warning["params"] == expected and out["unbucketed"] == expected
    assert "5 parameters" in warning["message"]


def test_check_warns_on_a_bucket_above_four_times_the_median(capsys, tmp_path):
    s = gpt_sizes(n_layer=10)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("bucket_plans: [[tok_emb, pos_emb], ['blocks.[0-4]'], 'blocks.[5-9]', [norm, head]]\n")
    code, out = run_json(capsys, "check", str(cfg), "--model", SMALL, "--model-arg", "n_layer=10")
    assert code == 0
    sizes = sorted([s["tok_emb"] + s["pos_emb"], 5 * s["block"], *[s["block"]] * 5, s["norm"] + s["head"]])
    median = (sizes[3] + sizes[4]) / 2
    assert 5 * s["block"] > 4 * median
    (warning,) = [w for w in out["warnings"] if w["kind"] == "large"]
    assert warning["buckets"] == [1] and f"{5 * s['block'] / median:.1f}x the median" in warning["message"]
    assert out["memory"]["prefetch_peak_bytes"] == 4 * 6 * s["block"]  # bucket 1 + blocks.5


def test_check_warns_on_latency_bound_buckets(capsys):
    s = gpt_sizes()
    code, out = run_json(capsys, "check", str(ROOT / "configs" / "plugin.yaml"), "--model", SMALL)
    (warning,) = [w for w in out["warnings"] if w["kind"] == "small"]
    assert warning["buckets"] == [0, 1, 2, 3, 4, 5]  # every gpt_small bucket is under 1 MiB
    code, out = run_json(
        capsys, "check", str(ROOT / "configs" / "plugin.yaml"), "--model", SMALL, "--small-bytes", "100KiB"
    )
    params = [s["tok_emb"] + s["pos_emb"], *[s["block"]] * 4, s["norm"] + s["head"]]
    below = [i for i, n in enumerate(params) if 4 * n < 100 * 1024]
    (warning,) = [w for w in out["warnings"] if w["kind"] == "small"]
    assert warning["buckets"] == below == [0, 5]
    code, out = run_json(capsys, "check", str(ROOT / "configs" / "plugin.yaml"), "--model", GPT + "gpt_1b")
    assert not [w for w in out["warnings"] if w["kind"] == "small"]


def test_check_strict_exits_1_on_warnings(capsys, tmp_path):
    assert main(["check", str(ROOT / "configs" / "plugin.yaml"), "--model", SMALL, "--strict"]) == 1
    assert main(["check", str(ROOT / "configs" / "plugin.yaml"), "--model", GPT + "gpt_1b", "--strict"]) == 0
    capsys.readouterr()


class NoParams(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.drop = nn.Dropout()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


def no_params_model() -> nn.Module:
    return NoParams()


def test_check_warns_on_empty_bucket_and_ignored_bucket_bytes(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("bucket_plans: [embed, drop, 'layers.*']\nbucket_bytes: 64MiB\n")
    code, out = run_json(capsys, "check", str(cfg), "--model", f"{ME}:no_params_model")
    assert code == 0
    kinds = {w["kind"]: w["message"] for w in out["warnings"]}
    assert "['drop'] owns no parameters" in kinds["no_params"]
    assert "bucket_bytes is set but only read when bucket_plans is auto" in kinds["ignored"]


def test_check_lightning_yaml(capsys):
    s = gpt_sizes(n_layer=6)
    path = FIXTURES / "lightning.yaml"
    code, out = run_json(capsys, "check", str(path))  # model from model.class_path (n_layer: 6)
    assert code == 0
    assert out["config"]["shape"] == "lightning" and out["config"]["section"] == "trainer.strategy.init_args"
    values = out["config"]["values"]
    assert values["param_dtype"] == "bf16"  # from trainer.precision: bf16-mixed
    assert values["reduce_dtype"] == "fp32" and values["bucket_plans"][1] == "blocks.*"
    rows = out["plan"]["buckets"]
    assert [r["modules"] for r in rows][1:7] == [[f"blocks.{i}"] for i in range(6)]
    assert rows[1]["gather_bytes"] == 2 * s["block"] and rows[1]["reduce_bytes"] == 4 * s["block"]
    assert out["memory"]["world"] == 2 and out["memory"]["sharded_storage_bytes_per_rank"] == 4 * s["total"] // 2


def test_check_lightning_yaml_with_config_path(capsys, monkeypatch):
    # init_args.config is relative to the YAML, as LightningCLI's parser resolves it
    monkeypatch.chdir(ROOT)
    code, out = run_json(capsys, "check", str(FIXTURES / "lightning_config_path.yaml"), "--model", SMALL)
    assert code == 0
    values = out["config"]["values"]
    assert values["manual_bucketing"] is False  # init_args override the included file
    assert values["param_dtype"] == "bf16" and values["mesh"]["replicate"] == 2  # from plugin_bf16.yaml
    assert [r["modules"] for r in out["plan"]["buckets"]][1] == ["blocks.0", "blocks.1"]
    assert out["memory"]["shard_size"] == 2 and out["memory"]["world"] == 4


@pytest.mark.parametrize(
    "text, culprit",
    [
        (
            "trainer:\n  strategy:\n    class_path: fsdp_overlap_plugin.lightning.FSDPOverlapStrategy\n"
            "    init_args:\n      reduce_dtpye: fp32\n",
            "'trainer.strategy.init_args.reduce_dtpye'. Did you mean 'reduce_dtype'",
        ),
        ("trainer:\n  strategy: ddp\n", "trainer.strategy: 'ddp' is not fsdp-overlap's strategy"),
        (
            "trainer:\n  strategy:\n    class_path: lightning.pytorch.strategies.FSDPStrategy\n",
            "trainer.strategy.class_path: 'lightning.pytorch.strategies.FSDPStrategy'",
        ),
        (
            "trainer:\n  strategy:\n    class_path: fsdp_overlap_plugin.lightning.FSDPOverlapStrategy\n"
            "    init_args:\n      config: missing.yaml\n",
            "missing.yaml' does not exist",
        ),
        (
            "trainer:\n  strategy:\n    class_path: fsdp_overlap_plugin.lightning.FSDPOverlapStrategy\n"
            "    init_args:\n      activation_checkpointing: ['layers.*']\n",
            "trainer.strategy.init_args.activation_checkpointing[0]: no module matches 'layers.*'",
        ),
        (
            "trainer:\n  strategy:\n    class_path: fsdp_overlap_plugin.lightning.FSDPOverlapStrategy\n"
            "    init_args:\n      backend: inductr\n",
            "trainer.strategy.init_args.backend: unknown backend 'inductr'",
        ),
    ],
)
def test_check_bad_lightning_yaml_names_the_key(capsys, tmp_path, text, culprit):
    cfg = tmp_path / "lightning.yaml"
    cfg.write_text(text)
    code, _, err = run(capsys, "check", str(cfg), "--model", SMALL)
    assert code == 2 and culprit in err, err


def test_check_lightning_strategy_string_means_defaults(capsys, tmp_path):
    cfg = tmp_path / "l.yaml"
    cfg.write_text("trainer:\n  strategy: fsdp_overlap\n  devices: 2\n  precision: 32-true\n")
    code, out = run_json(capsys, "check", str(cfg), "--model", SMALL)
    assert code == 0 and len(out["plan"]["buckets"]) == 6 and out["config"]["values"]["param_dtype"] is None


def test_check_accelerate_yaml(capsys):
    s = gpt_sizes()
    code, out = run_json(capsys, "check", str(FIXTURES / "accelerate.yaml"), "--model", SMALL)
    assert code == 0
    values = out["config"]["values"]
    assert values["param_dtype"] == "bf16"  # from mixed_precision: bf16
    assert values["reduce_dtype"] == "fp32" and values["overlap_grad_reduce"] is True
    assert values["bucket_bytes"] == 128 * 1024
    assert out["activation_checkpointing"] == [f"blocks.{i}" for i in range(4)]
    # 128 KiB target in bf16: the embeddings (40 KiB) and norm + head (32.25 KiB) stay merged
    assert [r["modules"] for r in out["plan"]["buckets"]][0] == ["tok_emb", "pos_emb"]
    assert out["plan"]["buckets"][0]["gather_bytes"] == 2 * (s["tok_emb"] + s["pos_emb"])
    assert out["memory"]["world"] == 8 and out["memory"]["sharded_storage_bytes_per_rank"] == 4 * s["total"] // 8


@pytest.mark.parametrize(
    "fsdp, top, culprit",
    [
        ({"fsdp_overlap_bucket_plan": "auto"}, {}, "fsdp_config.fsdp_overlap_bucket_plan: unknown fsdp-overlap key."),
        ({"fsdp_overlap_bucket_plans": ["blocks.0", "haed"]}, {}, "fsdp_config.fsdp_overlap_bucket_plans[1]"),
        ({"fsdp_overlap_manual_bucketing": "yes please"}, {}, "fsdp_config.fsdp_overlap_manual_bucketing: expected"),
        ({"fsdp_overlap_bucket_bytes": "64 MeB"}, {}, "fsdp_config.fsdp_overlap_bucket_bytes: cannot read"),
        (
            {"fsdp_overlap_overlap_grad_reduce": True},
            {},
            "fsdp_config.fsdp_overlap_overlap_grad_reduce: unknown fsdp-overlap key. Did you mean 'fsdp_overlap_grad_reduce'",
        ),
        ({"fsdp_overlap_grad_reduce": True, "overlap_grad_reduce": True}, {}, "fsdp_overlap_grad_reduce is set twice"),
        ({"fsdp_backwad_prefetch": "BACKWARD_PRE"}, {}, "fsdp_config.fsdp_backwad_prefetch: unknown key"),
        ({}, {"mixed_precision": "fp8"}, "mixed_precision 'fp8' (mixed_precision in"),
        ({}, {"mixed_precision": False}, "an unquoted no is YAML for false"),
        ({}, {"num_proceses": 2}, "unknown top-level key 'num_proceses'"),
        ({"fsdp_overlap_mesh": {"replicate": 3}}, {"num_processes": 8}, "does not divide the world size 8"),
    ],
)
def test_check_bad_accelerate_yaml_names_the_key(capsys, tmp_path, fsdp, top, culprit):
    data = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2, **fsdp}, **top}
    cfg = tmp_path / "overlap.yaml"
    cfg.write_text(yaml.safe_dump(data))
    code, _, err = run(capsys, "check", str(cfg), "--model", SMALL)
    assert code == 2 and culprit in err, err


def test_check_accelerate_alias_key(capsys, tmp_path):
    cfg = tmp_path / "overlap.yaml"
    cfg.write_text(
        "distributed_type: FSDP\nmixed_precision: 'no'\nfsdp_config:\n  fsdp_version: 2\n"
        "  fsdp_overlap_grad_reduce: false\n"
    )
    code, out = run_json(capsys, "check", str(cfg), "--model", SMALL)
    assert code == 0 and out["config"]["values"]["overlap_grad_reduce"] is False
    assert out["config"]["values"]["param_dtype"] is None


def test_check_without_model_checks_keys_only(capsys):
    code, out = run_json(capsys, "check", str(FIXTURES / "accelerate.yaml"))
    assert code == 0 and "plan" not in out and out["config"]["values"]["bucket_bytes"] == 131072


# ------------------------------------------------------------------------------ MODEL specs
def tiny(width: int = 4, depth: int = 2, bias: bool = True) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width, bias=bias) for _ in range(depth)])


def not_a_module() -> int:
    return 3


def test_model_spec_arguments(capsys, tmp_path):
    model, info = load_model(f"{ME}:tiny(width=8, depth=3)")
    assert info["params"] == 3 * (8 * 8 + 8) and all(p.is_meta for p in model.parameters())
    model, info = load_model(f"{ME}:tiny", ["width=6", "bias=false"])
    assert info["params"] == 2 * 36 and info["kwargs"] == {"width": 6, "bias": False}
    script = tmp_path / "my_model.py"
    script.write_text("import torch.nn as nn\n\ndef build(n=3):\n    return nn.Linear(n, n)\n")
    _, info = load_model(f"{script}:build", ["n=5"])
    assert info["params"] == 30 and info["class"] == "Linear"


@pytest.mark.parametrize(
    "spec, extra, culprit",
    [
        (GPT + "gpt_smal", [], "has no attribute 'gpt_smal'. Did you mean 'gpt_small'"),
        ("fsdp_overlap_plugin.models.gtp:gpt_small", [], "cannot import module 'fsdp_overlap_plugin.models.gtp'"),
        ("fsdp_overlap_plugin.models.gpt", [], "expected package.module:factory"),
        (f"{ME}:not_a_module", [], "returned int, not an nn.Module"),
        (f"{ME}:tiny", ["widht=3"], "unexpected keyword argument 'widht'. Did you mean 'width'"),
        (f"{ME}:tiny", ["width"], "--model-arg 'width': expected KEY=VALUE"),
        (f"{ME}:tiny(width=os.getcwd())", [], "factory arguments must be Python literals"),
    ],
)
def test_bad_model_spec_exits_2(capsys, spec, extra, culprit):
    argv = ["inspect", spec]
    for item in extra:
        argv += ["--model-arg", item]
    code, _, err = run(capsys, *argv)
    assert code == 2 and culprit in err, err


def test_json_error_object(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("bakend: inductor\n")
    code, out = run_json(capsys, "check", str(cfg), "--model", SMALL)
    assert code == 2 and out == {
        "command": "check",
        "ok": False,
        "error": out["error"],
    }
    assert "unknown key 'bakend'. Did you mean 'backend'" in out["error"]


def test_console_script_declared():
    import importlib
    import re

    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    target = re.search(r'^fsdp-overlap = "([\w.]+):(\w+)"$', section, re.M)
    assert target, section
    assert getattr(importlib.import_module(target.group(1)), target.group(2)) is main


def test_meta_build_leaves_default_device_alone():
    load_model(SMALL)
    assert torch.empty(1).device.type == "cpu"


def test_docs_tuning_examples_are_current(capsys, monkeypatch):
    """The docs/tuning.md examples that run from the repository root print what the docs show
    (as on a machine without a GPU, where the docs were written: the preset line says so)."""
    import shlex

    from fsdp_overlap_plugin.runtime import devices

    monkeypatch.setattr(devices, "detect_device_type", lambda preferred=None: "cpu")
    monkeypatch.chdir(ROOT)
    text = (ROOT / "docs" / "tuning.md").read_text()
    checked = 0
    for block in text.split("```")[1::2]:
        lines = block.strip("\n").splitlines()
        if not lines or not lines[0].startswith("$ fsdp-overlap "):
            continue
        argv = shlex.split(lines[0][len("$ fsdp-overlap ") :])
        paths = [a for a in argv if a.endswith((".yaml", ".json"))]
        if not all((ROOT / p).is_file() for p in paths):
            continue  # an example on a user's own file
        main(argv)
        assert capsys.readouterr().out.splitlines() == lines[1:], f"docs/tuning.md is stale for: {lines[0]}"
        checked += 1
    assert checked >= 2


def _refusal(capsys, path: Path, text: str) -> str:
    """``check``'s error for a file holding ``text`` (it must exit 2)."""
    path.write_text(text)
    code, out = run_json(capsys, "check", str(path), "--model", SMALL)
    assert code == 2 and not out["ok"], out
    return out["error"]


def test_framework_precision_disagreeing_with_param_dtype_is_an_error(capsys, tmp_path):
    """As in the run: the strategy and the Accelerate adapter refuse a param_dtype that
    contradicts the framework's precision (0.1's check only warned)."""
    strategy = "  strategy:\n    class_path: fsdp_overlap_plugin.lightning.FSDPOverlapStrategy\n"
    lightning = tmp_path / "l.yaml"
    error = _refusal(
        capsys, lightning, f"trainer:\n  precision: bf16-mixed\n{strategy}    init_args:\n      param_dtype: fp16\n"
    )
    assert "trainer.strategy.init_args.param_dtype: 'fp16' conflicts with precision='bf16-mixed'" in error
    accelerate = "distributed_type: FSDP\nmixed_precision: fp16\nfsdp_config:\n  fsdp_overlap_param_dtype: bf16\n"
    error = _refusal(capsys, tmp_path / "a.yaml", accelerate)
    assert "fsdp_config.fsdp_overlap_param_dtype is 'bf16' but Accelerate's mixed_precision is 'fp16'" in error
    error = _refusal(capsys, lightning, f"trainer:\n  precision: 16-mixed\n{strategy}")  # Lightning refuses it
    assert "trainer.precision='16-mixed': Lightning refuses it: The `ModelParallelStrategy`" in error
    # by name, with accelerator: auto, the machine decides: here a CPU, where Lightning uses bf16-mixed
    lightning.write_text("trainer:\n  precision: 16-mixed\n  strategy: fsdp_overlap\n")
    code, out = run_json(capsys, "check", str(lightning), "--model", SMALL)
    notes = " | ".join(out["config"]["notes"])
    assert code == 0 and "Using `precision='bf16-mixed'` instead" in notes and "auto is CPUAccelerator" in notes
    lightning.write_text("trainer:\n  precision: bf16-mixed\n  strategy: fsdp_overlap\n")
    code, out = run_json(capsys, "check", str(lightning), "--model", SMALL)
    # what the strategy runs with: gathers in bf16, reduce-scatters in fp32 (0.1's check said bf16)
    assert code == 0 and (out["config"]["values"]["param_dtype"], out["config"]["values"]["reduce_dtype"]) == (
        "bf16",
        "fp32",
    )


def test_lightning_yaml_for_hardware_this_machine_lacks(capsys, tmp_path):
    """A GPU config checked on a CPU-only machine: the keys and the strategy are checked,
    the precision is Lightning's normalised flag, and a note says what could not run."""
    cfg = tmp_path / "gpu.yaml"
    cfg.write_text("trainer:\n  accelerator: cuda\n  devices: 8\n  precision: bf16\n  strategy: fsdp_overlap\n")
    code, out = run_json(capsys, "check", str(cfg), "--model", SMALL)
    assert code == 0 and out["memory"]["world"] == 8
    assert (out["config"]["values"]["param_dtype"], out["config"]["values"]["reduce_dtype"]) == ("bf16", "fp32")
    assert any("accelerator 'cuda' cannot be built here" in note for note in out["config"]["notes"])
    cfg.write_text("trainer:\n  accelerator: cuda\n  precision: 16-mixed\n  strategy: fsdp_overlap\n")
    code, out = run_json(capsys, "check", str(cfg), "--model", SMALL)  # refused on the GPU: by the strategy
    assert code == 2 and "trainer.precision='16-mixed' is not supported by the fsdp_overlap strategy" in out["error"]


def test_lightning_yaml_nested_under_a_subcommand(capsys, tmp_path):
    """A config given before the subcommand (``python train.py --config c.yaml fit``) nests
    LightningCLI's keys under it; keys are named with that prefix."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("fit:\n  trainer:\n    devices: 2\n    precision: bf16-mixed\n    strategy: fsdp_overlap\n")
    code, out = run_json(capsys, "check", str(cfg), "--model", SMALL)
    assert code == 0 and out["config"]["section"] == "fit.trainer.strategy.init_args"
    assert out["config"]["values"]["param_dtype"] == "bf16" and out["memory"]["world"] == 2
    cfg.write_text("fit:\n  trainer:\n    presicion: bf16-mixed\n    strategy: fsdp_overlap\n")
    code, out = run_json(capsys, "check", str(cfg), "--model", SMALL)
    assert code == 2 and "unknown key 'fit.trainer.presicion'. Did you mean 'precision'" in out["error"]
