"""The cost model (issue 42): hardware presets with their sources, the user's own numbers,
a measured compute profile, the two-link simulation (latency, all-reduce bytes, the
replicas' link, compute slowed while the link is busy), and steps predicted from a bucket
plan for the three schedules it compares. Pure arithmetic: hand-computed expectations."""

from __future__ import annotations

import json

import pytest

from fsdp_overlap_plugin.config.schema import OverlapConfig, OverlapConfigError
from fsdp_overlap_plugin.report import costmodel as cm


def test_every_preset_says_where_its_numbers_come_from():
    for name, hw in cm.HARDWARE.items():
        assert hw.name == name and hw.link > 0 and hw.flops > 0 and hw.mem > 0
        assert hw.link_source and hw.flops_source, name
        assert (hw.inter_link is None) == (hw.inter_source is None), name
    # the complaint: the cuda default was a 25 GB/s "NVLink-ish" link
    assert cm.rates_for("cuda")["link"] == cm.HARDWARE["h100-nvlink"].link == 360e9
    assert cm.rates_for("cpu") == cm.HARDWARE["cpu-gloo-300mbit"].rates()
    assert cm.rates_for("tpu") == cm.rates_for("cpu")


@pytest.mark.parametrize(
    "text, value",
    [("360GB/s", 360e9), ("400Gbit/s", 50e9), ("300mbit", 37.5e6), ("400TFLOP/s", 4e14), ("15us", 15e-6), (7, 7.0)],
)
def test_rates_read_with_their_units(text, value):
    assert cm.parse_rate(text, "link") == pytest.approx(value)


def test_hardware_settings_preset_own_numbers_or_both():
    assert cm.parse_hardware(None) == {"preset": None}
    assert cm.parse_hardware("h100-ib400") == {"preset": "h100-ib400"}
    assert cm.parse_hardware("link=100GB/s, flops=300TFLOP/s") == {"preset": None, "link": 100e9, "flops": 3e14}
    assert cm.parse_hardware({"preset": "h100-nvlink", "link": "300GB/s"}) == {"preset": "h100-nvlink", "link": 3e11}
    with pytest.raises(ValueError, match=r"unknown preset 'h100-nvlnk'. Did you mean 'h100-nvlink'\?.*Presets: h100"):
        cm.parse_hardware("h100-nvlnk")
    with pytest.raises(ValueError, match=r"unknown key 'bandwidth'; valid: preset, link, inter_link"):
        cm.parse_hardware("bandwidth=3GB/s")
    with pytest.raises(ValueError, match=r"link='fast' is not a rate"):
        cm.parse_hardware("link=fast")
    with pytest.raises(ValueError, match="two presets"):
        cm.parse_hardware("h100-nvlink,h100-ib400")


def test_rates_resolve_device_default_then_preset_then_own_numbers_then_profile(tmp_path):
    default = cm.resolve_rates("npu")
    assert default["preset"] == "ascend-910b-hccs" and "the npu default" in default["sources"]["link"]
    chosen = cm.resolve_rates("cpu", "h100-ib400,link=100GB/s")
    assert chosen["preset"] == "h100-ib400" and chosen["own"] == ["link"]
    assert (chosen["rates"]["link"], chosen["rates"]["inter_link"]) == (100e9, 45e9)
    assert chosen["sources"]["link"] == "your own number (hardware setting)"
    assert "InfiniBand NDR" in chosen["sources"]["inter_link"]
    own = cm.resolve_rates("cpu", "link=1GB/s")  # no inter link of its own: the replicas use the same
    assert own["rates"]["inter_link"] == own["rates"]["link"] == 1e9
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"device": "my box", "achieved_flops_per_s": 2e11}))
    measured = cm.resolve_rates("cuda", None, str(profile))
    assert measured["rates"]["flops"] == 2e11 and measured["measured"] == ["flops"]
    assert measured["sources"]["flops"].startswith("measured compute profile (my box)")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"step_s": 1.0}))
    with pytest.raises(ValueError, match="no positive achieved_flops_per_s"):
        cm.resolve_rates("cpu", None, str(bad))


