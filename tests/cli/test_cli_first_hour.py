"""Issue 41, "the first hour": CLI output a practitioner reads without a glossary.

A. ``explain`` names what ran: a gradient reduce-scatter the passes sent as an all-to-all
   (``reduce_scatter_impl`` auto -> receive_first on 2 gloo ranks) is that bucket's
   reduce-scatter, "sent as all-to-all", never ``after: none``.
B. ``inspect`` / ``check`` count a tied parameter once, in the bucket that gathers it;
   bucket totals never exceed the model, nor the prefetch peak what the buckets hold.
C. ``check`` on a LightningCLI YAML whose ``model:`` has init args but no class_path.
D. ``launch`` checks the plan against the script's ``FSDP_OVERLAP_MODEL``, or says it did not.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import _hf
import pytest
import torch
from _accelerate import copy_yaml
from _fake import fake_world
from test_cli import run, run_json
from test_cli_launch import launched  # noqa: F401  (fixture)
from test_cli_launch import run as run_launch

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.cli import launch
from fsdp_overlap_plugin.cli.explain import carried_reduce_scatters, summarize_schedule
from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn

ROOT = Path(__file__).resolve().parents[2]
GPT_PLAN = [["tok_emb", "pos_emb"], ["blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3"], ["norm", "head"]]


# ---------------------------------------------------------------- A: explain and all-to-all
@pytest.fixture(scope="module")
def demo_report(tmp_path_factory) -> Path:
    """The demo's report (gpt_small, 2 ranks, defaults: auto -> receive_first), from rank 0
    of a fake 2-rank world, written as the demo's --report-json writes it."""
    with fake_world(2):
        torch.manual_seed(0)
        model = gpt_small()
        fo.parallelize(model, backend="aot_eager")
        x, y = fixed_batches(1, 2, 16, 256)[0]
        loss_fn(model(x), y).backward()
        report = fo.schedule_report(model)
    path = tmp_path_factory.mktemp("report") / "report.json"
    path.write_text(json.dumps(report, default=str))
    return path


def test_explain_shows_each_buckets_reduce_scatter_sent_as_all_to_all(capsys, demo_report):
    report = json.loads(demo_report.read_text())
    assert report["reduce_scatter"]["impl"] == "receive_first"
    assert report["backward"]["after"]["reduce_scatter_as_all_to_all"] == 6
    assert [i["op"] for i in report["backward"]["schedule"]["after"]].count("all_to_all") == 6

    code, out, err = run(capsys, "explain", str(demo_report), "--graph", "backward")
    assert code == 0, err
    backward = out[out.index("backward graph") :]
    assert "none" not in backward  # every bucket's gradients were reduced: none says otherwise
    lines = backward.splitlines()
    assert lines[1].startswith("  communication hidden behind compute (predicted): ")  # the cost model's time
    assert (
        "reduce_scatter 6 launches (all sent as all-to-all) in 6 buckets, 6 with compute between launch and wait, "
        "0 B of 925.5 KiB without (cannot hide)" in lines[3]
    )
    assert lines[4] == (
        "  after the passes, 6 gradient reduce-scatters ran as all-to-all plus a local sum (reduce_scatter_impl: "
        "auto -> receive_first): each rank receives every rank's copy of its own chunk and adds them up; listed "
        "below as reduce_scatter, sent as all-to-all"
    )
    sizes = {0: "80.0 KiB", 1: "195.2 KiB", 2: "195.2 KiB", 3: "195.2 KiB", 4: "195.2 KiB", 5: "64.5 KiB"}
    for bucket, size in sizes.items():
        head = lines.index(f"    bucket {bucket} [{', '.join(GPT_PLAN[bucket])}]  reduce_scatter")
        after = lines[head + 2]
        assert after.startswith("      after:  1 launch #"), after
        assert "(reduce-scatter, sent as all-to-all), wait #" in after and f", {size}; " in after, after
    assert "all_to_all\n" not in backward  # no group headed "all_to_all": they are the reduce-scatters

    code, data = run_json(capsys, "explain", str(demo_report), "--graph", "backward")
    after = data["graphs"]["backward"]["after"]
    before = data["graphs"]["backward"]["before"]
    scatters = {g["bucket"]: g for g in after["buckets"] if g["op"] == "reduce_scatter"}
    assert sorted(scatters) == [0, 1, 2, 3, 4, 5]
    assert all(g["sent_as_all_to_all"] == 1 and len(g["launches"]) == 1 == len(g["waits"]) for g in scatters.values())
    assert not [g for g in after["buckets"] if g["op"] == "all_to_all"]
    assert len(after["reduce_scatters_as_all_to_all"]) == 6
    # the same bytes as the 53 reduce-scatters before the passes, bucket by bucket
    before_bytes = {g["bucket"]: g["bytes"] for g in before["buckets"] if g["op"] == "reduce_scatter"}
    assert {b: g["bytes"] for b, g in scatters.items()} == before_bytes
    assert sum(before_bytes.values()) == 947_712


