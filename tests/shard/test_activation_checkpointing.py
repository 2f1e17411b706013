"""Activation checkpointing, trained: the repo GPT and transformers Llama and Mixtral.

In 0.1 ``activation_checkpointing: ["layers.*"]`` stopped the first step in AOT autograd
(``expected all tensors_saved_with_vc_check to be Tensors``), with both backends; no test
had ever trained with it. Single-process tests (a fake process group) check that it
compiles, what the joint-graph pass tags, the saved activations and the collective
counts; the slow job trains on 2 gloo ranks against one process.
"""

from __future__ import annotations

import copy
import math
import warnings

import _hf
import pytest
import torch
import torch._dynamo
from _dist import run_ranks
from _fake import fake_world
from _train import batches, full_params, local_slice, make_model, train_reference, train_sharded

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin import OverlapConfigError
from fsdp_overlap_plugin.models import loss_fn
from fsdp_overlap_plugin.runtime.memory import SavedActivations

pytestmark = pytest.mark.torch_sensitive  # CI runs its quick tests on both ends of its torch matrix (2.11, 2.15)

GPT_BLOCKS = ["blocks.*"]
HF_LAYERS = ["model.layers.*"]
STEPS = 3
LR = 0.5


def _saved_and_report(model, x, y) -> tuple[SavedActivations, dict]:
    """Two steps (the first compiles); what the second saved for backward, and the report."""
    for _ in range(2):
        with SavedActivations(model) as saved:
            loss = loss_fn(model(x), y)
        loss.backward()
    return saved, fo.schedule_report(model)


def test_checkpointed_gpt_compiles_recomputes_and_saves_less():
    """The regression test of the crash, and what checkpointing buys: fewer saved bytes,
    each block's parameters re-gathered once in backward (one bucketed all-gather per
    block, as without checkpointing), every block's forward tagged. (Inductor: the 2-rank
    job below.)"""
    x, y = batches(1)[0]
    x, y = x[:2], y[:2]
    results = {}
    for name, config in {
        "off": {},
        "full": {"activation_checkpointing": GPT_BLOCKS},
        "matmuls_saved": {"activation_checkpointing": GPT_BLOCKS, "activation_checkpointing_policy": "matmuls_saved"},
    }.items():
        with fake_world(2):
            model = make_model()
            fo.parallelize(model, backend="aot_eager", **config)
            results[name] = _saved_and_report(model, x, y)
    # what is saved for backward besides activations: the gathered parameters of the
    # buckets kept for the backward (the same in every run)
    kept = {results[k][1]["reshard"]["kept_bytes"] for k in results}
    assert len(kept) == 1 and kept.pop() == (16512 + 49984) * 4, "head and blocks.3"
    kept_bytes = results["off"][1]["reshard"]["kept_bytes"]
    off, full, selective = (results[k][0].bytes - kept_bytes for k in ("off", "full", "matmuls_saved"))
    assert full < selective < off, (full, selective, off)
    assert full < 0.4 * off and results["full"][0].count < results["off"][0].count / 2
    for name, (_, report) in results.items():
        forward, backward = report["forward"], report["backward"]
        # plan: [tok_emb, pos_emb], blocks.0-3, [norm, head]; the last two stay gathered
        # (the head's backward is too short to hide blocks.3's re-gather), the embeddings'
        # backward needs no weights: blocks 0-2 are re-gathered, once each
        assert forward["after"]["all_gather"] == 6 and backward["after"]["reduce_scatter"] == 6, name
        assert backward["after"]["all_gather"] == 3, (name, backward["after"])
        ac = report["activation_checkpointing"]
        if name == "off":
            assert ac == {}
            continue
        assert ac["modules"] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
        assert ac["traced"] == ac["modules"] and ac["policy"] == name and ac["recompute"] > 100
        assert f"activation checkpointing ({name}): 4 modules" in fo.format_report(report)
    # recomputing a whole block needs every one of its parameters in backward (biases and
    # norm weights too), before the bucketing makes them one gather per block
    assert (
        results["full"][1]["backward"]["before"]["all_gather"] > results["off"][1]["backward"]["before"]["all_gather"]
    )
    assert results["matmuls_saved"][1]["activation_checkpointing"]["saved_by_policy"] > 0


