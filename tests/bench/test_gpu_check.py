"""benchmarks/gpu_check.py on a CPU: arguments, the dry run (plan and bytes against values
computed here), the arithmetic (GPT and Llama FLOPs, the compute profile's aggregation),
the tables, the generated-code checker, the phase runner, the Llama and paths phases
themselves at tiny sizes (``--_device cpu --_size tiny``), and that a run without CUDA
stops at once with a clear message."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from _cuda import code_order, gpu_check, harness

from fsdp_overlap_plugin.models import gpt_1b

gc = gpu_check()
co = code_order()
gm = harness("gpu_models")  # model arithmetic
gp = harness("profiling")  # the compute profile
ph = harness("phases")  # phase processes
tb = harness("tables")
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
SMALL = ["--n-layer", "3", "--d-model", "64", "--n-head", "4", "--vocab", "512", "--seq", "32"]


def _script(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", **(env or {}))
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout
    )


# ----------------------------------------------------------------------------- arguments
def test_help_works_without_a_gpu():
    done = _script("--help")
    assert done.returncode == 0, done.stderr
    assert "--dry-run" in done.stdout and "--budget" in done.stdout
    assert "world of ONE NCCL rank" in done.stdout  # the help says what one GPU can show


def test_without_cuda_a_real_run_exits_2_before_anything(tmp_path):
    done = _script("--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert "no CUDA GPU is visible" in done.stderr and "--dry-run" in done.stderr
    assert not (tmp_path / "out" / "phases.log").exists()  # no phase was started


def test_out_defaults_to_dollar_out(monkeypatch):
    monkeypatch.setenv("OUT", "/somewhere/out")
    assert gc.parse_args([]).out == "/somewhere/out"
    monkeypatch.delenv("OUT")
    assert gc.parse_args([]).out == "gpu_check_out"
    assert gc.parse_args(["--out", "x"]).out == "x"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--n-head", "5"], "--d-model 2048 is not divisible by --n-head 5"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--warmup", "0"], "--warmup must be >= 1"),
        (["--code-world", "1"], "--code-world must be >= 2"),
        (["--phases", "compiled-onn"], "unknown phase 'compiled-onn'. Did you mean 'compiled-on'"),
        (["--phases", ","], "--phases is empty"),
        (["--cap", "tests"], "expected PHASE=SECONDS"),
        (["--cap", "tsts=60"], "Did you mean 'tests'"),
        (["--cap", "tests=5"], "a phase needs at least 20 s"),
        (["--cap", "tests=soon"], "'soon' is not a number"),
        (["--budget", "3"], "--budget must be >= 20"),
        (["--loss-rtol", "2"], "--loss-rtol must be between 0 and 1"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gc.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_phases_run_in_the_documented_order_and_caps_apply():
    args = gc.parse_args(["--phases", "eager,matmul,code-order", "--cap", "eager=200"])
    assert args.phase_list == ["matmul", "code-order", "eager"]
    assert args.caps["eager"] == 200 and args.caps["matmul"] == gc.DEFAULT_CAPS["matmul"]


def test_the_default_run_and_the_phase_groups():
    assert gc.parse_args([]).phase_list == list(gc.DEFAULT_PHASES) == ["matmul", "tests", "hf-1rank", "world8", "paths"]
    assert gc.parse_args(["--phases", "gpt"]).phase_list == [
        "matmul",
        "compiled-off",
        "compiled-on",
        "code-order",
        "eager",
    ]
    assert gc.parse_args(["--phases", "all"]).phase_list == list(gc.PHASES)
    assert gc.parse_args(["--phases", "paths,default"]).phase_list == list(gc.DEFAULT_PHASES)
    # the default run fits the budget on the module doc's estimates, with room to spare
    assert sum(gc.ESTIMATED_S[p] for p in gc.DEFAULT_PHASES) <= gc.DEFAULT_BUDGET_S - 30
    for phase in gc.DEFAULT_PHASES:
        assert re.search(rf"^    {phase} +~{gc.ESTIMATED_S[phase]} s ", gc.__doc__, re.M), phase
    assert set(gc.ESTIMATED_S) == set(gc.DEFAULT_CAPS) == set(gc.PHASES)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--phases", "world9"], "unknown phase 'world9'. Did you mean 'world8'"),
        (["--phases", "gtp"], "Did you mean 'gpt'"),
        (["--llama-steps", "0"], "--llama-steps must be >= 1"),
        (["--path-steps", "0"], "--path-steps must be >= 1"),
        (["--llama-rtol", "0"], "--llama-rtol must be between 0 and 1"),
        (["--cap", "world8=10"], "a phase needs at least 20 s"),
        (["--pass-rounds", "0"], "--pass-rounds must be >= 1"),
    ],
)
def test_bad_llama_and_paths_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gc.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_supported_torch_range_is_read_from_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    low, high = re.search(r'"torch>=(\d+\.\d+),<(\d+\.\d+)"', text).groups()
    assert gc.supported_range() == f"{low} <= torch < {high}"
    assert gc.torch_supported(f"{low}.0+cu130") and not gc.torch_supported(f"{high}.0+cu130")


# ----------------------------------------------------------------------------- dry run
def _block(d: int) -> int:
    # qkv (3d^2 + 3d), attn proj (d^2 + d), fc (4d^2 + 4d), mlp proj (4d^2 + d), 2 LayerNorms (4d)
    return 12 * d * d + 13 * d


def test_dry_run_of_the_1b_model_prints_plan_bytes_and_commands(tmp_path, capsys):
    assert gc.main(["--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    info = json.loads((tmp_path / "dry_run.json").read_text())
    d, v, t, n = 2048, 32768, 2048, 24
    assert info["params"] == 2 * v * d + t * d + n * _block(d) + 2 * d == 1_347_014_656
    blocks = [[f"blocks.{i}"] for i in range(n)]
    assert info["plan"] == [["tok_emb"], ["pos_emb"], *blocks, ["norm", "head"]]
    bf16 = 2
    assert info["bucket_bytes"] == [bf16 * v * d, bf16 * t * d] + [bf16 * _block(d)] * n + [bf16 * (2 * d + v * d)]
    assert "1,347,014,656 parameters (1.35B), built on the meta device" in out
    assert "   26    134,225,920 B     128.0 MiB  norm, head" in out
    assert "    2    100,716,544 B      96.1 MiB  blocks.0" in out
    # what would run: every phase, with its limit and exact command
    for phase in gc.PHASES:
        assert re.search(rf"^  {phase} +<= +\d+ s ", out, re.M), phase
    assert "-m pytest -m cuda" in out and "tests/bench/test_gpu_cuda.py" in out
    assert "--_phase compiled-on" in out and "--n-layer 24" in out
    assert info["commands"]["compiled-off"][info["commands"]["compiled-off"].index("--_phase") + 1] == "compiled-off"
    assert info["memory_estimate"]["total"] < 139 * 2**30 / 2  # fits an H200 comfortably
    assert len(info["code_order_plan"]) == 4 + 3


def test_dry_run_of_a_small_model_bytes_match_the_parameters(tmp_path):
    assert gc.main(["--dry-run", "--out", str(tmp_path), *SMALL]) == 0
    info = json.loads((tmp_path / "dry_run.json").read_text())
    d, v, t = 64, 512, 32
    # the median block (99,968 B) is above tok_emb + pos_emb, so the auto plan merges them
    assert info["plan"] == [["tok_emb", "pos_emb"], ["blocks.0"], ["blocks.1"], ["blocks.2"], ["norm", "head"]]
    assert info["bucket_bytes"] == [
        2 * (v * d + t * d),
        2 * _block(d),
        2 * _block(d),
        2 * _block(d),
        2 * (2 * d + v * d),
    ]
    with torch.device("meta"):
        model = gpt_1b(n_layer=3, d_model=d, n_head=4, vocab_size=v, block_size=t)
    assert info["params"] == sum(p.numel() for p in model.parameters()) == gm.param_count(info["model"])


def test_dry_run_lists_the_llama_phases_and_the_example_commands(tmp_path, capsys):
    assert gc.main(["--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    info = json.loads((tmp_path / "dry_run.json").read_text())
    assert info["phases"] == list(gc.DEFAULT_PHASES)
    # every phase with its limit, expected seconds and command; the GPT ones marked opt-in
    for phase in ("hf-1rank", "world8", "paths"):
        assert re.search(rf"^  {phase} +<= 150 s  ~ *\d+ s  +\S+ .*--_phase {phase} ", out, re.M), phase
        assert info["commands"][phase][info["commands"][phase].index("--_size") + 1] == "default"
    for phase in gc.GPT_PHASES:
        assert re.search(rf"^  {phase} +<= +\d+ s  ~ *\d+ s  \(opt-in\) ", out, re.M), phase
    assert f"~{sum(gc.ESTIMATED_S[p] for p in gc.DEFAULT_PHASES)} s expected" in out
    # the Llamas, built on the meta device: the counts the phases report
    hf, w8 = info["llama"]["hf-1rank"], info["llama"]["world8"]
    assert hf["params"] == 508_594_176 and w8["params"] == 1_923_125_248
    assert w8["shape"] == {
        **gm.LLAMA_SHAPES["world8"]["default"],
        "rope_theta": 500000.0,
        "batch": 2,
        "seq": 4096,
        "world": 8,
    }
    # 7.53e13 FLOPs per step: the figure costmodel.py's GPU rate was measured with
    assert w8["flops_per_token"] * w8["tokens_per_step"] == pytest.approx(7.53e13, rel=1e-3)
    layers = [[f"model.layers.{i}"] for i in range(4)]
    assert w8["plan"] == [["model.embed_tokens"], *layers, ["model.norm", "lm_head"]]
    assert "1,923,125,248 parameters (1.92B)" in out and "508,594,176 parameters (0.51B)" in out
    # the examples as the paths phase runs them on one GPU
    lightning, accelerate = info["path_commands"]["lightning"], info["path_commands"]["accelerate"]
    assert lightning[1:] == [
        "examples/hf_lightning.py",
        "--accelerator",
        "gpu",
        "--devices",
        "1",
        "--steps",
        "40",
        "--metrics",
        lightning[-1],
    ]
    assert "launch" in accelerate and "examples/hf_accelerate.py" in accelerate
    assert accelerate[accelerate.index("--num_processes") + 1] == "1"
    assert accelerate[accelerate.index("--config_file") + 1] == str(ROOT / "configs" / "overlap.yaml")
    assert "examples/hf_lightning.py --accelerator gpu --devices 1 --steps 40" in out


@pytest.mark.slow
def test_the_lightning_example_takes_devices_accelerator_and_backend():
    """examples/hf_lightning.py's flags the paths phase uses; their defaults are what it
    did before they existed (2 devices, accelerator auto, the strategy's own backend)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_lightning.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0, done.stderr
    for flag in ("--devices", "--accelerator", "--backend"):
        assert flag in done.stdout
    assert "(default: 2)" in done.stdout and "(default: auto)" in done.stdout


# ----------------------------------------------------------------------------- arithmetic
def test_flops_per_token_and_mfu():
    cfg = {"n_layer": 3, "d_model": 64, "n_head": 4, "vocab_size": 512, "block_size": 32}
    with torch.device("meta"):
        model = gpt_1b(**cfg)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert gm.matmul_params(cfg) == linear
    assert gm.flops_per_token(cfg, 32) == 6 * linear + 12 * 3 * 32 * 64
    got = gm.throughput(tokens_per_step=1000, step_s=0.5, fpt=1e9, matmul_flops_per_s=4e12)
    assert got == pytest.approx({"tokens_per_s": 2000.0, "model_tflops": 2.0, "mfu": 0.5})
    assert gm.throughput(1000, 0.5, 1e9, None)["mfu"] is None


def test_compare_losses():
    assert gc.compare_losses([2.0, 1.0], [2.0, 1.0], 1e-3)["ok"]
    near = gc.compare_losses([2.0, 1.01], [2.0, 1.0], 2e-2)
    assert near["ok"] and near["max_rel"] == pytest.approx(0.01) and near["worst_step"] == 1
    far = gc.compare_losses([2.0, 1.05], [2.0, 1.0], 2e-2)
    assert not far["ok"] and far["worst_step"] == 1
    assert not gc.compare_losses([float("nan")], [1.0], 0.5)["ok"]
    assert gc.compare_losses([1.0], [1.0, 2.0], 0.5)["why"] == "1 vs 2 losses"


@pytest.mark.parametrize("size", ["default", "tiny"])
@pytest.mark.parametrize("phase", ["hf-1rank", "world8"])
def test_llama_formulas_match_the_transformers_model(phase, size):
    """Parameters and matmul parameters of a LlamaForCausalLM built on the meta device from
    the phase's config equal the formulas (llama_summary raises otherwise), and FLOPs per
    token are 6 per matmul parameter plus attention's 12 x layers x seq x hidden."""
    info = gc.llama_summary(phase, size)
    shape = info["shape"]
    assert info["params"] == gm.llama_param_count(shape) and info["matmul_params"] == gm.llama_matmul_params(shape)
    assert info["flops_per_token"] == 6 * info["matmul_params"] + 12 * shape["n_layer"] * shape["seq"] * shape["hidden"]
    config = gm.llama_config(shape)
    assert config._attn_implementation == "sdpa" and config.use_cache is False and not config.tie_word_embeddings
    assert config.rope_parameters["rope_theta"] == shape["rope_theta"]
    assert shape["world"] == (8 if phase == "world8" else 1)


def test_loss_fell_compares_the_first_and_last_quarters():
    assert gc.loss_fell([5.5, 5.6, 5.4, 5.5, 5.3, 5.0, 5.2, 4.9])
    assert not gc.loss_fell([5.0, 5.1, 5.0, 5.2])
    assert gc.loss_fell([2.0, 1.0]) and not gc.loss_fell([1.0])
    assert not gc.loss_fell([5.0, float("nan"), 4.0])


def test_op_kind_names_the_kernels():
    kinds = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT": "matmul",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, cutlass::bfloat16_t> >": "attention",
        "triton_poi_fused__to_copy_cat_0": "triton",
        "triton_red_fused__to_copy_mul_rsqrt_1": "triton",
        "Memcpy DtoD (Device -> Device)": "copy",
        "ncclDevKernel_AllGather_RING_LL": "collective",
        "aten::mm": "matmul",
        "CompiledFunction": "other",
    }
    assert {name: gp.op_kind(name) for name in kinds} == kinds


