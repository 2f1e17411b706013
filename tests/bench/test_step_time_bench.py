"""The benchmark script's own logic (no namespaces, no timing assertions)."""

from __future__ import annotations

import json

import _bench
import pytest

step_time = _bench.load("step_time")
dynamic_lengths = _bench.load("dynamic_lengths")


def test_help_runs():
    text = _bench.help_text("step_time")
    assert "--rate" in text and "--quick" in text and "comm-only" in text


@pytest.mark.parametrize("text, bps", [("300mbit", 300e6), ("1gbit", 1e9), ("512kbit", 512e3), ("100", 100.0)])
def test_parse_rate(text, bps):
    assert step_time.parse_rate(text) == bps


def test_summary_bounds_and_ratios():
    def rank(times_by_mode, rss):
        return {
            "modes": {m: {"times": t, "losses": [1.0], "peak_rss_mib": rss} for m, t in times_by_mode.items()},
            "ideal_bytes": 3_750_000,
        }

    times = {
        "fsdp2-eager": [2.0, 2.2, 1.9],
        "both": [1.0, 1.1, 1.2],
        "compute-only": [0.5, 0.5, 0.5],
        "comm-only": [0.8, 0.8, 0.9],
    }
    summary = step_time.summarize([rank(times, 100.0), rank(times, 120.0)], rate_bps=300e6)
    assert summary["transport_bound_s"] == pytest.approx(0.8)
    assert summary["ideal_bound_s"] == pytest.approx(max(0.5, 3_750_000 * 8 / 300e6))  # 0.5 vs 0.1
    both = summary["rows"]["both"]
    assert both["median_s"] == pytest.approx(1.1) and both["x_eager"] == pytest.approx(1.1 / 2.0)
    assert both["x_transport"] == pytest.approx(1.1 / 0.8)
    assert both["peak_rss_mib"] == [100.0, 120.0]


def test_link_phases_counts_busy_time():
    # 1 Mbit/s link; busy (8 kbit per 10 ms = 0.8 Mbit/s) during the first 0.1 s, idle after
    samples = [(i * 0.01, i * 1000 if i <= 10 else 10_000, 0) for i in range(21)]
    marks = [("forward", 0.0), ("backward", 0.1), ("end", 0.2)]
    phases = step_time.link_phases(samples, marks, rate_bps=1e6)["phases"]
    assert phases[0]["busy_fraction"] == pytest.approx(1.0)
    assert phases[1]["busy_fraction"] == pytest.approx(0.0) and phases[1]["idle_s"] == pytest.approx(0.1)


def test_unknown_mode_is_rejected():
    _refused(["--modes", "both,fast"], "unknown mode(s) ['fast']")


def test_link_phases_counts_both_directions():
    # 1 Mbit/s link: rank 0 sends the whole 0.2 s, receives only during the first 0.1 s
    samples = [(i * 0.01, i * 1000, min(i, 10) * 1000) for i in range(21)]
    marks = [("forward", 0.0), ("backward", 0.1), ("end", 0.2)]
    phases = step_time.link_phases(samples, marks, rate_bps=1e6)["phases"]
    assert [p["busy_fraction"] for p in phases] == pytest.approx([1.0, 1.0])
    assert [p["both_fraction"] for p in phases] == pytest.approx([1.0, 0.0])


def _trace(start: float, launches: list[float], done: list[float], wait: float) -> dict:
    return {
        "step_ms": [start, start + 100.0],
        "launches": [(t, "allgather_base") for t in launches],
        "runs": [(t, d) for t, d in zip(launches, done)],
        "wait_ms": wait,
        "cpu_ms": {"main": 60.0, "gloo_tcp_loop": 20.0},
        "cpu_wall_ms": 99.0,
        "path": "trace.json",
    }


