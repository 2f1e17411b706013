"""Two real gloo ranks: the sharded, compiled model trains exactly like one process.

Each test spawns one 2-rank job that runs several scenarios, to pay process start-up
and imports once. The single-process reference runs inside rank 0 on the same data.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from _dist import run_ranks
from _train import full_params, make_model, train_reference, train_sharded

import fsdp_overlap_plugin as fo

pytestmark = pytest.mark.slow


def _run(rank: int, world: int, model_kwargs: dict | None = None, **config) -> dict:
    torch._dynamo.reset()
    model = make_model(**(model_kwargs or {}))
    ref_losses, ref_params = train_reference(model) if rank == 0 else (None, None)
    fo.parallelize(model, **config)
    losses = train_sharded(model, rank, world)
    params = full_params(model)
    report = fo.schedule_report(model)
    return {"losses": losses, "params": params, "ref_losses": ref_losses, "ref_params": ref_params, "report": report}


def _close(result: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert len(result["losses"]) == len(result["ref_losses"]) == 5
    for got, want in zip(result["losses"], result["ref_losses"]):
        assert math.isclose(got, want, rel_tol=rtol, abs_tol=atol), (result["losses"], result["ref_losses"])
    for name, want in result["ref_params"].items():
        torch.testing.assert_close(result["params"][name], want, rtol=rtol, atol=atol, msg=name)


def _dcp_roundtrip(rank: int, world: int, path: str) -> dict:
    """compiled -> DCP -> eager fully_shard -> DCP -> compiled, values identical each way."""
    import torch.distributed.checkpoint as dcp

    torch._dynamo.reset()
    a = fo.parallelize(make_model(seed=0), backend="aot_eager")
    train_sharded(a, rank, world, steps=2)
    dcp.save(a.state_dict(), checkpoint_id=f"{path}/compiled")
    b = fo.parallelize(make_model(seed=1), compile=False)
    state = b.state_dict()
    dcp.load(state, checkpoint_id=f"{path}/compiled")
    b.load_state_dict(state)
    a_to_b = full_params(a), full_params(b)
    train_sharded(b, rank, world, steps=1)
    dcp.save(b.state_dict(), checkpoint_id=f"{path}/eager")
    torch._dynamo.reset()
    c = fo.parallelize(make_model(seed=2), backend="aot_eager")
    state = c.state_dict()
    dcp.load(state, checkpoint_id=f"{path}/eager")
    c.load_state_dict(state)
    b_to_c = full_params(b), full_params(c)
    c_losses = train_sharded(c, rank, world, steps=1)  # and it still trains after loading
    return {"a_to_b": a_to_b, "b_to_c": b_to_c, "c_losses": c_losses}


def _meta_init(rank: int, world: int) -> dict:
    """A meta-device model sharded, then materialized: each rank holds a different part of
    one initialisation, equal to the same initialisation done without sharding."""
    torch._dynamo.reset()
    torch.manual_seed(5)
    with torch.device("meta"):
        sharded = make_model(seed=5, tie_weights=True, vocab_size=255)
    fo.parallelize(sharded, backend="aot_eager")
    torch.manual_seed(5)
    fo.materialize(sharded, "cpu")
    with torch.device("meta"):
        plain = make_model(seed=5, tie_weights=True, vocab_size=255)
    torch.manual_seed(5)
    fo.materialize(plain, "cpu")  # no DTensors: the same init, unsharded
    local = sharded.state_dict()["blocks.0.mlp.fc.weight"].to_local().clone()
    return {"sharded": full_params(sharded), "plain": full_params(plain), "local": local}


def _profile(path: str) -> str:
    """A compute profile as ``fsdp-overlap profile`` writes it (each rank writes the same)."""
    import json

    file = f"{path}/profile-{dist.get_rank()}.json"
    with open(file, "w") as f:
        json.dump({"device": "test", "achieved_flops_per_s": 2.5e11, "step_s": 0.1}, f)
    return file


def _aot_eager_scenarios(rank: int, world: int, path: str) -> dict:
    return {
        "meta_init": [_meta_init(rank, world)],
        "dcp": _dcp_roundtrip(rank, world, path),
        "fp32": _run(rank, world, backend="aot_eager"),
        # with the cost model's settings too: they change the report's predictions, never training
        "no_reshard": _run(
            rank,
            world,
            backend="aot_eager",
            reshard_after_forward=False,
            hardware="h100-ib400,link=100GB/s",
            compute_profile=_profile(path),
        ),
        "eager_fully_shard": _run(rank, world, compile=False),
        "tied": _run(rank, world, {"tie_weights": True, "vocab_size": 255}, backend="aot_eager"),
        "bf16": _bf16(rank, world),
        "bf16 passes off": _bf16(rank, world, passes=False),
    }


def _bf16(rank: int, world: int, passes: bool = True) -> dict:
    torch._dynamo.reset()
    model = make_model()
    fo.parallelize(
        model,
        backend="aot_eager",
        param_dtype="bf16",
        reduce_dtype="fp32",
        manual_bucketing=passes,
        overlap_grad_reduce=passes,
    )
    losses = train_sharded(model, rank, world, steps=8, lr=0.5, same_batch=True)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    return {"losses": losses, "dtypes": dtypes}


@pytest.fixture(scope="module")
def aot_eager_results(tmp_path_factory) -> dict:
    return run_ranks(_aot_eager_scenarios, str(tmp_path_factory.mktemp("dcp")))[0]


def test_aot_eager_matches_single_process(aot_eager_results):
    _close(aot_eager_results["fp32"])
    report = aot_eager_results["fp32"]["report"]
    assert report["forward"]["before"]["all_gather"] == 53  # one per parameter
    assert report["backward"]["before"]["reduce_scatter"] == 53


def test_without_reshard_matches_and_backward_has_no_all_gathers(aot_eager_results):
    _close(aot_eager_results["no_reshard"])
    assert aot_eager_results["no_reshard"]["report"]["backward"]["before"]["all_gather"] == 0
    # its hardware and compute_profile settings reached the report's predictions
    cost = aot_eager_results["no_reshard"]["report"]["cost_model"]
    assert (cost["preset"], cost["own"], cost["measured"]) == ("h100-ib400", ["link"], ["flops"])
    assert (cost["rates"]["link"], cost["rates"]["inter_link"], cost["rates"]["flops"]) == (100e9, 45e9, 2.5e11)
    assert aot_eager_results["no_reshard"]["report"]["predicted"]["forward"]["after"]["comm_s"] > 0
    assert aot_eager_results["fp32"]["report"]["backward"]["before"]["all_gather"] > 0


def test_eager_fully_shard_fallback_matches(aot_eager_results):
    result = aot_eager_results["eager_fully_shard"]
    _close(result)
    assert result["report"]["mode"] == "eager fully_shard"


def test_tied_weights_stay_one_parameter(aot_eager_results):
    result = aot_eager_results["tied"]
    _close(result)
    assert "head.weight" in result["params"] and "tok_emb.weight" in result["params"]
    torch.testing.assert_close(result["params"]["head.weight"], result["params"]["tok_emb.weight"])


def test_bf16_params_fp32_reduce_trains(aot_eager_results):
    result = aot_eager_results["bf16"]
    losses = result["losses"]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5, losses
    # the merged collectives' copy-ins convert (fp32 shards -> bf16, bf16 gradients ->
    # fp32) where each member had a cast of its own with the passes off: the same values
    assert losses == aot_eager_results["bf16 passes off"]["losses"]
    assert set(result["dtypes"].values()) == {torch.float32}  # master weights stay fp32


def test_materialize_gives_each_rank_its_part_of_one_init(aot_eager_results):
    result = aot_eager_results["meta_init"][0]
    for name, value in result["plain"].items():
        assert torch.equal(result["sharded"][name], value), name
    fc = result["plain"]["blocks.0.mlp.fc.weight"]
    rows = fc.shape[0] // 2
    assert torch.equal(result["local"], fc[:rows])  # rank 0's shard ...
    assert not torch.equal(fc[:rows], fc[rows:])  # ... and not a tiled copy of rank 1's
    assert torch.equal(result["sharded"]["head.weight"], result["sharded"]["tok_emb.weight"])


def test_dcp_checkpoint_interoperates_with_eager_fully_shard(aot_eager_results):
    result = aot_eager_results["dcp"]
    for pair in ("a_to_b", "b_to_c"):
        src, dst = result[pair]
        assert src.keys() == dst.keys()
        for name in src:
            assert torch.equal(src[name], dst[name]), (pair, name)
    assert math.isfinite(result["c_losses"][0])


def _inductor_scenarios(rank: int, world: int) -> dict:
    return {"fp32": _run(rank, world, backend="inductor")}


@pytest.mark.newest_torch  # CI runs it on 2.15, the newest torch of .ci/run
def test_inductor_matches_single_process():
    result = run_ranks(_inductor_scenarios)[0]["fp32"]
    _close(result)
    assert result["report"]["forward"]["before"]["all_gather"] == 53