def test_compute_profile_aggregates_rows_and_derives_the_rates():
    rows = [
        {"name": "gemm_a", "seconds": 0.06, "count": 3},
        {"name": "triton_poi_fused_0", "seconds": 0.03, "count": 6},
        {"name": "gemm_a", "seconds": 0.03, "count": 3},  # the same kernel again: summed
        {"name": "flash_fwd_kernel", "seconds": 0.015, "count": 3},
        {"name": "Memset (Device)", "seconds": 0.015, "count": 3},
    ]
    schedule = {"flops": 6e13, "bytes": 4e11, "graphs": 2}
    model = {"n_layer": 4, "hidden": 4096}
    profile = gp.compute_profile(
        rows, steps=3, step_s=0.1, schedule=schedule, device="NVIDIA H200", torch_version="2.11.0", model=model, world=8
    )
    # the keys the cost model reads, named exactly so
    assert {k: profile[k] for k in ("device", "torch", "model", "world", "step_s")} == {
        "device": "NVIDIA H200",
        "torch": "2.11.0",
        "model": model,
        "world": 8,
        "step_s": 0.1,
    }
    assert profile["schedule_flops_per_step"] == 6e13 and profile["schedule_bytes_per_step"] == 4e11
    assert profile["achieved_flops_per_s"] == pytest.approx(6e14)
    assert profile["matmul_flops_per_s"] is None and profile["achieved_of_matmul"] is None
    ops = profile["ops"]
    assert [o["name"] for o in ops] == ["gemm_a", "triton_poi_fused_0", "Memset (Device)", "flash_fwd_kernel"]
    assert ops[0] == pytest.approx(
        {
            "name": "gemm_a",
            "kind": "matmul",
            "count": 6,
            "total_s": 0.09,
            "per_step_s": 0.03,
            "calls_per_step": 2.0,
            "share": 0.6,
        }
    )
    assert sum(o["share"] for o in ops) == pytest.approx(1.0)
    assert profile["kernel_s_per_step"] == pytest.approx(0.05) and profile["busy_fraction"] == pytest.approx(0.5)
    assert profile["kind_s_per_step"] == pytest.approx(
        {"matmul": 0.03, "triton": 0.01, "copy": 0.005, "attention": 0.005}
    )
    assert list(profile["kind_s_per_step"])[0] == "matmul"  # longest first
    rated = gp.with_matmul_rate(profile, 8e14)
    assert rated["matmul_flops_per_s"] == 8e14 and rated["achieved_of_matmul"] == pytest.approx(0.75)
    json.dumps(rated)  # compute_profile.json
    assert gp.aggregate_ops([], 3) == []


