"""Real HSDP: a 2 x 2 (replicate x shard) mesh on four gloo ranks.

One 4-rank job (CI has two cores: every 4-rank start costs) runs every scenario:

* aot_eager and inductor at 2 x 2 train like one process on the union of the ranks'
  batches, on a model whose shards are uneven (vocabulary 97: 49 + 48 rows); with the
  passes off, aot_eager gives bitwise the same losses and parameters, inductor the same
  within 1e-6;
* the backward waits each replica all-reduce only after the next bucket's all-reduce has
  launched, with backward compute between (the cross-node link busy behind compute);
* gradient accumulation (``model.no_sync()`` on the first of 2 micro-batches) trains like
  the large batch, and the accumulating micro-batch's backward has no all-reduce;
* the backward graph after the passes reduces each plan entry's gradients the FSDP2 way:
  one reduce-scatter over the shard group, then one all-reduce of its result (the
  shard, not the full gradient) across the replicas;
* a DCP checkpoint written at 2 x 2 (model and SGD momentum) loads at 1 x 4 and 4 x 1
  with bitwise-equal parameters, and the next step matches continuing at 2 x 2.

The single-process reference runs inside rank 0 on the same data.

Before: the backward all-reduced each parameter's full gradient across replicas and
then reduce-scattered it (DTensor's plan for ``(Partial, Partial) -> (Replicate,
Shard(0))`` goes mesh dim 0 first), and the bucketing left one all-reduce per parameter.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from _dist import run_ranks
from _train import LR, SEQ, STEPS, batches, full_params, local_slice, make_model, train_reference, train_sharded

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.models import fixed_batches, loss_fn
from fsdp_overlap_plugin.shard import checkpoint

pytestmark = pytest.mark.slow

WORLD = 4
HSDP = {"replicate": 2, "shard": 2}
LAYOUTS = {"1x4": {"replicate": 1, "shard": 4}, "4x1": {"replicate": 4, "shard": 1}}
MODEL = {"n_layer": 2, "d_model": 32, "n_head": 4, "vocab_size": 97, "block_size": 32}
N_PARAMS = 29  # 2 embeddings + 2 blocks x 12 + norm 2 + head 1
MOMENTUM = 0.9  # the checkpoint carries optimizer state that must reshard too
# inductor compiles inside each rank: a pool of compile workers per rank (four ranks on
# two cores) costs more than it saves
ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}


def _local_rows(model: torch.nn.Module) -> dict:
    """This rank's shard of the uneven embedding: rows and placements."""
    value = model.state_dict()["tok_emb.weight"]
    return {"rows": value.to_local().shape[0], "placements": [str(p) for p in value.placements]}


def _step(model, optimizer, batch, rank: int, world: int) -> float:
    """One SGD step on this rank's part of ``batch``; the global mean loss."""
    x, y = batch
    loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    value = loss.detach().float().clone()
    dist.all_reduce(value)
    return value.item() / world


PASSES_OFF = {"manual_bucketing": False, "overlap_grad_reduce": False}


def _train_2x2(rank: int, world: int, backend: str, **overrides) -> tuple[torch.nn.Module, dict]:
    torch._dynamo.reset()
    model = make_model(**MODEL)
    reference = train_reference(model) if rank == 0 and backend == "aot_eager" and not overrides else (None, None)
    fo.parallelize(model, backend=backend, mesh=HSDP, **overrides)
    result = {
        "losses": train_sharded(model, rank, world),
        "params": full_params(model),
        "report": fo.schedule_report(model),
        "ref_losses": reference[0],
        "ref_params": reference[1],
    }
    return model, result


