"""The predicted step of ``fsdp-overlap check`` / ``inspect`` and ``fsdp-overlap suggest``:
each bucket's FLOPs against a count made here from the layer shapes, its bytes against
``bucket_rows``, the rates and where they come from, and the plan ``suggest`` picks, all on
the meta device with no process group."""

from __future__ import annotations

import argparse
import json

import _hf
import pytest
import yaml
from _cli import run, run_json
from test_cli import ROOT, SMALL

from fsdp_overlap_plugin.cli import load_model
from fsdp_overlap_plugin.cli.analysis import SMALL_BUCKET_BYTES, bucket_rows
from fsdp_overlap_plugin.cli.commands import cmd_check
from fsdp_overlap_plugin.cli.predict import ROOT_NAME, TIE, TIE_RULE, bucket_costs, choose
from fsdp_overlap_plugin.config.plan import resolve_plan
from fsdp_overlap_plugin.config.schema import OverlapConfig
from fsdp_overlap_plugin.report import costmodel

PLUGIN_YAML = str(ROOT / "configs" / "plugin.yaml")
# gpt_1b's layer shapes with 8 blocks: suggest's candidates in a fraction of a second
GPT8 = ["fsdp_overlap_plugin.models.gpt:gpt_1b", "--model-arg", "n_layer=8"]


def gpt_small_flops(batch: int, seq: int, d: int = 64, vocab: int = 256) -> dict[str, int]:
    """Forward FLOPs of models.gpt's parts from its layer shapes: qkv d x 3d, proj d x d,
    fc d x 4d, proj 4d x d per block (12 d^2 matmul weights); the head d x vocab."""
    tokens = batch * seq
    return {
        "block": 2 * tokens * 12 * d * d + 4 * batch * seq * seq * d,
        "head": 2 * tokens * d * vocab,
        "block_matmul_params": 12 * d * d,
    }


def costs_of(spec: str, config: OverlapConfig | None = None, *, batch: int, seq: int, args=()):
    model, _ = load_model(spec, list(args))
    config = config or OverlapConfig()
    plan = resolve_plan(model, config)
    return model, config, plan, bucket_costs(model, config, plan, batch=batch, seq=seq)


# ------------------------------------------------------------------------- bucket_costs
def test_gpt_flops_per_bucket_are_the_hand_count():
    _, _, plan, costs = costs_of(SMALL, batch=2, seq=64)
    hand = gpt_small_flops(2, 64)
    assert plan == [["tok_emb", "pos_emb"], ["blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3"], ["norm", "head"]]
    assert [c["flops_forward"] for c in costs] == [0] + [hand["block"]] * 4 + [hand["head"]]
    assert [c["flops_backward"] for c in costs] == [2 * c["flops_forward"] for c in costs]
    assert [c["name"] for c in costs] == [
        "tok_emb, pos_emb",
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "blocks.3",
        "norm, head",
    ]
    # one collective per parameter without the passes: ln1, qkv, proj, ln2, fc, proj (weight + bias each)
    assert [c["collectives"] for c in costs] == [2, 12, 12, 12, 12, 3]


def test_llama_flops_are_six_per_matmul_parameter_per_token_plus_attention(tmp_path):
    pytest.importorskip("transformers")
    cfg = _hf.config("llama")
    cfg.save_pretrained(tmp_path / "llama")
    batch, seq = 2, 16
    _, _, plan, costs = costs_of(f"hf:{tmp_path / 'llama'}", batch=batch, seq=seq)
    hidden, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    head_dim = hidden // cfg.num_attention_heads
    q_width, kv_width = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    per_layer = hidden * (q_width + 2 * kv_width) + q_width * hidden + 3 * hidden * inter
    matmul = layers * per_layer + hidden * cfg.vocab_size  # the tied head is a matmul where lm_head runs
    attention = layers * 4 * batch * seq * seq * q_width
    tokens = batch * seq
    assert sum(c["flops_forward"] + c["flops_backward"] for c in costs) == 6 * tokens * matmul + 3 * attention
    layer_buckets = [c for c in costs if c["name"].startswith("model.layers.")]
    assert len(layer_buckets) == layers
    assert {c["flops_forward"] for c in layer_buckets} == {2 * tokens * per_layer + 4 * batch * seq * seq * q_width}
    head = next(c for c in costs if "lm_head" in c["modules"])
    assert head["flops_forward"] == 2 * tokens * hidden * cfg.vocab_size