def test_transformers_llama_checkpointed_layers_compile():
    with fake_world(2):
        model = _hf.build("llama")
        fo.parallelize(model, backend="aot_eager", activation_checkpointing=HF_LAYERS)
        ids = _hf.batches(1, 2)[0]
        with SavedActivations(model) as saved:
            loss = _hf.loss(model, ids)
        loss.backward()
        report = fo.schedule_report(model)
    assert report["activation_checkpointing"]["traced"] == ["model.layers.0", "model.layers.1"]
    assert saved.count > 0


def test_gradient_checkpointing_enable_becomes_activation_checkpointing():
    """transformers' own switch: its layers are checkpointed the plugin's way, its
    checkpoint call (which does not compile on sharded parameters) is off."""
    with fake_world(2):
        model = _hf.build("llama")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5: a deprecated alias
            model.gradient_checkpointing_enable()
        fo.parallelize(model, backend="aot_eager")
        loss = _hf.loss(model, _hf.batches(1, 2)[0])
        loss.backward()
        report = fo.schedule_report(model)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert report["activation_checkpointing"]["modules"] == ["model.layers.0", "model.layers.1"]
    assert report["activation_checkpointing"]["traced"] == ["model.layers.0", "model.layers.1"]
    assert any("transformers gradient checkpointing (2 layers)" in note for note in report["adjustments"])


def test_gradient_checkpointing_on_a_module_that_is_not_a_layer_is_refused():
    model = _hf.build("llama")
    model.model.norm.gradient_checkpointing = True  # what a pre-GradientCheckpointingLayer model flags
    with fake_world(2), pytest.raises(OverlapConfigError, match="activation_checkpointing instead"):
        fo.parallelize(model, backend="aot_eager")


def test_policy_is_checked():
    with pytest.raises(
        OverlapConfigError, match="activation_checkpointing_policy: unknown value 'matmul'.*matmuls_saved"
    ):
        fo.OverlapConfig(activation_checkpointing_policy="matmul")
    with fake_world(2), pytest.raises(OverlapConfigError, match="activation_checkpointing lists none"):
        fo.parallelize(make_model(), activation_checkpointing_policy="matmuls_saved")


def test_a_checkpointed_module_the_forward_never_runs_is_named():
    class Unused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = make_model()
            self.spare = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.gpt(x)

    x, y = batches(1)[0]
    with fake_world(2):
        model = Unused()
        fo.parallelize(model, backend="aot_eager", activation_checkpointing=["gpt.blocks.0", "spare"])
        with pytest.warns(UserWarning, match="lists spare, which the compiled forward never ran"):
            loss_fn(model(x[:2]), y[:2]).backward()


# ----------------------------------------------------------------------------- 2 gloo ranks
GPT_VARIANTS = {  # name -> (backend, config)
    "aot_eager off": ("aot_eager", {}),
    "aot_eager full": ("aot_eager", {"activation_checkpointing": GPT_BLOCKS}),
    "aot_eager full, passes off": (
        "aot_eager",
        {"activation_checkpointing": GPT_BLOCKS, "manual_bucketing": False, "overlap_grad_reduce": False},
    ),
    "aot_eager matmuls_saved": (
        "aot_eager",
        {"activation_checkpointing": GPT_BLOCKS, "activation_checkpointing_policy": "matmuls_saved"},
    ),
    "inductor full": ("inductor", {"activation_checkpointing": GPT_BLOCKS}),
    "eager full": ("aot_eager", {"activation_checkpointing": GPT_BLOCKS, "compile": False}),
    "eager matmuls_saved": (
        "aot_eager",
        {"activation_checkpointing": GPT_BLOCKS, "activation_checkpointing_policy": "matmuls_saved", "compile": False},
    ),
    "bf16 off": ("aot_eager", {"param_dtype": "bf16", "reduce_dtype": "fp32"}),
    "bf16 full": ("aot_eager", {"param_dtype": "bf16", "reduce_dtype": "fp32", "activation_checkpointing": GPT_BLOCKS}),
}
HF_VARIANTS = {  # name -> (family, backend, config, call gradient_checkpointing_enable)
    "llama off": ("llama", "aot_eager", {}, False),
    "llama full": ("llama", "aot_eager", {"activation_checkpointing": HF_LAYERS}, False),
    "llama gradient_checkpointing_enable": ("llama", "aot_eager", {}, True),
    "llama inductor full": ("llama", "inductor", {"activation_checkpointing": HF_LAYERS}, False),
    "mixtral off": ("mixtral", "aot_eager", {}, False),
    "mixtral full": ("mixtral", "aot_eager", {"activation_checkpointing": HF_LAYERS}, False),
    "mixtral matmuls_saved": (
        "mixtral",
        "aot_eager",
        {"activation_checkpointing": HF_LAYERS, "activation_checkpointing_policy": "matmuls_saved"},
        False,
    ),
}