def _checkpoint(rank: int, world: int, model: torch.nn.Module, path: str) -> dict:
    """Save at 2 x 2 after one momentum step, continue there one step, and take the same
    step after loading the checkpoint at each other layout."""
    data = batches(STEPS + 2, MODEL["vocab_size"])
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    _step(model, optimizer, data[STEPS], rank, world)  # momentum buffers now exist
    checkpoint.save(path, model, optimizer, step=STEPS + 1)
    saved = full_params(model)
    out = {"saved": saved, "layout": {"2x2": _local_rows(model)}, "loss": {}, "after": {}, "loaded": {}, "step": {}}
    out["loss"]["2x2"] = _step(model, optimizer, data[STEPS + 1], rank, world)
    out["after"]["2x2"] = full_params(model)
    for name, mesh in LAYOUTS.items():
        torch._dynamo.reset()
        other = fo.parallelize(make_model(seed=1, **MODEL), backend="aot_eager", mesh=mesh)
        other_optimizer = torch.optim.SGD(other.parameters(), lr=LR, momentum=MOMENTUM)
        out["step"][name] = checkpoint.load_latest(path, other, other_optimizer)
        out["loaded"][name] = full_params(other)
        out["layout"][name] = _local_rows(other)
        out["loss"][name] = _step(other, other_optimizer, data[STEPS + 1], rank, world)
        out["after"][name] = full_params(other)
    return out


def _accumulate(rank: int, world: int) -> dict:
    """Each step's batch in 2 micro-batches, the first under ``model.no_sync()``: the
    replica all-reduce runs once per step (behind the second micro-batch), and the step
    equals one on the whole batch. The reference: one process, whole batches."""
    torch._dynamo.reset()
    data = fixed_batches(STEPS, 2 * world, SEQ, MODEL["vocab_size"])  # 2 rows per rank: 1 per micro-batch
    model = make_model(**MODEL)
    reference = train_reference(model, data=data) if rank == 0 else (None, None)
    fo.parallelize(model, backend="aot_eager", mesh=HSDP)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, graphs = [], []
    for x, y in data:
        mine_x, mine_y = local_slice(x, rank, world), local_slice(y, rank, world)
        half = mine_x.shape[0] // 2
        total = torch.zeros(())
        for k, sync in enumerate((model.no_sync(), contextlib.nullcontext())):
            with sync:
                part = slice(k * half, (k + 1) * half)
                loss = loss_fn(model(mine_x[part]), mine_y[part]) / 2
                loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    for entry in fo.schedule_report(model)["graphs"]:
        if entry["graph"] == "backward":
            graphs.append((entry["after"]["reduce_scatter"], entry["after"]["all_reduce"]))
    return {
        "losses": losses,
        "params": full_params(model),
        "ref_losses": reference[0],
        "ref_params": reference[1],
        "backward_graphs": graphs,
    }


def _scenarios(rank: int, world: int, path: str) -> dict:
    model, aot_eager = _train_2x2(rank, world, "aot_eager")
    dcp = _checkpoint(rank, world, model, path)
    _, aot_eager_off = _train_2x2(rank, world, "aot_eager", **PASSES_OFF)
    accumulate = _accumulate(rank, world)
    _, inductor = _train_2x2(rank, world, "inductor")
    _, inductor_off = _train_2x2(rank, world, "inductor", **PASSES_OFF)
    inductor["ref_losses"], inductor["ref_params"] = aot_eager["ref_losses"], aot_eager["ref_params"]
    # every rank's shard layout and backward graph (uneven shards: ranks 1 and 3 hold
    # smaller ones); losses and full parameters are the same on every rank
    out = {
        "layout": dcp["layout"],
        "backward": {"aot_eager": aot_eager["report"]["backward"], "inductor": inductor["report"]["backward"]},
        "reduce_scatter": {
            "aot_eager": aot_eager["report"]["reduce_scatter"],
            "inductor": inductor["report"]["reduce_scatter"],
        },
    }
    if rank == 0:
        out.update(
            aot_eager=aot_eager,
            inductor=inductor,
            dcp=dcp,
            aot_eager_off=aot_eager_off,
            inductor_off=inductor_off,
            accumulate=accumulate,
        )
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_scenarios, str(tmp_path_factory.mktemp("hsdp_dcp")), world=WORLD, timeout=840, env=ENV)


def _max_diff(result: dict) -> tuple[float, float]:
    losses = max(abs(a - b) for a, b in zip(result["losses"], result["ref_losses"]))
    params = max((result["params"][k] - v).abs().max().item() for k, v in result["ref_params"].items())
    return losses, params


