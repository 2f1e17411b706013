"""What the compile-visible sharding puts into the graphs (fake process group, one process)."""

from __future__ import annotations

import json

import pytest
import torch
from _dist import run_ranks
from _fake import GraphCapture, fake_world
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn
from fsdp_overlap_plugin.passes.graph import is_all_gather, is_reduce_scatter, is_wait, module_path, wait_of

pytestmark = pytest.mark.torch_sensitive  # CI runs its quick tests on both ends of its torch matrix (2.11, 2.15)

N_PARAMS = 53  # gpt_small: 2 embeddings + 4 blocks x 12 + norm 2 + head 1


def _step(model, world: int = 2) -> None:
    x, y = fixed_batches(1, 2, 16, 256)[0]
    loss_fn(model(x), y).backward()


def _compile_and_step(monkeypatch, world: int = 2, **config) -> GraphCapture:
    capture = GraphCapture(monkeypatch)
    torch.manual_seed(0)
    model = gpt_small()
    fo.parallelize(model, backend="aot_eager", **config)
    _step(model)
    capture.model = model
    return capture


def _nodes(gm, pred):
    return [n for n in gm.graph.nodes if pred(n)]


@pytest.fixture
def world2():
    with fake_world(2):
        yield


def test_forward_has_one_all_gather_per_parameter_and_backward_the_reduce_scatters(world2, monkeypatch):
    capture = _compile_and_step(monkeypatch)
    fwd, bwd = capture.get("forward"), capture.get("backward")
    gathers = _nodes(fwd, is_all_gather)
    assert len(gathers) == N_PARAMS
    assert all(wait_of(ag) is not None for ag in gathers)
    assert len(_nodes(bwd, is_reduce_scatter)) == N_PARAMS
    # reshard-after-forward: the backward re-gathers (all but the last bucket's weights)
    back_gathers = _nodes(bwd, is_all_gather)
    assert back_gathers
    paths = {module_path(n) for n in back_gathers}
    assert not any(p.startswith(("norm", "head")) for p in paths), paths
    assert any(p.startswith("blocks.0") for p in paths)


def test_no_all_gathers_in_backward_without_reshard(world2, monkeypatch):
    capture = _compile_and_step(monkeypatch, reshard_after_forward=False)
    assert _nodes(capture.get("backward"), is_all_gather) == []
    assert fo.schedule_report(capture.model)["reshard"]["resharded"] == 0


def test_reshard_last_bucket_regathers_head_in_backward(world2, monkeypatch):
    capture = _compile_and_step(monkeypatch, reshard_last_bucket=True)
    paths = {module_path(n) for n in _nodes(capture.get("backward"), is_all_gather)}
    assert "head" in paths
    assert fo.schedule_report(capture.model)["reshard"]["kept_gathered"] == 0


def test_bf16_param_dtype_gathers_and_computes_in_bf16(world2, monkeypatch):
    capture = _compile_and_step(monkeypatch, param_dtype="bf16", reduce_dtype="fp32")
    fwd, bwd = capture.get("forward"), capture.get("backward")
    for ag in _nodes(fwd, is_all_gather):
        assert ag.meta["val"].dtype == torch.bfloat16, ag
    mms = _nodes(fwd, lambda n: n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default))
    assert mms
    for mm in mms:
        weight = mm.args[-1]
        assert weight.meta["val"].dtype == torch.bfloat16, mm
    for rs in _nodes(bwd, is_reduce_scatter):
        assert rs.meta["val"].dtype == torch.float32, rs  # gradients reduced in fp32


def test_state_dict_holds_shard0_dtensors(world2):
    torch.manual_seed(0)
    model = gpt_small(vocab_size=255)  # odd sizes are padded the FSDP2 way
    fo.parallelize(model, backend="aot_eager")
    sd = model.state_dict()
    assert set(sd) == set(gpt_small().state_dict())
    for name, value in sd.items():
        assert isinstance(value, DTensor), name
        assert value.placements == (Shard(0),), name
    assert sd["tok_emb.weight"].to_local().shape[0] == 128  # ceil(255 / 2)