def test_gpt2_conv1d_layers_count_as_matmuls(tmp_path):
    pytest.importorskip("transformers")
    cfg = _hf.config("gpt2", architectures=["GPT2LMHeadModel"])
    cfg.to_json_file(tmp_path / "gpt2.json")
    _, _, _, costs = costs_of(f"hf:{tmp_path / 'gpt2.json'}", batch=1, seq=8)
    d = cfg.n_embd
    block = 2 * 8 * 12 * d * d + 4 * 8 * 8 * d  # c_attn d x 3d, c_proj, c_fc d x 4d, c_proj; attention width d
    assert [c["flops_forward"] for c in costs if c["name"].startswith("transformer.h.")] == [block] * cfg.n_layer


def test_bytes_are_bucket_rows_and_the_tied_weight_counts_once(tmp_path):
    pytest.importorskip("transformers")
    _hf.config("llama").save_pretrained(tmp_path / "llama")
    config = OverlapConfig(param_dtype="bf16", reduce_dtype="fp32")
    model, _, plan, costs = costs_of(f"hf:{tmp_path / 'llama'}", config, batch=1, seq=8)
    rows = bucket_rows(model, config, plan)
    assert [(c["gather_bytes"], c["reduce_bytes"]) for c in costs] == [
        (r["gather_bytes"], r["reduce_bytes"]) for r in rows
    ]
    params = {id(p): p for p in model.parameters()}.values()
    assert sum(c["gather_bytes"] for c in costs) == 2 * sum(p.numel() for p in params)
    assert sum(c["collectives"] for c in costs) == len(params)


def test_parameters_no_bucket_holds_are_a_last_bucket():
    model, _ = load_model(SMALL)
    config = OverlapConfig(bucket_plans=["blocks.*"], on_unbucketed="warn")
    plan = resolve_plan(model, config)
    costs = bucket_costs(model, config, plan, batch=1, seq=32)
    assert len(costs) == 5 and costs[-1]["name"] == ROOT_NAME
    loose = costs[-1]
    # tok_emb, pos_emb, norm (weight, bias), head
    assert loose["collectives"] == 5
    assert loose["gather_bytes"] == 4 * (256 * 64 + 64 * 64 + 2 * 64 + 64 * 256)
    assert loose["flops_forward"] == gpt_small_flops(1, 32)["head"]


def test_regather_follows_the_kept_buckets_and_reshard_after_forward():
    _, _, _, costs = costs_of(SMALL, batch=1, seq=32)
    # check: "after buckets 4-5, kept gathered"
    assert [c["regather"] for c in costs] == [True, True, True, True, False, False]
    _, _, _, costs = costs_of(SMALL, OverlapConfig(reshard_after_forward=False), batch=1, seq=32)
    assert not any(c["regather"] for c in costs)


@pytest.mark.parametrize("policy, again", [("full", 1), ("matmuls_saved", 0)])
def test_checkpointed_blocks_compute_their_forward_again(policy, again):
    config = OverlapConfig(activation_checkpointing=["blocks.*"], activation_checkpointing_policy=policy)
    _, _, _, costs = costs_of(SMALL, config, batch=1, seq=32)
    block = gpt_small_flops(1, 32)["block"]
    assert [c["flops_backward"] for c in costs[1:5]] == [(2 + again) * block] * 4
    assert costs[5]["flops_backward"] == 2 * costs[5]["flops_forward"]  # the head is not checkpointed