def test_schedule_totals_count_the_compute_of_the_graphs_that_run_now():
    def graph(kind, dynamo, flops, **extra):
        after = [
            {"op": "all_gather", "flops": 0, "bytes": 999},
            {"op": "compute", "flops": flops, "bytes": flops // 10},
            {"op": "wait", "flops": 0, "bytes": 0},
            {"op": "compute", "flops": 1, "bytes": 1},
        ]
        return {"graph": kind, "dynamo_graph": dynamo, "schedule": {"before": [], "after": after}, **extra}

    report = {
        "config": {"fullgraph": True},
        "graphs": [
            graph("forward", 0, 10**6),  # compiled again for a new length: replaced by the latest
            graph("backward", 0, 10**6),
            graph("forward", 1, 100),
            graph("backward", 1, 200),
            graph("forward", 1, 10**6, inference=True),  # under no_grad: not a training step
        ],
    }
    assert gp.schedule_totals(report) == {"flops": 302, "bytes": 32, "graphs": 2}
    # graph breaks: every piece runs
    report["config"]["fullgraph"] = False
    assert gp.schedule_totals(report)["graphs"] == 4
    # a report without per-graph schedules: report[kind]
    old = {"graphs": [], "forward": graph("forward", 0, 50), "backward": None}
    assert gp.schedule_totals(old) == {"flops": 51, "bytes": 6, "graphs": 1}


def test_read_path_losses_from_metrics_or_the_printed_steps(tmp_path):
    metrics, log = tmp_path / "m.json", tmp_path / "x.log"
    metrics.write_text(json.dumps({"losses": [5.5, 5.0], "report": {}}))  # the Lightning example
    assert gc.read_path_losses(metrics, log) == [5.5, 5.0]
    metrics.write_text(json.dumps({"losses": {"10": 4.0, "2": 5.0, "0": 6.0}}))  # the Accelerate example, by step
    assert gc.read_path_losses(metrics, log) == [6.0, 5.0, 4.0]
    metrics.unlink()
    log.write_text(
        "fsdp-overlap: compiling\nstep 0: loss 5.527614  4.82 s (includes compilation)\nstep 1: loss 5.1  0.02 s\n"
    )
    assert gc.read_path_losses(metrics, log) == [5.527614, 5.1]
    log.unlink()
    assert gc.read_path_losses(metrics, log) == []


def _train_result(losses, step_s=0.5, first=30.5, peak=40 * 2**30):
    return {
        "status": "ok",
        "losses": losses,
        "step_s": step_s,
        "first_step_s": first,
        "compile_s": first - step_s,
        "tokens_per_step": 1000,
        "peak_allocated": peak,
        "collectives": {"forward": {"all_gather": 0}, "backward": {"all_gather": 0}},
    }


def test_table_rows_and_markdown():
    runs = {
        "compiled-off": ph.PhaseRun("compiled-off", "ok", result=_train_result([10.0, 9.0])),
        "compiled-on": ph.PhaseRun("compiled-on", "timeout"),
        "eager": ph.PhaseRun("eager", "ok", result=_train_result([10.0, 9.1], step_s=1.0, first=2.0)),
    }
    rows = gc.table_rows(runs, fpt=1e9, matmul_rate=4e12)
    assert [r["phase"] for r in rows] == ["eager", "compiled-off", "compiled-on"]
    assert rows[1]["tokens_per_s"] == 2000 and rows[1]["mfu"] == pytest.approx(0.5)
    assert rows[0]["compile_s"] is None  # eager compiles nothing
    lines = tb.format_table(rows).splitlines()
    assert lines[0].startswith("|  | compile s | first step s | step s | tokens/s")
    assert lines[2] == "| eager fully_shard (compile: false) | - | 2.0 | 1.000 | 1,000 | 1 | 25.0% | 40.0 | 9.1000 |"
    assert lines[3] == "| compiled, passes off | 30.0 | 30.5 | 0.500 | 2,000 | 2 | 50.0% | 40.0 | 9.0000 |"
    assert lines[4] == "| compiled, passes on (timeout) | - | - | - | - | - | - | - | - |"
    no_rate = tb.format_table(gc.table_rows(runs, fpt=1e9, matmul_rate=None)).splitlines()
    assert no_rate[3].split(" | ")[6] == "-"


# ----------------------------------------------------------------------------- generated code
SYNTHETIC = textwrap.dedent(
    """\
    buf1 = torch.ops._c10d_functional.all_gather_into_tensor.default(buf0, 2, '0')
    assert_size_stride(buf1, (512, 32), (32, 1), 'torch.ops._c10d_functional.all_gather_into_tensor.default')
    buf4 = torch.ops._c10d_functional.all_gather_into_tensor.default(buf3, 2, '0')
    assert_size_stride(buf4, (100, ), (1, ), 'torch.ops._c10d_functional.all_gather_into_tensor.default')
    torch.ops._c10d_functional.wait_tensor.default(buf1)
    triton_poi_fused_embedding_0.run(buf1, buf5)
    buf7 = torch.ops._c10d_functional.all_gather_into_tensor.default(buf6, 2, '0')
    assert_size_stride(buf7, (100, ), (1, ), 'torch.ops._c10d_functional.all_gather_into_tensor.default')
    torch.ops._c10d_functional.wait_tensor.default(buf4)
    extern_kernels.addmm(buf9, buf8, buf4, alpha=1, beta=1, out=buf10)
    buf11 = torch.ops.aten._scaled_dot_product_flash_attention.default(buf10, buf10, buf10, 0.0, True)
    torch.ops._c10d_functional.wait_tensor.default(buf7)
    extern_kernels.mm(buf10, buf7, out=buf12)
    """
)


def test_gather_windows_read_launch_wait_compute_and_size():
    windows = co.gather_windows(SYNTHETIC)
    assert [(w.buf, w.numel, w.compute) for w in windows] == [("buf1", 512 * 32, 0), ("buf4", 100, 0), ("buf7", 100, 2)]
    assert co.check_code_order(SYNTHETIC, [16384, 100, 100], [False, False, True], "forward") == []


def test_gather_windows_read_merged_all_gathers_that_write_into_their_output():
    """A merged all-gather (passes/merge.py) fills a buffer allocated before it (out=), as
    inductor generates it (copied from a CPU run; the CUDA allocator is named the same way)."""
    code = textwrap.dedent(
        """\
        buf0 = empty_strided_cuda((20480, ), (1, ), torch.float32)
        cpp_fused_cat_copy_slice_0(arg0_1, arg1_1, buf0)
        torch.ops._c10d_functional.all_gather_into_tensor_out.default(reinterpret_tensor(buf0, (10240, ), (1, ), 10240), 2, '0', out=buf0)
        buf9 = empty_strided_cuda((49984, ), (1, ), torch.float32)
        torch.ops._c10d_functional.all_gather_into_tensor_out.default(reinterpret_tensor(buf9, (24992, ), (1, ), 24992), 2, '0', out=buf9)
        torch.ops._c10d_functional.wait_tensor.default(buf0)
        extern_kernels.mm(buf2, buf0, out=buf3)
        torch.ops._c10d_functional.wait_tensor.default(buf9)
        """
    )  # fmt: skip
    windows = co.gather_windows(code)
    assert [(w.buf, w.numel, w.compute) for w in windows] == [("buf0", 20480, 0), ("buf9", 49984, 1)]
    assert co.check_code_order(code, [20480, 49984], [False, True], "forward") == []


def test_code_order_checker_reports_each_kind_of_problem():
    check = co.check_code_order
    assert check(SYNTHETIC, [16384, 100], [False] * 2, "forward") == [
        "forward: 3 all-gathers in the generated code, 2 planned"
    ]
    assert check(SYNTHETIC, [16384, 100, 99], [False] * 3, "forward") == [
        "forward: all-gather 2 (buf7) returns 100 elements, planned 99 (out of order?)"
    ]
    assert check(SYNTHETIC, [16384, 100, 100], [False, True, True], "backward") == [
        "backward: no matmul or attention between all-gather 1's launch and its wait (nothing hides it)"
    ]
    swapped = SYNTHETIC.splitlines()
    swapped.insert(2, swapped.pop(4))  # buf1's wait before buf4's launch: no prefetch
    assert check("\n".join(swapped), [16384, 100, 100], [False] * 3, "forward") == [
        "forward: all-gather 1 (buf4) launches after all-gather 0's wait (no prefetch)"
    ]
    unwaited = SYNTHETIC.replace("torch.ops._c10d_functional.wait_tensor.default(buf7)", "pass")
    assert check(unwaited, [16384, 100, 100], [False] * 3, "forward") == [
        "forward: all-gather 2 (buf7) is never waited on"
    ]


def test_gather_numel_pads_each_parameter_to_the_world():
    with torch.device("meta"):
        model = gpt_1b(n_layer=1, d_model=8, n_head=2, vocab_size=11, block_size=4)
    # tok_emb: 11 rows -> 12 on 2 ranks, 12 on 3 ranks, 12 on 4 ranks; pos_emb: 4 rows
    assert co.gather_numel(model, ["tok_emb"], 2) == 12 * 8
    assert co.gather_numel(model, ["tok_emb", "pos_emb"], 3) == 12 * 8 + 6 * 8
    assert co.gather_numel(model, ["blocks.0"], 1) == _block(8)  # no padding on one rank
    # weight shapes (rows, cols): qkv (24, 8), proj (8, 8), fc (32, 8), mlp proj (8, 32)
    weights = 24 * 8 + 9 * 8 + 33 * 8 + 9 * 32  # rows padded to a multiple of 3
    biases = 24 + 9 + 33 + 9
    norms = 4 * 9  # two LayerNorms, weight and bias, 8 -> 9
    assert co.gather_numel(model, ["blocks.0"], 3) == weights + biases + norms == 927


@pytest.fixture(scope="module")
def cpu_code():
    """A real code-order phase on CPU: inductor, fake world of 2, an odd vocabulary (padded shards)."""
    torch.set_num_threads(1)
    cfg = {"n_layer": 2, "d_model": 32, "n_head": 2, "vocab_size": 255, "block_size": 16}
    start = time.perf_counter()
    result = gc.code_order_check(cfg, world=2, device_type="cpu", batch=2)
    result["seconds"] = time.perf_counter() - start
    return cfg, result


@pytest.mark.slow
@pytest.mark.oldest_torch  # the GPU machines carry torch 2.11: these must pass there first
def test_code_order_phase_passes_on_cpu_inductor_code(cpu_code):
    cfg, result = cpu_code
    assert result["problems"] == []
    d, t = cfg["d_model"], cfg["block_size"]
    v = 256  # 255 rows padded to 2 x 128
    assert result["plan"] == [["tok_emb", "pos_emb"], ["blocks.0"], ["blocks.1"], ["norm", "head"]]
    fwd = result["windows"]["forward"]
    # forward: one all-gather per bucket, in plan order, of the padded gathered size
    assert [w["numel"] for w in fwd] == [v * d + t * d, _block(d), _block(d), 2 * d + v * d]
    assert [w["compute"] >= 1 for w in fwd] == [False, False, True, True]
    assert all(a["launch"] < b["wait"] for a, b in zip(fwd[1:], fwd))
    # backward: only blocks.0 is re-gathered, without biases (the backward does not read
    # them): the forward keeps norm + head gathered and, as they gather fewer elements
    # than a block (2d + 256d < 12d^2 + ...), blocks.1 as well, whose gradients hide the re-gather
    bwd = result["windows"]["backward"]
    assert result["expected"]["backward_buckets"] == [1]
    assert [w["numel"] for w in bwd] == [12 * d * d + 2 * d]  # Linear weights + LayerNorm weights
    assert all(w["compute"] >= 1 for w in bwd)
    # on a separate gather group, as NCCL runs it: every parameter's all-gather (29 = 2
    # embeddings + 2 x 12 per block + norm 2 + head 1), and blocks.0's 6 weights re-gathered
    assert result["passes"]["forward"]["gather_group"]["moved"] == 29
    assert result["passes"]["backward"]["gather_group"]["moved"] == 6


@pytest.mark.slow
@pytest.mark.oldest_torch  # the GPU machines carry torch 2.11: these must pass there first
def test_code_order_checker_catches_a_late_prefetch_in_real_code(cpu_code):
    _, result = cpu_code
    code = result["codes"][0]
    windows = co.gather_windows(code)
    lines = code.splitlines()
    # move blocks.1's launch to just after blocks.0's wait (a merged all-gather writes into
    # its out= buffer, an unmerged one's size assert follows it and moves with it)
    launch = windows[2].launch
    assert "all_gather_into_tensor_out" in lines[launch] and f"out={windows[2].buf})" in lines[launch]
    moved = lines[launch : launch + 1]
    del lines[launch : launch + 1]
    wait = next(i for i, line in enumerate(lines) if f"wait_tensor.default({windows[1].buf})" in line)
    lines[wait + 1 : wait + 1] = moved
    expected = result["expected"]
    problems = co.check_code_order("\n".join(lines), expected["forward"], expected["forward_needs_compute"], "forward")
    assert any("all-gather 2" in p and "launches after all-gather 1's wait" in p for p in problems), problems


@pytest.mark.slow
@pytest.mark.oldest_torch  # the GPU machines carry torch 2.11: these must pass there first
def test_two_fake_ranks_graph_check_passes_on_cpu(monkeypatch):
    """The CPU twin of tests/bench/test_gpu_cuda.py's 2-fake-rank graph check (which needs a
    GPU): the same model and assertions, the gather group switched on and the native
    reduce-scatter kept, as nccl does (reduce_scatter_impl: auto picks all-to-all on gloo)."""
    from _bucket_graphs import check_two_rank_graphs, two_rank_graphs

    torch.set_num_threads(1)
    graphs = two_rank_graphs(monkeypatch, "cpu", separate_gather_group=True, reduce_scatter_impl="native")
    check_two_rank_graphs(graphs, "cpu")


# ----------------------------------------------------------------------------- the parent
def test_run_child_stops_a_phase_at_its_limit(tmp_path):
    log = tmp_path / "phases.log"
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); print('started', flush=True); time.sleep(60)"
    start = time.perf_counter()
    status, seconds = ph.run_child([sys.executable, "-c", code], log, limit=3, env=dict(os.environ))
    assert status == "timeout" and seconds < 20 and time.perf_counter() - start < 20
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "started" in log.read_text()
    assert ph.run_child([sys.executable, "-c", "raise SystemExit(3)"], log, 30, dict(os.environ))[0] == "failed"


