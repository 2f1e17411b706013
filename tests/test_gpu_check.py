"""benchmarks/gpu_check.py on a CPU: arguments, the dry run (plan and bytes against values
computed here), the arithmetic, the table, the generated-code checker, the phase runner,
and that a run without CUDA stops at once with a clear message."""

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
from _cuda import gpu_check

from fsdp_overlap_plugin.models import gpt_1b

gc = gpu_check()
ROOT = Path(__file__).resolve().parents[1]
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
    assert "-m pytest -m cuda" in out and "tests/test_gpu_cuda.py" in out
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
    assert info["params"] == sum(p.numel() for p in model.parameters()) == gc.param_count(info["model"])


# ----------------------------------------------------------------------------- arithmetic
def test_flops_per_token_and_mfu():
    cfg = {"n_layer": 3, "d_model": 64, "n_head": 4, "vocab_size": 512, "block_size": 32}
    with torch.device("meta"):
        model = gpt_1b(**cfg)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert gc.matmul_params(cfg) == linear
    assert gc.flops_per_token(cfg, 32) == 6 * linear + 12 * 3 * 32 * 64
    got = gc.throughput(tokens_per_step=1000, step_s=0.5, fpt=1e9, matmul_flops_per_s=4e12)
    assert got == pytest.approx({"tokens_per_s": 2000.0, "model_tflops": 2.0, "mfu": 0.5})
    assert gc.throughput(1000, 0.5, 1e9, None)["mfu"] is None


def test_compare_losses():
    assert gc.compare_losses([2.0, 1.0], [2.0, 1.0], 1e-3)["ok"]
    near = gc.compare_losses([2.0, 1.01], [2.0, 1.0], 2e-2)
    assert near["ok"] and near["max_rel"] == pytest.approx(0.01) and near["worst_step"] == 1
    far = gc.compare_losses([2.0, 1.05], [2.0, 1.0], 2e-2)
    assert not far["ok"] and far["worst_step"] == 1
    assert not gc.compare_losses([float("nan")], [1.0], 0.5)["ok"]
    assert gc.compare_losses([1.0], [1.0, 2.0], 0.5)["why"] == "1 vs 2 losses"


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
        "compiled-off": gc.PhaseRun("compiled-off", "ok", result=_train_result([10.0, 9.0])),
        "compiled-on": gc.PhaseRun("compiled-on", "timeout"),
        "eager": gc.PhaseRun("eager", "ok", result=_train_result([10.0, 9.1], step_s=1.0, first=2.0)),
    }
    rows = gc.table_rows(runs, fpt=1e9, matmul_rate=4e12)
    assert [r["phase"] for r in rows] == ["eager", "compiled-off", "compiled-on"]
    assert rows[1]["tokens_per_s"] == 2000 and rows[1]["mfu"] == pytest.approx(0.5)
    assert rows[0]["compile_s"] is None  # eager compiles nothing
    lines = gc.format_table(rows).splitlines()
    assert lines[0].startswith("|  | compile s | first step s | step s | tokens/s")
    assert lines[2] == "| eager fully_shard (compile: false) | - | 2.0 | 1.000 | 1,000 | 1 | 25.0% | 40.0 | 9.1000 |"
    assert lines[3] == "| compiled, passes off | 30.0 | 30.5 | 0.500 | 2,000 | 2 | 50.0% | 40.0 | 9.0000 |"
    assert lines[4] == "| compiled, passes on (timeout) | - | - | - | - | - | - | - | - |"
    no_rate = gc.format_table(gc.table_rows(runs, fpt=1e9, matmul_rate=None)).splitlines()
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
    windows = gc.gather_windows(SYNTHETIC)
    assert [(w.buf, w.numel, w.compute) for w in windows] == [("buf1", 512 * 32, 0), ("buf4", 100, 0), ("buf7", 100, 2)]
    assert gc.check_code_order(SYNTHETIC, [16384, 100, 100], [False, False, True], "forward") == []


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
    windows = gc.gather_windows(code)
    assert [(w.buf, w.numel, w.compute) for w in windows] == [("buf0", 20480, 0), ("buf9", 49984, 1)]
    assert gc.check_code_order(code, [20480, 49984], [False, True], "forward") == []


def test_code_order_checker_reports_each_kind_of_problem():
    check = gc.check_code_order
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
    assert gc.gather_numel(model, ["tok_emb"], 2) == 12 * 8
    assert gc.gather_numel(model, ["tok_emb", "pos_emb"], 3) == 12 * 8 + 6 * 8
    assert gc.gather_numel(model, ["blocks.0"], 1) == _block(8)  # no padding on one rank
    # weight shapes (rows, cols): qkv (24, 8), proj (8, 8), fc (32, 8), mlp proj (8, 32)
    weights = 24 * 8 + 9 * 8 + 33 * 8 + 9 * 32  # rows padded to a multiple of 3
    biases = 24 + 9 + 33 + 9
    norms = 4 * 9  # two LayerNorms, weight and bias, 8 -> 9
    assert gc.gather_numel(model, ["blocks.0"], 3) == weights + biases + norms == 927


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
    windows = gc.gather_windows(code)
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
    problems = gc.check_code_order("\n".join(lines), expected["forward"], expected["forward_needs_compute"], "forward")
    assert any("all-gather 2" in p and "launches after all-gather 1's wait" in p for p in problems), problems