# ------------------------------------------------------------------- check and inspect
def test_check_prints_and_returns_the_prediction_with_its_sources(capsys):
    argv = ["check", PLUGIN_YAML, "--model", SMALL, "--world", "8", "--batch", "2", "--seq", "64"]
    code, text, _ = run(capsys, *argv)
    assert code == 0
    lines = text.splitlines()
    ok = next(i for i, line in enumerate(lines) if line.startswith("OK: 6 buckets"))
    assert lines[ok + 1].startswith(
        "predicted step per rank (cost model; 8 ranks, mesh 8; 2 x 64 tokens per rank from --batch/--seq): "
    )
    assert "with the passes" in lines[ok + 1] and "for torch's fully_shard" in lines[ok + 1]
    hw = costmodel.HARDWARE["h100-nvlink"]
    assert f"h100-nvlink (the cuda default): {hw.link_source}" in text
    assert hw.flops_source in text
    assert "a prediction, not a measurement" in text

    code, out = run_json(capsys, *argv)
    pred = out["prediction"]
    assert (pred["world"], pred["shard"], pred["replicate"], pred["batch"], pred["seq"]) == (8, 8, 1, 2, 64)
    assert pred["preset"] == "h100-nvlink" and pred["rates"]["link"] == hw.link
    assert pred["sources"]["link"].startswith("h100-nvlink (the cuda default)")
    for schedule in ("passes", "no-passes", "fsdp2"):
        step = pred[schedule]
        assert step["step_s"] >= step["compute_s"] > 0
        assert 0 <= step["exposed_comm_s"] <= step["comm_s"]
        assert step["tokens_per_s"] == pytest.approx(128 / step["step_s"])
    assert pred["no-passes"]["step_s"] > pred["passes"]["step_s"]
    hand = gpt_small_flops(2, 64)
    assert [b["flops_forward"] for b in pred["buckets"]] == [0] + [hand["block"]] * 4 + [hand["head"]]
    n_params = out["model"]["params"]
    assert pred["optimizer_s"] == pytest.approx(28 * -(-n_params // 8) / hw.mem)


def test_inspect_prints_and_returns_the_prediction(capsys):
    longer = ["--model-arg", "block_size=2048"]  # gpt_small takes 64 tokens; this one the default 2048
    code, out = run_json(capsys, "inspect", SMALL, *longer, "--world", "4")
    assert code == 0
    assert out["prediction"]["world"] == 4 and out["prediction"]["seq"] == 2048 and out["prediction"]["batch"] == 1
    assert out["prediction"]["seq_note"] is None
    code, text, _ = run(capsys, "inspect", SMALL, *longer, "--world", "4")
    lines = text.splitlines()
    warned = next(i for i, line in enumerate(lines) if line.startswith("warnings"))
    predicted = next(i for i, line in enumerate(lines) if line.startswith("predicted step per rank"))
    assert predicted > warned  # after the existing output
    assert lines[predicted].startswith("predicted step per rank (cost model; 4 ranks, mesh 4; 1 x 2048 tokens")
    assert not any(line.startswith("seq ") for line in lines)


# ------------------------------------------------------ the model's longest sequence (issue 55)
def _argv(command: str, *model: str) -> list[str]:
    return [command, PLUGIN_YAML, "--model", *model] if command == "check" else [command, *model]


SEQ_LIMIT = "takes at most 64 tokens per sequence (its block_size, the rows of its position table)"


@pytest.mark.parametrize("command", ["inspect", "check", "suggest"])
def test_a_seq_longer_than_the_model_takes_is_exit_2_naming_its_limit(capsys, command):
    """gpt_small has 64 positions: --seq 2048 was predicted silently (and profile's 128 died
    in a native kernel)."""
    code, _, err = run(capsys, *_argv(command, SMALL), "--seq", "2048")
    assert code == 2
    assert f"fsdp-overlap {command}: error: --seq 2048: model {SMALL} {SEQ_LIMIT}; pass --seq 64 or less" in err
    assert "--model-arg block_size=2048" in err
    code, out = run_json(capsys, *_argv(command, SMALL), "--seq", "64")
    pred = out if command == "suggest" else out["prediction"]
    assert code == 0 and pred["seq"] == 64 and pred["seq_note"] is None


@pytest.mark.parametrize("command", ["inspect", "check", "suggest"])
def test_without_seq_the_default_is_cut_to_the_models_limit_in_one_line(capsys, command):
    code, out = run_json(capsys, *_argv(command, SMALL))
    pred = out if command == "suggest" else out["prediction"]
    assert code == 0 and pred["seq"] == 64 and pred["tokens_per_rank"] == 64
    code, text, _ = run(capsys, *_argv(command, SMALL))
    said = [line for line in text.splitlines() if "tokens per sequence" in line]
    assert said == [
        "seq     64 tokens per sequence, the model's most (its block_size, the rows of its position table), "
        "not the default 2048 (--seq sets it)"
    ]
    # a model with positions to spare keeps the default, and says nothing
    code, out = run_json(capsys, *_argv(command, SMALL, "--model-arg", "block_size=4096"))
    pred = out if command == "suggest" else out["prediction"]
    assert pred["seq"] == 2048 and pred["seq_note"] is None


def test_profile_defaults_run_the_models_length_and_refuse_a_longer_seq(capsys, tmp_path):
    """``profile gpt_small`` with its defaults (--seq 128) died with SIGABRT in an inductor
    kernel; now it times 64 tokens and says so, and --seq 128 is exit 2 before anything runs."""
    out_file = tmp_path / "p.json"
    base = ["profile", SMALL, "--out", str(out_file), "--no-compile", "--steps", "1", "--warmup", "0"]
    code, _, err = run(capsys, *base, "--seq", "128")
    assert code == 2 and f"--seq 128: model {SMALL} {SEQ_LIMIT}" in err
    assert not out_file.exists()
    code, text, _ = run(capsys, *base)
    assert code == 0
    assert text.splitlines()[0].startswith("seq     64 tokens per sequence, the model's most")
    assert "not the default 128 (--seq sets it)" in text
    assert json.loads(out_file.read_text())["model"]["seq"] == 64


def test_our_gpt_refuses_a_longer_input_in_python_and_compiles_without_graph_breaks():
    import torch
    import torch._dynamo

    from fsdp_overlap_plugin.models import gpt_small

    torch.manual_seed(0)
    model = gpt_small()
    with pytest.raises(ValueError, match=r"GPT: the input has 65 tokens per sequence, more than block_size 64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    x = torch.zeros(2, 16, dtype=torch.long)
    torch._dynamo.reset()
    try:
        assert torch._dynamo.explain(model)(x).graph_break_count == 0
        for dynamic in (False, True):  # the check is a guard on the length, compiled in one graph
            compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=dynamic)
            assert torch.equal(compiled(x), model(x))
            with pytest.raises(Exception, match="more than block_size 64"):
                compiled(torch.zeros(2, 65, dtype=torch.long))
    finally:
        torch._dynamo.reset()


def test_without_a_world_size_eight_ranks_are_assumed_and_said(capsys):
    code, out = run_json(capsys, "check", PLUGIN_YAML, "--model", SMALL)
    assert out["prediction"]["world"] == 8 and out["prediction"]["world_assumed"]
    code, text, _ = run(capsys, "check", PLUGIN_YAML, "--model", SMALL)
    assert "(cost model; 8 ranks assumed (--world), mesh 8;" in text


def test_hardware_option_overrides_the_configs(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("hardware: h100-ib400\nmesh:\n  replicate: 2\n")
    code, out = run_json(capsys, "check", str(cfg), "--model", SMALL, "--world", "16")
    pred = out["prediction"]
    assert (pred["preset"], pred["replicate"], pred["shard"]) == ("h100-ib400", 2, 8)
    assert pred["rates"]["inter_link"] == costmodel.HARDWARE["h100-ib400"].inter_link
    assert "hardware preset" in pred["sources"]["inter_link"]
    code, text, _ = run(capsys, "check", str(cfg), "--model", SMALL, "--world", "16")
    assert "    replicas: 45 GB/s per rank between replicas; h100-ib400 (hardware preset): InfiniBand NDR" in text

    code, out = run_json(capsys, "check", str(cfg), "--model", SMALL, "--world", "16", "--hardware", "cpu-gloo-300mbit")
    assert out["prediction"]["preset"] == "cpu-gloo-300mbit"
    code, out = run_json(
        capsys, "check", str(cfg), "--model", SMALL, "--world", "16", "--hardware", "h100-ib400,link=1GB/s"
    )
    assert out["prediction"]["rates"]["link"] == 1e9 and out["prediction"]["own"] == ["link"]
    assert out["prediction"]["sources"]["link"] == "your own number (hardware setting)"


@pytest.mark.parametrize("command", ["check", "inspect", "suggest"])
def test_bad_hardware_exits_2_naming_the_presets(capsys, command):
    argv = [command, PLUGIN_YAML, "--model", SMALL] if command == "check" else [command, SMALL]
    code, _, err = run(capsys, *argv, "--hardware", "h100")
    assert code == 2
    assert f"fsdp-overlap {command}: error: hardware: unknown preset 'h100'" in err
    assert all(name in err for name in costmodel.HARDWARE)
    code, out = run_json(capsys, *argv, "--hardware", "link=fast")
    assert code == 2 and not out["ok"] and "link='fast' is not a rate" in out["error"]


def test_a_compute_profile_replaces_the_compute_rate(capsys, tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"achieved_flops_per_s": 2e12, "device": "my GPU"}))
    code, out = run_json(capsys, "check", PLUGIN_YAML, "--model", SMALL, "--profile", str(profile))
    pred = out["prediction"]
    assert pred["rates"]["flops"] == 2e12 and pred["measured"] == ["flops"]
    assert pred["sources"]["flops"].startswith("measured compute profile (my GPU)")
    code, text, _ = run(capsys, "check", PLUGIN_YAML, "--model", SMALL, "--profile", str(profile))
    assert "    compute: 2 TFLOP/s achieved; measured compute profile (my GPU)" in text
    code, _, err = run(capsys, "check", PLUGIN_YAML, "--model", SMALL, "--profile", str(tmp_path / "none.json"))
    assert code == 2 and "compute_profile: cannot read" in err


def test_a_faster_link_exposes_less_communication(capsys):
    def exposed(link: str) -> float:
        _, out = run_json(capsys, "check", PLUGIN_YAML, "--model", *GPT8, "--world", "8", "--hardware", f"link={link}")
        return out["prediction"]["passes"]["exposed_comm_s"]

    slow, fast = exposed("10GB/s"), exposed("100GB/s")
    assert fast < slow


@pytest.mark.parametrize("command", ["inspect", "check", "suggest"])
def test_the_preset_assumed_is_the_machines_accelerator_or_a_gpu_said_in_one_line(capsys, monkeypatch, command):
    """Issue 55: on a CPU-only machine check/inspect predicted with h100-nvlink while a run
    there reports with cpu-gloo-300mbit, and nothing said why. The CLI takes the device type
    the runtime picks (its report's preset); with no accelerator it still plans a GPU run,
    and one line says so and how to predict the run on this machine."""
    from fsdp_overlap_plugin.runtime import devices

    def preset(out):
        return (out if command == "suggest" else out["prediction"])["preset"]

    monkeypatch.setattr(devices, "detect_device_type", lambda preferred=None: "cpu")
    code, out = run_json(capsys, *_argv(command, SMALL))
    assert code == 0 and preset(out) == "h100-nvlink"
    code, text, _ = run(capsys, *_argv(command, SMALL))
    said = [line for line in text.splitlines() if line.startswith("rates   ")]
    assert said == [
        "rates   no --hardware and no hardware setting: predicting a GPU run with the cuda default h100-nvlink; "
        "this machine has no GPU, and a run on it reports with the cpu default cpu-gloo-300mbit "
        "(--hardware cpu-gloo-300mbit predicts that; --hardware names the machine you will run on)"
    ]
    code, text, _ = run(capsys, *_argv(command, SMALL), "--hardware", "h100-ib400")
    assert "rates   no --hardware" not in text  # the user named the machine

    for here, expected in (("cuda", "h100-nvlink"), ("npu", "ascend-910b-hccs")):
        monkeypatch.setattr(devices, "detect_device_type", lambda preferred=None, here=here: here)
        code, out = run_json(capsys, *_argv(command, SMALL))
        assert preset(out) == expected  # the preset the run's report on this machine assumes
        code, text, _ = run(capsys, *_argv(command, SMALL))
        assert f"{expected} (the {here} default)" in text and "rates   no --hardware" not in text


def test_launch_checks_without_predicting(capsys):
    """``launch`` runs ``check`` with its own namespace (no --seq) and prints its last line."""
    ns = argparse.Namespace(config=PLUGIN_YAML, model=SMALL, model_arg=[], world=2)
    ns.__dict__.update(small_bytes=SMALL_BUCKET_BYTES, expand=False, strict=False, json=False, environ=None)
    _, out, lines = cmd_check(ns)
    assert out["prediction"] is None
    assert lines[-1].startswith("OK: 6 buckets")


# ----------------------------------------------------------------------------- suggest
def suggest_json(capsys, *extra: str) -> tuple[int, dict]:
    return run_json(capsys, "suggest", *GPT8, "--world", "8", "--batch", "2", *extra)


def test_suggest_tries_each_grouping_at_each_depth(capsys):
    code, out = suggest_json(capsys)
    assert code == 0 and out["ok"]
    seen = {(c["per_bucket"], c["depth"]) for c in out["candidates"]}
    assert seen == {(k, d) for k in (None, 2, 3, 4, 6, 8) for d in (1, 2, 3)}
    by = {(c["per_bucket"], c["depth"]): c for c in out["candidates"]}
    # tok_emb, pos_emb, the blocks in groups of k (the last may be smaller), norm + head
    assert [by[(k, 1)]["buckets"] for k in (None, 2, 3, 4, 6, 8)] == [2 + 8 + 1, 7, 6, 5, 5, 4]
    assert by[(3, 1)]["modules"][2:5] == [
        ["blocks.0", "blocks.1", "blocks.2"],
        ["blocks.3", "blocks.4", "blocks.5"],
        ["blocks.6", "blocks.7"],
    ]
    assert [c["current"] for c in out["candidates"]].count(True) == 1
    assert out["candidates"][out["current"]]["plan"] == "auto"


def test_suggest_keeps_the_defaults_when_compute_dominates(capsys):
    code, out = suggest_json(capsys, "--hardware", "flops=1TFLOP/s")
    assert out["chosen"] == out["current"] and out["speedup"] == 1
    code, text, _ = run(capsys, "suggest", *GPT8, "--world", "8", "--batch", "2", "--hardware", "flops=1TFLOP/s")
    assert "your settings are already the best of these (auto (one block per bucket), prefetch_depth 1)" in text
    assert "paste into" not in text


def test_suggest_prefetches_further_or_buckets_coarser_on_a_slow_link(capsys):
    code, out = suggest_json(capsys, "--hardware", "link=1GB/s")
    chosen = out["candidates"][out["chosen"]]
    assert chosen["depth"] >= 2 or (chosen["per_bucket"] or 1) >= 2
    assert out["speedup"] > 1.01
    fastest = min(c["step_s"] for c in out["candidates"])
    assert chosen["step_s"] <= fastest * 1.01
    code, text, _ = run(capsys, "suggest", *GPT8, "--world", "8", "--batch", "2", "--hardware", "link=1GB/s")
    assert f"suggested: {chosen['words']}, prefetch_depth {chosen['depth']}:" in text
    assert f"{(out['speedup'] - 1) * 100:.1f}% faster than now (auto (one block per bucket), prefetch_depth 1" in text
    assert "    link:    1 GB/s per rank between the ranks of a shard group; your own number (hardware setting)" in text


def test_suggest_respects_the_memory_budget(capsys):
    _, free = suggest_json(capsys, "--hardware", "link=1GB/s")
    auto_peak = free["candidates"][free["current"]]["peak_bytes"]
    assert free["candidates"][free["chosen"]]["peak_bytes"] > auto_peak
    code, out = suggest_json(capsys, "--hardware", "link=1GB/s", "--memory-budget", str(auto_peak))
    chosen = out["candidates"][out["chosen"]]
    assert chosen["peak_bytes"] <= auto_peak == out["budget"]
    assert chosen["depth"] == 1 and chosen["per_bucket"] is None
    assert all(c["fits"] == (c["peak_bytes"] <= auto_peak) for c in out["candidates"])

    code, out = suggest_json(capsys, "--memory-budget", "1MiB")
    assert code == 1 and out["chosen"] is None and not out["ok"]
    code, text, _ = run(capsys, "suggest", *GPT8, "--memory-budget", "1MiB")
    assert code == 1 and "nothing fits the memory budget of 1.0 MiB" in text


def test_suggest_yaml_loads_back_and_check_resolves_it_to_the_same_buckets(capsys, tmp_path):
    code, out = suggest_json(capsys, "--hardware", "link=1GB/s")
    chosen = out["candidates"][out["chosen"]]
    snippet = out["yaml"]
    config = OverlapConfig.from_dict(yaml.safe_load(snippet))
    assert config.prefetch_depth == chosen["depth"]
    path = tmp_path / "suggested.yaml"
    path.write_text(snippet)
    code, checked = run_json(capsys, "check", str(path), "--model", *GPT8, "--world", "8")
    assert code == 0
    assert [r["modules"] for r in checked["plan"]["buckets"]] == chosen["modules"]
    assert checked["memory"]["prefetch_peak_bytes"] == chosen["peak_bytes"]
    code, text, _ = run(capsys, "suggest", *GPT8, "--world", "8", "--batch", "2", "--hardware", "link=1GB/s")
    assert "paste into the plugin config:\n" + "".join(f"  {line}\n" for line in snippet.splitlines()) in text


def test_suggest_compares_against_the_configs_own_plan(capsys, tmp_path):
    cfg = tmp_path / "mine.yaml"
    cfg.write_text("bucket_plans: [[tok_emb, pos_emb, blocks.0], 'blocks.[1-7]', [norm, head]]\nprefetch_depth: 2\n")
    code, out = suggest_json(capsys, "--config", str(cfg))
    now = out["candidates"][out["current"]]
    assert now["words"] == "your bucket_plans" and now["depth"] == 2 and now["buckets"] == 9
    assert sorted(c["depth"] for c in out["candidates"] if c["words"] == "your bucket_plans") == [1, 2, 3]


# --------------------------------------------------------------- suggest's tie rule (issue 55)
GIB = 2**30


def _candidate(step: float, peak: float, *, fits: bool = True, auto: bool = False, current: bool = False) -> dict:
    return {"step_s": step, "peak_bytes": int(peak * GIB), "fits": fits, "auto": auto, "current": current}


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        ((0.531, 0.531), 1),  # equal steps: 1.5 GiB beats 1.8 GiB (the issue: 1.8 GiB was picked)
        ((0.531, 0.531 * (1 + TIE / 2)), 1),  # within 1%: still a tie, the smaller memory wins
        ((0.531, 0.531 * (1 + 2 * TIE)), 0),  # 2% slower is not a tie: the faster wins
        ((0.531 * (1 + TIE / 2), 0.531), 1),  # the smaller is also the faster
    ],
)
def test_suggest_picks_the_least_memory_among_steps_within_the_tie(steps, expected):
    # the pair: 4 blocks per bucket at depth 1 (1.8 GiB) and 2 blocks at depth 3 (1.5 GiB)
    candidates = [
        _candidate(0.560, 0.44, auto=True, current=True),
        _candidate(steps[0], 1.8),
        _candidate(steps[1], 1.5),
        _candidate(0.500, 2.3, fits=False),  # fastest, but over the budget: not a candidate
    ]
    assert choose(candidates) == expected + 1
    # equal step and memory: the auto plan, then the settings now
    same = [_candidate(0.5, 1.0), _candidate(0.5, 1.0, current=True), _candidate(0.5, 1.0, auto=True)]
    assert choose(same) == 2
    assert choose([_candidate(0.5, 1.0, fits=False)]) is None


