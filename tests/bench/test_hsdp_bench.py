"""benchmarks/hsdp_step.py's own logic (no namespaces, no timing assertions), and one
loopback smoke run of all its modes."""

from __future__ import annotations

import json

import _bench
import pytest

hsdp_step = _bench.load("hsdp_step")


def test_help_runs():
    text = _bench.help_text("hsdp_step")
    assert "--rate" in text and "--loopback" in text and "hsdp-eager" in text


def test_rate_parsing():
    assert hsdp_step.parse_rate("300mbit") == 300e6 and hsdp_step.parse_rate("1gbit") == 1e9


def test_shard_groups_stay_in_a_node_and_replicas_cross():
    shard, replica = hsdp_step.mesh_groups()
    assert shard == [[0, 1], [2, 3]] and replica == [[0, 2], [1, 3]]
    assert all(len({hsdp_step.node_of(r) for r in group}) == 1 for group in shard)
    assert all(len({hsdp_step.node_of(r) for r in group}) == 2 for group in replica)


def test_unknown_mode_is_rejected():
    out = _bench.run("hsdp_step", "--modes", "defaults,fast")
    assert out.returncode == 2 and "unknown mode(s) ['fast']" in out.stderr


def _schedule() -> dict:
    """A 2-bucket defaults schedule: gathers, compute, all-to-all reduce-scatters and the
    replica all-reduces deferred past the next one's launch."""
    fwd = [
        {"op": "all_gather", "name": "ag0", "bytes": 800, "bucket": 0},
        {"op": "all_gather", "name": "ag1", "bytes": 800, "bucket": 1},
        {"op": "wait", "name": "w_ag0", "of": "ag0"},
        {"op": "compute", "name": "c0", "flops": 100},
        {"op": "wait", "name": "w_ag1", "of": "ag1"},
        {"op": "compute", "name": "c1", "flops": 100},
    ]
    bwd = [
        {"op": "compute", "name": "c2", "flops": 200},
        {"op": "all_to_all", "name": "rs1", "bytes": 800, "bucket": 1},
        {"op": "compute", "name": "c3", "flops": 200},
        {"op": "all_to_all", "name": "rs0", "bytes": 800, "bucket": 0},
        {"op": "wait", "name": "w_rs1", "of": "rs1"},
        {"op": "all_reduce", "name": "ar1", "bytes": 400, "bucket": 1},
        {"op": "wait", "name": "w_rs0", "of": "rs0"},
        {"op": "all_reduce", "name": "ar0", "bytes": 400, "bucket": 0},
        {"op": "wait", "name": "w_ar1", "of": "ar1"},
        {"op": "wait", "name": "w_ar0", "of": "ar0"},
    ]
    return {"forward": fwd, "backward": bwd}


def test_replica_all_reduces_go_on_the_inter_lane():
    events = hsdp_step.on_lanes(_schedule()["backward"])
    lanes = {e["name"]: e.get("lane") for e in events}
    assert lanes["ar0"] == lanes["ar1"] == "inter" and lanes["rs0"] == lanes["rs1"] == "link"
    assert all(e.get("ranks") == 2 for e in events if e["op"] not in ("compute", "wait"))


def test_eager_schedule_waits_each_reduction_at_once():
    backward = hsdp_step.eager_hsdp(_schedule())["backward"]
    ops = [(e["op"], e.get("of") or e["name"]) for e in backward if e["op"] != "compute"]
    # gloo's reduce-scatter (an all-reduce on the shard link), waited, then the replica
    # all-reduce of the shard (half the bytes), waited; the deferred ones are gone
    assert [op for op, _ in ops] == ["all_reduce", "wait", "all_reduce", "wait"] * 2
    replica = [e for e in backward if e["name"].startswith("replica_")]
    assert [e["bytes"] for e in replica] == [400, 400]
    assert not any(e["name"] in ("ar0", "ar1") or e.get("of") in ("ar0", "ar1") for e in backward)
    # gloo's reduce-scatter runs as an all-reduce too, but on the shard link
    lanes = [e["lane"] for e in hsdp_step.on_lanes(backward) if e["op"] == "all_reduce"]
    assert lanes == ["link", "inter"] * 2


def test_native_reduce_scatter_stays_on_the_shard_link():
    events = [
        {"op": "reduce_scatter", "name": "rs", "bytes": 800},
        {"op": "all_reduce", "name": "ar", "bytes": 400},
    ]
    lanes = [(e["op"], e["lane"]) for e in hsdp_step.on_lanes(hsdp_step.native(events))]
    assert lanes == [("all_reduce", "link"), ("all_reduce", "inter")]


def test_probe_rates_invert_the_link_time():
    from fsdp_overlap_plugin.report.costmodel import _link_time

    probe = {"bytes": 4e6, "shard_all_to_all_s": 0.05, "replica_all_reduce_s": 0.4}
    rates = hsdp_step.probe_rates(probe, latency=0.002, send_first=2.0)
    assert _link_time("all_to_all", 4e6, 2, rates["link"], 0.002, 2.0) == pytest.approx(0.05)
    assert _link_time("all_reduce", 4e6, 2, rates["inter_link"], 0.002, 2.0) == pytest.approx(0.4)


def test_summary_ratios_losses_and_memory():
    def rank(scale):
        modes = {
            "hsdp-eager": {"times": [2.0, 2.0], "losses": [5.0, 4.0]},
            "defaults": {"times": [1.0, 1.2], "losses": [5.0, 4.00002]},
        }
        memory = {m: {"peak_bytes": scale * 2**20, "state_bytes": 2**20, "rss_hwm_increase_bytes": 0} for m in modes}
        return {"modes": modes, "memory": memory}

    summary = hsdp_step.summarize([rank(10), rank(12), rank(10), rank(10)], rate_bps=300e6)
    rows = summary["rows"]
    assert rows["defaults"]["mean_s"] == pytest.approx(1.1) and rows["defaults"]["x_eager"] == pytest.approx(0.55)
    assert rows["defaults"]["max_loss_diff_vs_eager"] == pytest.approx(2e-5)
    assert rows["defaults"]["peak_mib"] == pytest.approx(12.0) and rows["defaults"]["x_eager_peak_mib"] == 1.0
    assert summary["prediction"] == {}  # no compute-only rows, no probe
    hsdp_step.print_table(summary)


@pytest.mark.slow
def test_loopback_smoke_run(tmp_path):
    """All modes on loopback (tiny GPT, aot_eager), 1 step each: every mode ran, the sharded modes' losses agree
    with eager HSDP's, and the JSON holds the table, memory, probe and predictions."""
    out = tmp_path / "hsdp.json"
    _bench.smoke_run(
        "hsdp_step",
        *("--loopback", "--model-size", "tiny", "--backend", "aot_eager"),
        *("--steps", "1", "--reps", "1", "--warmup", "1"),
        out=out,
    )
    data = json.loads(out.read_text())
    rows = data["summary"]["rows"]
    assert list(rows) == hsdp_step.MODES
    for mode in hsdp_step.SHARDED:
        assert rows[mode]["steps"] == 1 and rows[mode]["peak_mib"] > 0, mode
        assert rows[mode]["max_loss_diff_vs_eager"] < 1e-4, (mode, rows[mode])
    assert data["loopback"] is True and data["summary"]["probe"]["bytes"] > 0
    prediction = data["summary"]["prediction"]
    assert set(prediction["modes"]) == set(hsdp_step.SHARDED)
    assert "measured" in prediction["links"] and "nominal" not in prediction["links"]  # uncapped
    assert data["summary"]["deferred_ar_waits"] >= 1
