"""Every FSDP collective is attributed to its parameter, whatever Dynamo calls the module,
and a plan entry whose collectives the bucketing misses stops the run instead of training
silently without overlap (0.1 bucketed nothing on transformers models and said so only in
a counter). One process, fake process group."""

from __future__ import annotations

import copy
import functools
import warnings

import _hf
import pytest
import torch
import torch._dynamo
import torch.nn as nn
from _fake import GraphCapture, fake_world
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

import fsdp_overlap_plugin as fo
import fsdp_overlap_plugin.passes.bucketing as bucketing
from fsdp_overlap_plugin.compile.diagnostics import UnbucketedError, UnbucketedWarning
from fsdp_overlap_plugin.models import GPT, fixed_batches, gpt_small, loss_fn
from fsdp_overlap_plugin.passes import manual_bucketing, overlap_grad_reduce
from fsdp_overlap_plugin.passes.graph import (
    clean_module_path,
    dynamo_module_path,
    is_all_gather,
    is_reduce_scatter,
    module_path,
    owner_module,
    param_fqn,
)

PLAN = [["tok_emb", "pos_emb"], "blocks.0", "blocks.1", "blocks.2", "blocks.3", ["norm", "head"]]


def _step(model) -> None:
    x, y = fixed_batches(1, 2, 16, 256)[0]
    loss_fn(model(x), y).backward()


def _collectives(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if is_all_gather(n) or is_reduce_scatter(n)]


# ----------------------------------------------------------------------- module paths
@pytest.mark.parametrize(
    "source, path",
    [
        ("L['self'].blocks.0.ln", "blocks.0.ln"),
        ("L['self']._modules['blocks']['0']", "blocks.0"),
        ("L['args'][0].model.layers.0", "model.layers.0"),  # a decorator took self through *args
        ("L['args'][0]", ""),
        ("L['fn'].layers._modules['3'].mlp", "layers.3.mlp"),
        ("G['model'].head", "head"),
        ("dict(type(L['self'].tok_embeddings).__dict__)['weight'].fget.__closure__[0].cell_contents", None),
    ],
)
def test_clean_module_path(source, path):
    assert clean_module_path(source) == path


def test_module_path_skips_sources_that_are_not_attribute_chains():
    node = torch.fx.Graph().placeholder("x")
    closure = "dict(type(L['self'].tok_embeddings).__dict__)['weight'].fget.__closure__[0].cell_contents"
    node.meta["nn_module_stack"] = {"a": ("L['self'].tok_embeddings", nn.Embedding), "b": (closure, nn.Module)}
    assert module_path(node) == "tok_embeddings"
    assert dynamo_module_path(node) == closure  # messages quote what Dynamo said
    node.meta["custom"] = {"fsdp_overlap_param": "blocks.1.mlp.fc.weight"}
    assert owner_module(node) == "blocks.1.mlp.fc"  # the annotation, when there is one, decides


# --------------------------------------------------- a forward that takes self through *args
def takes_self_through_args(forward):
    """What transformers' ``can_return_tuple`` / ``check_model_inputs`` do to ``forward``."""

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs)

    return wrapper


class DecoratedGPT(GPT):
    @takes_self_through_args
    def forward(self, idx):
        return super().forward(idx)


@pytest.mark.parametrize("annotated", [True, False], ids=["parameter-annotation", "module-paths-only"])
def test_forward_wrapped_by_an_args_decorator_gets_its_buckets(monkeypatch, annotated):
    if not annotated:  # a torch without fx annotations: the module paths alone must do
        monkeypatch.setattr("fsdp_overlap_plugin.shard.sharding._annotate", None)
    with fake_world(2):
        capture = GraphCapture(monkeypatch)
        torch.manual_seed(0)
        model = DecoratedGPT(gpt_small().cfg)
        fo.parallelize(model, backend="aot_eager", bucket_plans=PLAN)
        _step(model)
        report = fo.schedule_report(model)
    forward = capture.get("forward")
    sources = {dynamo_module_path(n) for n in _collectives(forward)}
    assert all(s.startswith("L['args'][0].") for s in sources), sources  # the failure mode of 0.1
    assert all((param_fqn(n) is not None) == annotated for n in _collectives(forward))
    assert report["forward"]["after"]["all_gather"] == 6 < report["forward"]["before"]["all_gather"]
    assert report["backward"]["after"]["reduce_scatter"] == 6 < report["backward"]["before"]["reduce_scatter"]
    assert report["forward"]["passes"]["manual_bucketing"]["prefetched"] == 6


# ------------------------------------------- graphs traced by someone else's FSDP (SimpleFSDP)
class ReplicateComputation(nn.Module):
    """torchtitan's SimpleFSDP gathers a parameter in a module of its own, called from the
    parameter's property; Dynamo then names that module through the property's closure."""

    def forward(self, x):
        return x.redistribute(placements=(Replicate(),)).to_local(grad_placements=(Partial("avg"),))


def _register_parametrization(module: nn.Module, names: list[str], parametrization: nn.Module) -> None:
    properties = {name: property(lambda self, pn=name: parametrization(self._parameters[pn])) for name in names}
    module.__class__ = type(f"SimpleFSDP{type(module).__name__}", (type(module),), properties)


def _simple_fsdp(model: nn.Module, mesh) -> nn.Module:
    for module in list(model.modules()):
        names = [name for name, p in module._parameters.items() if p is not None]
        for name in names:
            param = module._parameters[name]
            module._parameters[name] = nn.Parameter(distribute_tensor(param.detach(), mesh, (Shard(0),)))
        if names:
            _register_parametrization(module, names, ReplicateComputation())
    return model


