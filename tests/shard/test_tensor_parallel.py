"""Tensor parallelism under the sharding, in one process (a fake process group of 4 or 8
ranks): the config's checks, the mesh the plugin builds, the layout of a split
parameter, and what the passes do to graphs holding both kinds of collectives.

The numerics (4 gloo ranks at dp 2 x tp 2, like one process) are in
``integration/test_tensor_parallel_training.py``.
"""

from __future__ import annotations

import pytest
import torch
from _fake import GraphCapture, collectives_by_group, fake_world, tensor_parallel_order
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.config.schema import OverlapConfig, OverlapConfigError
from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn
from fsdp_overlap_plugin.passes.graph import (
    group_name,
    is_all_gather,
    is_reduce_scatter,
)
from fsdp_overlap_plugin.runtime.state import get_state

pytestmark = pytest.mark.torch_sensitive  # DTensor placements and parallel styles move between torches

#: the repo GPT's MLP split the Megatron way (its attention's fused qkv cannot be split by columns)
GPT_PLAN = {"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}
SMALL = {"n_layer": 2}


def _gpt(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return gpt_small(**{**SMALL, **overrides})


def _step(model) -> None:
    x, y = fixed_batches(1, 2, 16, 256)[0]
    loss_fn(model(x), y).backward()


# ---------------------------------------------------------------- the config


def test_mesh_tensor_divides_the_world_before_the_data_parallel_sizes():
    assert OverlapConfig(mesh={"tensor": 2}).mesh.sizes(8) == (1, 4)
    assert OverlapConfig(mesh={"tensor": 2, "replicate": 2}).mesh.sizes(8) == (2, 2)
    with pytest.raises(
        OverlapConfigError, match=r"mesh.tensor=3 does not divide the world size 8; valid values: \[1, 2, 4, 8\]"
    ):
        OverlapConfig(mesh={"tensor": 3}).mesh.sizes(8)
    with pytest.raises(
        OverlapConfigError,
        match=r"mesh.replicate=3 does not divide the 4 data-parallel ranks \(world size 8 / tensor=2\)",
    ):
        OverlapConfig(mesh={"tensor": 2, "replicate": 3}).mesh.sizes(8)
    with pytest.raises(OverlapConfigError, match=r"the world size is 4 data-parallel ranks \(8 / tensor=2\)"):
        OverlapConfig(mesh={"tensor": 2, "replicate": 2, "shard": 4}).mesh.sizes(8)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"mesh": {"tensor": 0}}, r"mesh.tensor: must be >= 1, got 0"),
        ({"mesh": {"tensor": "2"}}, r"mesh.tensor: expected an integer, got '2'"),
        (
            {"mesh": {"tensr": 2}},
            r"unknown key 'mesh.tensr'. Did you mean 'tensor'\? Valid keys: mesh.shard, mesh.replicate, mesh.tensor",
        ),
        (
            {"tp_plan": {"a": "colwize"}, "mesh": {"tensor": 2}},
            r"tp_plan\['a'\]: unknown style 'colwize'; valid: colwise, rowwise, replicate, sequence_parallel. "
            r"Did you mean 'colwise'",
        ),
        (
            {"tp_plan": ["a"], "mesh": {"tensor": 2}},
            r'tp_plan: expected "auto" \(a transformers model\'s own plan\) or a mapping of module FQNs or patterns to a style \(colwise, rowwise, replicate, sequence_parallel\)',
        ),
        ({"tp_plan": {}, "mesh": {"tensor": 2}}, r'tp_plan: expected "auto" .* got \{\}'),
        (
            {"tp_plan": {"norm": "sequence paralel"}, "mesh": {"tensor": 2}},
            r"tp_plan\['norm'\]: unknown style 'sequence paralel'; .* Did you mean 'sequence_parallel'",
        ),
    ],
)
def test_bad_tensor_parallel_config_names_the_key(config, message):
    with pytest.raises(OverlapConfigError, match=message):
        OverlapConfig.from_dict(config)


# ---------------------------------------------------------------- the mesh and the layout


