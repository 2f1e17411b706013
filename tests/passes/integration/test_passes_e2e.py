"""Two gloo ranks: the passes change when things run, never what is computed."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from _dist import run_ranks
from _train import full_params, make_model, train_sharded

import fsdp_overlap_plugin as fo

pytestmark = pytest.mark.slow

ISSUE_PLAN = [["tok_emb", "pos_emb"], "blocks.0", "blocks.1", "blocks.2", "blocks.3", ["norm", "head"]]
VARIANTS = {
    "off": {"manual_bucketing": False, "overlap_grad_reduce": False, "reduce_scatter_impl": "native"},
    "bucketing": {"manual_bucketing": True, "overlap_grad_reduce": False},
    "grad_overlap": {"manual_bucketing": False, "overlap_grad_reduce": True},
    "both": {},  # the defaults: on 2 gloo ranks reduce_scatter_impl auto runs receive_first
    "both+native": {"reduce_scatter_impl": "native"},
    "both+gather_group": {"separate_gather_group": True},
    # the same all-to-alls on gloo's own group (which sends before it receives)
    "both+all_to_all": {"reduce_scatter_impl": "all_to_all"},
    "prefetch_2": {"prefetch_depth": 2},
    # a budget of two blocks (195.25 KiB each): depth 2 only where the window fits
    "prefetch_2+budget": {"prefetch_depth": 2, "max_prefetch_bytes": 2 * 199_936},
}


def _train(rank: int, world: int, **config) -> dict:
    torch._dynamo.reset()
    model = make_model()
    fo.parallelize(model, bucket_plans=ISSUE_PLAN, **config)
    losses = train_sharded(model, rank, world)
    return {"losses": losses, "params": full_params(model), "report": fo.schedule_report(model)}


def _variants(rank: int, world: int, backend: str, names: list[str]) -> dict:
    return {name: _train(rank, world, backend=backend, **VARIANTS[name]) for name in names}


@pytest.mark.newest_torch  # CI runs it on 2.15, the newest torch of .ci/run
def test_aot_eager_losses_bitwise_equal_with_and_without_passes():
    results = run_ranks(_variants, "aot_eager", list(VARIANTS))[0]
    reference = results["off"]
    for name, result in results.items():
        assert result["losses"] == reference["losses"], name  # exact float equality
        for key, value in reference["params"].items():
            assert torch.equal(result["params"][key], value), (name, key)
    both = results["both"]["report"]
    assert both["forward"]["after"]["all_gather"] == 6 and both["backward"]["after"]["reduce_scatter"] == 6
    assert results["off"]["report"]["forward"] is None  # no pass ran, nothing recorded
    gathered = results["both+gather_group"]["report"]["forward"]["passes"]["gather_group"]["moved"]
    assert gathered == 53  # every parameter all-gather moved to the second communicator
    # auto chose receive-first all-to-alls on 2 gloo ranks, and said why; native kept
    # gloo's reduce-scatter; all_to_all ran them on gloo's own group
    _assert_receive_first(both, len(reference["losses"]))
    assert both["backward"]["after"]["all_to_all"] == 0
    plain = results["both+all_to_all"]["report"]
    assert plain["reduce_scatter"]["impl"] == "all_to_all" and plain["reduce_scatter"]["groups"] == []
    assert plain["backward"]["after"]["reduce_scatter_as_all_to_all"] == 6
    native = results["both+native"]["report"]
    assert native["reduce_scatter"]["impl"] == "native" and "all_to_all" not in native["backward"]["passes"]
    assert "reduce_scatter_as_all_to_all" not in native["backward"]["after"]
    # prefetch depth: forward buckets in plan order, backward in reverse (its first bucket
    # is the one the forward kept gathered; the embeddings need no weights in backward)
    assert both["prefetch"]["forward"]["depths"] == [1, 1, 1, 1, 1, 1]
    deep = results["prefetch_2"]["report"]["prefetch"]
    assert deep["forward"]["depths"] == [1, 2, 2, 2, 2, 2] and deep["backward"]["depths"] == [1, 1, 2]
    # the forward keeps its last 2 buckets gathered: blocks 2, 1, 0 are re-gathered
    assert len(results["prefetch_2"]["report"]["reshard"]["kept_buckets"]) == 2
    assert deep["forward"]["peak_bytes"] > both["prefetch"]["forward"]["peak_bytes"]
    budget = results["prefetch_2+budget"]["report"]["prefetch"]
    assert budget["forward"]["peak_bytes"] <= 2 * 199_936 < deep["forward"]["peak_bytes"]
    assert budget["backward"]["peak_bytes"] <= 2 * 199_936
    assert budget["forward"]["depths"] == [1, 2, 1, 1, 1, 1]
    # head + blocks.3 kept (265,984 bytes); the first re-gather does not fit beside them
    assert budget["backward"]["depths"] == [0, 1, 1]


def _assert_receive_first(report: dict, steps: int) -> None:
    rs = report["reduce_scatter"]
    assert rs["requested"] == "auto" and rs["impl"] == "receive_first"
    assert "bitwise equal on 2 ranks" in rs["reason"] and "receives before its sends" in rs["reason"]
    assert len(rs["groups"]) == 1 and rs["groups"][0].startswith("fsdp_overlap_receive_first:")
    assert report["backward"]["after"]["reduce_scatter_as_all_to_all"] == 6
    # every gradient all-to-all of every step ran on that group, none on gloo's own
    assert rs["exchanges"] == 6 * steps


@pytest.mark.newest_torch  # CI runs it on 2.15 (on 2.11 it took 204 s of CI; transformers' Trainer trains with inductor there)
def test_inductor_losses_equal_within_1e6():
    # prefetch_2+budget: under a budget the passes follow FSDP2's memory order (each prefetch
    # after the previous copy-out, each reduce-scatter waited before the next copy-in) and
    # inductor frees dead buffers at their last use; trained here with inductor's own code
    results = run_ranks(_variants, "inductor", ["off", "both", "prefetch_2+budget", "both+all_to_all"])[0]
    off = results["off"]
    _assert_receive_first(results["both"]["report"], len(off["losses"]))
    for name in ("both", "prefetch_2+budget", "both+all_to_all"):
        result = results[name]
        for a, b in zip(off["losses"], result["losses"]):
            assert abs(a - b) <= 1e-6 * max(1.0, abs(a)), (name, off["losses"], result["losses"])
        for key, value in off["params"].items():
            torch.testing.assert_close(result["params"][key], value, rtol=1e-6, atol=1e-6, msg=f"{name} {key}")
        report = result["report"]
        assert report["forward"]["after"]["all_gather"] == 6, name
        assert report["backward"]["after"]["reduce_scatter"] == 6, name
        assert report["backward"]["passes"]["pin_order"]["dependencies"] > 0, name
    # the same prefetch windows as with aot_eager: the budget is honoured under inductor
    budget = results["prefetch_2+budget"]["report"]["prefetch"]
    assert budget["order"] == "fsdp2" and results["both"]["report"]["prefetch"]["order"] == "queued"
    assert budget["forward"]["depths"] == [1, 2, 1, 1, 1, 1] and budget["backward"]["depths"] == [0, 1, 1]
    assert budget["forward"]["peak_bytes"] <= 2 * 199_936 and budget["backward"]["peak_bytes"] <= 2 * 199_936