def test_trace_summary_lines_up_the_ranks():
    r0 = _trace(1000.0, [1001.0, 1010.0, 1050.0], [1009.0, 1040.0, 1090.0], 30.0)
    r1 = _trace(1002.0, [1003.0, 1030.0, 1045.0], [1012.0, 1041.0, 1080.0], 10.0)
    trace = step_time.trace_summary([{"trace": r0}, {"trace": r1}])
    assert [row["launch_ms"] for row in trace["rows"]] == [[1.0, 3.0], [10.0, 30.0], [50.0, 45.0]]
    assert [row["skew_ms"] for row in trace["rows"]] == [2.0, 20.0, -5.0]
    assert trace["rows"][1]["done_ms"] == [40.0, 41.0]
    assert trace["max_skew_ms"] == 20.0 and trace["median_skew_ms"] == 5.0
    assert [r["wait_ms"] for r in trace["ranks"]] == [30.0, 10.0]
    assert step_time.trace_summary([{"trace": r0}, {}]) is None  # one rank without a trace
    step_time.print_trace(trace)  # formats


def test_summary_recv_first_and_overlap_bounds():
    def rank(times_by_mode):
        return {"modes": {m: {"times": t, "losses": [1.0], "peak_rss_mib": 1.0} for m, t in times_by_mode.items()}}

    times = {
        "both": [0.70],
        "compute-only": [0.20],
        "comm-only": [0.60],
        "comm-only+recv-first": [0.50],
        "comm+compute": [0.62],
    }
    summary = step_time.summarize([rank(times), rank(times)], rate_bps=None)
    assert summary["recv_first_bound_s"] == pytest.approx(0.50)
    assert summary["overlap_bound_s"] == pytest.approx(0.62)
    both = summary["rows"]["both"]
    assert both["x_transport"] == pytest.approx(0.70 / 0.60)
    assert both["x_recv_first"] == pytest.approx(0.70 / 0.50)
    assert both["x_overlap"] == pytest.approx(0.70 / 0.62)


def test_each_row_against_its_own_replay():
    """both (receive-first all-to-alls) against comm-only, both+all-to-all against gloo's
    all-to-alls replayed, both+native against gloo's reduce-scatters replayed."""
    times = {
        "both": [0.70],
        "both+all-to-all": [0.75],
        "both+native": [0.90],
        "compute-only": [0.20],
        "comm-only": [0.60],
        "comm-only+all-to-all": [0.65],
        "comm-only+native": [0.80],
    }
    rank = {"modes": {m: {"times": t, "losses": [1.0], "peak_rss_mib": 1.0} for m, t in times.items()}}
    rows = step_time.summarize([rank, rank], rate_bps=None)["rows"]
    assert rows["both"]["x_transport"] == pytest.approx(0.70 / 0.60)
    assert rows["both+all-to-all"]["x_transport"] == pytest.approx(0.75 / 0.65)
    assert rows["both+native"]["x_transport"] == pytest.approx(0.90 / 0.80)


@pytest.mark.parametrize(
    "modes, message",
    [
        ("both,comm+compute", "comm+compute runs comm-only and compute-only at once: list both before it"),
        ("compute-only,comm-only+recv-first", "comm-only+recv-first replays the collectives of a `both` step"),
    ],
)
def test_modes_that_need_others_say_which(modes, message):
    _refused(["--modes", modes], message)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--trace-mode", "both+prefetch-2"], "--trace-mode needs --trace-dir"),
        (
            ["--trace-dir", "tr", "--trace-mode", "both+fsdp2-order"],
            "--trace-mode both+fsdp2-order: list it in --modes",
        ),
        (["--trace-dir", "tr", "--trace-mode", "both+native"], "invalid choice: 'both+native'"),
    ],
)
def test_trace_mode_is_checked(extra, message):
    _refused(["--modes", "both,both+prefetch-2", *extra], message)