_FAKE_CHILD = textwrap.dedent(
    """\
    import json, sys
    phase, path, payload = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    print(f"fake {phase} running")
    if payload is None:
        sys.exit(1)
    if phase == "tests":  # junit XML, or [XML, pytest's exit code]
        xml, rc = payload if isinstance(payload, list) else (payload, 0)
        open(path, "w").write(xml)
        sys.exit(rc)
    else:
        for name, data in payload.pop("_files", {}).items():  # files a phase leaves in --out
            json.dump(data, open(name, "w"))
        json.dump(payload, open(path, "w"))
    """
)


def _fake_phases(monkeypatch, results: dict):
    """Every phase becomes a small process that writes the given result (None: it fails)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def command(args, phase, result):
        return [sys.executable, "-c", _FAKE_CHILD, phase, str(result), json.dumps(results[phase])]

    monkeypatch.setattr(gc, "child_command", command)


JUNIT = '<testsuites><testsuite name="pytest" tests="5" failures="0" errors="0" skipped="1"/></testsuites>'
MATMUL = {
    "status": "ok",
    "device": "NVIDIA H200",
    "capability": "9.0",
    "total_memory": 141 * 10**9,
    "torch": "2.13.0",
    "matmul_flops_per_s": 8e14,
}


def _variant(losses, step_s=0.5, first=20.5, peak=10 * 2**30, **extra):
    return {
        "status": "ok",
        "losses": losses,
        "step_s": step_s,
        "first_step_s": first,
        "compile_s": first - step_s,
        "tokens_per_step": 8192,
        "peak_allocated": peak,
        **extra,
    }


PROFILE = {
    "profiled_steps": 3,
    "step_s": 0.15,
    "kernel_s_per_step": 0.12,
    "busy_fraction": 0.8,
    "kind_s_per_step": {"matmul": 0.09, "triton": 0.03},
    "schedule_flops_per_step": 7.5e13,
    "achieved_flops_per_s": 5e14,
    "ops": 2,
}


def _llama(world, plugin, torch_variant, **extra):
    return {
        "status": "ok",
        "world": world,
        "flops_per_token": 1e9,
        "variants": {"plugin": plugin, "fully_shard": torch_variant},
        "problems": [],
        **extra,
    }


def _path(losses, status="ok"):
    return {"status": status, "wall_s": 30.0, "losses": losses, "falling": gc.loss_fell(losses), "log": "x.log"}


def _paths(lightning, accelerate):
    runs = {"lightning": lightning, "accelerate": accelerate}
    for name, r in runs.items():
        r.update(label=gc.PATH_LABELS[name], command=["python", f"{name}.py"], log=f"paths_{name}.log")
    return {"status": "ok", "runs": runs}


def _all_ok() -> dict:
    code = {"problems": [], "windows": {"forward": [{}] * 6, "backward": [{}] * 3}}
    return {
        "matmul": MATMUL,
        "tests": JUNIT,
        "compiled-off": dict(_train_result([10.0, 8.0, 6.0]), collectives={"forward": None, "backward": None}),
        "compiled-on": _train_result([10.0, 8.01, 6.02]),
        "eager": _train_result([10.0, 8.1, 6.1], step_s=0.8, first=1.0),
        "code-order": {"status": "ok", "problems": [], "windows": {"forward": [{}] * 7, "backward": [{}] * 4}},
        "hf-1rank": _llama(1, _variant([10.0, 9.0, 8.0, 7.0], step_s=0.4), _variant([10.0, 9.01, 8.02, 7.03])),
        "world8": _llama(8, _variant([1.0, 1.0], step_s=0.15, code=code, profile=PROFILE), _variant([1.0, 1.0], 0.15)),
        "torch-passes": _torch_passes(),
        "paths": _paths(_path([5.5, 5.4, 5.2, 5.0]), _path([5.5, 5.45, 5.3, 5.1])),
    }


def _torch_passes() -> dict:
    """A torch-passes result as a torch 2.11 GPU would give it: simple absent, the rest ran."""
    code = {"forward": {"all_gather": 4, "reduce_scatter": 0}, "backward": {"all_gather": 2, "reduce_scatter": 4}}
    ran = {"status": "ok", "compile_s": 20.0, "first_step_s": 20.1, "step_s": 0.1, "code_collectives": code}
    counts = {"all_gather": 21, "reduce_scatter": 0}
    graph = {"kind": "forward", "before": counts, "after": dict(counts, all_gather=4), "pass_s": 0.3}
    return {
        "status": "ok",
        "torch": "2.11.0+cu130",
        "device": "NVIDIA H200",
        "world": 8,
        "shape": {"n_layer": 2, "batch": 2, "seq": 4096},
        "passes_in_torch": {"simple_overlap": False, "overlap_scheduling": True},
        "note": "collectives move no data, so step times are the compute side only",
        "settings": {
            "baseline": dict(ran, step_s=0.125, step_peak_bytes=3 * 2**30),
            "defaults": dict(ran, step_peak_bytes=2**30),
            "simple": {"status": "absent", "error": "absent on torch 2.11.0+cu130: inductor_overlap: simple needs"},
            "auto": {"status": "failed", "error": "InductorError: realize NYI on Subgraph\nmore"},
            "manual": dict(ran, step_s=0.11, bucketed=True, plan=[["a"]] * 4, manual_pass=[graph]),
        },
    }


def test_parent_passes_when_every_phase_passes(tmp_path, monkeypatch, capsys):
    _fake_phases(monkeypatch, _all_ok())
    assert gc.main(["--out", str(tmp_path), "--phases", "all"]) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "Result: PASS" in summary and "NVIDIA H200" in summary
    assert "- [x] losses agree: compiled-on vs compiled-off" in summary
    assert "- [x] CUDA unit tests: 4 passed, 1 skipped" in summary
    assert "- [x] generated code keeps the bucketed collectives in order: 7 forward / 4 backward" in summary
    assert (
        "All-gathers in the 1-rank compiled graphs (0 expected, see above): "
        "compiled-off not recorded (no pass ran), compiled-on 0" in summary
    )
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["passed"] is True and [r["phase"] for r in results["rows"]] == [
        "eager",
        "compiled-off",
        "compiled-on",
    ]
    assert "fake eager running" in (tmp_path / "phases.log").read_text()
    assert "all checks passed" in (tmp_path / "console.log").read_text()
    # torch-passes: its table, what is absent, what failed (a finding, not a failed check)
    assert "## Inductor's own distributed passes vs ours (torch-passes, issue 57)" in summary
    assert (
        "| baseline: our passes off, nothing of torch's | ok | 20.0 | 0.1250 | 1.000 | 3.00 | - | 4 / 2 / 4 |"
        in summary
    )
    assert (
        "| defaults: our passes, inductor_overlap: off (the defaults) | ok | 20.0 | 0.1000 | 0.800 | 1.00 |" in summary
    )
    assert "| simple: our passes + inductor_overlap: simple | absent | - | - | - | - | - | - |" in summary
    assert "- simple: absent on torch 2.11.0+cu130: inductor_overlap: simple needs" in summary
    assert "- auto: InductorError: realize NYI on Subgraph\n" in summary
    assert "manual_overlap_bucketing on our graphs (4 plan entries): forward all-gathers 21 -> 4" in summary
    assert (
        "- [x] torch-passes: manual_overlap_bucketing bucketed our plan: all-gathers 21 -> 4 over 1 graphs" in summary
    )
    assert "- [x] torch-passes: defaults ran: median step 0.1000 s" in summary
    assert "On a fake process group: collectives move no data, so step times are the compute side only." in summary


def test_parent_fails_loudly_on_a_loss_mismatch_and_a_failed_phase(tmp_path, monkeypatch, capsys):
    results = _all_ok()
    results["compiled-on"] = _train_result([10.0, 8.5, 6.0])  # 6% off at step 1
    results["code-order"] = None  # the process fails
    _fake_phases(monkeypatch, results)
    assert gc.main(["--out", str(tmp_path), "--phases", "all"]) == 1
    summary = (tmp_path / "summary.md").read_text()
    assert "Result: FAIL" in summary
    assert "- [ ] losses agree: compiled-on vs compiled-off: max relative difference 6.25e-02 at step 1" in summary
    assert "- [ ] phase code-order: failed" in summary
    assert "- [x] losses agree: eager vs compiled-off" in summary  # the rest still ran and was checked
    out = capsys.readouterr().out
    assert "[code-order] failed" in out and "fake code-order running" in out  # the log tail is shown
    assert "gpu_check: FAILED: phase code-order; losses agree: compiled-on vs compiled-off" in out


def test_parent_fails_when_the_loss_does_not_fall_or_tests_fail(tmp_path, monkeypatch):
    results = _all_ok()
    results["eager"] = _train_result([10.0, 10.0, 10.5])
    results["tests"] = [JUNIT.replace('failures="0"', 'failures="2"'), 1]  # pytest: 2 failed
    _fake_phases(monkeypatch, results)
    assert gc.main(["--out", str(tmp_path), "--phases", "all"]) == 1
    summary = (tmp_path / "summary.md").read_text()
    assert "- [ ] eager: loss finite and falling: 10.0000 -> 10.5000" in summary
    assert "- [ ] phase tests: failed: 2 failed, 0 errors, 2 passed" in summary
    results["tests"] = None  # pytest dies before writing its report
    assert gc.main(["--out", str(tmp_path), "--phases", "all"]) == 1
    assert "- [ ] phase tests: failed\n" in (tmp_path / "summary.md").read_text()


def test_parent_default_run_renders_the_llama_and_paths_sections(tmp_path, monkeypatch):
    results = _all_ok()
    profile = {"achieved_flops_per_s": 5e14, "matmul_flops_per_s": None, "ops": []}
    results["world8"] = dict(results["world8"], _files={str(tmp_path / gc.PROFILE_FILE): profile})
    _fake_phases(monkeypatch, results)
    assert gc.main(["--out", str(tmp_path)]) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "Result: PASS" in summary and "## GPT" not in summary  # the GPT phases are opt-in
    assert "## Transformers Llama: the plugin vs torch's FSDP2 (fully_shard + torch.compile)" in summary
    assert "- world8: LlamaForCausalLM, 4 layers, hidden 4096, intermediate 14336, 32 heads / 8 kv heads" in summary
    # 8192 tokens / 0.4 s = 20,480 tokens/s; x 1 GFLOP/token = 20 TFLOP/s, 2.6% of 800
    assert (
        "| hf-1rank: plugin, parallelize() defaults | 20.1 | 20.5 | 0.400 | 20,480 | 20 | 2.6% | 10.0 | 7.0000 |"
        in summary
    )
    assert "| hf-1rank: torch fully_shard per layer + torch.compile | 20.0 | 20.5 | 0.500 | 16,384 |" in summary
    assert "| world8: plugin, parallelize() defaults | 20.4 | 20.5 | 0.150 | 54,613 | 55 | 6.8% | 10.0 | - |" in summary
    assert "Step time, plugin / torch: hf-1rank 0.80, world8 1.00 (below 1: the plugin's step is shorter)." in summary
    assert "collectives move no data, so these rows are the compute side only" in summary
    assert (
        "Compute profile of the world8 plugin step (compute_profile.json, 3 steps): kernels 0.120 s per 0.150 s step"
        in summary
    )
    assert "| Lightning Trainer (examples/hf_lightning.py) | ok | 30 | 4 | 5.5000 -> 5.0000 |" in summary
    assert "- accelerate: `python accelerate.py` (output: paths_accelerate.log)" in summary
    for check in (
        "- [x] hf-1rank: plugin loss finite and falling: 10.0000 -> 7.0000",
        "- [x] hf-1rank: losses agree: fully_shard vs plugin: max relative difference",
        "- [x] world8: generated code keeps the bucketed collectives in order: 6 forward / 3 backward",
        "- [x] world8: compute profile written (compute_profile.json): 2 kernels over 3 steps; schedule 75.00 TFLOP",
        "- [x] paths: Lightning Trainer (examples/hf_lightning.py) exits 0, loss falling: ok in 30 s",
        "- [x] paths: accelerate launch (examples/hf_accelerate.py) exits 0, loss falling",
    ):
        assert check in summary, check
    assert "world8: fully_shard loss" not in summary  # a fake process group's losses are not checked
    results_json = json.loads((tmp_path / "results.json").read_text())
    assert [(r["phase"], r["variant"]) for r in results_json["llama_rows"]] == [
        ("hf-1rank", "plugin"),
        ("hf-1rank", "fully_shard"),
        ("world8", "plugin"),
        ("world8", "fully_shard"),
    ]
    assert results_json["llama_step_ratios"] == pytest.approx({"hf-1rank": 0.8, "world8": 1.0})
    # the parent adds the matmul phase's rate to the profile the world8 process wrote
    written = json.loads((tmp_path / gc.PROFILE_FILE).read_text())
    assert written["matmul_flops_per_s"] == 8e14 and written["achieved_of_matmul"] == pytest.approx(0.625)


def test_parent_fails_on_llama_and_paths_problems(tmp_path, monkeypatch, capsys):
    results = _all_ok()
    hf = results["hf-1rank"]["variants"]
    hf["fully_shard"] = _variant([10.0, 9.0, 8.0, 7.7])  # 10% above the plugin at the last step
    w8 = results["world8"]["variants"]
    w8["fully_shard"] = {"status": "failed", "error": "RuntimeError: boom"}
    w8["plugin"]["code"] = {"problems": ["forward: 5 all-gathers in the generated code, 6 planned"], "windows": {}}
    results["paths"] = _paths(_path([5.5, 5.6, 5.5, 5.7]), _path([], status="timeout"))
    _fake_phases(monkeypatch, results)
    assert gc.main(["--out", str(tmp_path)]) == 1
    summary = (tmp_path / "summary.md").read_text()
    assert "Result: FAIL" in summary
    for check in (
        "- [ ] hf-1rank: losses agree: fully_shard vs plugin: max relative difference 1.00e-01 at step 3 (rtol 0.05)",
        "- [ ] world8: torch fully_shard per layer + torch.compile ran: RuntimeError: boom",
        "- [ ] world8: generated code keeps the bucketed collectives in order: forward: 5 all-gathers",
        "- [ ] paths: Lightning Trainer (examples/hf_lightning.py) exits 0, loss falling: ok in 30 s; loss 5.5000 -> 5.7000",
        "- [ ] paths: accelerate launch (examples/hf_accelerate.py) exits 0, loss falling: timeout in 30 s; no losses read",
    ):
        assert check in summary, check
    assert "| world8: torch fully_shard per layer + torch.compile (failed) | - | - |" in summary
    assert "5.5000 -> 5.7000 (not falling)" in summary
    assert "Step time, plugin / torch: hf-1rank 0.80 (below 1" in summary  # world8 has no ratio


def test_llama_rows_keep_the_variants_a_stopped_phase_finished():
    """A Llama phase stopped at its limit leaves a partial result (status "partial"): the
    variants it finished keep their numbers, the rest show the phase's status."""
    partial = {"status": "partial", "world": 8, "flops_per_token": 1e9, "variants": {"plugin": _variant([1.0])}}
    runs = {"world8": ph.PhaseRun("world8", "timeout", result=partial), "hf-1rank": ph.PhaseRun("hf-1rank", "skipped")}
    rows = gc.llama_rows(runs, None)
    assert [(r["label"], r["status"]) for r in rows] == [
        ("hf-1rank: plugin, parallelize() defaults", "skipped"),
        ("hf-1rank: torch fully_shard per layer + torch.compile", "skipped"),
        ("world8: plugin, parallelize() defaults", "ok"),
        ("world8: torch fully_shard per layer + torch.compile", "timeout"),
    ]
    assert rows[2]["step_s"] == 0.5 and rows[2]["mfu"] is None and rows[2]["final_loss"] is None
    assert gc.step_ratios(rows) == {}