def test_explain_sequence_names_the_all_to_all_as_a_reduce_scatter(capsys, demo_report):
    code, out, _ = run(capsys, "explain", str(demo_report), "--graph", "backward", "--sequence")
    assert code == 0
    rows = [line for line in out.splitlines() if re.match(r"\s+\d+  all_to_all", line)]
    assert len(rows) == 6 and all("  all_to_all (reduce-scatter)  all_to_all_single_default" in r for r in rows)


def _a2a(name, bucket, group):
    return {"op": "all_to_all", "name": name, "bucket": bucket, "module": "m", "bytes": 8, "flops": 0, "of": None}


def _wait(name, of):
    return {"op": "wait", "name": name, "bucket": None, "module": "m", "bytes": 0, "flops": 0, "of": of}


def test_only_the_all_to_alls_that_carry_reduce_scatters_are_named_so():
    items = [_a2a("mine", 0, "g"), _wait("w1", "mine"), _a2a("users", None, "g"), _wait("w2", "users")]
    items[0]["group"], items[2]["group"] = "fsdp_overlap_receive_first:0", "0"
    record = {"after": {"reduce_scatter": 1, "all_to_all": 1, "reduce_scatter_as_all_to_all": 1}}
    # receive_first: the one on the exchange group the report names
    report = {"reduce_scatter": {"impl": "receive_first", "groups": ["fsdp_overlap_receive_first:0"]}}
    assert carried_reduce_scatters(record, items, report) == {"mine"}
    # all_to_all on the shard group: the bucketed one
    assert carried_reduce_scatters(record, items, {"reduce_scatter": {"groups": []}}) == {"mine"}
    groups = summarize_schedule(items, {"mine"})
    assert [(g["op"], g["bucket"], g["sent_as_all_to_all"]) for g in groups] == [
        ("reduce_scatter", 0, 1),
        ("all_to_all", None, 0),
    ]
    # a report without the counter (native): nothing is a reduce-scatter
    assert carried_reduce_scatters({"after": {"all_to_all": 2}}, items, report) == set()
    # cannot tell which one: none named (shown as all-to-all, what ran)
    items[2]["bucket"] = 1
    assert carried_reduce_scatters(record, items, {}) == set()


# ------------------------------------------------------------------- B: tied parameters
LLAMA_ARGS = ["--model-arg", "hidden_size=64", "--model-arg", "intermediate_size=128", "--model-arg", "head_dim=16"]
TWO = "bucket_plans:\n  - [model.embed_tokens, model.layers.0]\n  - [model.layers.1, model.norm, lm_head]\n"


@pytest.fixture
def llama(tmp_path) -> tuple[str, str]:
    """The issue's model (tied Llama, hidden 64: 80,256 parameters) and its 2-entry plan."""
    _hf.config("llama").save_pretrained(tmp_path / "llama")
    (tmp_path / "two.yaml").write_text(TWO)
    return f"hf:{tmp_path / 'llama'}", str(tmp_path / "two.yaml")


