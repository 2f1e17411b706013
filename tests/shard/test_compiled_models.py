"""A model that arrives already compiled, or is changed after prepare (issue 54, items 2 and 3).

Whatever way a user arrives, the run gets the plugin (sharded, compiled by the plugin,
passes on, the summary printed) or stops with a clear error. Before this, a
``torch.compile(model)`` given to ``parallelize`` trained with the user's compile and
per-parameter gathers while the summary said "both passes on" (plan names
``_orig_mod.*``), and ``gradient_checkpointing_enable()`` after prepare crashed in AOT
autograd (``tensors_saved_with_vc_check ... DeviceMesh``).

Quick tests: a fake 2-rank process group (what was compiled, the messages), or one real
gloo rank (numbers, bitwise). The slow job trains on 2 gloo ranks against one process.
"""

from __future__ import annotations

import copy
import math
import warnings

import _hf
import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from _dist import run_ranks
from _fake import fake_world, process_group
from _train import batches, full_params, make_model, train_reference, train_sharded

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.models import loss_fn
from fsdp_overlap_plugin.shard.takeover import ChangedAfterPrepareError, CompiledModelError

# Dynamo's wrappers and in-place compiles are taken apart here: the quick tests also run on
# every torch of the CI matrix
pytestmark = pytest.mark.torch_sensitive

AOT = {"backend": "aot_eager"}
TAKEN_OVER = "fsdp-overlap: the model was already compiled ("
PLUGIN_COMPILES = (
    "The plugin compiles it once itself, with its passes; the torch.compile arguments are not used "
    "(set backend, fullgraph or dynamic in the plugin's config instead)."
)


def _gpt() -> torch.nn.Module:
    return make_model(n_layer=2)  # plan: embeddings, blocks.0, blocks.1, norm + head


def _step(model, n: int = 1) -> None:
    x, y = batches(1)[0]
    for _ in range(n):
        loss_fn(model(x[:2]), y[:2]).backward()


def _bucketed(model) -> dict:
    """What the passes did on the first step: the plugin's graphs, bucketed."""
    report = fo.schedule_report(model)
    assert report["forward"]["after"]["all_gather"] == 4, report["forward"]  # one per plan entry
    assert report["backward"]["after"]["reduce_scatter"] == 4, report["backward"]
    assert all("_orig_mod" not in fqn for entry in report["plan"] for fqn in entry), report["plan"]
    assert fo.format_report(report).splitlines()[0].endswith("compiled with aot_eager, both passes on")
    return report


def _one_rank():
    return process_group("gloo", dist.HashStore(), 1)


# ------------------------------------------------------------------ compiled before prepare
def test_torch_compile_wrapper_is_taken_over_and_its_module_returned(capsys):
    with fake_world(2):
        inner = _gpt()
        wrapped = torch.compile(inner, backend="eager", mode=None)
        out = fo.parallelize(wrapped, **AOT)
        assert out is inner and type(out).__name__ == "GPT"
        assert all("_orig_mod" not in key for key in out.state_dict())
        _step(out)
        report = _bucketed(out)
        # the wrapper the user kept still runs the plugin's compiled forward (its Dynamo stops at it)
        _step(wrapped)
        assert fo.schedule_report(wrapped)["forward"]["after"]["all_gather"] == 4
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith(TAKEN_OVER))
    assert line == TAKEN_OVER + "torch.compile(model) given: the module inside it is prepared). " + PLUGIN_COMPILES
    assert report["adjustments"][0] == "torch.compile(model) given: the module inside it is prepared"
    assert "adjusted: torch.compile(model) given" in fo.format_report(report)