def _matches_reference(result: dict, tol: float) -> None:
    assert len(result["losses"]) == len(result["ref_losses"]) == STEPS
    assert result["params"].keys() == result["ref_params"].keys()
    for got, want in zip(result["losses"], result["ref_losses"]):
        assert math.isclose(got, want, rel_tol=0, abs_tol=tol), (result["losses"], result["ref_losses"])
    for name, want in result["ref_params"].items():
        torch.testing.assert_close(result["params"][name], want, rtol=0, atol=tol, msg=name)
    assert result["losses"][-1] != result["losses"][0]  # it trained
    assert result["report"]["mesh"] == [2, 2]
    assert result["report"]["mode"] == "compiled"


def test_shards_are_uneven_on_every_layout(results):
    rows = {name: [r["layout"][name]["rows"] for r in results] for name in ("2x2", *LAYOUTS)}
    assert rows["2x2"] == [49, 48, 49, 48]  # ranks 0, 1 | 2, 3 are the shard groups
    assert rows["1x4"] == [25, 25, 25, 22]
    assert rows["4x1"] == [97, 97, 97, 97]
    placements = results[0]["layout"]
    assert placements["2x2"]["placements"] == placements["4x1"]["placements"] == ["R", "S(0)"]
    assert placements["1x4"]["placements"] == ["S(0)"]


@pytest.mark.parametrize(("backend", "tol"), [("aot_eager", 1e-6), ("inductor", 1e-6)])
def test_hsdp_2x2_matches_single_process(results, backend, tol):
    result = results[0][backend]
    _matches_reference(result, tol)
    print(f"{backend}: max |loss - ref| = {_max_diff(result)[0]:.3g}, max |param - ref| = {_max_diff(result)[1]:.3g}")


@pytest.mark.parametrize(("backend", "tol"), [("aot_eager", 0.0), ("inductor", 1e-6)])
def test_passes_change_no_number(results, backend, tol):
    """Passes on and off at 2 x 2: aot_eager bitwise, inductor within 1e-6."""
    on, off = results[0][backend], results[0][f"{backend}_off"]
    assert off["report"]["passes"] == {"manual_bucketing": False, "overlap_grad_reduce": False}
    assert off["report"]["backward"]["after"]["all_reduce"] == N_PARAMS  # unbucketed: one per parameter
    for got, want in zip(on["losses"], off["losses"], strict=True):
        assert abs(got - want) <= tol, (on["losses"], off["losses"])
    for name, want in off["params"].items():
        torch.testing.assert_close(on["params"][name], want, rtol=0, atol=tol, msg=name)


def test_accumulation_all_reduces_once_per_step_and_trains_like_the_large_batch(results):
    acc = results[0]["accumulate"]
    _matches_reference({**acc, "report": {"mesh": [2, 2], "mode": "compiled"}}, 1e-6)
    # two backward graphs: the accumulating micro-batch's reduce-scatters without any
    # all-reduce, the last one's reduce-scatters then all-reduces each bucket
    assert sorted(acc["backward_graphs"]) == [(4, 0), (4, 4)], acc["backward_graphs"]
    print(f"accumulation: max |loss - ref| = {_max_diff(acc)[0]:.3g}, max |param - ref| = {_max_diff(acc)[1]:.3g}")