def test_check_counts_the_tied_weight_once_in_its_first_uses_bucket(capsys, llama):
    model, plan = llama
    code, out = run_json(capsys, "check", plan, "--model", model, *LLAMA_ARGS, "--world", "2")
    assert code == 0
    assert out["model"]["params"] == 80_256
    rows = out["plan"]["buckets"]
    # before: 43,200 + 43,264 = 86,464 (the tied 6,208 twice)
    assert [r["params"] for r in rows] == [43_200, 37_056]
    assert sum(r["params"] for r in rows) == 80_256
    assert [r["gather_bytes"] for r in rows] == [172_800, 148_224]
    assert sum(r["gather_bytes"] for r in rows) == out["model"]["storage_bytes"] == 321_024
    assert rows[0]["tied"] == []
    assert rows[1]["tied"] == [
        {"param": "lm_head.weight", "same_as": "model.embed_tokens.weight", "params": 6_208, "counted_in": 0}
    ]
    assert out["tied"] == [
        {"param": "model.embed_tokens.weight", "names": ["lm_head.weight"], "params": 6_208, "bucket": 0}
    ]
    memory = out["memory"]
    assert memory["all_gathered_bytes"] == 321_024
    assert memory["prefetch_peak_bytes"] == 321_024  # both buckets at once: the whole model, not more
    window = sum(rows[i]["gather_bytes"] for i in memory["prefetch_peak_buckets"])
    assert memory["prefetch_peak_bytes"] <= window

    code, text, _ = run(capsys, "check", plan, "--model", model, *LLAMA_ARGS, "--world", "2")
    lines = text.splitlines()
    assert (
        "       1  model.layers.1, model.norm, lm_head (tied)  37,056  144.8 KiB   144.8 KiB       144.8 KiB" in lines
    )
    assert (
        "tied    lm_head.weight is model.embed_tokens.weight (6,208 parameters): counted once, in bucket 0, where its "
        "first use gathers it and its summed gradient is reduced; rows marked (tied) hold it but do not count it"
    ) in lines
    assert "peak 313.5 KiB (buckets 0-1)" in text and "313.8 KiB" not in text


def test_inspect_tree_and_auto_plan_count_the_tied_weight_once(capsys, llama):
    model, plan = llama
    code, out = run_json(capsys, "inspect", model, *LLAMA_ARGS, "--config", plan)
    assert code == 0
    top = [r for r in out["tree"] if r["depth"] == 0]
    assert [(r["fqn"], r["params"]) for r in top] == [("model", 80_256), ("lm_head", 0)]
    assert sum(r["params"] for r in top) == out["model"]["params"] == 80_256
    assert top[1]["tied"] == [{"param": "lm_head.weight", "same_as": "model.embed_tokens.weight", "params": 6_208}]
    auto = out["auto_plan"]["buckets"]
    assert [r["modules"] for r in auto] == [
        ["model.embed_tokens"],
        ["model.layers.0"],
        ["model.layers.1"],
        ["model.norm", "lm_head"],
    ]
    assert [r["params"] for r in auto] == [6_208, 36_992, 36_992, 64]
    assert out["auto_plan"]["tied"][0]["bucket"] == 0
    code, text, _ = run(capsys, "inspect", model, *LLAMA_ARGS, "--config", plan)
    assert re.search(r"^lm_head \(tied\) +Linear +0 +0 B +0 B +0 B +1$", text, re.M)
    assert re.search(r"^ +3  model\.norm, lm_head \(tied\) +64 +256 B +256 B +256 B$", text, re.M)


def test_a_tied_weight_first_held_by_no_bucket_counts_in_none(capsys, tmp_path):
    """The embedding unbucketed: its first use gathers the tied weight outside every
    bucket, so the head's bucket does not count it."""
    _hf.config("llama").save_pretrained(tmp_path / "llama")
    (tmp_path / "p.yaml").write_text("bucket_plans:\n  - [model.layers.0]\n  - [model.layers.1, model.norm, lm_head]\n")
    code, out = run_json(capsys, "check", str(tmp_path / "p.yaml"), "--model", f"hf:{tmp_path / 'llama'}")
    assert code == 0
    rows = out["plan"]["buckets"]
    assert [r["params"] for r in rows] == [9_280, 9_312]
    assert rows[1]["tied"][0]["counted_in"] is None
    assert out["unbucketed"] == ["model.embed_tokens.weight"]
    assert sum(r["params"] for r in rows) + 3_104 == out["model"]["params"] == 21_696


def test_untied_models_have_no_tied_rows(capsys):
    code, out = run_json(
        capsys,
        "check",
        str(ROOT / "configs" / "plugin.yaml"),
        "--model",
        "fsdp_overlap_plugin.models.gpt:gpt_small(vocab_size=255)",
    )
    assert code == 0
    assert out["tied"] == [] and all(r["tied"] == [] for r in out["plan"]["buckets"])
    assert sum(r["params"] for r in out["plan"]["buckets"]) == out["model"]["params"]