def test_compile_in_place_compiled_forward_and_compiled_blocks_are_undone(capsys):
    with fake_world(2):
        model = _gpt()
        model.compile(backend="eager")
        model.blocks[1].compile(backend="eager")
        model.blocks[0] = torch.compile(model.blocks[0], backend="eager")
        model.forward = torch.compile(model.forward, backend="eager")
        model.head.forward = torch.compile(model.head.forward, backend="eager")  # a torch.nn module's: wrapped twice
        out = fo.parallelize(model, **AOT)
        assert out is model and "forward" not in vars(model) and "forward" not in vars(model.head)
        assert all(vars(b).get("_compiled_call_impl") is None for b in model.blocks)
        assert type(model.blocks[0]).__name__ == "Block"  # no wrapper left
        _step(model)
        report = _bucketed(model)
    # blocks.0 stays a block of its own: the auto plan sees it as one of the repeated blocks
    assert report["plan"][1] == ["blocks.0"]
    assert report["adjustments"][:3] == [
        "torch.compile(...) around blocks.0: replaced by the module inside",
        ".compile() on the model, blocks.1: undone",
        "forward = torch.compile(forward) on the model, head: undone",
    ]
    assert capsys.readouterr().err.count(TAKEN_OVER) == 1  # one line for all of it


def test_taken_over_compile_trains_bitwise_like_the_plain_model():
    """One gloo rank: parallelize(torch.compile(model)) and parallelize(model) give the
    same losses and weights, bit for bit (the same graphs, compiled by the plugin)."""
    runs = []
    for compiled in (False, True):
        with _one_rank():
            model = _gpt()
            model = fo.parallelize(torch.compile(model) if compiled else model, **AOT)
            runs.append((train_sharded(model, 0, 1, steps=3), full_params(model)))
    (losses, params), (losses_c, params_c) = runs
    assert losses_c == losses and len(set(losses)) == 3
    assert all(torch.equal(params_c[k], v) for k, v in params.items())


def test_disabled_model_or_forward_cannot_be_taken_over():
    with fake_world(2):
        with pytest.raises(CompiledModelError, match=r"the model is wrapped in torch\.compiler\.disable"):
            fo.parallelize(torch.compiler.disable(_gpt()), **AOT)
        model = _gpt()
        model.blocks[1].forward = torch.compiler.disable(model.blocks[1].forward)
        with pytest.raises(CompiledModelError, match=r"blocks\.1\.forward is wrapped in torch\.compiler\.disable"):
            fo.parallelize(model, **AOT)
        model = _gpt()
        model.forward = torch.compile(lambda x: x, backend="eager")
        with pytest.raises(CompiledModelError, match=r"not a method of the module.*Remove the torch\.compile"):
            fo.parallelize(model, **AOT)


# ---------------------------------------------------------------- compiled after prepare
@pytest.mark.parametrize("fullgraph", [False, True])
def test_torch_compile_around_the_prepared_model_runs_the_plugin_inside(fullgraph, capsys):
    with fake_world(2):
        model = fo.parallelize(_gpt(), **AOT)
        _step(torch.compile(model, backend="eager", fullgraph=fullgraph), n=2)
        report = _bucketed(model)
    note = report["adjustments"][-1]
    assert note.startswith("the model is called through a torch.compile(...) wrapper")
    assert f"fsdp-overlap: {note}." in capsys.readouterr().err


def test_compile_of_the_prepared_model_in_place_is_an_error():
    with fake_world(2):
        model = fo.parallelize(_gpt(), **AOT)
        model.compile(backend="eager")
        with pytest.raises(ChangedAfterPrepareError, match="compiled by a torch.compile other than the plugin's"):
            _step(model)
    with fake_world(2):  # a fresh Dynamo: the first compile's cached frames would run the second model
        model = fo.parallelize(_gpt(), **AOT)
        model.compile(backend="eager", fullgraph=True)  # Dynamo's own error, quoting ours
        with pytest.raises(Exception, match="compiled by a torch.compile other than the plugin's"):
            _step(model)


def test_compiled_forward_after_prepare_is_undone_before_the_first_step_refused_after():
    with fake_world(2):
        model = fo.parallelize(_gpt(), **AOT)
        model.forward = torch.compile(model.forward, backend="eager")
        _step(model)
        report = _bucketed(model)
        assert "forward" not in vars(model)
        assert report["adjustments"][-1] == (
            "compiled after prepare, before the first step: forward = torch.compile(forward) on the model: undone"
        )
        model.forward = torch.compile(model.forward, backend="eager")
        with pytest.raises(ChangedAfterPrepareError, match=r"replaced by torch\.compile\(\.\.\.\) after its first"):
            _step(model)