def _refused(args: list[str], message: str) -> None:
    """step_time.py stops at its argument checks (exit 2) with ``message``."""
    out = _bench.run("step_time", *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def _exchange_vs_gloo(rank: int, world: int) -> dict:
    """The plugin's receive-first exchange (which ``--recv-first`` and the recv-first
    replay use for all-gathers too) against gloo's own collectives, bitwise: directly, and
    through the replaced kernels of the functional ops the compiled graphs call."""
    import torch
    import torch.distributed as dist

    from fsdp_overlap_plugin.runtime.exchange import exchange

    bench = _bench.load("step_time")
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(rank)
    shard = torch.randn(5, 3, generator=g)
    rows = torch.randn(world * 4, 3, generator=g)
    gathered, swapped = torch.empty(world * 5, 3), torch.empty_like(rows)
    dist.all_gather_into_tensor(gathered, shard)
    dist.all_to_all_single(swapped, rows)

    out = torch.empty_like(gathered)
    exchange(list(out.chunk(world)), [shard] * world, group).wait()
    direct_gather = torch.equal(out, gathered)
    out = torch.empty_like(rows)
    exchange(list(out.chunk(world)), list(rows.chunk(world)), group).wait()
    direct_swap = torch.equal(out, swapped)

    c10d = torch.ops._c10d_functional
    lib = bench.use_recv_first_kernels()
    buf = torch.zeros(world * 5 * 3)
    slot = buf.narrow(0, rank * 15, 15)
    slot.copy_(shard.reshape(-1))  # in place, as the bucketed graphs gather
    res = c10d.wait_tensor(c10d.all_gather_into_tensor_out(slot, world, group.group_name, out=buf))
    kernel_gather = torch.equal(res.view(world * 5, 3), gathered)
    res = c10d.wait_tensor(c10d.all_to_all_single(rows, [4] * world, [4] * world, group.group_name))
    kernel_swap = torch.equal(res, swapped)
    del lib
    return {"direct": (direct_gather, direct_swap), "kernels": (kernel_gather, kernel_swap)}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_recv_first_exchange_equals_gloo_collectives(world):
    from _dist import run_ranks

    for result in run_ranks(_exchange_vs_gloo, world=world):
        assert result == {"direct": (True, True), "kernels": (True, True)}


# ------------------------------------------------------------------ variable lengths (issue 45)
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--lengths", "64"], "--lengths: at least two lengths"),
        (["--lengths", "64,64,96"], "the first two different"),
        (["--lengths", "64,256"], "--lengths: at most 128"),
        (["--lengths", "64,96", "--memory"], "--lengths: not with --memory"),
        (["--lengths", "64,96", "--warmup", "1"], "--lengths needs --warmup 2"),
    ],
)
def test_lengths_are_checked(extra, message):
    _refused(["--modes", "both", *extra], message)


def test_data_cycles_the_lengths_over_the_same_batches():
    fixed = step_time._data(512, 128, 2, 5)
    cut = step_time._data(512, 128, 2, 5, [64, 96])
    assert [x.shape for x, _ in cut] == [(16, n) for n in (64, 96, 64, 96, 64)]
    for (x, y), (fx, fy) in zip(cut, fixed):
        n = x.shape[1]
        assert x.equal(fx[:, :n]) and y.equal(fy[:, :n]) and x.is_contiguous()


def test_summary_carries_compile_counts():
    def rank(graphs):
        modes = {
            "fsdp2-eager": {"times": [1.0], "losses": [1.0], "peak_rss_mib": 1.0, "compiles": None},
            "both": {"times": [0.5], "losses": [1.0], "peak_rss_mib": 1.0, "compiles_warm": 2, "compiles": graphs},
        }
        return {"modes": modes}

    summary = step_time.summarize([rank(2), rank(3)], rate_bps=None)
    assert summary["rows"]["both"]["compiles"] == [2, 3] and summary["rows"]["both"]["compiles_warm"] == [2, 2]
    assert summary["rows"]["fsdp2-eager"]["compiles"] == [None, None]
    step_time.print_table(summary, "header")  # formats the counts line


