"""benchmarks/step_time_2d.py's own logic (no namespaces, no timing assertions), and one
loopback smoke run of all its modes."""

from __future__ import annotations

import json

import _bench
import pytest

step_time_2d = _bench.load("step_time_2d")
netns = _bench.load("_harness.netns")


def test_help_runs():
    text = _bench.help_text("step_time_2d")
    assert "--rate" in text and "--loopback" in text and "torchtitan-eager-order" in text


def test_arguments_default_to_every_mode_and_check_the_rest():
    _, args = step_time_2d.parse_args([])
    assert args.modes.split(",") == step_time_2d.MODES and args.backend == "inductor" and not args.worker
    _, args = step_time_2d.parse_args(["--modes", " defaults, compute-only ", "--rate", "1gbit"])
    assert args.modes == "defaults,compute-only"
    assert "--modes" in (worker := step_time_2d.worker_args(args)) and worker[worker.index("--modes") + 1] == (
        "defaults,compute-only"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--modes", "defaults,fast"], "unknown mode(s) ['fast']"),
        (["--modes", "compute-only"], "name at least one of"),
        (["--steps", "0"], "at least 1"),
    ],
)
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        step_time_2d.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_rank_namespaces_place_a_tensor_parallel_pair_per_namespace():
    assert netns.rank_namespaces(2) == [0, 1]  # step_time.py's: one rank per namespace
    assert netns.rank_namespaces(4, 2) == [0, 0, 1, 1]
    tp_groups, dp_groups = step_time_2d.mesh_groups()
    assert tp_groups == [[0, 1], [2, 3]] and dp_groups == [[0, 2], [1, 3]]
    nodes = netns.rank_namespaces(step_time_2d.WORLD, step_time_2d.TP)
    assert all(len({nodes[r] for r in group}) == 1 for group in tp_groups)  # the fast path
    assert all(len({nodes[r] for r in group}) == 2 for group in dp_groups)  # the shaped veth
    assert [step_time_2d.dp_rank_of(r) for r in range(4)] == [0, 0, 1, 1]
    for world, per in ((4, 3), (6, 2), (4, 0)):
        with pytest.raises(ValueError, match="rank_namespaces"):
            netns.rank_namespaces(world, per)


def test_torch_plan_is_the_config_plan_inside_a_block():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = step_time_2d.torch_tp_plan()
    assert set(plan) == {"mlp.fc", "mlp.proj"}
    assert isinstance(plan["mlp.fc"], ColwiseParallel) and isinstance(plan["mlp.proj"], RowwiseParallel)


def _losses(base: list[float], shift: float = 0.0, rank_shift: dict | None = None) -> list[list[float]]:
    return [[x + shift + (rank_shift or {}).get(r, 0.0) for x in base] for r in range(4)]


def test_loss_agreement():
    base = [5.0, 4.9, 4.8]
    per_rank = {
        "torchtitan-eager-order": _losses(base),
        "defaults": _losses(base, 3e-6),
        "passes-off": _losses(base, 2e-3),  # a broken reduction: off by a training step's change
        "compute-only": _losses(base, 1.0),  # not compared
    }
    check = step_time_2d.loss_agreement(per_rank, "torchtitan-eager-order", tol=1e-4)
    assert set(check["modes"]) == {"torchtitan-eager-order", "defaults", "passes-off"}
    assert check["modes"]["defaults"]["agree"] and check["modes"]["defaults"]["max_diff"] == pytest.approx(3e-6)
    assert not check["modes"]["passes-off"]["agree"] and not check["all_agree"]
    # the two ranks of a tensor-parallel pair disagree: caught even where rank 0 matches the reference
    split = step_time_2d.loss_agreement(
        {"torchtitan-eager-order": _losses(base), "defaults": _losses(base, rank_shift={1: 1e-3})},
        "torchtitan-eager-order",
    )
    assert split["modes"]["defaults"]["tp_pair_diff"] == pytest.approx(1e-3) and not split["all_agree"]
    # a NaN, or fewer steps than the reference, never agrees
    nan = step_time_2d.loss_agreement(
        {"torchtitan-eager-order": _losses(base), "defaults": _losses([5.0, float("nan"), 4.8])},
        "torchtitan-eager-order",
    )
    assert not nan["modes"]["defaults"]["agree"] and nan["modes"]["defaults"]["max_diff"] is None
    short = step_time_2d.loss_agreement(
        {"torchtitan-eager-order": _losses(base), "defaults": _losses(base[:2])}, "torchtitan-eager-order"
    )
    assert not short["modes"]["defaults"]["agree"]


def _rank(times: dict[str, list[float]], peak: float, losses: dict[str, list[float]], probe=None) -> dict:
    memory = {m: {"peak_bytes": peak * 2**20, "state_bytes": 2**20, "rss_hwm_increase_bytes": 0} for m in times}
    modes = {m: {"times": t, "losses": losses[m], "compile_s": 1.0} for m, t in times.items()}
    return {"modes": modes, "memory": memory, "probe": probe}


