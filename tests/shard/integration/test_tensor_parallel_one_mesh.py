"""The user's own mesh and split, then ``parallelize`` with mesh sizes, on four gloo ranks
(data-parallel 2 x tensor-parallel 2): one mesh, one set of process groups, and it trains
like one process.

The combination: ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``, torch's
``parallelize_module`` over its ``"tp"`` dimension, then ``fo.parallelize(model,
mesh={"tensor": 2})``. The plugin used to build a second mesh of the same ranks with groups
of its own beside the user's (under Accelerate, where the same happened, 10 of 23 launches
hung in their first steps: docs/tensor-parallel.md); it now shards on the user's mesh. Each
rank checks that the plugin's data-parallel and tensor-parallel groups are the user's mesh's
very group objects, for the first model and for a second one split over the same mesh in
the same process; both train like one process on the union of the data-parallel ranks'
batches (the second with gradient clipping: the norm over both mesh dimensions).

The same in one process on a fake process group (the groups, the collectives' groups in the
compiled graphs, the errors) is ``tests/shard/test_tensor_parallel_mesh.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from _dist import run_ranks
from _train import full_params, make_model
from test_tensor_parallel_training import CLIP, ENV, MODEL, TOL, TP, WORLD, _gpt_loss, _train

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.models import fixed_batches
from fsdp_overlap_plugin.runtime.state import get_state

pytestmark = [pytest.mark.slow, pytest.mark.middle_torch]

STEPS = 5
SEQ = 16  # one length: one compile per model


def _data() -> list:
    return [fixed_batches(1, 4, SEQ, MODEL["vocab_size"], seed=200 + i)[0] for i in range(STEPS)]


def _split(model: torch.nn.Module, tp_mesh) -> torch.nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.blocks:
        parallelize_module(block.mlp, tp_mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    return model


def _all(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    users = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp", "tp"))
    out = {}
    for name, clip in (("first", None), ("second", CLIP)):
        torch._dynamo.reset()
        sharded = _split(make_model(**MODEL), users["tp"])
        fo.parallelize(sharded, mesh={"tensor": TP}, backend="aot_eager")
        state = get_state(sharded)
        result = {
            "same_tensor_group": state.tp_mesh.get_group() is users["tp"].get_group(),
            "same_data_parallel_group": state.mesh.get_group() is users["dp"].get_group(),
            "groups": (state.mesh.get_group().group_name, state.tp_mesh.get_group().group_name),
            "users_groups": (users["dp"].get_group().group_name, users["tp"].get_group().group_name),
            "losses": _train(sharded, _data(), _gpt_loss, dp_rank=rank // TP, clip=clip),
            "params": full_params(sharded),
        }
        if rank == 0:
            reference = make_model(**MODEL)
            result["ref_losses"] = _train(reference, _data(), _gpt_loss, clip=clip)
            result["ref_params"] = full_params(reference)
        out[name] = result
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_all, world=WORLD, env=ENV, timeout=600)


@pytest.mark.parametrize("name", ["first", "second"])
def test_sharded_on_the_users_mesh_it_trains_like_one_process(results, name):
    for rank, result in enumerate(results):
        ours = result[name]
        assert ours["same_tensor_group"] and ours["same_data_parallel_group"], (
            rank,
            ours["groups"],
            ours["users_groups"],
        )
    ours = results[0][name]
    assert len(ours["losses"]) == STEPS
    for got, want in zip(ours["losses"], ours["ref_losses"]):
        assert abs(got - want) <= TOL, (ours["losses"], ours["ref_losses"])
    assert ours["params"].keys() == ours["ref_params"].keys()
    worst = max((ours["params"][k] - ours["ref_params"][k]).abs().max().item() for k in ours["params"])
    assert worst <= TOL, worst
    for other in results[1:]:
        for k, v in other[name]["params"].items():
            assert torch.equal(v, ours["params"][k]), k