@pytest.fixture
def world4():
    with fake_world(4):
        yield


def test_the_mesh_has_the_tensor_dimension_innermost(world4):
    mesh = fo.build_mesh({"tensor": 2})
    assert mesh.mesh_dim_names == ("shard", "tensor")
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]]  # the ranks of one tensor-parallel group are consecutive
    assert mesh["tensor"].mesh.tolist() == [0, 1] and mesh["shard"].mesh.tolist() == [0, 2]


def test_a_split_parameter_is_stored_as_fsdp2_stores_it(world4):
    model = fo.parallelize(_gpt(), backend="aot_eager", mesh={"tensor": 2}, tp_plan=GPT_PLAN)
    params = dict(model.named_parameters())
    fc, proj = params["blocks.0.mlp.fc.weight"], params["blocks.0.mlp.proj.weight"]
    # colwise splits dim 0 over the tensor group: the data-parallel shard of that part is strided
    assert fc.placements == (_StridedShard(0, split_factor=2), Shard(0))
    assert proj.placements == (Shard(0), Shard(1))
    assert params["blocks.0.mlp.proj.bias"].placements == (Shard(0), Replicate())
    assert fc.device_mesh.mesh_dim_names == ("shard", "tensor")
    # global shapes kept; each rank holds a quarter of fc (256 x 64: 64 rows) and of proj (64 x 256)
    assert fc.shape == (256, 64) and fc.to_local().shape == (64, 64)
    assert proj.shape == (64, 256) and proj.to_local().shape == (32, 128)
    # a module the plan did not name is sharded over the data-parallel ranks only, whole on
    # each tensor-parallel rank: every parameter on one mesh, as gradient clipping's norm needs
    qkv = params["blocks.0.attn.qkv.weight"]
    assert qkv.placements == (Shard(0), Replicate()) and qkv.to_local().shape == (96, 64)
    assert {p.device_mesh for p in params.values()} == {fc.device_mesh}
    state = get_state(model)
    assert state.tensor_parallel == 2 and state.mesh_shape == (2,)
    assert state.tp_plan == {
        f"blocks.{i}.mlp.{m}": s for i in (0, 1) for m, s in (("fc", "colwise"), ("proj", "rowwise"))
    }


def test_plan_errors_name_the_entry_and_the_nearest_modules(world4):
    with pytest.raises(
        OverlapConfigError,
        match=r"tp_plan\['blocks.\*.mlp.fcc'\]: pattern 'blocks.\*.mlp.fcc' matches no module. Did you mean 'blocks.\*.mlp.fc'",
    ):
        fo.parallelize(_gpt(), backend="aot_eager", mesh={"tensor": 2}, tp_plan={"blocks.*.mlp.fcc": "colwise"})
    with pytest.raises(
        OverlapConfigError,
        match=r"tp_plan\['blocks.0.mlp'\]: colwise splits nn.Linear and nn.Embedding modules; 'blocks.0.mlp' is a MLP",
    ):
        fo.parallelize(_gpt(), backend="aot_eager", mesh={"tensor": 2}, tp_plan={"blocks.0.mlp": "colwise"})
    with pytest.raises(
        OverlapConfigError,
        match=r"module 'blocks.0.mlp.fc' is matched by 'blocks.\*.mlp.fc' \(colwise\) and by 'blocks.0.mlp.fc' \(rowwise\)",
    ):
        fo.parallelize(
            _gpt(),
            backend="aot_eager",
            mesh={"tensor": 2},
            tp_plan={"blocks.*.mlp.fc": "colwise", "blocks.0.mlp.fc": "rowwise"},
        )


def test_a_plan_with_no_tensor_dimension_is_an_error(world4):
    with pytest.raises(OverlapConfigError, match=r"tp_plan: a tensor-parallel plan needs a tensor dimension"):
        fo.parallelize(_gpt(), backend="aot_eager", tp_plan=GPT_PLAN)