def _first_step_saved(model, step) -> tuple[int, int]:
    with SavedActivations(model) as saved:
        loss = step()
    loss.backward()
    return saved.count, saved.bytes


def _run(model, train, saved_step) -> dict:
    losses = train(model)
    saved = _first_step_saved(model, saved_step)  # after training: compiled, the numbers already taken
    report = fo.schedule_report(model)
    return {
        "losses": losses,
        "params": full_params(model),
        "saved": saved,
        "report": {
            k: report.get(k) for k in ("forward", "backward", "activation_checkpointing", "adjustments", "reshard")
        },
    }


def _activations(run: dict) -> int:
    """Bytes saved for backward less the gathered parameters of the buckets the forward
    keeps for it (the last bucket, and the block before it where that one is smaller: the
    same in a run with checkpointing and without; none in eager FSDP2)."""
    return run["saved"][1] - ((run["report"].get("reshard") or {}).get("kept_bytes") or 0)


def _job(rank: int, world: int) -> dict:
    out: dict = {"gpt": {}, "hf": {}}
    base = make_model()
    data = batches(STEPS)
    out["gpt"]["reference"] = train_reference(base, steps=STEPS) if rank == 0 else None
    x, y = (local_slice(t, rank, world) for t in data[0])
    for name, (backend, config) in GPT_VARIANTS.items():
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        fo.parallelize(model, backend=backend, **config)
        out["gpt"][name] = _run(
            model,
            lambda m: train_sharded(m, rank, world, steps=STEPS),
            lambda m=model: loss_fn(m(x), y),
        )
    hf_data = _hf.batches(1, 4) * STEPS
    ids = local_slice(hf_data[0], rank, world)
    for family in ("llama", "mixtral"):
        hf_base = _hf.build(family)
        out["hf"][f"{family} reference"] = _hf.train_reference(hf_base, hf_data, LR) if rank == 0 else None
        out["hf"][f"{family} expected"] = _hf.expected_collectives(hf_base, fo.auto_plan(hf_base))
        for name, (fam, backend, config, enable) in HF_VARIANTS.items():
            if fam != family:
                continue
            torch._dynamo.reset()
            model = copy.deepcopy(hf_base)
            if enable:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    model.gradient_checkpointing_enable()
            fo.parallelize(model, backend=backend, **config)
            out["hf"][name] = _run(
                model,
                lambda m: _hf.train_sharded(m, rank, world, hf_data, LR),
                lambda m=model: _hf.loss(m, ids),
            )
    return out


@pytest.fixture(scope="module")
def trained():
    return run_ranks(_job, world=2, timeout=1500)[0]


def _bitwise(a: dict, b: dict, what: str) -> None:
    assert a["losses"] == b["losses"], (what, a["losses"], b["losses"])
    for key, value in b["params"].items():
        assert torch.equal(a["params"][key], value), (what, key)


def _close(run: dict, reference: tuple, tol: float, what: str) -> None:
    ref_losses, ref_params = reference
    for a, b in zip(run["losses"], ref_losses):
        assert math.isclose(a, b, rel_tol=tol, abs_tol=tol), (what, run["losses"], ref_losses)
    for key, value in ref_params.items():
        torch.testing.assert_close(run["params"][key], value, rtol=tol, atol=tol, msg=f"{what} {key}")


@pytest.mark.slow
@pytest.mark.newest_torch  # CI runs it on 2.15, the newest torch of .ci/run
def test_gpt_checkpointed_trains_like_one_process(trained):
    gpt = trained["gpt"]
    off = gpt["aot_eager off"]
    # aot_eager: recomputing gives the very same numbers, with the passes on and off
    for name in ("aot_eager full", "aot_eager full, passes off", "aot_eager matmuls_saved"):
        _bitwise(gpt[name], off, name)
    for name in ("aot_eager full", "aot_eager matmuls_saved", "eager full", "eager matmuls_saved"):
        _close(gpt[name], gpt["reference"], 1e-5, name)
    # matmuls_saved is a recompute policy, the same for both backends: aot_eager runs it above
    _close(gpt["inductor full"], gpt["reference"], 1e-4, "inductor full")


