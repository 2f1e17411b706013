"""``Fabric(strategy="fsdp_overlap")`` on 2 real gloo ranks, checked with numbers.

One ``run_ranks`` job runs every scenario; Fabric is built inside each rank (``LOCAL_RANK``
is set, so ``fabric.launch()`` starts no processes and reuses the process group). The
ranks read exactly the batches the Trainer tests use, so the comparisons are with the
core ``parallelize()`` run and with one unsharded process.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo
from _dist import run_ranks
from _lightning import close, core_run, dataset, full_params, global_batches, mean_over_ranks, rank_batches
from _lightning import reference_run as reference

from fsdp_overlap_plugin.lightning import FSDPOverlapFabricStrategy
from fsdp_overlap_plugin.models import gpt_small, loss_fn

pytestmark = pytest.mark.slow

GPT = {"n_layer": 2}
FAST = {"backend": "aot_eager"}


def _fabric(**kwargs):
    from lightning.fabric import Fabric

    fabric = Fabric(strategy=FSDPOverlapFabricStrategy(**{**FAST, **kwargs}), accelerator="cpu", devices=2)
    fabric.launch()
    return fabric


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return gpt_small(**GPT)


def _train_and_resume(rank: int, world: int, root: str) -> dict:
    """4 AdamW steps, a sharded checkpoint after step 2, then resumed into a new model."""
    batches = rank_batches(dataset(16), rank, world)
    torch._dynamo.reset()
    fabric = _fabric()
    model = _model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # before setup: re-pointed at the shards
    model, optimizer = fabric.setup(model, optimizer)
    losses = []
    for step, (x, y) in enumerate(batches):
        loss = loss_fn(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step == 1:
            fabric.save(f"{root}/sharded", {"model": model, "optimizer": optimizer, "step": step})
            saved = full_params(model)
    out = {
        "losses": losses,
        "report": fabric.strategy.schedule_report,
        "metrics": fabric.strategy.schedule_metrics,
        "sharded_files": sorted(os.listdir(f"{root}/sharded")),
        "core": core_run(_model(0), batches, optimizer="adamw", lr=3e-3, **FAST)["losses"],
    }

    torch._dynamo.reset()
    fabric = _fabric()
    model = fabric.setup_module(_model(1))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    state = {"model": model, "optimizer": optimizer, "step": -1}
    fabric.load(f"{root}/sharded", state)
    out["loaded_step"] = state["step"]
    resumed = []
    for x, y in batches[2:]:
        loss = loss_fn(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        resumed.append(loss.item())
    out["resumed"] = resumed

    # Full state dict: one file from rank 0, loaded by every rank into a fresh model.
    fabric = _fabric(state_dict_type="full")  # Lightning FSDP's spelling of save_distributed_checkpoint=False
    model = fabric.setup_module(_model(1))
    fabric.load(f"{root}/sharded", {"model": model})  # sharded -> this model
    fabric.save(f"{root}/full.ckpt", {"model": model})
    other = fabric.setup_module(_model(2))
    fabric.load(f"{root}/full.ckpt", {"model": other})
    out["full_roundtrip"] = (saved, full_params(other))
    out["full_is_file"] = os.path.isfile(f"{root}/full.ckpt")
    return out


def _clip_and_accumulate(rank: int, world: int, root: str) -> dict:
    """fabric.clip_gradients and no_backward_sync accumulation vs one unsharded process."""
    clip = 0.1
    data = dataset(8)
    per_rank = [rank_batches(data, r, world) for r in range(world)]
    torch._dynamo.reset()
    fabric = _fabric()
    model = fabric.setup_module(_model(0))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5))
    losses = []
    for x, y in per_rank[rank]:
        loss = loss_fn(model(x), y)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_over_ranks(loss.item()))
    out = {"clip": {"losses": losses, "params": full_params(model)}}
    out["clip_ref"] = reference(_model(0), global_batches(per_rank), clip=clip) if rank == 0 else None

    per_rank = [rank_batches(dataset(12), r, world, batch=1) for r in range(world)]
    torch._dynamo.reset()
    fabric = _fabric()
    model = fabric.setup_module(_model(0))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5))
    micro = []
    for i, (x, y) in enumerate(per_rank[rank]):
        with fabric.no_backward_sync(model, enabled=(i % 2 == 0)):
            loss = loss_fn(model(x), y)
            fabric.backward(loss / 2)
        micro.append(loss.item())
        if i % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()
    steps = [mean_over_ranks((a + b) / 2) for a, b in zip(micro[::2], micro[1::2])]
    out["accumulate"] = {"losses": steps, "params": full_params(model)}
    out["accumulate_ref"] = reference(_model(0), global_batches(per_rank, group=2)) if rank == 0 else None
    return out


def _init_on_meta(rank: int, world: int, root: str) -> dict:
    """fabric.init_module(empty_init=True): meta device, materialized on the shards."""
    fabric = _fabric()
    torch.manual_seed(3)
    with fabric.init_module(empty_init=True):
        model = gpt_small(**GPT)
    on_meta = all(p.device.type == "meta" for p in model.parameters())
    model = fabric.setup_module(model)
    with torch.device("meta"):
        core = gpt_small(**GPT)
    torch.manual_seed(3)
    initial = core_run(core, [], **FAST)["initial"]
    return {"on_meta": on_meta, "fabric": full_params(model), "core": initial}


def _compiled(rank: int, world: int, root: str) -> dict:
    """fabric.setup(torch.compile(model)): Fabric takes the wrapper off, the strategy
    prepares the module, Fabric compiles it again with the user's arguments; that outer
    compile stops at the model, whose own compiled forward runs with the passes."""
    batches = rank_batches(dataset(8), rank, world)
    torch._dynamo.reset()
    fabric = _fabric()
    model = torch.compile(_model(0), backend="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = fabric.setup(model, optimizer)
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "report": fabric.strategy.schedule_report,
        "core": core_run(_model(0), batches, **FAST)["losses"],
    }


def _all(rank: int, world: int, root: str) -> dict:
    return {
        "train": _train_and_resume(rank, world, f"{root}/train"),
        "compiled": _compiled(rank, world, root),
        "clip": _clip_and_accumulate(rank, world, root),
        "meta": _init_on_meta(rank, world, root),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_ranks(_all, str(tmp_path_factory.mktemp("fabric")), timeout=600)


def test_fabric_trains_like_core_parallelize(results):
    for r in results:
        train = r["train"]
        assert len(train["losses"]) == 4
        assert train["losses"] == train["core"], (train["losses"], train["core"])
    report = results[0]["train"]["report"]
    assert report["mode"] == "compiled" and len(report["plan"]) == 4
    assert results[0]["train"]["metrics"]["fsdp_overlap/backward_reduce_scatters_before"] == 29


def test_fabric_compiling_the_model_again_runs_the_plugin_inside(results):
    for r in results:
        run = r["compiled"]
        assert run["losses"] == run["core"], (run["losses"], run["core"])  # bitwise: the plugin's graphs
    report = results[0]["compiled"]["report"]
    assert report["forward"]["after"]["all_gather"] == len(report["plan"]) == 4  # bucketed by the passes
    assert any(a.startswith("the model is called through a torch.compile(...) wrapper") for a in report["adjustments"])


def test_fabric_sharded_checkpoint_resumes_exactly(results):
    for r in results:
        train = r["train"]
        assert train["loaded_step"] == 1
        assert train["resumed"] == train["losses"][2:], (train["resumed"], train["losses"])
    assert {"__0_0.distcp", "__1_0.distcp", "meta.pt"} <= set(results[0]["train"]["sharded_files"])


def test_fabric_full_checkpoint_roundtrip(results):
    for r in results:
        saved, loaded = r["train"]["full_roundtrip"]
        assert r["train"]["full_is_file"]
        assert saved.keys() == loaded.keys()
        for name in saved:
            assert torch.equal(saved[name], loaded[name]), name


def test_fabric_clip_gradients_matches_unsharded_reference(results):
    got, ref = results[0]["clip"]["clip"], results[0]["clip"]["clip_ref"]
    assert min(ref["norms"]) > 0.2  # clipping active at 0.1
    assert close(got["losses"], ref["losses"]), (got["losses"], ref["losses"])
    for name, want in ref["params"].items():
        torch.testing.assert_close(got["params"][name], want, rtol=1e-5, atol=1e-6, msg=name)


def test_fabric_no_backward_sync_accumulation_matches_one_big_batch(results):
    got, ref = results[0]["clip"]["accumulate"], results[0]["clip"]["accumulate_ref"]
    assert len(got["losses"]) == 3
    assert close(got["losses"], ref["losses"]), (got["losses"], ref["losses"])
    for name, want in ref["params"].items():
        torch.testing.assert_close(got["params"][name], want, rtol=1e-5, atol=1e-6, msg=name)


def test_fabric_init_module_empty_init_materializes_like_core(results):
    for r in results:
        meta = r["meta"]
        assert meta["on_meta"]
        for name, want in meta["core"].items():
            assert torch.equal(meta["fabric"][name], want), name