def _entries_with_params(plan: list[list[str]], params: list[str]) -> int:
    def owns(entry: list[str], name: str) -> bool:
        return any(name == m or name.startswith(m + ".") for m in entry)

    return sum(1 for entry in plan if any(owns(entry, name) for name in params))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_backward_reduce_scatters_then_all_reduces_each_bucket(results, backend):
    """On every rank, per plan entry: one reduce-scatter over the shard group, then one
    all-reduce of its result (the bucket's shard, not the full gradient) across replicas."""
    report = results[0][backend]["report"]
    entries = _entries_with_params(report["plan"], list(results[0][backend]["params"]))
    assert entries == len(report["plan"]) == 4
    for rank, result in enumerate(results):
        backward = result["backward"][backend]
        assert backward["before"]["reduce_scatter"] == backward["before"]["all_reduce"] == N_PARAMS, rank
        assert backward["after"]["reduce_scatter"] == entries, (rank, backward["after"])
        assert backward["after"]["all_reduce"] == entries, (rank, backward["after"])

        events = backward["schedule"]["after"]
        at = {e["name"]: i for i, e in enumerate(events)}
        waits = {e["of"]: i for i, e in enumerate(events) if e["op"] == "wait"}
        # 2 ranks per shard group on gloo: reduce_scatter_impl auto runs them as all-to-alls,
        # receive-first, on a group over this rank's own shard group
        assert backward["after"]["reduce_scatter_as_all_to_all"] == entries, (rank, backward["after"])
        chosen = result["reduce_scatter"][backend]
        assert chosen["impl"] == "receive_first" and chosen["exchanges"] == entries * STEPS, (rank, chosen)
        scatters = {e["bucket"]: e for e in events if e["op"] in ("reduce_scatter", "all_to_all")}
        reduces = {e["bucket"]: e for e in events if e["op"] == "all_reduce"}
        assert sorted(scatters) == sorted(reduces) == list(range(entries)), (rank, events)
        launched = sorted(reduces.values(), key=lambda e: at[e["name"]])
        for bucket, rs in scatters.items():
            ar = reduces[bucket]
            # launch, wait, then the replica all-reduce of the waited result, and its wait
            assert at[rs["name"]] < waits[rs["name"]] < at[ar["name"]] < waits[ar["name"]], (rank, bucket, events)
            # bytes: the reduce-scatter's input (padded to 2 equal chunks), the all-reduce's
            # input: this rank's shards; rank 0 holds the larger of uneven shards
            if rank == 0:
                assert ar["bytes"] * HSDP["shard"] == rs["bytes"], (bucket, rs, ar)
            else:
                assert 0 < ar["bytes"] * HSDP["shard"] <= rs["bytes"], (rank, bucket, rs, ar)
        # each all-reduce is waited only after the next bucket's all-reduce has launched:
        # it runs behind that bucket's backward, not waited at once
        for ar, nxt in zip(launched, launched[1:]):
            assert waits[ar["name"]] > at[nxt["name"]], (rank, ar, nxt, events)
            assert any(e["op"] == "compute" for e in events[at[ar["name"]] : waits[ar["name"]]]), (rank, ar)


def test_each_shard_group_has_its_own_receive_first_group(results):
    """Ranks 0-1 and 2-3 shard over different groups, so their receive-first groups differ
    by name; the rank agreement still lines them up (a name in its key once made ranks 0-1
    and 2-3 wait for each other until rank_check_timeout)."""
    names = [tuple(r["reduce_scatter"]["inductor"]["groups"]) for r in results]
    assert all(len(n) == 1 and n[0].startswith("fsdp_overlap_receive_first:") for n in names), names
    assert names[0] == names[1] and names[2] == names[3] and names[0] != names[2], names


def test_checkpoint_from_2x2_loads_at_1x4_and_4x1(results):
    dcp = results[0]["dcp"]
    saved = dcp["saved"]
    assert len(saved) == N_PARAMS
    for name in LAYOUTS:
        assert dcp["step"][name] == (STEPS + 1, {}), name
        loaded = dcp["loaded"][name]
        assert loaded.keys() == saved.keys(), name
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), (name, key)  # bitwise


def test_next_step_after_loading_matches_continuing_at_2x2(results):
    dcp = results[0]["dcp"]
    want_loss, want_params = dcp["loss"]["2x2"], dcp["after"]["2x2"]
    assert math.isfinite(want_loss)
    for name in LAYOUTS:
        after = max((dcp["after"][name][k] - v).abs().max().item() for k, v in want_params.items())
        print(f"{name}: |loss - 2x2| = {abs(dcp['loss'][name] - want_loss):.3g}, max |param - 2x2| = {after:.3g}")
        assert abs(dcp["loss"][name] - want_loss) <= 1e-6, (name, dcp["loss"])
        # the update used the resharded momentum buffers: parameters agree after it
        for key, value in want_params.items():
            torch.testing.assert_close(dcp["after"][name][key], value, rtol=0, atol=1e-6, msg=(name, key))
        assert not torch.equal(dcp["after"][name]["head.weight"], dcp["loaded"][name]["head.weight"])