def _capture_simple_fsdp() -> dict[str, torch.fx.GraphModule]:
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: dict[str, torch.fx.GraphModule] = {}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = copy.deepcopy(gm)
            return make_boxed_func(gm.forward)

        return compiler

    torch.manual_seed(0)
    model = _simple_fsdp(gpt_small(), init_device_mesh("cpu", (2,)))
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward")))
    _step(compiled)
    return graphs


def test_manual_bucketing_on_torchtitan_style_simple_fsdp_graphs():
    with fake_world(2):
        graphs = _capture_simple_fsdp()
    forward, backward = graphs["forward"], graphs["backward"]
    assert any("__closure__" in (dynamo_module_path(n) or "") for n in _collectives(forward))
    assert all(param_fqn(n) is None for n in _collectives(forward))  # no help from our sharding
    stats = manual_bucketing(forward, PLAN)
    assert (stats["all_gathers_before"], stats["all_gathers_after"], stats["prefetched"]) == (53, 6, 6)
    assert stats["left_unbucketed"] == []
    stats = manual_bucketing(backward, PLAN)
    assert overlap_grad_reduce(backward)["matched"] == 6
    assert (stats["reduce_scatters_before"], stats["reduce_scatters_after"]) == (53, 6)


# ------------------------------------------------------------------ never silent
def _misattribute_like_0_1(monkeypatch) -> None:
    """The bucketing looks modules up the way 0.1 did for transformers models: with a
    leftover ``0.`` of ``L['args'][0]`` in front, which matches no plan entry."""
    real = bucketing.owner_module
    monkeypatch.setattr(bucketing, "owner_module", lambda node: "0." + (real(node) or ""))


def test_a_plan_entry_the_bucketing_misses_stops_the_first_step(monkeypatch):
    _misattribute_like_0_1(monkeypatch)
    with fake_world(2):
        torch.manual_seed(0)
        model = fo.parallelize(gpt_small(), backend="aot_eager", bucket_plans=PLAN)
        with pytest.raises(UnbucketedError) as info:
            _step(model)
    message = str(info.value)
    assert "bucket_plans entry 1 ['blocks.0']: 12 all-gather(s) left unbucketed in the forward graph" in message
    assert "entry 1 ['blocks.0']: 12 reduce-scatter(s) left unbucketed in the backward graph" in message
    assert "reads 'blocks.0." in message and "Dynamo calls \"L['self'].blocks.0." in message
    # (the entries 2-5 follow; entry 5's backward re-gathers nothing: with every gather its
    # own misattributed bucket, the forward keeps the last two, norm.weight and head.weight)
    assert "... and 7 more" in message and "on_unbucketed: warn" in message


def test_on_unbucketed_warn_trains_and_warns(monkeypatch):
    _misattribute_like_0_1(monkeypatch)
    with fake_world(2):
        torch.manual_seed(0)
        model = fo.parallelize(gpt_small(), backend="aot_eager", bucket_plans=PLAN, on_unbucketed="warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(model)
    texts = [str(w.message) for w in caught if issubclass(w.category, UnbucketedWarning)]
    assert any("bucket_plans entry 1 ['blocks.0']: 12 all-gather(s)" in t for t in texts)


def test_parameters_outside_the_plan_only_warn():
    with fake_world(2):
        torch.manual_seed(0)
        model = fo.parallelize(gpt_small(), backend="aot_eager", bucket_plans=["blocks.*"])
        with pytest.warns(UnbucketedWarning, match=r"no bucket_plans entry covers \(modules head, norm, pos_emb"):
            _step(model)
        report = fo.schedule_report(model)
    assert report["forward"]["after"]["all_gather"] == 4 + 5  # 4 buckets, 5 loose parameters


def test_on_unbucketed_is_validated():
    with pytest.raises(fo.OverlapConfigError, match=r"on_unbucketed: unknown value 'raise'; valid: error, warn"):
        fo.OverlapConfig(on_unbucketed="raise")


# ------------------------------------------ collectives AOT autograd merged or summed
def test_tied_weights_reduce_scatters_are_bucketed():
    """A tied parameter is reduce-scattered once per use and the results added (0.1 did not
    recognise them); the passes sum the uses' gradients first and reduce-scatter once, in
    the bucket of the forward's first read (tok_emb's entry)."""
    with fake_world(2):
        torch.manual_seed(0)
        model = fo.parallelize(gpt_small(tie_weights=True, vocab_size=255), backend="aot_eager", bucket_plans=PLAN)
        _step(model)
        backward = fo.schedule_report(model)["backward"]
    assert backward["before"]["reduce_scatter"] == 53  # one per parameter read: the tied one twice
    assert backward["passes"]["tied"]["merged"] == 1
    assert backward["after"]["reduce_scatter"] == 6
    assert backward["passes"]["overlap_grad_reduce"]["matched"] == 6


def test_merged_reduce_scatters_with_two_waits_are_bucketed(monkeypatch):
    """GPT-NeoX adds attention and MLP outputs in parallel: two biases get the same
    gradient, AOT autograd merges their reduce-scatters but not the two waits."""

    def run() -> dict:
        with fake_world(2):
            model = _hf.build("neox")
            fo.parallelize(model, backend="aot_eager")
            _hf.loss(model, _hf.batches(1, 2)[0]).backward()
            return fo.schedule_report(model)

    report = run()
    backward = report["backward"]
    assert backward["after"]["reduce_scatter"] == len(report["plan"]) == 4
    assert backward["passes"]["manual_bucketing"]["duplicate_waits_merged"] == 2  # one per layer
    # without the merge of the two waits, the pass would skip those reduce-scatters: loudly
    monkeypatch.setattr(bucketing, "merge_duplicate_waits", lambda graph: 0)
    with pytest.raises(UnbucketedError, match=r"entry 1 \['gpt_neox.layers.0'\]: 1 reduce-scatter\(s\) left unb"):
        run()