def test_parent_restores_signal_handlers(tmp_path, monkeypatch):
    import signal

    _fake_phases(monkeypatch, _all_ok())
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert gc.main(["--out", str(tmp_path), "--phases", "matmul"]) == 0
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_parent_skips_phases_once_the_budget_is_spent(tmp_path, monkeypatch):
    _fake_phases(monkeypatch, _all_ok())
    clock = iter([0.0] + [1000.0] * 100)  # the first reading starts the budget; then it is spent
    monkeypatch.setattr(gc.time, "monotonic", lambda: next(clock))
    assert gc.main(["--out", str(tmp_path), "--budget", "300"]) == 1
    phases = json.loads((tmp_path / "results.json").read_text())["phases"]
    assert {p["status"] for p in phases.values()} == {"skipped"}
    assert "budget spent" in phases["matmul"]["note"]


def test_parent_refuses_a_model_that_would_not_fit(tmp_path, monkeypatch):
    results = _all_ok()
    results["matmul"] = dict(MATMUL, total_memory=16 * 2**30)
    _fake_phases(monkeypatch, results)
    assert gc.main(["--out", str(tmp_path), "--phases", "matmul,compiled-on"]) == 1
    phases = json.loads((tmp_path / "results.json").read_text())["phases"]
    assert phases["compiled-on"]["status"] == "skipped" and "lower --batch" in phases["compiled-on"]["note"]