def test_cast_after_prepare_is_an_error_naming_the_call():
    with fake_world(2):
        model = fo.parallelize(_gpt(), **AOT)
        model.to(torch.bfloat16)
        x, _ = batches(1)[0]
        with pytest.raises(
            ChangedAfterPrepareError,
            match=r"parameter tok_emb\.weight changed dtype after prepare \(float32 -> bfloat16\): model\.to\(dtype\)"
            r".*set param_dtype",
        ):
            model(x[:2])
        # after a step torch itself refuses the cast: the compiled frames hold the parameters
        model = fo.parallelize(_gpt(), **AOT)
        _step(model)
        with pytest.raises(RuntimeError, match="Couldn't swap"):
            model.half()


def test_replaced_module_after_prepare_is_an_error():
    with fake_world(2):
        model = fo.parallelize(_gpt(), **AOT)
        _step(model)
        model.head = torch.nn.Linear(model.head.in_features, model.head.out_features, bias=False)
        with pytest.raises(
            ChangedAfterPrepareError, match=r"module head was replaced \(FSDPOverlapLinear -> Linear\) after prepare"
        ):
            _step(model)


def test_a_module_called_on_its_own_is_said_once():
    """Code that calls a module of the prepared model directly bypasses the plugin's
    compiled forward: it runs, uncompiled, and the first such gather says so."""
    with fake_world(2):
        model = fo.parallelize(_gpt(), **AOT)
        _step(model)
        x = torch.randn(2, 16, model.head.in_features)
        with pytest.warns(UserWarning, match=r"parameter head\.weight was gathered outside the plugin's compiled"):
            model.head(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model.head(x)  # once per model
            _step(model)  # the compiled forward: no warning


def test_no_graph_for_the_plugin_is_an_error():
    """A forward the plugin's Dynamo never traces (here: Dynamo switched off) is a run without
    the plugin: the first call says so instead of training on."""
    with fake_world(2), torch._dynamo.config.patch(disable=True):  # (monkeypatch's undo deletes config entries)
        model = fo.parallelize(_gpt(), fullgraph=False, **AOT)  # fullgraph: Dynamo's own error first
        with pytest.raises(ChangedAfterPrepareError, match=r"no graph \(Dynamo is switched off: TORCHDYNAMO_DISABLE"):
            _step(model)


def test_report_before_the_first_step_says_the_passes_have_not_run():
    with fake_world(2):
        model = fo.parallelize(_gpt(), **AOT)
        text = fo.format_report(fo.schedule_report(model))
    assert text.splitlines()[0] == (
        "fsdp-overlap summary: 2 ranks, compiled with aot_eager; the passes (both on) have not run on anything yet"
    )
    assert "both passes on" not in text


# ------------------------------------------------------ transformers' gradient checkpointing
def _enable(model) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5: a deprecated alias
        model.gradient_checkpointing_enable()


def _disable(model) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_disable()


def _llama_steps(when: str, steps: int = 2) -> tuple[list[float], dict, dict]:
    """One gloo rank, a tiny Llama: gradient_checkpointing_enable() ``when`` ("before" or
    "after" parallelize, "never", or "before, disabled after")."""
    with _one_rank():
        model = _hf.build("llama")
        if when.startswith("before"):
            _enable(model)
        fo.parallelize(model, **AOT)
        if when == "after":
            _enable(model)
        if when == "before, disabled after":
            _disable(model)
        data = _hf.batches(steps, 2)
        losses = _hf.train_sharded(model, 0, 1, data, 0.5)
        return losses, full_params(model), fo.schedule_report(model)


def test_gradient_checkpointing_enable_after_prepare_is_taken_over_bitwise():
    before, after = _llama_steps("before"), _llama_steps("after")
    assert after[0] == before[0]
    assert all(torch.equal(after[1][k], v) for k, v in before[1].items())
    layers = ["model.layers.0", "model.layers.1"]
    for report in (before[2], after[2]):
        assert report["activation_checkpointing"]["modules"] == layers
        assert report["activation_checkpointing"]["traced"] == layers
    assert after[2]["adjustments"][-1] == (
        "transformers gradient checkpointing (2 layers, switched on after prepare, before the first step) runs as "
        "activation_checkpointing ['model.layers.0', 'model.layers.1']: transformers' own checkpoint call is off"
    )


def test_gradient_checkpointing_disable_after_prepare_is_taken_over_bitwise():
    never, disabled = _llama_steps("never"), _llama_steps("before, disabled after")
    assert disabled[0] == never[0]
    assert all(torch.equal(disabled[1][k], v) for k, v in never[1].items())
    assert disabled[2]["activation_checkpointing"] == {} and never[2]["activation_checkpointing"] == {}
    assert disabled[2]["adjustments"][-1] == (
        "transformers gradient checkpointing switched off after prepare, before the first step: "
        "['model.layers.0', 'model.layers.1'] no longer recomputed"
    )


@pytest.mark.parametrize("call", ["gradient_checkpointing_enable()", "gradient_checkpointing_disable()"])
def test_gradient_checkpointing_switched_after_the_first_step_is_an_error(call):
    with fake_world(2):
        model = _hf.build("llama")
        if call.endswith("disable()"):
            _enable(model)
        fo.parallelize(model, **AOT)
        ids = _hf.batches(1, 2)[0]
        _hf.loss(model, ids).backward()
        (_disable if call.endswith("disable()") else _enable)(model)
        with pytest.raises(ChangedAfterPrepareError, match=rf"{call[:-2]}\(\) was called after the model's first"):
            _hf.loss(model, ids)


def test_gradient_checkpointing_enable_again_after_the_first_step_changes_nothing():
    """Enabled before prepare and again later: the same layers, already checkpointed."""
    with fake_world(2):
        model = _hf.build("llama")
        _enable(model)
        fo.parallelize(model, **AOT)
        ids = _hf.batches(1, 2)[0]
        _hf.loss(model, ids).backward()
        _enable(model)
        _hf.loss(model, ids).backward()
        assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        assert len(fo.schedule_report(model)["recompiles"]) == 0


# ----------------------------------------------------------------------------- 2 gloo ranks
def _job(rank: int, world: int) -> dict:
    out: dict = {}
    torch._dynamo.reset()
    base = _gpt()
    out["gpt reference"] = train_reference(base, steps=3) if rank == 0 else None
    model = fo.parallelize(torch.compile(copy.deepcopy(base)), **AOT)
    out["gpt compiled"] = {"losses": train_sharded(model, rank, world, steps=3), "params": full_params(model)}
    hf_base = _hf.build("llama")
    data = _hf.batches(3, 4)
    out["llama reference"] = _hf.train_reference(hf_base, data, 0.5) if rank == 0 else None
    for when in ("before", "after"):
        torch._dynamo.reset()
        model = copy.deepcopy(hf_base)
        if when == "before":
            _enable(model)
        fo.parallelize(model, **AOT)
        if when == "after":
            _enable(model)
        losses = _hf.train_sharded(model, rank, world, data, 0.5)
        out[f"llama {when}"] = {
            "losses": losses,
            "params": full_params(model),
            "traced": fo.schedule_report(model)["activation_checkpointing"]["traced"],
        }
    return out


def _close(run: dict, reference: tuple, what: str, tol: float = 1e-5) -> None:
    losses, params = reference
    assert all(math.isclose(a, b, rel_tol=tol, abs_tol=tol) for a, b in zip(run["losses"], losses)), (what, run)
    for key, value in params.items():
        torch.testing.assert_close(run["params"][key], value, rtol=tol, atol=tol, msg=f"{what} {key}")


@pytest.mark.slow
@pytest.mark.newest_torch  # CI runs it on 2.15, the newest torch of .ci/run
def test_two_ranks_train_like_one_process():
    """parallelize(torch.compile(model)), and gradient_checkpointing_enable() after prepare,
    on 2 gloo ranks: the losses and weights of one unsharded process (1e-5); late
    checkpointing bit for bit what checkpointing enabled before prepare gives."""
    out = run_ranks(_job, world=2, timeout=600)[0]
    _close(out["gpt compiled"], out["gpt reference"], "torch.compile(model)")
    _close(out["llama after"], out["llama reference"], "gradient_checkpointing_enable() after prepare")
    assert out["llama after"]["losses"] == out["llama before"]["losses"]
    assert all(torch.equal(out["llama after"]["params"][k], v) for k, v in out["llama before"]["params"].items())
    assert out["llama after"]["traced"] == ["model.layers.0", "model.layers.1"]