def test_suggest_follows_the_rule_its_footer_and_the_docs_state(capsys):
    """The docs' example: 2 blocks per bucket at depth 3 and 4 at depth 1 both predict
    0.531 s; the one gathering 1.5 GiB ahead wins over 1.8 GiB. The footer prints TIE_RULE,
    and docs/tuning.md states the same words."""
    argv = ["suggest", "fsdp_overlap_plugin.models.gpt:gpt_1b", "--world", "8", "--batch", "2"]
    argv += ["--hardware", "h100-ib400,link=25GB/s", "--memory-budget", "2GiB"]
    code, out = run_json(capsys, *argv)
    chosen = out["candidates"][out["chosen"]]
    fastest = min(c["step_s"] for c in out["candidates"] if c["fits"])
    tied = [c for c in out["candidates"] if c["fits"] and c["step_s"] <= fastest * (1 + TIE)]
    assert len(tied) >= 2 and chosen["peak_bytes"] == min(c["peak_bytes"] for c in tied)
    assert (chosen["per_bucket"], chosen["depth"]) == (2, 3)
    code, text, _ = run(capsys, *argv)
    assert f"  ({TIE_RULE})" in text.splitlines()
    assert "fewer buckets ahead" not in text
    docs = " ".join((ROOT / "docs" / "tuning.md").read_text().split())
    assert TIE_RULE[0].upper() + TIE_RULE[1:] in docs
