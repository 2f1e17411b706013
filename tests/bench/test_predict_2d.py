"""The 2-D prediction script (issue 59): Llama3-70B shapes at FSDP x TP through the cost
model. A 2-layer model with short sequences, so each test takes a second or two: the label
says PREDICTED, tokens/s is a TP group's tokens over the step over the TP degree, each rank
computes 1/TP of every split bucket, TP 1 is the 1-D prediction, the tensor-parallel
collectives carry the activation's bytes, and the calibrated row lands on the published number."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import predict_2d  # noqa: E402

SMALL = {"layers": 2, "batch": 1, "seq": 1024, "shard": 4, "tensor": 8, "ac": "full", "hardware": None, "profile": None}


def _predict(**over) -> dict:
    result = predict_2d.predict(argparse.Namespace(**{**SMALL, **over}))
    return {r["variant"]: r for r in result["rows"]} | {"_": result}


def test_the_script_prints_a_labelled_prediction_beside_the_published_numbers(tmp_path, capsys):
    out = tmp_path / "2d.json"
    assert predict_2d.main(["--layers", "2", "--seq", "1024", "--batch", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("PREDICTED (cost model, not measured)")
    assert "FSDP 32 x TP 8 = 256 GPUs" in text and "829 TPS/GPU" in text and "597.3 TPS/GPU" in text
    result = json.loads(out.read_text())
    for r in result["rows"]:
        assert r["tps_per_gpu"] == pytest.approx(1024 / 8 / r["step_s"])
        assert r["exposed_comm_s"] >= r["tp_comm_s"] * (0 if r["async_tp"] else 1) - 1e-9
    # calibrated on torchtitan's vanilla-TP FSDP2 + compile number, that row lands on it
    for precision, target in (("bf16", 597.3), ("float8", 829)):
        fitted = {r["variant"]: r for r in result["at_published_compute"][precision]["rows"]}
        assert fitted[predict_2d.CALIBRATED_ON]["tps_per_gpu"] == pytest.approx(target, rel=2e-3)
        assert fitted[predict_2d.ASYNC_ROW]["tps_per_gpu"] > target  # async TP hides the TP collectives


def test_each_rank_computes_a_tensor_degree_share_of_every_split_bucket():
    one, eight = _predict(tensor=1), _predict(tensor=8)
    for variant in ("plugin defaults, every layer split", "FSDP2 + compile, torchtitan plan (SP)"):
        work = [r[variant]["compute_s"] - r[variant]["optimizer_s"] for r in (one, eight)]
        assert work[0] == pytest.approx(8 * work[1])
    # tp_plan auto leaves the embedding and the head whole: more than an eighth per rank
    whole = "plugin defaults, tp_plan auto (ends whole)"
    assert eight[whole]["compute_s"] > eight["plugin defaults, every layer split"]["compute_s"]
    assert one[whole]["compute_s"] == pytest.approx(one["plugin defaults, every layer split"]["compute_s"])


def test_tensor_one_is_the_1d_prediction():
    from _harness.models import build_llama, llama3_70b_config

    from fsdp_overlap_plugin.cli.predict import bucket_costs
    from fsdp_overlap_plugin.config.plan import resolve_plan
    from fsdp_overlap_plugin.config.schema import OverlapConfig
    from fsdp_overlap_plugin.report import costmodel

    rows = _predict(tensor=1)
    model = build_llama(llama3_70b_config(2, 1024), device="meta")
    config = OverlapConfig(param_dtype="bf16", reduce_dtype="fp32", activation_checkpointing=["model.layers.*"])
    buckets = bucket_costs(model, config, resolve_plan(model, config), batch=1, seq=1024)
    rates = rows["_"]["rates"]["used"]
    for label, schedule, *_ in predict_2d.VARIANTS:
        row = rows[label]
        one_d = costmodel.predict_step(
            buckets, rates, schedule=schedule, shard=4, extra_compute_s=row["optimizer_s"], tp_overlap=row["async_tp"]
        )
        assert row["step_s"] == one_d["step_s"] and row["tp_comm_s"] == 0.0


def test_the_tensor_parallel_collectives_of_a_layer_carry_its_activation():
    a = 16 * 8192 * 8192 * 2  # torchtitan's local batch x sequence x hidden, bf16
    fwd, bwd = predict_2d.tp_collectives("model.layers.3", a, sequence_parallel=False, recompute=True)
    assert fwd == [("all_reduce", a)] * 2 and bwd == [("all_reduce", a)] * 4
    fwd, bwd = predict_2d.tp_collectives("model.layers.3", a, sequence_parallel=True, recompute=False)
    assert fwd == bwd == [("all_gather", a), ("reduce_scatter", a)] * 2
    assert predict_2d.tp_collectives("model.embed_tokens", a, sequence_parallel=False, recompute=False) == (
        [("all_reduce", a)],
        [],
    )
    assert predict_2d.tp_collectives("model.norm, lm_head", a, sequence_parallel=True, recompute=False) == (
        [("all_gather", a)],
        [("reduce_scatter", a)],
    )
    assert predict_2d.tp_collectives("model.norm", a, sequence_parallel=True, recompute=True) == ([], [])


def test_the_tensor_lane_time_is_the_ring_cost_of_those_bytes_at_nvlink():
    """2 layers, full recompute, no sequence parallelism: 2 + 4 all-reduces a layer, the
    embedding's and the head's one each; each 2 x 7/8 of the activation at the preset's NVLink
    rate plus its latency. Sequence parallelism moves the same bytes in twice the collectives."""
    rows = _predict()
    rates = rows["_"]["rates"]["used"]
    a = 1 * 1024 * 8192 * 2
    per_all_reduce = rates["latency"] + 2 * 7 / 8 * a / rates["tensor_link"]
    assert rows["plugin defaults, every layer split"]["tp_comm_s"] == pytest.approx((2 * 6 + 2) * per_all_reduce)
    assert rows["plugin defaults, tp_plan auto (ends whole)"]["tp_comm_s"] == pytest.approx(2 * 6 * per_all_reduce)
    sp = rows["FSDP2 + compile, torchtitan plan (SP)"]["tp_comm_s"]
    assert sp == pytest.approx((2 * 6 + 2) * per_all_reduce + (2 * 6 + 2) * rates["latency"])
    # the checkpointed layer inputs split 8 ways by sequence parallelism
    floor = {r["sequence_parallel"]: r["memory_floor_gib"] for k, r in rows.items() if k != "_" and r["ends_split"]}
    assert (floor[False] - floor[True]) * 2**30 == pytest.approx(2 * a * (1 - 1 / 8))
