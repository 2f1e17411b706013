"""Checkpoints cross world sizes and frameworks, with equal parameters each way:

* the plugin at 2 ranks writes ``fsdp_overlap_plugin.shard.checkpoint.save``; the plugin loads it at
  1 and at 4 ranks (``load_latest``), and so does torch's own ``fully_shard`` model at 4 ranks
  through torch's own API (``get_model_state_dict`` / ``dcp.load`` / ``set_model_state_dict``);
* torch's ``fully_shard`` (per decoder layer, then the root) at 2 ranks writes
  ``dcp.save({"model": get_model_state_dict(model)})``; the plugin loads it at 1 and 4 ranks.

The model is the tied transformers Llama of tests/_hf.py with a vocabulary of 97: shards of
49/48 rows at 2 ranks, 25/24/24/24 at 4, all of one row at 1. Every load is compared with the
full parameters the writing run had, bit for bit.
"""

from __future__ import annotations

import _hf
import pytest
import torch
import torch._dynamo
from _dist import run_ranks

# on the oldest torch of the CI matrix too: DCP's reading and writing and DTensor's gathers
# are what changes between releases
pytestmark = [pytest.mark.slow, pytest.mark.oldest_torch]


def _plugin_model(seed: int):
    import fsdp_overlap_plugin as fo

    torch._dynamo.reset()
    return fo.parallelize(_hf.build("llama", seed=seed), backend="aot_eager")


def _torch_fsdp2_model(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _hf.build("llama", seed=seed)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    from fsdp_overlap_plugin.shard.sharding import gather_disabled

    with gather_disabled():
        state = model.state_dict()
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def _train(model, rank: int, world: int, steps: int = 2) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for ids in _hf.batches(steps, 2 * world):
        _hf.loss(model, ids[rank * 2 : (rank + 1) * 2]).backward()
        optimizer.step()
        optimizer.zero_grad()


def _write(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from fsdp_overlap_plugin.shard import checkpoint

    plugin = _plugin_model(seed=1)
    _train(plugin, rank, world)
    checkpoint.save(f"{root}/plugin", plugin, step=2)
    fsdp2 = _torch_fsdp2_model(seed=2)
    _train(fsdp2, rank, world)
    dcp.save({"model": get_model_state_dict(fsdp2)}, checkpoint_id=f"{root}/fsdp2")
    return {"plugin": _full(plugin), "fsdp2": _full(fsdp2)}


def _torch_load(model, path: str) -> None:
    """torch's own way to load a DCP checkpoint into a sharded model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])


def _read(rank: int, world: int, root: str) -> dict:
    from fsdp_overlap_plugin.shard import checkpoint

    out = {"world": world}
    plugin = _plugin_model(seed=7)  # other initial values: everything must come from the files
    step, _ = checkpoint.load_latest(f"{root}/plugin", plugin)
    out["plugin <- plugin"] = (step, _full(plugin))
    plugin = _plugin_model(seed=8)
    _torch_load(plugin, f"{root}/fsdp2")
    out["plugin <- fsdp2"] = (None, _full(plugin))
    if world > 1:
        fsdp2 = _torch_fsdp2_model(seed=9)
        _torch_load(fsdp2, f"{root}/plugin/step_00000002")
        out["fsdp2 <- plugin"] = (None, _full(fsdp2))
        _train(plugin, rank, world, steps=1)  # the loaded plugin model still trains at this world size
        out["trains"] = all(torch.isfinite(v).all() for v in _full(plugin).values())
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("interop"))
    written = run_ranks(_write, root)[0]
    return {"written": written, 1: run_ranks(_read, root, world=1), 4: run_ranks(_read, root, world=4)}


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key in want:
        assert torch.equal(got[key], want[key]), (what, key)


@pytest.mark.parametrize("world", [1, 4])
def test_the_plugins_checkpoint_loads_at_another_world_size(runs, world):
    for rank in runs[world]:
        step, params = rank["plugin <- plugin"]
        assert step == 2
        _assert_equal(params, runs["written"]["plugin"], f"plugin at 2 -> plugin at {world}")


@pytest.mark.parametrize("world", [1, 4])
def test_torch_fully_shards_checkpoint_loads_into_the_plugin(runs, world):
    for rank in runs[world]:
        _assert_equal(rank["plugin <- fsdp2"][1], runs["written"]["fsdp2"], f"fsdp2 at 2 -> plugin at {world}")


def test_the_plugins_checkpoint_loads_into_torch_fully_shard_at_4_ranks(runs):
    for rank in runs[4]:
        _assert_equal(rank["fsdp2 <- plugin"][1], runs["written"]["plugin"], "plugin at 2 -> fsdp2 at 4")
        assert rank["trains"]
    # the two writers trained different models: the comparisons above can tell them apart
    written = runs["written"]
    assert not torch.equal(written["plugin"]["model.norm.weight"], written["fsdp2"]["model.norm.weight"])