@pytest.mark.slow
@pytest.mark.oldest_torch  # the GPU machines carry torch 2.11: these must pass there first
def test_training_and_hf_1rank_phases_run_through_the_parent_on_one_cpu_rank(tmp_path):
    """One parent run, as on the GPU, of the GPT training phases and hf-1rank, each phase a
    process of its own on one gloo rank with aot_eager (``--_device cpu``, ``--_size tiny``).

    The GPT phases (build, parallelize, train, report, result file): the compile path and
    the phase plumbing. A 1-rank mesh puts no collective in the graphs (DTensor skips the
    gather), so "compiled-on" and "compiled-off" run the same graph and this says nothing
    about the passes (tests/bench/test_gpu_cuda.py checks them on two fake ranks on the GPU,
    tests/passes/test_passes_traced.py on CPU).

    hf-1rank, started by the parent with --_size and --llama-steps forwarded: the plugin
    and torch's fully_shard + torch.compile train the same tiny LlamaForCausalLM, with every
    field the summary needs; on one rank both compute the same losses; the parent renders
    its rows and checks. (One parent run instead of three jobs: this used to be three tests,
    the hf-1rank one in-process and again through the parent.)"""
    tiny = ["--n-layer", "2", "--d-model", "64", "--n-head", "4", "--vocab", "256", "--seq", "32", "--batch", "4"]
    argv = ["--_device", "cpu", "--_size", "tiny", "--out", str(tmp_path), *tiny]
    argv += ["--phases", "compiled-off,compiled-on,eager,hf-1rank", "--llama-steps", "4"]
    # four phases, each compiling, on two shared cores: the limit only stops a hang
    done = _script(*argv, "--steps", "3", "--warmup", "1", "--lr", "3e-3", timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    phases = results["phases"]
    summary = (tmp_path / "summary.md").read_text()
    assert "Result: PASS" in summary
    # the GPT training phases
    losses = {p: phases[p]["result"]["losses"] for p in ("compiled-off", "compiled-on", "eager")}
    assert all(len(v) == 4 and v[-1] < v[0] for v in losses.values())
    assert losses["compiled-on"] == losses["compiled-off"]  # world of 1, aot_eager: the same graph
    on = phases["compiled-on"]["result"]
    assert on["collectives"]["forward"]["all_gather"] == on["collectives"]["backward"]["all_gather"] == 0
    # what the script's summary says about a world of one: its graphs, before any pass, hold
    # no collective at all (DTensor skips the gather; nothing to reduce-scatter either)
    for kind in ("forward", "backward"):
        assert on["collectives"][kind]["all_gather"] == on["collectives"][kind]["reduce_scatter"] == 0
    assert phases["compiled-off"]["result"]["collectives"] == {"forward": None, "backward": None}
    rows = {r["phase"]: r for r in results["rows"]}
    assert rows["compiled-on"]["tokens_per_s"] == pytest.approx(4 * 32 / on["step_s"])
    assert rows["compiled-on"]["mfu"] is None  # no matmul phase ran
    assert "compiled-on step 3: loss" in (tmp_path / "phases.log").read_text()
    # hf-1rank: the phase process's result, as the parent read it back
    result = phases["hf-1rank"]["result"]
    shape = gm.llama_shape("hf-1rank", "tiny")
    assert result["problems"] == [] and result["world"] == 1 and result["tokens_per_step"] == 2 * 32
    for name in ("plugin", "fully_shard"):
        v = result["variants"][name]
        assert v["status"] == "ok" and v["attention"] == "sdpa" and v["params"] == gm.llama_param_count(shape)
        assert len(v["losses"]) == 5 and gc.loss_fell(v["losses"]), v["losses"]
        assert 0 < v["step_s"] <= v["first_step_s"] and v["peak_allocated"] is None
    assert [len(v["losses"]) for v in result["variants"].values()] == [5, 5]  # --llama-steps 4 forwarded
    plugin = result["variants"]["plugin"]
    assert plugin["schedule"]["flops"] > 0 and plugin["schedule"]["graphs"] == 2
    assert plugin["collectives"]["forward"]["all_gather"] == 0  # one rank: DTensor gathers nothing
    assert gc.compare_losses(result["variants"]["fully_shard"]["losses"], plugin["losses"], 1e-3)["ok"]
    runs = {"hf-1rank": ph.PhaseRun("hf-1rank", "ok", result=result)}
    llama_rows = gc.llama_rows(runs, None)
    assert [r["status"] for r in llama_rows] == ["ok", "ok"] and all(r["tokens_per_s"] > 0 for r in llama_rows)
    args = _tiny_args(tmp_path)
    assert all(ok for _, ok, _ in gc.llama_checks(runs, args)), gc.llama_checks(runs, args)
    # ... and the parent's rendering of them
    assert "| hf-1rank: plugin, parallelize() defaults |" in summary
    assert "- [x] hf-1rank: losses agree: fully_shard vs plugin" in summary


# ----------------------------------------------------------------------------- new phases on CPU
def _tiny_args(tmp_path, *extra: str):
    """A phase's arguments as the parent forwards them, on CPU with the tiny Llamas."""
    argv = ["--_device", "cpu", "--_size", "tiny", "--out", str(tmp_path), "--warmup", "1", "--llama-steps", "4"]
    return gc.parse_args([*argv, "--lr", "3e-3", *extra])


def _json(result: dict) -> dict:
    """What the parent reads back from the phase's result file."""
    return json.loads(json.dumps(result, default=str))


@pytest.mark.slow
@pytest.mark.oldest_torch  # the GPU machines carry torch 2.11: these must pass there first
def test_world8_phase_writes_the_compute_profile_on_cpu(tmp_path):
    """world8's process function on a fake process group of 8 ranks on CPU: both variants
    run, and compute_profile.json holds the keys the cost model reads, the schedule's
    FLOPs of the plugin's graphs and the profiler's ops."""
    torch.set_num_threads(1)
    result = gc.phase_llama(_tiny_args(tmp_path), "world8")
    assert result["problems"] == [] and result["world"] == 8
    plugin = result["variants"]["plugin"]
    assert result["variants"]["fully_shard"]["status"] == plugin["status"] == "ok"
    # the tiny model's auto plan: embedding, 2 layers, norm + head: one bucketed gather each
    assert plugin["collectives"]["forward"]["all_gather"] == 4
    assert plugin["collectives"]["backward"]["reduce_scatter"] == 4
    assert "code" not in plugin  # aot_eager generates no code; on the GPU inductor's is checked
    profile = json.loads((tmp_path / gc.PROFILE_FILE).read_text())
    required = {"device", "torch", "model", "world", "step_s", "schedule_flops_per_step"}
    required |= {"schedule_bytes_per_step", "achieved_flops_per_s", "matmul_flops_per_s", "ops"}
    assert required <= set(profile)
    assert profile["device"] == "cpu" and profile["torch"] == torch.__version__ and profile["world"] == 8
    assert profile["model"] == {k: v for k, v in gm.llama_shape("world8", "tiny").items() if k != "world"}
    assert profile["step_s"] == plugin["step_s"]
    assert profile["schedule_flops_per_step"] == plugin["schedule"]["flops"] > 0
    assert profile["schedule_bytes_per_step"] == plugin["schedule"]["bytes"] > 0
    assert profile["achieved_flops_per_s"] == pytest.approx(profile["schedule_flops_per_step"] / profile["step_s"])
    assert profile["matmul_flops_per_s"] is None  # the parent adds it after a matmul phase
    assert profile["model_flops_per_step"] == result["flops_per_token"] * result["tokens_per_step"]
    ops = profile["ops"]
    assert ops and sum(o["share"] for o in ops) == pytest.approx(1.0)
    assert any(o["kind"] == "matmul" for o in ops) and all(o["count"] >= 1 for o in ops)
    assert plugin["profile"]["ops"] == len(ops) and plugin["profile"]["top"] == ops[:10]
    runs = {"world8": ph.PhaseRun("world8", "ok", result=_json(result))}
    lines = "\n".join(gc.llama_lines(_tiny_args(tmp_path), runs, gc.llama_rows(runs, None)))
    assert (
        "| world8: plugin, parallelize() defaults |" in lines and "Compute profile of the world8 plugin step" in lines
    )


@pytest.mark.slow
def test_paths_phase_runs_both_examples_on_cpu(tmp_path, monkeypatch):
    """The paths phase's process function on CPU: examples/hf_lightning.py (Trainer, 1 CPU
    device, bf16-mixed, aot_eager) and accelerate launch --num_processes 1 of
    examples/hf_accelerate.py (a copy of configs/overlap.yaml on aot_eager) both exit 0
    with their loss falling, each with its log in --out."""
    monkeypatch.setenv("GPU_CHECK_PHASE_LIMIT", "300")
    result = gc.phase_paths(_tiny_args(tmp_path, "--path-steps", "20"))
    runs = result["runs"]
    assert list(runs) == ["lightning", "accelerate"]
    for r in runs.values():
        log = (tmp_path / r["log"]).read_text()
        assert r["status"] == "ok", log[-3000:]
        assert len(r["losses"]) == 20 and r["falling"], r["losses"]
        assert r["wall_s"] > 0
    assert "LlamaForCausalLM: losses" in (tmp_path / "paths_lightning.log").read_text()
    assert "step 19: loss" in (tmp_path / "paths_accelerate.log").read_text()
    lightning = " ".join(runs["lightning"]["command"])
    assert "--accelerator cpu --devices 1 --steps 20" in lightning and "--backend aot_eager" in lightning
    assert "--num_processes 1 examples/hf_accelerate.py --steps 20" in " ".join(runs["accelerate"]["command"])
    table = tb.format_paths(result)
    assert table[2].startswith("| Lightning Trainer (examples/hf_lightning.py) | ok |")


@pytest.mark.slow
def test_torch_passes_phase_runs_every_setting_this_torch_has_on_cpu(tmp_path, monkeypatch):
    """torch-passes' process function on a fake process group of 8 ranks on CPU (inductor,
    the tiny Llama, a cold cache of its own): each setting this torch has compiles and is
    timed in turns, with its numbers and its generated code's collectives; a setting this
    torch lacks says so; torch's manual_overlap_bucketing, given our plan as a post-grad pass,
    buckets the baseline's per-parameter all-gathers into one per plan entry. Inductor's lite
    mode (``fallback_by_default``: every op an ATen call, no C++ kernels) keeps the test near
    30 s instead of ~110 s: the passes, torch's and ours, and the collectives in the generated
    code are the same (checked by hand: 21 / 4 / 4 / 1 forward all-gathers either way)."""
    from fsdp_overlap_plugin import _torch_compat as compat
    from fsdp_overlap_plugin.config import inductor_overlap
    from fsdp_overlap_plugin.shard.hf import model_from_config

    torch.set_num_threads(1)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    tp = harness("torch_passes_phase")
    args = _tiny_args(tmp_path, "--pass-rounds", "2")  # 1 warm-up, then 2 rounds of 2 steps
    # torch's own patch, not monkeypatch: pytest 9 takes the old value from the module's
    # __dict__ (torch's config module keeps none there), so its undo deletes the key, which
    # torch's config then hides: every later inductor compile in the process failed
    with torch._inductor.config.patch(fallback_by_default=True):
        result = gc.phase_torch_passes(args)
    shape = gm.llama_shape("world8", "tiny")
    have = compat.inductor_distributed_passes()
    assert result["torch"] == torch.__version__ and result["passes_in_torch"] == have
    assert result["world"] == 8 and result["shape"] == shape and "compute side only" in result["note"]
    settings = result["settings"]
    assert list(settings) == list(tp.RUN_ORDER) and set(settings) == set(tp.SETTINGS)
    absent = {"simple"} if not have["simple_overlap"] else set()
    absent |= {"auto"} if not have["overlap_scheduling"] else set()
    unsupported = {"auto"} - absent if inductor_overlap.device_error("auto", "cpu") else set()  # torch 2.11
    for name, r in settings.items():
        if name in absent | unsupported:
            start = "absent on torch" if name in absent else "not on cpu with torch"
            assert r["status"] == ("absent" if name in absent else "unsupported")
            assert r["error"].startswith(f"{start} {torch.__version__}: ") and "step_s" not in r
            continue
        assert r["status"] == "ok", (name, r.get("error"))
        assert r["timed_steps"] == 4 and len(r["step_times"]) == 4 and len(r["losses"]) == 5
        assert 0 < r["step_s"] < r["first_step_s"]  # (no loss check: a fake process group gathers garbage)
        assert r["compile_s"] == pytest.approx(r["first_step_s"] - r["step_s"])
        assert r.get("step_peak_bytes") is None  # CPU: no allocator statistics
        assert set(r["code_collectives"]) == {"forward", "backward"}
    # the tiny Llama: 21 parameters (2 layers of 9, embedding, norm, head), 4 plan entries
    params = len(list(model_from_config(gm.llama_config(shape), device="meta").parameters()))
    code = {name: r["code_collectives"] for name, r in settings.items() if r["status"] == "ok"}
    assert code["baseline"]["forward"]["all_gather"] == params == 21
    assert code["baseline"]["backward"]["reduce_scatter"] == params
    assert code["defaults"]["forward"]["all_gather"] == 4 and code["defaults"]["backward"]["reduce_scatter"] == 4
    assert settings["defaults"]["collectives"]["forward"]["all_gather"] == 4  # our report agrees with the code
    manual = settings["manual"]
    assert manual["bucketed"] and manual["plan"] == [
        ["model.embed_tokens"],
        ["model.layers.0"],
        ["model.layers.1"],
        ["model.norm", "lm_head"],
    ]
    forward = next(g for g in manual["manual_pass"] if g["kind"] == "forward")
    assert (forward["before"]["all_gather"], forward["after"]["all_gather"]) == (params, 4)
    assert code["manual"]["forward"]["all_gather"] == 4 and code["manual"]["backward"]["reduce_scatter"] == 4
    if "auto" not in absent | unsupported:  # torch's own bucketing: fewer all-gathers than one per parameter
        assert settings["auto"]["torch_passes"]["ran"] == ["overlap_scheduling"]
        assert 1 <= code["auto"]["forward"]["all_gather"] < params
    # the parent's section and checks
    run = ph.PhaseRun("torch-passes", "ok", result=_json(result))
    lines = tp.summary_lines(run.result, run.status)
    table = [line for line in lines if line.startswith("| ") and ": " in line.split("|")[1]]
    assert [row.split("|")[1].strip().split(":")[0] for row in table] == list(tp.SETTINGS)
    assert "| baseline: our passes off, nothing of torch's | ok |" in "\n".join(lines)
    assert "| 1.000 |" in next(row for row in table if row.startswith("| baseline:"))
    assert "| defaults: our passes, inductor_overlap: off (the defaults) | ok |" in "\n".join(lines)
    assert f"| manual: {tp.SETTINGS['manual']} | ok |" in "\n".join(lines)
    assert "| 4 / " in next(row for row in table if row.startswith("| manual:"))
    for name in absent:
        assert f"| {name}: {tp.SETTINGS[name]} | absent |" in "\n".join(lines)
        assert f"- {name}: absent on torch {torch.__version__}: " in "\n".join(lines)
    assert "compute side only" in "\n".join(lines)
    checks = tp.checks(run.result)
    assert [name for name, _, _ in checks] == [
        "torch-passes: defaults ran",
        "torch-passes: baseline ran",
        "torch-passes: manual_overlap_bucketing bucketed our plan",
    ]
    assert all(ok for _, ok, _ in checks), checks