# -------------------------------------------------------- C: LightningCLI model: init args
LIGHTNING_YAML = "configs/lightning.yaml"


def test_check_lightning_yaml_without_class_path_says_what_it_needs(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out, _ = run(capsys, "check", LIGHTNING_YAML)
    assert code == 0
    assert out.splitlines()[1] == (
        "model   configs/lightning.yaml has `model:` init args but no class_path (LightningCLI takes the class from "
        "the script: LightningCLI(YourModule)); pass --model package.module:YourModule, the class your script gives "
        "LightningCLI, to check the plan against it (the YAML's model: values are passed to it)"
    )
    assert "none given" not in out
    code, data = run_json(capsys, "check", LIGHTNING_YAML)
    assert data["needs"] == "--model" and data["model"] is None


def test_check_lightning_yaml_applies_init_args_to_the_model_class(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    spec = "examples.lightning_gpt:GPTLitModule"
    code, out = run_json(capsys, "check", LIGHTNING_YAML, "--model", spec)
    assert code == 0
    assert out["model"]["class"] == "GPTLitModule"
    assert out["model"]["kwargs"] == {
        "vocab_size": 256,
        "block_size": 64,
        "n_layer": 4,
        "n_head": 4,
        "d_model": 64,
        "lr": 0.003,
        "init_on_meta": False,
    }
    assert out["model"]["params"] == 236_928
    assert [r["modules"] for r in out["plan"]["buckets"]] == GPT_PLAN
    # --model-arg wins over the YAML, as on LightningCLI's command line
    code, out = run_json(capsys, "check", LIGHTNING_YAML, "--model", spec, "--model-arg", "n_layer=2")
    assert out["model"]["kwargs"]["n_layer"] == 2 and len(out["plan"]["buckets"]) == 4
    code, text, _ = run(capsys, "check", LIGHTNING_YAML, "--model", spec)
    assert text.splitlines()[1] == (
        "        model from --model examples.lightning_gpt:GPTLitModule with the YAML's model: init args "
        "(vocab_size=256, block_size=64, n_layer=4, n_head=4, d_model=64, lr=0.003, init_on_meta=False)"
    )


def test_check_lightning_yaml_init_args_not_for_the_given_factory(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    factory = tmp_path / "builders.py"
    factory.write_text(
        "from fsdp_overlap_plugin.models import gpt_small\n\n"
        "def build(vocab_size=256, n_layer=2):\n    return gpt_small(vocab_size=vocab_size, n_layer=n_layer)\n"
    )
    code, out, err = run(capsys, "check", LIGHTNING_YAML, "--model", f"{factory}:build")
    assert code == 0, err
    assert out.splitlines()[1] == (
        f"        the YAML's model: init args (vocab_size=256, block_size=64, n_layer=4, n_head=4, d_model=64, "
        f"lr=0.003, init_on_meta=False) are not passed to --model {factory}:build: it takes no block_size, n_head, "
        "d_model, lr, init_on_meta (they are for the LightningModule the script gives LightningCLI; name that class "
        "with --model to use them)"
    )
    assert "6 buckets" not in out and "OK: 4 buckets" in out  # its own n_layer=2, not the YAML's 4
    # a **kwargs factory that refuses them when called: checked without them, said so
    code, data = run_json(capsys, "check", LIGHTNING_YAML, "--model", "fsdp_overlap_plugin.models.gpt:gpt_small")
    assert code == 0 and data["model"]["kwargs"] == {} and len(data["plan"]["buckets"]) == 6


# ----------------------------------------------------------- D: launch and the script's model
CONFIG = "configs/overlap.yaml"
SCRIPT_MODEL = 'FSDP_OVERLAP_MODEL = "fsdp_overlap_plugin.models.gpt:gpt_small(n_layer=4, d_model=64)"\n'


def _script(tmp_path: Path, head: str) -> Path:
    script = tmp_path / "train.py"
    script.write_text(head + 'raise SystemExit("the check reads this file, never runs it")\n')
    return script


def test_launch_checks_the_plan_against_the_scripts_model(capsys, launched, tmp_path):  # noqa: F811
    script = _script(tmp_path, "import os\n" + SCRIPT_MODEL)
    code, out, err = run_launch(capsys, "--config", CONFIG, "--num_processes", "2", str(script), "--lr", "3")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == (
        f"fsdp-overlap launch: {CONFIG}: OK: 6 buckets, 1 warning; passes on: manual_bucketing, overlap_grad_reduce"
    )
    assert lines[1] == (
        f"  model: fsdp_overlap_plugin.models.gpt:gpt_small(n_layer=4, d_model=64) (from {script}: FSDP_OVERLAP_MODEL)"
    )
    [(cmd, _)] = launched
    assert cmd[-3:] == [str(script), "--lr", "3"]


def test_launch_stops_on_a_plan_the_scripts_model_refuses(capsys, launched, tmp_path):  # noqa: F811
    bad = copy_yaml(tmp_path / "plan.yaml", fsdp_overlap_bucket_plans=[["tok_emb", "pos_emb"], "blocks.*", "heads"])
    script = _script(tmp_path, SCRIPT_MODEL)
    code, out, err = run_launch(capsys, "--config", str(bad), str(script))
    assert code == 2 and out == "" and not launched
    assert f"{bad}: fsdp_config.fsdp_overlap_bucket_plans[2]: no module named 'heads'" in err


def test_launch_without_a_model_says_the_plan_was_not_checked(capsys, launched, tmp_path):  # noqa: F811
    script = _script(tmp_path, "MODEL = 'not the convention'\n")
    code, out, err = run_launch(capsys, "--config", CONFIG, str(script))
    assert code == 0, err
    assert out.splitlines()[0] == (
        f"fsdp-overlap launch: {CONFIG}: keys valid; plan not checked against a model "
        "(pass --model pkg.mod:factory to check it before launching)"
    )
    assert len(launched) == 1


def test_launch_model_conventions(capsys, launched, tmp_path, monkeypatch):  # noqa: F811
    # --model wins over the script's
    script = _script(tmp_path, 'FSDP_OVERLAP_MODEL = "no.such.module:f"\n')
    code, out, err = run_launch(
        capsys, "--config", CONFIG, "--model", "fsdp_overlap_plugin.models.gpt:gpt_small", str(script)
    )
    assert code == 0, err
    assert "  model:" not in out and "OK: 6 buckets" in out.splitlines()[0]
    # the script's, unimportable: exit 2 naming where it came from, nothing launched
    code, out, err = run_launch(capsys, "--config", CONFIG, str(script))
    assert code == 2 and len(launched) == 1
    assert f"error: {script}: FSDP_OVERLAP_MODEL = 'no.such.module:f': model: cannot import module" in err
    # not a string literal
    script.write_text("FSDP_OVERLAP_MODEL = make_spec()\n")
    code, _, err = run_launch(capsys, "--config", CONFIG, str(script))
    assert code == 2 and f"{script}:1: FSDP_OVERLAP_MODEL must be a string" in err
    # a file beside the script, and a script run with -m
    (tmp_path / "mine.py").write_text("from fsdp_overlap_plugin.models import gpt_small\nbuild = gpt_small\n")
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "train.py").write_text('FSDP_OVERLAP_MODEL = "../mine.py:build"\n')
    assert launch.script_model(pkg / "train.py") == f"{pkg / '../mine.py'}:build"
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run_launch(capsys, "--config", CONFIG, "-m", "pkg.train")
    assert code == 0, err
    assert out.splitlines()[1].startswith(f"  model: {pkg / '../mine.py'}:build (from ")
    assert sys.modules.get("pkg.train") is None  # found on the path, not imported


def test_the_accelerate_examples_model_line_is_the_model_it_trains(capsys, launched):  # noqa: F811
    # examples/accelerate_train.py names its model for `fsdp-overlap launch`; the line must
    # stay the model the script builds (tests/_accelerate.MODEL), or the check is of another
    from _accelerate import MODEL

    from fsdp_overlap_plugin.cli.models import load_model

    script = Path(__file__).resolve().parents[2] / "examples" / "accelerate_train.py"
    code, out, err = run_launch(capsys, "--config", CONFIG, "--num_processes", "2", str(script))
    assert code == 0, err
    spec = re.search(r"  model: (.+?) \(from .*accelerate_train\.py: FSDP_OVERLAP_MODEL\)", out).group(1)
    built, _ = load_model(spec)
    assert [(n, p.shape) for n, p in built.named_parameters()] == [
        (n, p.shape) for n, p in gpt_small(**MODEL).named_parameters()
    ]
    assert "OK: 6 buckets" in out.splitlines()[0] and len(launched) == 1