def test_summary_ratios_exposure_memory_and_probe(capsys):
    times = {
        "defaults": [1.0, 1.2, 1.1],
        "passes-off": [2.0, 2.0, 2.1],
        "torchtitan-eager-order": [1.5, 1.6, 1.4],
        "compute-only": [0.8, 0.8, 0.8],
    }
    losses = {m: [5.0, 4.9, 4.8] for m in times}
    losses["compute-only"] = [5.0, 5.5, 6.0]  # no dp averaging: differs by design
    probe = {
        "bytes": 4 * 2**20,
        "ifname": "fo2dv0",
        "tp_all_reduce_s": 0.01,
        "dp_all_reduce_s": 0.4,
        "tp_link_bytes": 200.0,
        "dp_link_bytes": 16 * 2**20,
    }
    results = [_rank(times, peak, losses, probe) for peak in (10.0, 12.0, 10.0, 11.0)]
    summary = step_time_2d.summarize(results)
    rows = summary["rows"]
    assert summary["reference"] == "torchtitan-eager-order"
    assert rows["defaults"]["median_s"] == pytest.approx(1.1) and rows["defaults"]["x_reference"] == pytest.approx(
        1.1 / 1.5
    )
    assert rows["defaults"]["exposed_s"] == pytest.approx(0.3)
    assert rows["defaults"]["exposed_fraction"] == pytest.approx(0.3 / 1.1)
    assert rows["compute-only"]["exposed_s"] is None
    assert rows["passes-off"]["peak_mib"] == pytest.approx(12.0) and rows["passes-off"]["x_reference_peak"] == 1.0
    assert summary["losses"]["all_agree"] and "loss_check" not in rows["compute-only"]
    assert summary["probe"]["tp_off_link"] is True and summary["probe"]["dp_over_tp"] == pytest.approx(40.0)
    step_time_2d.print_table(summary)
    out = capsys.readouterr().out
    assert "stay off the shaped link" in out and "all agree" in out and "DISAGREE" not in out


def test_link_verdict():
    probe = {"bytes": 100, "ifname": "fo2dv0", "tp_all_reduce_s": 0.01, "dp_all_reduce_s": 0.02}
    assert step_time_2d.link_verdict({**probe, "tp_link_bytes": 50, "dp_link_bytes": 400})["tp_off_link"] is False
    assert step_time_2d.link_verdict({**probe, "tp_link_bytes": 0, "dp_link_bytes": 50})["tp_off_link"] is False
    loopback = {**probe, "ifname": "lo", "tp_link_bytes": 400, "dp_link_bytes": 400}
    assert step_time_2d.link_verdict(loopback)["tp_off_link"] is None
    assert step_time_2d.link_verdict(None) is None


def test_summary_without_the_reference_compares_to_the_first_sharded_mode():
    times = {"compute-only": [0.5], "defaults": [1.0], "passes-off": [2.0]}
    losses = {m: [5.0] for m in times}
    summary = step_time_2d.summarize([_rank(times, 10.0, losses) for _ in range(4)])
    assert summary["reference"] == "defaults" and summary["rows"]["passes-off"]["x_reference"] == pytest.approx(2.0)
    assert summary["probe"] is None


# CI: on its 2.14 leg (passed there and on 2.13), to keep the main lane short
@pytest.mark.slow
@pytest.mark.middle_torch
def test_loopback_smoke_run(tmp_path):
    """All modes on loopback (tiny GPT, aot_eager), 2 timed steps each: every mode ran, the
    sharded modes' losses agree with torchtitan-eager-order's, and the JSON holds the table,
    memory and the link probe."""
    out = tmp_path / "2d.json"
    proc = _bench.smoke_run(
        "step_time_2d",
        *("--loopback", "--model-size", "tiny", "--backend", "aot_eager"),
        *("--steps", "2", "--reps", "1", "--warmup", "1"),
        out=out,
    )
    assert "link check" in proc.stdout and "all agree" in proc.stdout
    data = json.loads(out.read_text())
    summary = data["summary"]
    assert data["loopback"] is True and data["backend"] == "aot_eager" and len(data["raw"]) == 4
    assert list(summary["rows"]) == step_time_2d.MODES and summary["reference"] == "torchtitan-eager-order"
    for mode in step_time_2d.MODES:
        row = summary["rows"][mode]
        assert row["steps"] == 2 and row["peak_mib"] > 0 and row["x_reference"] > 0, mode
    assert summary["losses"]["all_agree"]
    for mode in step_time_2d.SHARDED:
        check = summary["losses"]["modes"][mode]
        assert check["steps"] == 2 and check["max_diff"] <= step_time_2d.LOSS_TOL, (mode, check)
    probe = summary["probe"]
    assert probe["bytes"] > 0 and probe["tp_all_reduce_s"] > 0 and probe["dp_all_reduce_s"] > 0
    assert probe["tp_off_link"] is None  # loopback: no shaped link to check
