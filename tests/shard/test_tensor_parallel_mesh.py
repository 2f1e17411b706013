"""One mesh, one set of process groups, under tensor parallelism (a fake process group of 4
or 8 ranks, in one process).

Two meshes over the same ranks compare equal (DeviceMesh equality is ranks, layout and
names) but carry process groups of their own; with both in one job, two ranks of a
tensor-parallel group ran one all-reduce on different gloo groups and hung
(docs/tensor-parallel.md). So: ``build_mesh`` gives one mesh per layout in a process; a model
the user split over a mesh of theirs and handed to ``parallelize`` with mesh sizes
(``mesh={"tensor": 2}``) is sharded on the user's mesh, its very groups; and a split over
other groups of the same ranks is an error at startup that says which mesh to pass.

The 4-rank gloo run of the same combination (it trains like one process) is
``integration/test_tensor_parallel_one_mesh.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _fake import GraphCapture, fake_world
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.config.schema import OverlapConfigError
from fsdp_overlap_plugin.lightning._common import LIGHTNING_MESH_NAMES
from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn
from fsdp_overlap_plugin.passes.graph import group_name, is_collective
from fsdp_overlap_plugin.runtime.exchange import GROUP_PREFIX
from fsdp_overlap_plugin.runtime.state import get_state

pytestmark = pytest.mark.torch_sensitive  # DeviceMesh internals and DTensor's caches move between torches

GPT_PLAN = {"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt_small(n_layer=2)


def _split(model: torch.nn.Module, tp_mesh: DeviceMesh) -> torch.nn.Module:
    """The user's own split (the torchtitan way): each MLP Megatron-style over ``tp_mesh``."""
    for block in model.blocks:
        parallelize_module(block.mlp, tp_mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    return model


def _step(model) -> None:
    x, y = fixed_batches(1, 2, 16, 256)[0]
    loss_fn(model(x), y).backward()


def _groups(mesh: DeviceMesh) -> list:
    return [mesh.get_group(dim) for dim in range(mesh.ndim)]


@pytest.fixture
def world4():
    # DTensor caches each operation's output layout, mesh included, keyed on meshes that compare
    # equal: a parameter split in this test could come out on an equal mesh of an earlier test's
    # (destroyed) process group. Started clean, each test's meshes are its own.
    _clear_sharding_prop_cache()
    with fake_world(4):
        yield
    _clear_sharding_prop_cache()


def test_build_mesh_gives_one_mesh_per_layout_in_a_process(world4):
    mesh = fo.build_mesh({"tensor": 2})
    assert fo.build_mesh({"tensor": 2}) is mesh  # the same groups for every caller
    assert fo.build_mesh({"tensor": 2}, "cpu") is mesh
    lightning = fo.build_mesh({"tensor": 2}, names=LIGHTNING_MESH_NAMES)
    assert lightning is not mesh and lightning.mesh_dim_names == ("data_parallel", "tensor_parallel")
    assert fo.build_mesh({"tensor": 2}, names=LIGHTNING_MESH_NAMES) is lightning
    flat = fo.build_mesh({})
    assert flat is not mesh and flat.mesh_dim_names == ("shard",)
    dist.destroy_process_group()  # a new default process group: new meshes
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    again = fo.build_mesh({"tensor": 2})
    assert again is not mesh and again == mesh


def test_the_users_mesh_given_as_sizes_is_the_mesh_the_model_is_sharded_on(world4, monkeypatch):
    """The combination that hung: the user's own (dp, tp) mesh and parallelize_module, then
    ``parallelize(model, mesh={"tensor": 2})``. The plugin shards on the user's mesh: its
    data-parallel and tensor-parallel groups are the user's mesh's very groups, and every
    collective of the compiled graphs runs on one of them."""
    users = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _split(_gpt(), users["tp"])
    capture = GraphCapture(monkeypatch)
    fo.parallelize(model, backend="aot_eager", mesh={"tensor": 2})
    _step(model)
    state = get_state(model)
    assert state.tp_mesh.get_group() is users["tp"].get_group()
    assert state.mesh.get_group() is users["dp"].get_group()
    assert state.tp_groups == (users["tp"].get_group().group_name,)
    fc = dict(model.named_parameters())["blocks.0.mlp.fc.weight"]
    assert fc.device_mesh.mesh_dim_names == ("dp", "tp") and _groups(fc.device_mesh) == _groups(users)
    names = {group.group_name for group in _groups(users)}
    # the reduce-scatter's exchange (gloo's: runtime/exchange.py) wraps the data-parallel group
    names.add(GROUP_PREFIX + users["dp"].get_group().group_name)
    for kind in ("forward", "backward"):
        used = {group_name(n) for n in capture.get(kind, "after").graph.nodes if is_collective(n)}
        assert used and used <= names, (kind, used, names)
    assert get_state(model).tp_plan == {}  # nothing of ours applied


def test_a_second_model_gets_the_first_models_mesh(world4):
    """Two models parallelized with the same mesh sizes share one mesh (``build_mesh``), so
    DTensor's taking one equal mesh for the other changes no group; a second model split by
    the user over the same mesh of theirs is sharded on it too."""
    first = fo.parallelize(_gpt(), backend="aot_eager", mesh={"tensor": 2}, tp_plan=GPT_PLAN)
    second = fo.parallelize(_gpt(), backend="aot_eager", mesh={"tensor": 2}, tp_plan=GPT_PLAN)
    for model in (first, second):
        _step(model)
    assert get_state(second).tp_groups == get_state(first).tp_groups
    assert get_state(second).mesh.get_group() is get_state(first).mesh.get_group()

    users = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    models = [fo.parallelize(_split(_gpt(), users["tp"]), backend="aot_eager", mesh={"tensor": 2}) for _ in range(2)]
    for model in models:
        _step(model)
        assert get_state(model).tp_mesh.get_group() is users["tp"].get_group()
        assert get_state(model).mesh.get_group() is users["dp"].get_group()


def test_a_split_over_another_mesh_of_the_same_ranks_as_the_one_given_is_an_error(world4):
    """A mesh passed to parallelize, the model split over another mesh of the same ranks (equal
    to DTensor, other groups): the core loop, and Lightning's (the strategy passes its own
    ``self.device_mesh``)."""
    for names in ({}, LIGHTNING_MESH_NAMES):
        given = fo.build_mesh({"tensor": 2}, names=names)
        users = init_device_mesh("cpu", (2, 2), mesh_dim_names=given.mesh_dim_names)
        tensor = given.mesh_dim_names[-1]
        assert users[tensor] == given[tensor]  # equal meshes, other groups
        model = _split(_gpt(), users[tensor])
        with pytest.raises(
            OverlapConfigError,
            match=r"parameter blocks.0.mlp.fc.weight is split over a tensor-parallel mesh whose process group is "
            r"\S+, but the tensor dimension of the mesh passed to parallelize has process group \S+: two meshes over "
            r"the same ranks, each with process groups of its own .* Split the model over the tensor dimension of the mesh you pass",
        ):
            fo.parallelize(model, backend="aot_eager", mesh=given)


@pytest.mark.parametrize(
    ("shape", "names", "sizes", "why"),
    [
        # the tensor dimension named as no framework the plugin knows names it
        (
            (2, 2),
            ("data", "model"),
            {"tensor": 2},
            r"a mesh data 2 x model 2 whose tensor dimension 'model' is not named tensor or tp or tensor_parallel",
        ),
        # the user's mesh is not the layout the sizes ask for
        (
            (2, 1, 2),
            ("replicate", "dp", "tp"),
            {"tensor": 2},
            r"a mesh replicate 2 x dp 1 x tp 2, not the layout the config's mesh sizes ask for \(shard 2 x tensor 2\)",
        ),
    ],
)
def test_a_split_over_a_mesh_the_sizes_do_not_describe_says_to_pass_it(world4, shape, names, sizes, why):
    users = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = _split(_gpt(), users[names[-1]])
    with pytest.raises(
        OverlapConfigError,
        match=rf"parameter blocks.0.mlp.fc.weight is split over {why}, and parallelize got mesh sizes \(shard 2 x "
        r"tensor 2\), not that mesh: a mesh of the plugin's over the same ranks would carry process groups of its "
        r"own .* Pass the mesh you split over: parallelize\(model, mesh=my_mesh\)",
    ):
        fo.parallelize(model, backend="aot_eager", mesh=sizes)


def test_a_split_over_a_one_dimensional_mesh_of_its_own_says_to_pass_a_whole_mesh(world4):
    group, _ = dist.new_subgroups(2)
    tp = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("tp",))
    model = _split(_gpt(), tp)
    with pytest.raises(
        OverlapConfigError,
        match=r"parameter blocks.0.mlp.fc.weight is split over a 1-D mesh of 2 ranks, and parallelize got mesh sizes",
    ):
        fo.parallelize(model, backend="aot_eager", mesh={"tensor": 2})


def test_an_hsdp_mesh_of_the_users_with_the_sizes_layout_is_used_whole():
    _clear_sharding_prop_cache()
    with fake_world(8):
        users = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        model = _split(_gpt(), users["tp"])
        fo.parallelize(model, backend="aot_eager", mesh={"replicate": 2, "tensor": 2})
        _step(model)
        state = get_state(model)
        assert state.mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
        assert _groups(state.mesh) == _groups(users)[:2] and state.tp_mesh.get_group() is users["tp"].get_group()
    _clear_sharding_prop_cache()