@pytest.mark.slow
@pytest.mark.newest_torch  # CI runs it on 2.15, the newest torch of .ci/run
def test_gpt_checkpointed_saves_less_and_regathers_once_per_block(trained):
    gpt = trained["gpt"]
    off, full, selective = (_activations(gpt[f"aot_eager {k}"]) for k in ("off", "full", "matmuls_saved"))
    assert full < selective < off, (full, selective, off)
    for backend in ("aot_eager", "inductor"):
        assert _activations(gpt[f"{backend} full"]) < 0.4 * off
    # the eager FSDP2 path (torch.utils.checkpoint) saves as little
    assert _activations(gpt["eager full"]) < 0.4 * off
    assert _activations(gpt["eager matmuls_saved"]) < off
    for name, run in gpt.items():
        if name == "reference" or name.startswith("eager") or "passes off" in name:
            continue  # no pass ran: no counts recorded
        report = run["report"]
        assert report["forward"]["after"]["all_gather"] == 6, name
        assert report["backward"]["after"]["reduce_scatter"] == 6, name
        # blocks 0-2 re-gathered; blocks.3 stays gathered with norm + head (smaller than a block)
        kept = [k.split(" [")[0] for k in report["reshard"]["kept_buckets"]]
        assert kept == ["bucket 5", "bucket 4"], (name, report["reshard"])
        assert report["backward"]["after"]["all_gather"] == 3, (name, report["backward"]["after"])


@pytest.mark.slow
@pytest.mark.newest_torch  # CI runs it on 2.15, the newest torch of .ci/run
def test_bf16_checkpointed_equals_bf16_without(trained):
    gpt = trained["gpt"]
    _bitwise(gpt["bf16 full"], gpt["bf16 off"], "bf16")
    assert max(abs(a - b) for a, b in zip(gpt["bf16 full"]["losses"], gpt["aot_eager off"]["losses"])) > 1e-4
    assert _activations(gpt["bf16 full"]) < 0.4 * _activations(gpt["bf16 off"])


@pytest.mark.slow
@pytest.mark.newest_torch  # CI runs it on 2.15, the newest torch of .ci/run
def test_transformers_families_checkpointed_train_like_one_process(trained):
    hf = trained["hf"]
    for family in ("llama", "mixtral"):
        off = hf[f"{family} off"]
        reference = hf[f"{family} reference"]
        full = hf[f"{family} full"]
        _bitwise(full, off, f"{family} full")
        _close(full, reference, 1e-5, f"{family} full")
        assert _activations(full) < 0.5 * _activations(off), (family, full["saved"], off["saved"])
        gathers, reductions = hf[f"{family} expected"]
        for name in (f"{family} off", f"{family} full"):
            forward, backward = hf[name]["report"]["forward"], hf[name]["report"]["backward"]
            assert forward["after"]["all_gather"] == gathers and backward["after"]["reduce_scatter"] == reductions
            # one re-gather per decoder layer's bucket, checkpointed or not, but for the
            # buckets kept gathered: the last (norm + lm_head) and, where it gathers fewer
            # bytes than a layer, the last layer too
            kept = hf[name]["report"]["reshard"]["kept_buckets"]
            layers_kept = sum(1 for k in kept if "'model.layers." in k)
            assert len(kept) == 1 + layers_kept and all("'model.layers.1'" in k for k in kept[1:]), (name, kept)
            assert backward["after"]["all_gather"] == 2 - layers_kept, (name, backward["after"], kept)
        assert full["report"]["activation_checkpointing"]["traced"] == ["model.layers.0", "model.layers.1"]
    _bitwise(hf["llama gradient_checkpointing_enable"], hf["llama full"], "gradient_checkpointing_enable")
    _close(hf["llama inductor full"], hf["llama reference"], 1e-4, "llama inductor")
    selective = hf["mixtral matmuls_saved"]
    _bitwise(selective, hf["mixtral off"], "mixtral matmuls_saved")
    assert _activations(hf["mixtral full"]) < _activations(selective) < _activations(hf["mixtral off"])