@pytest.mark.slow
def test_quick_run_at_two_lengths_compiles_twice(tmp_path):
    """A loopback --quick run cycling 2 lengths: both modes ran every step at the same
    lengths, `both` compiled a static and a dynamic graph in warm-up and nothing after,
    and its losses agree with eager FSDP2's."""
    out = tmp_path / "lengths.json"
    proc = _bench.smoke_run(
        "step_time", "--quick", "--loopback", "--modes", "fsdp2-eager,both", "--lengths", "64,96", out=out
    )
    assert "Dynamo graphs per compiled mode r0/r1 (after warm-up -> after the timed steps): both 2/2 -> 2/2" in (
        proc.stdout
    )
    rows = json.loads(out.read_text())["summary"]["rows"]
    assert list(rows) == ["fsdp2-eager", "both"]
    assert rows["both"]["compiles_warm"] == [2, 2] and rows["both"]["compiles"] == [2, 2]
    assert rows["fsdp2-eager"]["compiles"] == [None, None]
    for row in rows.values():
        assert row["steps"] == 10 and row["lengths"] == [64, 96] * 5  # warm-up took steps 0 and 1
    assert rows["both"]["max_loss_diff_vs_eager"] < 1e-4


def test_dynamic_lengths_help_and_arguments():
    text = _bench.help_text("dynamic_lengths")
    assert "--quick" in text and "--length" in text and "--warm-lengths" in text
    assert dynamic_lengths.default_warm_lengths(128) == [64, 96]
    assert dynamic_lengths.default_warm_lengths(64) == [32, 48]
    out = _bench.run("dynamic_lengths", "--length", "64", "--warm-lengths", "32,64")
    assert out.returncode == 2 and "two different lengths, neither of them --length" in out.stderr


def test_dynamic_lengths_summary():
    def mode(times, losses, compiles):
        return {
            "times": times,
            "rep_times": [times[:2], times[2:]],
            "losses": losses,
            "compiles": compiles,
            "compile_steps_s": [30.0] * compiles,
            "cache": [],
            "recompiled_at_length": False,
        }

    model = {
        "length": 128,
        "warm_lengths": [64, 96],
        "modes": {
            "static": mode([1.0, 1.0, 2.0, 2.0], [3.0, 2.5, 2.0, 1.5], 1),
            "dynamic": mode([1.1, 1.1, 2.2, 2.2], [3.0, 2.5, 2.0, 1.5001], 2),
        },
    }
    summary = dynamic_lengths.summarize([{"models": {"gpt": model}}] * 2)["gpt"]
    assert summary["ratio"] == pytest.approx(1.65 / 1.5)
    assert summary["rep_ratios"] == pytest.approx([1.1, 1.1])
    assert summary["pair_ratio"] == pytest.approx(1.1) and summary["min_ratio"] == pytest.approx(1.1)
    assert summary["rows"]["dynamic"]["compiles"] == [2, 2] and summary["rows"]["static"]["compile_s"] == 30.0
    assert summary["max_loss_diff"] == pytest.approx(1e-4)
    dynamic_lengths.print_table({"gpt": summary})  # formats


# ------------------------------------------------------------------ torch's own passes as modes (issue 57)
runners = _bench.load("_harness.runners")


def test_link_hardware_costs_collectives_at_the_benchmark_rate():
    from fsdp_overlap_plugin.config.hardware import resolve_rates

    assert runners.link_hardware(300e6) == "cpu-gloo-300mbit,link=37.5MB/s"
    for bps in (300e6, 100e6):
        rates = resolve_rates("cpu", runners.link_hardware(bps))["rates"]
        assert rates["link"] == pytest.approx(bps / 8)  # bytes/s per rank = the tc rate
        assert rates["latency"] == resolve_rates("cpu", "cpu-gloo-300mbit")["rates"]["latency"]
    assert runners.link_hardware(0.0) == "cpu-gloo-300mbit"  # alloc_peak.py: no link


def _state(runner):
    from fsdp_overlap_plugin.runtime.state import get_state

    return get_state(runner.model)