def test_config_names_the_bad_hardware_or_profile(tmp_path):
    assert OverlapConfig(hardware="h200-nvlink").hardware == "h200-nvlink"
    with pytest.raises(OverlapConfigError, match="hardware: unknown preset 'dgx'"):
        OverlapConfig(hardware="dgx")
    with pytest.raises(OverlapConfigError, match="compute_profile: cannot read"):
        OverlapConfig(compute_profile=str(tmp_path / "missing.json"))
    with pytest.raises(OverlapConfigError, match="compute_profile: expected the path"):
        OverlapConfig(compute_profile=3)


def _launch(name, op, nbytes, **extra):
    return {"op": op, "name": name, "bytes": nbytes, **extra}


def test_simulate_costs_bytes_latency_and_all_reduce_twice():
    rates = {"flops": 1e9, "mem": 1e18, "link": 1e6}
    events = [
        _launch("ag", "all_gather", 2e6),
        {"op": "wait", "name": "w", "of": "ag"},
        _launch("ar", "all_reduce", 2e6),
        {"op": "wait", "name": "w2", "of": "ar"},
    ]
    sim = cm.simulate(events, world=2, **rates)
    assert sim["comm_s"] == pytest.approx(1.0 + 2.0)  # half of 2 MB at 1 MB/s, then twice that
    sim = cm.simulate(events, world=2, latency=0.5, **rates)
    assert sim["comm_s"] == pytest.approx(4.0) and sim["exposed_comm_s"] == pytest.approx(4.0)


def test_the_replicas_link_is_a_lane_of_its_own():
    rates = {"flops": 1e9, "mem": 1e18, "link": 1e6, "inter_link": 1e5}
    events = [
        _launch("rs", "reduce_scatter", 2e6, ranks=2),
        _launch("ar", "all_reduce", 1e5, ranks=2, lane="inter"),
        {"op": "compute", "name": "c", "flops": 1e9},
        {"op": "wait", "name": "w", "of": "rs"},
        {"op": "wait", "name": "w2", "of": "ar"},
    ]
    sim = cm.simulate(events, world=8, **rates)
    # both start at 0 on their own links: 1 s and 1 s, hidden behind 1 s of compute
    assert sim["total_s"] == pytest.approx(1.0) and sim["exposed_comm_s"] == pytest.approx(0.0)


def test_a_tensor_parallel_plans_collectives_are_a_lane_of_their_own():
    """On HSDP x TP the plan's all-reduces are not the replicas': they keep the lane and the
    group size the record gave them (the shard link's rate, their own queue)."""
    rates = {"flops": 1e9, "mem": 1e18, "link": 1e6, "inter_link": 1e5}
    events = [
        _launch("rs", "reduce_scatter", 2e6, ranks=2),
        _launch("tp", "all_reduce", 1e6, ranks=4, lane="tensor"),
        {"op": "compute", "name": "c", "flops": 1e9},
        {"op": "wait", "name": "w", "of": "rs"},
        {"op": "wait", "name": "w2", "of": "tp"},
    ]
    on_lanes = cm.hsdp_lanes(events, [2, 2])
    assert [(e.get("lane"), e.get("ranks")) for e in on_lanes[:2]] == [("link", 2), ("tensor", 4)]
    sim = cm.simulate(on_lanes, world=8, **rates)
    # the reduce-scatter takes 1 s on the shard link, the all-reduce 2 * 3/4 * 1 MB at 1 MB/s
    # = 1.5 s on its own lane (at the shard link's rate), both from 0: 0.5 s exposed
    assert sim["total_s"] == pytest.approx(1.5) and sim["exposed_comm_s"] == pytest.approx(0.5)