@pytest.mark.slow
@pytest.mark.oldest_torch  # the GPU machines carry torch 2.11: these must pass there first
def test_two_fake_ranks_graph_check_passes_on_cpu(monkeypatch):
    """The CPU twin of tests/test_gpu_cuda.py's 2-fake-rank graph check (which needs a
    GPU): the same model and assertions, the gather group switched on and the native
    reduce-scatter kept, as nccl does (reduce_scatter_impl: auto picks all-to-all on gloo)."""
    from _bucket_graphs import check_two_rank_graphs, two_rank_graphs

    torch.set_num_threads(1)
    graphs = two_rank_graphs(monkeypatch, "cpu", separate_gather_group=True, reduce_scatter_impl="native")
    check_two_rank_graphs(graphs, "cpu")


def test_one_rank_mesh_has_no_collectives_in_its_graphs():
    """What the script's summary says about a world of one (DTensor skips the gather)."""
    from _fake import fake_world

    import fsdp_overlap_plugin as fo
    from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn

    with fake_world(1):
        model = gpt_small(n_layer=2)
        fo.parallelize(model, backend="aot_eager")
        x, y = fixed_batches(1, 2, 16, 256)[0]
        loss_fn(model(x), y).backward()
        report = fo.schedule_report(model)
    for kind in ("forward", "backward"):
        assert report[kind]["before"]["all_gather"] == report[kind]["before"]["reduce_scatter"] == 0


# ----------------------------------------------------------------------------- the parent
def test_run_child_stops_a_phase_at_its_limit(tmp_path):
    log = tmp_path / "phases.log"
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); print('started', flush=True); time.sleep(60)"
    start = time.perf_counter()
    status, seconds = gc.run_child([sys.executable, "-c", code], log, limit=3, env=dict(os.environ))
    assert status == "timeout" and seconds < 20 and time.perf_counter() - start < 20
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "started" in log.read_text()
    assert gc.run_child([sys.executable, "-c", "raise SystemExit(3)"], log, 30, dict(os.environ))[0] == "failed"


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


def _all_ok() -> dict:
    return {
        "matmul": MATMUL,
        "tests": JUNIT,
        "compiled-off": dict(_train_result([10.0, 8.0, 6.0]), collectives={"forward": None, "backward": None}),
        "compiled-on": _train_result([10.0, 8.01, 6.02]),
        "eager": _train_result([10.0, 8.1, 6.1], step_s=0.8, first=1.0),
        "code-order": {"status": "ok", "problems": [], "windows": {"forward": [{}] * 7, "backward": [{}] * 4}},
    }


def test_parent_passes_when_every_phase_passes(tmp_path, monkeypatch, capsys):
    _fake_phases(monkeypatch, _all_ok())
    assert gc.main(["--out", str(tmp_path)]) == 0
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


def test_parent_fails_loudly_on_a_loss_mismatch_and_a_failed_phase(tmp_path, monkeypatch, capsys):
    results = _all_ok()
    results["compiled-on"] = _train_result([10.0, 8.5, 6.0])  # 6% off at step 1
    results["code-order"] = None  # the process fails
    _fake_phases(monkeypatch, results)
    assert gc.main(["--out", str(tmp_path)]) == 1
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
    assert gc.main(["--out", str(tmp_path)]) == 1
    summary = (tmp_path / "summary.md").read_text()
    assert "- [ ] eager: loss finite and falling: 10.0000 -> 10.5000" in summary
    assert "- [ ] phase tests: failed: 2 failed, 0 errors, 2 passed" in summary
    results["tests"] = None  # pytest dies before writing its report
    assert gc.main(["--out", str(tmp_path)]) == 1
    assert "- [ ] phase tests: failed\n" in (tmp_path / "summary.md").read_text()


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
def test_training_phases_run_the_compile_path_on_one_cpu_rank(tmp_path):
    """The phase processes themselves (build, parallelize, train, report, result file),
    run by the parent as on the GPU, but on one gloo rank with aot_eager (``--_device cpu``):
    the compile path and the phase plumbing. A 1-rank mesh puts no collective in the
    graphs, so "compiled-on" and "compiled-off" run the same graph and this says nothing
    about the passes (tests/test_gpu_cuda.py checks them on two fake ranks on the GPU,
    tests/test_passes_traced.py on CPU)."""
    tiny = ["--n-layer", "2", "--d-model", "64", "--n-head", "4", "--vocab", "256", "--seq", "32", "--batch", "4"]
    argv = ["--_device", "cpu", "--out", str(tmp_path), "--phases", "compiled-off,compiled-on,eager", *tiny]
    # three phases, each compiling, on two shared cores: the limit only stops a hang
    done = _script(*argv, "--steps", "3", "--warmup", "1", "--lr", "3e-3", timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    phases = results["phases"]
    losses = {p: phases[p]["result"]["losses"] for p in ("compiled-off", "compiled-on", "eager")}
    assert all(len(v) == 4 and v[-1] < v[0] for v in losses.values())
    assert losses["compiled-on"] == losses["compiled-off"]  # world of 1, aot_eager: the same graph
    on = phases["compiled-on"]["result"]
    assert on["collectives"]["forward"]["all_gather"] == on["collectives"]["backward"]["all_gather"] == 0
    assert phases["compiled-off"]["result"]["collectives"] == {"forward": None, "backward": None}
    rows = {r["phase"]: r for r in results["rows"]}
    assert rows["compiled-on"]["tokens_per_s"] == pytest.approx(4 * 32 / on["step_s"])
    assert rows["compiled-on"]["mfu"] is None  # no matmul phase ran
    assert "Result: PASS" in (tmp_path / "summary.md").read_text()
    assert "compiled-on step 3: loss" in (tmp_path / "phases.log").read_text()