def test_new_modes_build_the_configs_they_name():
    """What make_runner builds (a fake world of 2, nothing compiled): torch-auto is the
    package's inductor_overlap: auto with our passes off, gloo's reduce-scatter and the
    benchmark's link as hardware; torch-manual is `compiled` plus torch's pass with
    `both`'s plan; both+suggest takes the plan and depth suggest picked."""
    from _fake import fake_world

    from fsdp_overlap_plugin.config.hardware import resolve_rates

    modes = ("torch-auto", "torch-manual", "both+suggest", "both", "compiled")
    with fake_world(2):
        built = {m: runners.make_runner(m, "gpt", "small", {}, 100e6, 2) for m in modes}
        configs = {m: _state(r).config for m, r in built.items()}
        plans = {m: _state(r).plan for m, r in built.items()}
    auto = configs["torch-auto"]
    assert (auto.inductor_overlap, auto.manual_bucketing, auto.overlap_grad_reduce) == ("auto", False, False)
    assert auto.reduce_scatter_impl == "native" and built["torch-auto"].patch is None
    assert resolve_rates("cpu", auto.hardware)["rates"]["link"] == pytest.approx(100e6 / 8)
    manual = configs["torch-manual"]
    assert manual == configs["compiled"] and manual.inductor_overlap == "off"
    assert (manual.manual_bucketing, manual.overlap_grad_reduce, manual.reduce_scatter_impl) == (False, False, "native")
    patch = built["torch-manual"].patch
    assert patch["reorder_for_peak_memory"] is False and patch["allow_buffer_reuse"] is False
    assert patch["post_grad_custom_post_pass"].plan == plans["both"] == built["torch-manual"].info["plan"]
    assert len(plans["both"]) == 6  # embeddings, 4 blocks, the head and norm
    assert built["torch-manual"].may_fail and not built["both"].may_fail
    suggested = built["both+suggest"].info["suggest"]
    assert suggested["hardware"] == runners.link_hardware(100e6)
    assert configs["both+suggest"].prefetch_depth == suggested["depth"]
    assert plans["both+suggest"] == (plans["both"] if suggested["plan"] == "auto" else suggested["plan"])


def test_simple_modes_set_inductor_overlap_simple(monkeypatch):
    """compiled+simple is `compiled` and both+simple the defaults, each with inductor_overlap:
    simple; valid configs where torch has the pass (made so here on any torch)."""
    from fsdp_overlap_plugin import _torch_compat
    from fsdp_overlap_plugin.config.schema import OverlapConfig

    monkeypatch.setattr(
        _torch_compat, "inductor_distributed_passes", lambda: {"simple_overlap": True, "overlap_scheduling": True}
    )
    assert runners.mode_config("compiled+simple", 300e6) == {
        **runners.mode_config("compiled", 300e6),
        "inductor_overlap": "simple",
    }
    assert runners.mode_config("both+simple", 300e6) == {"inductor_overlap": "simple"}
    assert runners.mode_config("both", 300e6) == {}
    for mode in ("compiled+simple", "both+simple", "torch-auto"):
        OverlapConfig.from_dict(runners.mode_config(mode, 300e6))  # valid as they are
    with pytest.raises(ValueError, match="no plugin config"):
        runners.mode_config("comm-only", 300e6)


def test_torch_manual_pass_calls_torchs_function_with_the_plan(monkeypatch):
    import torch
    from torch._inductor.fx_passes import overlap_manual_scheduling

    calls = []

    def fake(gm, plans, insert_overlap_deps=False, module_stack_fn=None, bucket_mode=None):
        calls.append((gm, plans, insert_overlap_deps, module_stack_fn))
        return gm

    monkeypatch.setattr(overlap_manual_scheduling, "manual_overlap_bucketing", fake)
    plan = [["embed"], ["blocks.0", "blocks.1"], "head"]
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    custom = runners.torch_manual_pass(plan)
    custom(gm.graph)
    assert calls == [(gm, plan, True, runners._module_stack)]
    assert custom.runs == [{"graph": "forward", "before": custom.runs[0]["before"], "after": custom.runs[0]["after"]}]
    assert custom.runs[0]["before"]["all_gather"] == 0
    assert json.dumps(plan) in custom.uuid()
    assert runners.torch_manual_pass([["embed"]]).uuid() != custom.uuid()  # the cache keys on the plan