def test_contention_slows_compute_only_while_the_link_is_busy():
    rates = {"flops": 1.0, "mem": 1e18, "link": 1.0}
    events = [_launch("ag", "all_gather", 4.0), {"op": "compute", "name": "c", "flops": 3.0}]
    # the link is busy for 2 s (half of 4 bytes at 1 B/s); at half speed 1 unit of work
    # is done by then, the other 2 take 2 s more
    assert cm.simulate(events, world=2, contention=1.0, **rates)["compute_s"] == pytest.approx(4.0)
    assert cm.simulate(events, world=2, **rates)["compute_s"] == pytest.approx(3.0)


def test_gloo_reduce_scatter_costs_an_all_reduce():
    events = [_launch("rs", "reduce_scatter", 8.0), _launch("a", "all_to_all", 8.0)]
    assert [e["op"] for e in cm.as_run(events, "cpu")] == ["all_reduce", "all_to_all"]
    assert cm.as_run(events, "cuda") is events


def _buckets(n=4, kept_last=True):
    out = [
        {"gather_bytes": 8e6, "reduce_bytes": 16e6, "flops_forward": 1e9, "flops_backward": 2e9, "collectives": 3}
        for _ in range(n)
    ]
    for i, b in enumerate(out):
        b["regather"] = not (kept_last and i == n - 1)
    return out


def _ops(events):
    return [(e["op"], e.get("bucket")) for e in events if e["op"] != "compute"]


def test_plan_schedule_prefetches_depth_buckets_ahead_and_keeps_the_kept_bucket():
    fwd = cm.plan_schedule(_buckets(), schedule="passes", depth=2, shard=2)["forward"]
    assert _ops(fwd)[:4] == [("all_gather", 0), ("all_gather", 1), ("all_gather", 2), ("wait", 0)]
    bwd = cm.plan_schedule(_buckets(), schedule="passes", depth=1, shard=2)["backward"]
    gathers = [b for op, b in _ops(bwd) if op == "all_gather"]
    assert gathers == [2, 1, 0]  # bucket 3 stays gathered from the forward
    scatters = [b for op, b in _ops(bwd) if op == "reduce_scatter"]
    assert scatters == [3, 2, 1, 0]
    # the gradient reduce-scatters are waited at the end, after the last compute
    last_compute = max(i for i, e in enumerate(bwd) if e["op"] == "compute")
    assert all(i > last_compute for i, e in enumerate(bwd) if e["op"] == "wait" and e["of"].startswith("reduce"))


def test_without_the_passes_every_parameter_is_its_own_collective_waited_at_once():
    graphs = cm.plan_schedule(_buckets(2, kept_last=False), schedule="no-passes", shard=2)
    fwd = graphs["forward"]
    assert sum(e["op"] == "all_gather" for e in fwd) == 6
    assert all(fwd[i + 1]["op"] == "wait" for i, e in enumerate(fwd) if e["op"] == "all_gather")
    with pytest.raises(ValueError, match="valid: passes, no-passes, fsdp2"):
        cm.plan_schedule(_buckets(), schedule="ddp", shard=2)