def test_a_tensor_dimension_with_nothing_split_is_an_error(world4):
    with pytest.raises(
        OverlapConfigError, match=r"mesh.tensor=2, but no parameter is split over the tensor-parallel ranks"
    ):
        fo.parallelize(_gpt(), backend="aot_eager", mesh={"tensor": 2})
    with pytest.raises(OverlapConfigError, match=r"mesh.tensor=2, but no parameter is split"):
        fo.parallelize(_gpt(), backend="aot_eager", mesh={"tensor": 2}, tp_plan={"blocks.*.mlp.fc": "replicate"})


def test_the_users_own_parallelize_module_on_the_users_mesh(world4, monkeypatch):
    """The torchtitan spelling: the user's (dp, tp) mesh and parallelize_module, then
    parallelize with that mesh; the data-parallel sharding goes over "dp" only."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _gpt()
    for block in model.blocks:
        parallelize_module(block.mlp, mesh["tp"], {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
    capture = GraphCapture(monkeypatch)
    fo.parallelize(model, backend="aot_eager", mesh=mesh)
    _step(model)
    fc = dict(model.named_parameters())["blocks.0.mlp.fc.weight"]
    assert fc.placements == (_StridedShard(0, split_factor=2), Shard(0))
    assert get_state(model).tp_plan == {}  # nothing of ours applied
    forward = capture.get("forward", "after")
    assert sum(is_all_gather(n) for n in forward.graph.nodes) == 4  # one per bucket


def test_a_split_parameter_without_a_tensor_dimension_is_an_error(world4):
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _gpt()
    parallelize_module(model.blocks[0].mlp, mesh["tp"], {"fc": ColwiseParallel()})
    with pytest.raises(
        OverlapConfigError,
        match=r"parameter blocks.0.mlp.fc.weight is already a DTensor on a mesh of 2 ranks .* set mesh: \{tensor: 2\}",
    ):
        fo.parallelize(model, backend="aot_eager")
    model = _gpt()
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))["tp"]  # ranks 0 and 2: not consecutive
    parallelize_module(model.blocks[0].mlp, other, {"fc": ColwiseParallel()})
    with pytest.raises(
        OverlapConfigError,
        match=r"blocks.0.mlp.fc.weight is split over ranks \[0, 2\], but this rank's tensor-parallel group .* is ranks \[0, 1\]",
    ):
        fo.parallelize(model, backend="aot_eager", mesh={"tensor": 2})


@pytest.mark.parametrize("dynamic", ["auto", True])
def test_new_sequence_lengths_compile_symbolic_under_tensor_parallelism(world4, dynamic):
    """torch 2.13 to 2.15's tracer recursed without end in a tensor-parallel Linear's backward
    when a size was symbolic, so every length compiled on its own; the backend now traces
    with ``compat.symbols_keep_their_first_proxy``. "auto": the first length static, one
    symbolic graph for every later one; ``dynamic: true``: one graph."""
    model = fo.parallelize(_gpt(), backend="aot_eager", mesh={"tensor": 2}, tp_plan=GPT_PLAN, dynamic=dynamic)
    for length in (16, 12, 8, 10):
        x, y = fixed_batches(1, 2, length, 256, seed=length)[0]
        loss_fn(model(x), y).backward()
    assert get_state(model).dynamo_graphs == (2 if dynamic == "auto" else 1)
    report = fo.schedule_report(model)
    assert not [line for line in report["adjustments"] if "under tensor parallelism" in line], report["adjustments"]


def test_where_the_tracer_cannot_be_helped_each_length_compiles_static(world4, monkeypatch):
    from fsdp_overlap_plugin import _torch_compat

    monkeypatch.setattr(_torch_compat, "symbolic_sizes_traceable_under_tensor_parallel", lambda: False)
    with pytest.raises(
        OverlapConfigError,
        match=r"dynamic: true compiles every size symbolic, which this torch cannot trace through DTensor under "
        r"tensor parallelism",
    ):
        fo.parallelize(_gpt(), backend="aot_eager", mesh={"tensor": 2}, tp_plan=GPT_PLAN, dynamic=True)
    model = fo.parallelize(_gpt(), backend="aot_eager", mesh={"tensor": 2}, tp_plan=GPT_PLAN)
    adjustments = fo.schedule_report(model)["adjustments"]
    assert any(line.startswith("dynamic: auto -> false under tensor parallelism") for line in adjustments)


def test_a_mesh_and_mesh_tensor_that_disagree_is_an_error(world4):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "tensor"))
    with pytest.raises(
        OverlapConfigError,
        match=r"mesh.tensor=4 contradicts the mesh passed to parallelize, whose tensor dimension has 2 ranks",
    ):
        fo.parallelize(_gpt(), backend="aot_eager", mesh=mesh, config={"mesh": {"tensor": 4}})
    inner = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "shard"))
    with pytest.raises(
        OverlapConfigError,
        match=r"expected one tensor-parallel dimension \(tensor or tp or tensor_parallel\), the innermost",
    ):
        fo.parallelize(_gpt(), backend="aot_eager", mesh=inner)


# ---------------------------------------------------------------- the passes, at 8 ranks


def test_at_8_ranks_the_passes_bucket_the_data_parallel_collectives_and_leave_the_plans(monkeypatch):
    """replicate 2 x shard 2 x tensor 2: each bucket's gathers and reduce-scatters are one
    collective on the shard group, its replica all-reduce one on the replicate group; the
    plan's all-reduces (one per MLP in forward, one per MLP's input gradient in backward) stay
    on the tensor group, as many as before, in the same order against every matmul."""
    capture = GraphCapture(monkeypatch)
    with fake_world(8):
        model = fo.parallelize(
            _gpt(),
            backend="aot_eager",
            mesh={"replicate": 2, "tensor": 2},
            tp_plan=GPT_PLAN,
            reduce_scatter_impl="native",
        )
        _step(model)
        state = get_state(model)
        assert state.mesh_shape == (2, 2) and state.tensor_parallel == 2
        tp = state.tp_mesh.get_group().group_name
        groups = {
            tp: "tensor",
            state.mesh.get_group(1).group_name: "shard",
            state.mesh.get_group(0).group_name: "replicate",
        }
        assert len({*groups}) == 3
        report = fo.schedule_report(model)
    n_params = 29  # 2 embeddings + 2 blocks x 12 + norm 2 + head 1
    buckets = 4
    before, after = capture.get("forward"), capture.get("forward", "after")
    assert collectives_by_group(before, groups) == {
        ("shard", "all_gather_into_tensor"): n_params,
        ("tensor", "all_reduce"): 2,
    }
    # each bucket's gather writes this rank's shards into its slot of the bucket's buffer (fill_slot)
    assert collectives_by_group(after, groups) == {
        ("shard", "all_gather_into_tensor_out"): buckets,
        ("tensor", "all_reduce"): 2,
    }
    assert tensor_parallel_order(after, tp) == tensor_parallel_order(before, tp)
    before, after = capture.get("backward"), capture.get("backward", "after")
    counts = collectives_by_group(before, groups)
    assert counts[("shard", "reduce_scatter_tensor")] == n_params and counts[("replicate", "all_reduce")] == n_params
    assert counts[("tensor", "all_reduce")] == 2
    counts = collectives_by_group(after, groups)
    assert counts[("shard", "reduce_scatter_tensor")] == buckets and counts[("replicate", "all_reduce")] == buckets
    assert counts[("tensor", "all_reduce")] == 2
    assert tensor_parallel_order(after, tp) == tensor_parallel_order(before, tp)
    assert not any(is_reduce_scatter(n) and group_name(n) == tp for n in after.graph.nodes)
    # the report counts each kind apart
    assert report["tensor_parallel"]["size"] == 2
    assert report["forward"]["tensor_parallel"]["after"]["all_reduce"] == 2
    assert report["forward"]["after"]["all_reduce"] == 0  # the data-parallel columns hold none of the plan's
    assert report["backward"]["after"]["all_reduce"] == buckets
    text = fo.format_report(report)
    assert "8 ranks (2 replicas of 2 shards x 2 tensor-parallel)" in text
    assert (
        "tensor parallel: groups of 2 ranks; the plan's collectives: forward 2 all-reduces; backward 2 all-reduces "
        "(1 per bucket that has any), on the tensor-parallel group, not bucketed and not moved by the passes"
    ) in text


def test_split_parameters_are_dtensors_in_the_state_dict(world4):
    model = fo.parallelize(_gpt(), backend="aot_eager", mesh={"tensor": 2}, tp_plan=GPT_PLAN)
    state = model.state_dict()
    assert all(isinstance(v, DTensor) for v in state.values())
    assert state["blocks.1.mlp.proj.weight"].placements == (Shard(0), Shard(1))


HF_PLAN = {
    "model.layers.*.self_attn.[qkv]_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


class _Summaries:
    """What ``run_passes`` saw of each graph before and after the passes, summarised at once
    (collectives by group, the tensor group's order against the matmuls): a transformers
    model's graphs hold fake constants that ``GraphCapture``'s deepcopy cannot copy."""

    def __init__(self, monkeypatch):
        import fsdp_overlap_plugin.compile.backends as backends

        self.graphs: dict[str, dict] = {}
        self.groups: dict = {}
        original = backends.run_passes

        def summarising(gm, kind, state, **kwargs):
            tp = state.tp_groups[0]
            before = (collectives_by_group(gm, self.groups), tensor_parallel_order(gm, tp))
            record = original(gm, kind, state, **kwargs)
            self.graphs[kind] = {
                "before": before,
                "after": (collectives_by_group(gm, self.groups), tensor_parallel_order(gm, tp)),
            }
            return record

        monkeypatch.setattr(backends, "run_passes", summarising)


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # tied, untied
def test_at_8_ranks_a_transformers_model_keeps_its_plans_collectives(monkeypatch, family):
    """The same at replicate 2 x shard 2 x tensor 2 for transformers models split over
    attention and MLP: per layer the forward all-reduces after o_proj and down_proj, the
    backward the input gradient of each of the five colwise projections; the data-parallel
    collectives are one per bucket."""
    import _hf

    summaries = _Summaries(monkeypatch)
    with fake_world(8):
        model = _hf.build(family)
        fo.parallelize(
            model,
            backend="aot_eager",
            mesh={"replicate": 2, "tensor": 2},
            tp_plan=HF_PLAN,
            reduce_scatter_impl="native",
        )
        state = get_state(model)
        summaries.groups.update(
            {
                state.tp_mesh.get_group().group_name: "tensor",
                state.mesh.get_group(1).group_name: "shard",
                state.mesh.get_group(0).group_name: "replicate",
            }
        )
        _hf.loss(model, _hf.batches(1, 2)[0]).backward()
        gathers, scatters = _hf.expected_collectives(model, state.plan)
    layers = 2
    for kind, per_layer in (("forward", 2), ("backward", 5)):
        (counts_before, order_before), (counts_after, order_after) = (
            summaries.graphs[kind]["before"],
            summaries.graphs[kind]["after"],
        )
        assert counts_before[("tensor", "all_reduce")] == layers * per_layer
        assert counts_after[("tensor", "all_reduce")] == layers * per_layer
        assert order_after == order_before
    forward = summaries.graphs["forward"]["after"][0]
    # a bucket of one parameter keeps its own all_gather_into_tensor; a merged one writes into its buffer
    merged = forward.get(("shard", "all_gather_into_tensor_out"), 0)
    assert merged >= 2 and merged + forward.get(("shard", "all_gather_into_tensor"), 0) == gathers
    counts = summaries.graphs["backward"]["after"][0]
    assert counts[("shard", "reduce_scatter_tensor")] == scatters and counts[("replicate", "all_reduce")] == scatters


def test_a_second_model_in_the_process_counts_its_plans_collectives(world4):
    """Two meshes over the same ranks are equal to DTensor: the second model's graphs may run
    the plan's collectives on the first model's tensor group. They are still the plan's."""
    for _ in range(2):
        torch._dynamo.reset()
        model = fo.parallelize(_gpt(), backend="aot_eager", mesh={"tensor": 2}, tp_plan=GPT_PLAN)
        _step(model)
        report = fo.schedule_report(model)
        assert report["forward"]["tensor_parallel"]["after"]["all_reduce"] == 2
        assert report["backward"]["tensor_parallel"]["after"]["all_reduce"] == 2
        assert report["forward"]["after"]["all_reduce"] == 0


def test_check_says_what_its_numbers_leave_out_under_tensor_parallelism(capsys):
    from pathlib import Path

    from _cli import run

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "plugin_ok_tensor_parallel.yaml"
    code, out, _ = run(
        capsys, "check", str(fixture), "--model", "fsdp_overlap_plugin.models.gpt:gpt_small", "--world", "4"
    )
    assert code == 0, out
    assert (
        "tensor  mesh.tensor 2: tensor-parallel groups of 2 consecutive ranks (tp_plan with 2 entries); the sizes and "
        "predictions here count the data-parallel sharding only"
    ) in out
    assert "memory  4 ranks (mesh 2):" in out  # the data-parallel shard group: 2 of the 4 ranks


def test_auto_applies_a_transformers_models_own_plan(world4):
    """``tp_plan: auto``: the colwise / rowwise entries of the model's ``_tp_plan`` (its
    config's ``base_model_tp_plan``); the vocabulary-parallel embedding and the gathered head
    stay whole, and the report says so."""
    import _hf

    model = _hf.build("llama")
    fo.parallelize(model, backend="aot_eager", mesh={"tensor": 2}, tp_plan="auto")
    state = get_state(model)
    assert state.tp_plan == {
        f"model.layers.{i}.{m}": style
        for i in (0, 1)
        for m, style in (
            ("self_attn.q_proj", "colwise"),
            ("self_attn.k_proj", "colwise"),
            ("self_attn.v_proj", "colwise"),
            ("self_attn.o_proj", "rowwise"),
            ("mlp.gate_proj", "colwise"),
            ("mlp.up_proj", "colwise"),
            ("mlp.down_proj", "rowwise"),
        )
    }
    params = dict(model.named_parameters())
    assert params["model.layers.0.self_attn.o_proj.weight"].placements == (Shard(0), Shard(1))
    assert params["model.embed_tokens.weight"].placements == (Shard(0), Replicate())
    assert (
        "tp_plan: auto applied the model's colwise and rowwise entries; left whole (not split yet): "
        "lm_head (colwise_gather_output), model.embed_tokens (embedding_rowwise)"
    ) in state.adjustments


def test_auto_on_a_model_without_a_plan_says_to_write_one(world4):
    with pytest.raises(
        OverlapConfigError,
        match=r"tp_plan: auto reads a transformers model's own tensor-parallel plan .* GPT has no colwise or rowwise entry there: write the plan",
    ):
        fo.parallelize(_gpt(), backend="aot_eager", mesh={"tensor": 2}, tp_plan="auto")


def test_untested_checkpoint_paths_refuse_a_tensor_parallel_model_and_name_the_tested_ones(world4):
    """The Lightning and Accelerate saves call this before writing (their integration tests
    see it raise on every rank); a data-parallel-only model passes."""
    from fsdp_overlap_plugin.shard.tensor_parallel import refuse_tensor_parallel_checkpoint

    model = fo.parallelize(_gpt(), backend="aot_eager", mesh={"tensor": 2}, tp_plan=GPT_PLAN)
    with pytest.raises(
        OverlapConfigError,
        match=r"Trainer checkpoint save: the model is tensor-parallel \(blocks.0.mlp.fc.weight is split .*"
        r"Tested at 2-D: fsdp_overlap_plugin.shard.checkpoint.save / load_latest .*\.save_pretrained / load_pretrained",
    ):
        refuse_tensor_parallel_checkpoint(model, "Trainer checkpoint save")
    refuse_tensor_parallel_checkpoint(
        fo.parallelize(_gpt(), backend="aot_eager", mesh={"shard": 2, "replicate": 2}), "x"
    )