def test_hsdp_mesh_is_2d_and_backward_all_reduces(monkeypatch):
    with fake_world(4):
        capture = _compile_and_step(monkeypatch, mesh={"replicate": 2, "shard": 2})
        value = capture.model.state_dict()["blocks.0.mlp.fc.weight"]
        assert value.placements == (Replicate(), Shard(0))
        report = fo.schedule_report(capture.model)
        assert report["mesh"] == [2, 2]
        assert report["backward"]["before"]["all_reduce"] == N_PARAMS
        assert report["backward"]["before"]["reduce_scatter"] == N_PARAMS
        # one replica all-reduce per bucket, each waited after the next one launched
        buckets = len(report["plan"])
        assert report["backward"]["after"]["all_reduce"] == buckets
        assert report["backward"]["passes"]["manual_bucketing"]["deferred_ar_waits"] == buckets - 1
        events = report["backward"]["schedule"]["after"]
        at = {e["name"]: i for i, e in enumerate(events)}
        waits = {e["of"]: i for i, e in enumerate(events) if e["op"] == "wait"}
        reduces = [e for e in events if e["op"] == "all_reduce"]
        for ar, nxt in zip(reduces, reduces[1:]):
            assert at[ar["name"]] < at[nxt["name"]] < waits[ar["name"]], (ar, nxt)


def test_schedule_report_is_json_and_formats(world2, monkeypatch):
    capture = _compile_and_step(monkeypatch)
    report = fo.schedule_report(capture.model)
    json.dumps(report)
    assert report["forward"]["before"]["all_gather"] == N_PARAMS
    assert report["backward"]["before"]["wait"] == len(_nodes(capture.get("backward"), is_wait))
    text = fo.format_report(report)
    assert "forward" in text and "backward" in text and "plan: 6 buckets" in text


def _meta_model_materialized(rank: int, world: int) -> dict:
    """On each of two gloo ranks: a meta-device GPT sharded, materialized and stepped,
    next to the same GPT built normally (same seed) and run unsharded."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = gpt_small()
    fo.parallelize(model, backend="aot_eager")
    fo.materialize(model, "cpu")  # full_init: a CPU mesh
    torch.manual_seed(0)
    plain = gpt_small()
    shards = {}
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and isinstance(p, DTensor) and p.placements == (Shard(0),), name
        shards[name] = (p.to_local().detach().clone(), dict(plain.named_parameters())[name].detach().clone())
    x, y = fixed_batches(1, 2, 16, 256)[0]
    losses = []
    for net in (model, plain):  # the loss, one SGD step, the loss again: it trains
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
        for _ in range(2):
            loss = loss_fn(net(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return {"shards": shards, "losses": losses[:2], "plain_losses": losses[2:]}


@pytest.mark.slow
def test_meta_device_model_materializes_after_sharding():
    results = run_ranks(_meta_model_materialized)
    world = len(results)
    for rank, result in enumerate(results):
        assert len(result["shards"]) == N_PARAMS
        for name, (local, full) in result["shards"].items():
            # FSDP2's Shard(0): rank r holds rows [r * ceil(n / world), ...) of the full parameter
            rows = -(-full.shape[0] // world)
            assert torch.equal(local, full[rank * rows : (rank + 1) * rows]), (rank, name)
        ln = result["shards"]["blocks.0.ln1.weight"][0]
        assert torch.equal(ln, torch.ones_like(ln))  # reset_parameters ran on the shards
        assert result["losses"][1] < result["losses"][0]
        for got, want in zip(result["losses"], result["plain_losses"]):
            assert abs(got - want) <= 1e-6, (rank, result["losses"], result["plain_losses"])
    # the ranks hold different parts of one init, not the same values twice
    assert not torch.equal(
        results[0]["shards"]["blocks.0.mlp.fc.weight"][0], results[1]["shards"]["blocks.0.mlp.fc.weight"][0]
    )


def test_parallelize_twice_is_an_error(world2):
    model = gpt_small()
    fo.parallelize(model, backend="aot_eager")
    with pytest.raises(RuntimeError, match="already sharded"):
        fo.parallelize(model, backend="aot_eager")