def test_predicted_step_orders_the_schedules_and_hsdp_exposes_the_replica_all_reduce():
    rates = {"flops": 1e12, "mem": 1e18, "link": 1e9, "inter_link": 1e8, "latency": 0.0, "contention": 0.0}
    one = {s: cm.predict_step(_buckets(), rates, schedule=s, shard=8) for s in cm.SCHEDULES}
    assert one["passes"]["step_s"] < one["no-passes"]["step_s"]
    assert (
        one["passes"]["exposed_comm_s"]
        < one["no-passes"]["exposed_comm_s"]
        == pytest.approx(one["no-passes"]["comm_s"])
    )
    assert one["passes"]["compute_s"] == pytest.approx(12e9 / 1e12)
    hsdp = {s: cm.predict_step(_buckets(), rates, schedule=s, shard=8, replicas=4) for s in ("passes", "fsdp2")}
    # the passes wait each replica all-reduce once the next has launched (fully_shard: all at
    # the end of the backward); before issue 43 each was waited at once
    assert hsdp["passes"]["exposed_comm_s"] >= hsdp["fsdp2"]["exposed_comm_s"]
    events = cm.plan_schedule(_buckets(), schedule="passes", shard=8, replicas=4)["backward"]
    at = {e["name"]: i for i, e in enumerate(events)}
    waits = {e["of"]: i for i, e in enumerate(events) if e["op"] == "wait"}
    reduces = [e for e in events if e["op"] == "all_reduce"]
    assert [e["bucket"] for e in reduces] == [3, 2, 1, 0]
    for ar, nxt in zip(reduces, reduces[1:]):
        assert at[ar["name"]] < at[nxt["name"]] < waits[ar["name"]]
    # an all-reduce of a 1/8 gradient shard over 4 replicas: 2 * 3/4 * 2e6 bytes at 1e8 B/s, per bucket
    assert hsdp["passes"]["comm_s"] - one["passes"]["comm_s"] == pytest.approx(4 * 2 * 0.75 * 2e6 / 1e8)
    extra = cm.predict_step(_buckets(), rates, shard=8, extra_compute_s=0.5)
    assert extra["step_s"] == pytest.approx(one["passes"]["step_s"] + 0.5)