def test_module_stack_reads_any_dynamo_root():
    import torch

    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    node.meta["nn_module_stack"] = {
        "a": ("L['args'][0]._modules['model']", torch.nn.Module),
        "b": ("L['args'][0]._modules['model']._modules['layers']['0']", torch.nn.Linear),
    }
    assert runners._module_stack(node) == [("model", torch.nn.Module), ("model.layers.0", torch.nn.Linear)]
    del node.meta["nn_module_stack"]
    node.meta["fwd_nn_module_stack"] = {"a": ("L['self'].blocks.0", torch.nn.Module)}
    assert runners._module_stack(node) == [("blocks.0", torch.nn.Module)]


@pytest.mark.parametrize("mode", ["compiled+simple", "both+simple"])
def test_simple_modes_need_torch_2_14_at_argument_check(monkeypatch, capsys, mode):
    """The simple modes are refused before any worker starts where torch has no simple
    overlap pass, with the package's own message; allowed where it has one."""
    import sys

    from fsdp_overlap_plugin import _torch_compat

    monkeypatch.setattr(
        _torch_compat, "inductor_distributed_passes", lambda: {"simple_overlap": True, "overlap_scheduling": True}
    )
    assert runners.mode_torch_error(mode) is None
    monkeypatch.setattr(
        _torch_compat, "inductor_distributed_passes", lambda: {"simple_overlap": False, "overlap_scheduling": True}
    )
    monkeypatch.setattr(sys, "argv", ["step_time.py", "--modes", f"fsdp2-eager,{mode}", "--loopback"])
    with pytest.raises(SystemExit) as exc:
        step_time.main()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"mode {mode}: inductor_overlap: simple needs torch 2.14 or newer" in err


def test_torch_auto_on_cpu_needs_torch_2_13(monkeypatch):
    from fsdp_overlap_plugin import _torch_compat

    monkeypatch.setattr(
        _torch_compat, "inductor_distributed_passes", lambda: {"simple_overlap": False, "overlap_scheduling": True}
    )
    monkeypatch.setattr(_torch_compat, "TORCH_VERSION", "2.11.0")
    assert "inductor_overlap: auto on cpu needs torch 2.13" in runners.mode_torch_error("torch-auto")
    monkeypatch.setattr(_torch_compat, "TORCH_VERSION", "2.13.0")
    assert runners.mode_torch_error("torch-auto") is None


def test_summary_and_table_carry_compile_time_and_failures(capsys):
    def rank(compile_s):
        modes = {
            "fsdp2-eager": {"times": [1.0], "losses": [2.0], "peak_rss_mib": 1.0, "compile_s": 0.5},
            "both": {"times": [0.5], "losses": [2.0], "peak_rss_mib": 1.0, "compile_s": compile_s},
            "torch-manual": {
                "times": [0.001],
                "losses": [],
                "peak_rss_mib": 0.0,
                "compile_s": None,
                "failed": "BackendCompilerFailed: torch's pass\nline two",
            },
        }
        return {"modes": modes}

    summary = step_time.summarize([rank(30.0), rank(42.0)], rate_bps=None)
    rows = summary["rows"]
    assert rows["both"]["compile_s"] == 42.0 and rows["fsdp2-eager"]["compile_s"] == 0.5
    assert (
        rows["torch-manual"]["failed"].startswith("BackendCompilerFailed") and rows["torch-manual"]["x_eager"] is None
    )
    step_time.print_table(summary, "header")
    out = capsys.readouterr().out
    assert "torch-manual         failed: BackendCompilerFailed: torch's pass | line two" in out
    assert "compile s" in out and " 42.0 " in out