def test_profile_measures_a_rate_that_check_then_uses(tmp_path, capsys):
    """``fsdp-overlap profile`` times the model on this CPU and writes the JSON that
    ``compute_profile`` and ``--profile`` read; ``check`` then predicts with its rate."""
    from fsdp_overlap_plugin.cli.main import main

    out = tmp_path / "profile.json"
    spec = "fsdp_overlap_plugin.models.gpt:gpt_small"
    args = ["profile", spec, "--batch", "2", "--seq", "32", "--steps", "2", "--warmup", "1", "--no-compile"]
    assert main([*args, "--out", str(out), "--threads", "1"]) == 0
    profile = json.loads(out.read_text())
    assert profile["device_type"] == "cpu" and profile["compiled"] is False and len(profile["steps"]) == 2
    assert profile["achieved_flops_per_s"] == pytest.approx(profile["schedule_flops_per_step"] / profile["step_s"])
    assert "FLOP/s achieved" in capsys.readouterr().out
    cost = cm.resolve_rates("cpu", None, str(out))
    assert cost["rates"]["flops"] == profile["achieved_flops_per_s"]
    config = tmp_path / "plugin.yaml"
    config.write_text(f"compute_profile: {out}\n")
    assert main(["check", str(config), "--model", spec, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prediction"]["rates"]["flops"] == profile["achieved_flops_per_s"]
    assert main(["profile", spec, "--steps", "0"]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err


def test_prediction_settings_leave_the_rank_agreement_and_caches_alone(tmp_path):
    """``hardware`` and ``compute_profile`` only feed predictions: two ranks with different
    profile paths (a node-local file, say) must agree on ``uuid()``, or each would wait for
    the other under its own agreement key until rank_check_timeout (CI found this with a
    path per rank), and changing the hardware must not invalidate the compile caches."""
    from fsdp_overlap_plugin.runtime.state import OverlapState

    paths = []
    for rank in (0, 1):
        path = tmp_path / f"profile-{rank}.json"
        path.write_text(json.dumps({"achieved_flops_per_s": 1e12}))
        paths.append(str(path))

    def state(**config):
        return OverlapState(OverlapConfig(**config), [["blocks.0"]], "cpu", 2, (2,), local_layout="even")

    plain = state()
    ranks = [state(hardware="h100-ib400", compute_profile=p) for p in paths]
    assert plain.uuid() == ranks[0].uuid() == ranks[1].uuid()
    assert plain.cache_key() == ranks[0].cache_key()
    assert state(prefetch_depth=2).uuid() != plain.uuid()  # a key the passes read still counts


def test_the_report_plays_hsdp_all_reduces_on_the_link_between_replicas():
    """A report of a 2 x 2 mesh: its all-reduces take the inter-node rate over 2 replicas,
    its reduce-scatters the shard link over 2 ranks; a 1-D report ignores inter_link."""
    from fsdp_overlap_plugin.report.costmodel import hsdp_lanes, predicted

    events = [
        {"op": "compute", "name": "mm", "flops": 1e9, "bytes": 0},
        {"op": "reduce_scatter", "name": "rs", "bytes": 8e6, "bucket": 0},
        {"op": "wait", "name": "w_rs", "of": "rs"},
        {"op": "all_reduce", "name": "ar", "bytes": 4e6, "bucket": 0},
        {"op": "wait", "name": "w_ar", "of": "ar"},
    ]
    lanes = hsdp_lanes(events, [2, 2])
    assert [(e.get("lane"), e.get("ranks")) for e in lanes] == [
        (None, None),
        ("link", 2),
        (None, None),
        ("inter", 2),
        (None, None),
    ]
    assert hsdp_lanes(events, [1, 4]) is events and hsdp_lanes(events, [4]) is events

    def report(mesh):
        record = {"graph": "backward", "schedule": {"before": events, "after": events}}
        return {"graphs": [record], "mesh": mesh, "world_size": 4, "device_type": "cuda", "config": {}}

    fast = {"link": 1e10, "inter_link": 1e10, "flops": 1e12, "mem": 1e12, "latency": 0.0}
    slow = dict(fast, inter_link=1e8)
    hsdp_fast = predicted(report([2, 2]), fast)["backward"]["after"]["comm_s"]
    hsdp_slow = predicted(report([2, 2]), slow)["backward"]["after"]["comm_s"]
    # the all-reduce's 4 MB over 2 replicas at 100 MB/s: twice its bytes x (n-1)/n = 40 ms more
    assert hsdp_slow - hsdp_fast == pytest.approx(2 * 4e6 * 0.5 * (1 / 1e8 - 1 / 1e10), rel=1e-6)
    flat = predicted(report([4]), slow)["backward"]["after"]["comm_s"]
    assert flat == predicted(report([4]), fast)["backward"]["after"]["comm_s"]


def _tp_buckets(n=3):
    """``_buckets`` with a decoder layer's tensor-parallel collectives: 2 all-reduces of a 1 MB
    activation forward, 4 backward (the 2 of the backward and the 2 a full recompute repeats)."""
    out = _buckets(n)
    for b in out:
        b["tp_forward"] = [("all_reduce", 1e6)] * 2
        b["tp_backward"] = [("all_reduce", 1e6)] * 4
    return out


def test_tensor_one_is_the_1d_schedule_whatever_the_buckets_carry():
    """Issue 59: the 2-D arguments change nothing at tensor 1: the same events, the same step."""
    rates = {"flops": 1e12, "mem": 1e18, "link": 1e9, "inter_link": 1e8, "latency": 1e-5}
    for schedule in cm.SCHEDULES:
        for replicas in (1, 4):
            one_d = cm.plan_schedule(_buckets(3), schedule=schedule, depth=2, shard=8, replicas=replicas)
            for overlap in (False, True):
                two_d = cm.plan_schedule(
                    _tp_buckets(3), schedule=schedule, depth=2, shard=8, replicas=replicas, tensor=1, tp_overlap=overlap
                )
                assert two_d == one_d
            base = cm.predict_step(_buckets(3), rates, schedule=schedule, shard=8, replicas=replicas)
            same = cm.predict_step(_tp_buckets(3), rates, schedule=schedule, shard=8, replicas=replicas, tensor=1)
            assert same == base and base["tensor_comm_s"] == 0.0


def test_tensor_parallel_splits_each_bucket_and_puts_its_collectives_on_the_tensor_lane():
    graphs = cm.plan_schedule(_tp_buckets(3), schedule="passes", shard=8, tensor=4)
    fwd, bwd = graphs["forward"], graphs["backward"]
    # one rank of 4 gathers and reduces a quarter of each bucket, over its 8-rank shard group
    gathers = [e for e in fwd if e["op"] == "all_gather"]
    assert [(e["bytes"], e["ranks"], e["lane"]) for e in gathers] == [(2e6, 8, "link")] * 3
    assert {e["bytes"] for e in bwd if e["op"] == "reduce_scatter"} == {4e6}
    # and a quarter of its FLOPs, in as many pieces as it has tensor-parallel collectives
    for events, pieces, flops in ((fwd, 2, 1e9), (bwd, 4, 2e9)):
        tensor = [e for e in events if e.get("lane") == "tensor"]
        assert len(tensor) == pieces * 3
        assert all((e["op"], e["bytes"], e["ranks"]) == ("all_reduce", 1e6, 4) for e in tensor)
        for bucket in range(3):
            work = [e["flops"] for e in events if e["op"] == "compute" and e["bucket"] == bucket]
            assert work == [pytest.approx(flops / 4 / pieces)] * pieces
        # blocking: each launched right after the compute that makes its input, waited at once
        for ev in tensor:
            k = events.index(ev)
            assert events[k - 1]["op"] == "compute" and events[k + 1] == {
                "op": "wait",
                "name": f"wait_{ev['name']}",
                "of": ev["name"],
                "bucket": ev["bucket"],
            }
    # async TP: launched before the piece of compute it runs beside, waited after it
    fwd = cm.plan_schedule(_tp_buckets(3), schedule="fsdp2", shard=8, tensor=4, tp_overlap=True)["forward"]
    for ev in (e for e in fwd if e.get("lane") == "tensor"):
        k = fwd.index(ev)
        assert fwd[k + 1]["op"] == "compute" and fwd[k + 2]["of"] == ev["name"]
    # a bucket left whole on every rank of the group keeps its bytes and FLOPs
    whole = cm.tensor_buckets([dict(_buckets(1)[0], tensor_split=False)] + _buckets(1), 4)
    assert [(b["gather_bytes"], b["flops_forward"]) for b in whole] == [(8e6, 1e9), (2e6, 2.5e8)]


def test_tensor_parallel_collectives_cost_their_own_link_and_block_compute_unless_async():
    """One bucket, 2 ranks of tensor parallelism, hand-computed: its forward's 4e9 FLOPs per
    rank in 2 pieces of 1 s each, each followed by an all-reduce of 1 MB over 2 ranks on the
    tensor lane at 2 MB/s (2 x 1/2 x 1 MB: 0.5 s); the gathers, on the shard link, are free."""
    bucket = {"gather_bytes": 0.0, "reduce_bytes": 0.0, "flops_forward": 8e9, "flops_backward": 0.0}
    bucket["tp_forward"] = [("all_reduce", 1e6)] * 2
    rates = {"flops": 2e9, "mem": 1e18, "link": 1e9, "tensor_link": 2e6}
    blocking = cm.predict_step([dict(bucket, regather=False)], rates, shard=4, tensor=2)
    assert blocking["forward"]["total_s"] == pytest.approx(2 * (1.0 + 0.5))
    assert blocking["exposed_comm_s"] == pytest.approx(1.0) and blocking["tensor_comm_s"] == pytest.approx(1.0)
    assert blocking["compute_s"] == pytest.approx(2.0)
    overlapped = cm.predict_step([dict(bucket, regather=False)], rates, shard=4, tensor=2, tp_overlap=True)
    assert overlapped["forward"]["total_s"] == pytest.approx(2.0) and overlapped["exposed_comm_s"] == 0.0
    # without its own rate the tensor lane runs at the shard link's: 1 GB/s, 1 ms each
    shared = cm.predict_step([dict(bucket, regather=False)], dict(rates, tensor_link=None), shard=4, tensor=2)
    assert shared["tensor_comm_s"] == pytest.approx(2 * 1e-3)