def test_torch_pass_lines_say_what_torchs_pass_did():
    run = {"graph": "forward", "before": {"all_gather": 53, "reduce_scatter": 0}}
    run["after"] = {"all_gather": 6, "reduce_scatter": 0}
    rows = {"torch-manual": {"torch_pass": [run]}, "torch-manual-b": {"torch_pass": []}}
    lines = step_time.torch_pass_lines(rows)
    assert lines[0] == (
        "torch-manual: torch's manual_overlap_bucketing ran on 1 graphs: forward all-gathers 53 -> 6, "
        "reduce-scatters 0 -> 0"
    )
    assert "did NOT run" in lines[1]


def test_memory_summary_keeps_a_failed_mode():
    mem = {"peak_bytes": 2**21, "state_bytes": 2**20, "step_peak_bytes": 2**20, "rss_hwm_increase_bytes": 2**20}
    ok = [{"memory": mem, "compile_s": 3.0}, {"memory": mem, "compile_s": 4.0}]
    failed = [{"memory": None, "failed": "RuntimeError: no"}] * 2
    summary = step_time.summarize_memory({"fsdp2-eager": ok, "torch-manual": failed})
    assert summary["rows"]["fsdp2-eager"]["compile_s"] == 4.0 and summary["rows"]["fsdp2-eager"]["peak_mib"] == 2.0
    assert summary["rows"]["torch-manual"] == {"failed": "RuntimeError: no", "peak_mib": None, "x_eager": None}
    step_time.print_memory_table(summary, "header")  # formats


def test_each_launch_gets_a_fresh_inductor_cache(monkeypatch, tmp_path):
    """The workers compile into a cache of their own (cold compile times; no entry of an
    earlier run skips torch-manual's pass), even though importing torch has written its
    default cache folder into os.environ; a cache the user named is kept."""
    import argparse
    import os

    from fsdp_overlap_plugin import _torch_compat

    _torch_compat.inductor_cache_dir()  # torch's cache_dir(): sets os.environ's entry
    seen = []

    def run_workers(*args):
        seen.append(args[5])
        (tmp_path / "inductor_cache" / "fxgraph").mkdir(parents=True, exist_ok=True)  # what torch writes
        return []

    monkeypatch.setattr(step_time, "run_workers", run_workers)
    monkeypatch.setattr(step_time, "USER_CACHE_DIR", None)
    args = argparse.Namespace(worker_args=["--modes", "both"], timeout=10)
    step_time.launch(args, tmp_path, False)
    assert seen[-1]["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor_cache")
    assert not (tmp_path / "inductor_cache").exists()  # removed after the run
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") != seen[-1]["TORCHINDUCTOR_CACHE_DIR"]
    monkeypatch.setattr(step_time, "USER_CACHE_DIR", "/somewhere/mine")
    step_time.launch(args, tmp_path, False)
    assert seen[-1]["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/mine"


def test_default_mode_list_skips_what_this_torch_cannot_run(monkeypatch, capsys, tmp_path):
    """Named, a mode this torch cannot run is an error (above); in the default list it is
    left out with a line saying why, and the rest runs."""
    import sys

    from fsdp_overlap_plugin import _torch_compat

    monkeypatch.setattr(_torch_compat, "TORCH_VERSION", "2.11.0")
    launched = []
    monkeypatch.setattr(step_time, "launch_on_link", lambda args, out, netns: launched.append(args) or [])
    monkeypatch.setattr(step_time, "summarize", lambda *a: {})
    monkeypatch.setattr(step_time, "print_table", lambda *a: None)
    monkeypatch.setattr(step_time.signal, "signal", lambda *a: None)  # main's handlers: not in pytest
    monkeypatch.setattr(step_time.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["step_time.py", "--loopback"])
    step_time.main()
    assert "skipped mode torch-auto: inductor_overlap: auto on cpu needs torch 2.13" in capsys.readouterr().out
    modes = launched[0].worker_args[launched[0].worker_args.index("--modes") + 1].split(",")
    assert modes == [m for m in step_time.ALL_MODES if m != "torch-auto"]
    monkeypatch.setattr(sys, "argv", ["step_time.py", "--loopback", "--modes", "both,torch-auto"])
    with pytest.raises(SystemExit):
        step_time.main()
