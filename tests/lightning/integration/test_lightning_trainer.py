"""``Trainer(strategy="fsdp_overlap")`` on 2 real gloo ranks, checked with numbers.

One ``run_ranks`` job runs every scenario (process start-up and imports are paid once);
each test reads its part. The Trainer is built inside each rank (see tests/_lightning.py:
no Lightning launcher is involved). Scenarios use ``backend="aot_eager"`` and a 2-block
GPT to stay quick; ``test_plain_string_inductor_matches_core`` runs the plain string with
its defaults (inductor, passes on).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch._dynamo
from _dist import run_ranks
from _lightning import (
    LitGPT,
    RecordInitial,
    close,
    core_run,
    dataset,
    full_params,
    global_batches,
    loader,
    mean_over_ranks,
    rank_batches,
    reference_run,
    standalone_lit_gpt,
    trainer,
)
from torch.utils.data import TensorDataset

from fsdp_overlap_plugin.lightning import FSDPOverlapStrategy
from fsdp_overlap_plugin.models import gpt_small, loss_fn

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]

GPT = {"n_layer": 2}
FAST = {"backend": "aot_eager"}  # passes stay on: they never change numbers, only order


def _strategy(**kwargs) -> FSDPOverlapStrategy:
    return FSDPOverlapStrategy(**{**FAST, **kwargs})


def _core_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return gpt_small(**GPT)


# --------------------------------------------------------------------------- scenarios
def _basic_and_resume(rank: int, world: int, root: str) -> dict:
    """6 AdamW steps over 2 epochs (Lightning shuffles per epoch), a checkpoint at the end of epoch 0; then
    resumed from it (sharded and full) into a differently initialised model."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = dataset(12)  # 6 per rank = 3 steps per epoch
    out: dict = {}
    torch._dynamo.reset()
    lit = LitGPT(seed=0, optimizer="adamw", lr=3e-3, **GPT)
    ckpt = ModelCheckpoint(dirpath=f"{root}/sharded", filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    tr = trainer(root, max_epochs=2, strategy=_strategy(), enable_checkpointing=True, callbacks=[ckpt])
    tr.fit(lit, loader(data))
    out["losses"] = lit.losses
    out["metrics"] = {k: float(v) for k, v in tr.callback_metrics.items() if k.startswith("fsdp_overlap/")}
    out["report"] = tr.strategy.schedule_report
    out["param_type"] = type(next(lit.model.parameters())).__name__
    out["core"] = core_run(_core_model(0), rank_batches(data, rank, world, 2), optimizer="adamw", lr=3e-3, **FAST)[
        "losses"
    ]
    sharded = f"{root}/sharded/epoch=0.ckpt"
    out["sharded_files"] = sorted(os.listdir(sharded))

    torch._dynamo.reset()
    lit = LitGPT(seed=1, optimizer="adamw", lr=3e-3, **GPT)
    trainer(root, max_epochs=2, strategy=_strategy()).fit(lit, loader(data), ckpt_path=sharded)
    out["resumed_sharded"] = lit.losses

    # Full state dict on request: one file written by rank 0, read back by every rank.
    torch._dynamo.reset()
    lit = LitGPT(seed=0, optimizer="adamw", lr=3e-3, **GPT)
    full_ckpt = ModelCheckpoint(dirpath=f"{root}/full", filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    strategy = _strategy(save_distributed_checkpoint=False)
    trainer(root, max_epochs=1, strategy=strategy, enable_checkpointing=True, callbacks=[full_ckpt]).fit(
        lit, loader(data)
    )
    out["full_first_epoch"] = lit.losses
    full = f"{root}/full/epoch=0.ckpt"
    out["full_is_file"] = os.path.isfile(full)
    if rank == 0:
        saved = torch.load(full, map_location="cpu", weights_only=False)
        out["full_shapes"] = {k: tuple(v.shape) for k, v in saved["state_dict"].items()}
    torch._dynamo.reset()
    lit = LitGPT(seed=1, optimizer="adamw", lr=3e-3, **GPT)
    strategy = _strategy(save_distributed_checkpoint=False)
    trainer(root, max_epochs=2, strategy=strategy).fit(lit, loader(data), ckpt_path=full)
    out["resumed_full"] = lit.losses
    return out


def _clipping(rank: int, world: int, root: str) -> dict:
    """gradient_clip_val by norm on sharded gradients vs one process, unsharded. Run with
    the standalone ``pytorch_lightning`` package (its own strategy class and registry)."""
    from fsdp_overlap_plugin.lightning.standalone import FSDPOverlapStrategy as StandaloneStrategy

    clip = 0.1
    data = dataset(8)
    torch._dynamo.reset()
    lit = standalone_lit_gpt()(seed=0, **GPT)
    strategy = StandaloneStrategy(**FAST)
    trainer(root, standalone=True, max_epochs=1, strategy=strategy, gradient_clip_val=clip).fit(lit, loader(data))
    per_rank = [rank_batches(data, r, world, 1) for r in range(world)]
    ref = reference_run(_core_model(0), global_batches(per_rank), clip=clip) if rank == 0 else None
    unclipped = reference_run(_core_model(0), global_batches(per_rank)) if rank == 0 else None
    return {
        "losses": [mean_over_ranks(x) for x in lit.losses],
        "params": full_params(lit.model),
        "ref": ref,
        "unclipped": unclipped,
        "clip": clip,
        "trainer": type(lit.trainer).__module__,
    }


def _accumulation(rank: int, world: int, root: str) -> dict:
    """accumulate_grad_batches=2 of 1 sequence per rank == one process on 4 sequences."""
    data = dataset(12)
    torch._dynamo.reset()
    lit = LitGPT(seed=0, **GPT)
    tr = trainer(root, max_epochs=1, strategy=_strategy(), accumulate_grad_batches=2)
    tr.fit(lit, loader(data, batch=1))
    per_rank = [rank_batches(data, r, world, 1, batch=1) for r in range(world)]
    ref = reference_run(_core_model(0), global_batches(per_rank, group=2)) if rank == 0 else None
    steps = [mean_over_ranks((a + b) / 2) for a, b in zip(lit.losses[::2], lit.losses[1::2])]
    return {
        "losses": steps,
        "micro": len(lit.losses),
        "global_step": tr.global_step,
        "params": full_params(lit.model),
        "ref": ref,
    }


def _precision(rank: int, world: int, root: str) -> dict:
    """bf16-mixed and bf16-true vs the core with the same dtypes (and autocast)."""
    data = dataset(8)
    batches = rank_batches(data, rank, world, 1)
    out = {}
    for key, precision, core_dtype, core_kwargs in (
        ("mixed", "bf16-mixed", torch.float32, {"autocast": torch.bfloat16, "reduce_dtype": "fp32"}),
        ("true", "bf16-true", torch.bfloat16, {"default_dtype": torch.bfloat16, "reduce_dtype": "bf16"}),
    ):
        torch._dynamo.reset()
        lit = LitGPT(seed=0, **GPT)
        tr = trainer(root, max_epochs=1, strategy=_strategy(), precision=precision)
        tr.fit(lit, loader(data))
        core = core_run(_core_model(0).to(core_dtype), batches, param_dtype="bf16", **core_kwargs, **FAST)
        out[key] = {
            "losses": lit.losses,
            "core": core["losses"],
            "config": (tr.strategy.overlap_config.param_dtype, tr.strategy.overlap_config.reduce_dtype),
            "dtypes": {p.dtype for p in lit.parameters()},
        }
    # fp32, with validation during fit and trainer.validate() afterwards (setup runs
    # again on the already parallelized model; no_grad forward = an inference graph).
    torch._dynamo.reset()
    lit = LitGPT(seed=0, **GPT)
    val = dataset(4, seed=99)
    tr = trainer(root, max_epochs=1, strategy=_strategy())
    tr.fit(lit, loader(data), val_dataloaders=loader(val, batch=1))
    tr.validate(lit, loader(val, batch=1), verbose=False)
    eager = gpt_small(**GPT)
    eager.load_state_dict(full_params(lit.model))
    with torch.no_grad():  # the ranks' validation samples (DistributedSampler, no shuffle)
        expected = [loss_fn(eager(x), y).item() for x, y in list(loader(val, batch=1))[rank::world]]
    out["fp32"] = lit.losses
    out["val"] = {"losses": lit.val_losses, "expected": expected * 2, "logged": float(tr.callback_metrics["val_loss"])}
    return out


def _checkpointing(rank: int, world: int, root: str) -> dict:
    """bf16-mixed with activation checkpointing of every block, vs the core with the same."""
    data = dataset(8)
    torch._dynamo.reset()
    lit = LitGPT(seed=0, **GPT)
    tr = trainer(root, max_epochs=1, strategy=_strategy(activation_checkpointing=["blocks.*"]), precision="bf16-mixed")
    tr.fit(lit, loader(data))
    core = core_run(
        _core_model(0),
        rank_batches(data, rank, world, 1),
        param_dtype="bf16",
        autocast=torch.bfloat16,
        reduce_dtype="fp32",
        activation_checkpointing=["blocks.*"],
        **FAST,
    )
    return {
        "losses": lit.losses,
        "core": core["losses"],
        "checkpointing": tr.strategy.schedule_report["activation_checkpointing"],
    }


def _configure_model(rank: int, world: int, root: str) -> dict:
    """A model built on the meta device in configure_model, materialized on the shards."""
    data = dataset(8)
    torch._dynamo.reset()
    lit = LitGPT(meta=True, **GPT)
    tr = trainer(root, max_epochs=1, strategy=_strategy(), callbacks=[RecordInitial()])
    torch.manual_seed(7)
    tr.fit(lit, loader(data))
    with torch.device("meta"):
        meta_model = gpt_small(**GPT)
    batches = rank_batches(data, rank, world, 1)  # iterating a DataLoader draws a seed: before manual_seed
    torch.manual_seed(7)
    core = core_run(meta_model, batches, **FAST)
    return {"losses": lit.losses, "initial": lit.initial, "core": core}


def _compiled_child(rank: int, world: int, root: str) -> dict:
    """``self.model = torch.compile(self.model)`` in configure_model: the strategy puts the
    module inside the wrapper back on the LightningModule and compiles it itself, with the
    passes (issue 54: before, the user's compile ran, gathering per parameter)."""

    class CompiledChild(LitGPT):
        def configure_model(self) -> None:
            self.model = torch.compile(self.model, backend="eager")

    data = dataset(8)
    torch._dynamo.reset()
    lit = CompiledChild(seed=0, **GPT)
    tr = trainer(root, max_epochs=1, strategy=_strategy())
    tr.fit(lit, loader(data))
    core = core_run(_core_model(0), rank_batches(data, rank, world, 1), **FAST)
    return {
        "losses": lit.losses,
        "core": core["losses"],
        "child": type(lit.model).__name__,
        "keys": list(lit.state_dict()),
        "report": tr.strategy.schedule_report,
    }


def _plain_string(rank: int, world: int, root: str) -> dict:
    """The literal user line: strategy="fsdp_overlap" (bucket_plans auto, passes on, inductor)."""
    data = dataset(8)
    torch._dynamo.reset()
    lit = LitGPT(seed=0, **GPT)
    tr = trainer(root, max_epochs=1)  # strategy="fsdp_overlap"
    tr.fit(lit, loader(data))
    core = core_run(_core_model(0), rank_batches(data, rank, world, 1))
    return {"losses": lit.losses, "core": core["losses"], "report": tr.strategy.schedule_report}


def _lightning_cli(rank: int, world: int, root: str) -> dict:
    """examples/lightning_gpt.py under LightningCLI with configs/lightning.yaml (a few
    keys overridden on the command line, as a user would) vs the core with the YAML's
    plan, optimizer, clipping and seed."""
    import sys

    try:
        import jsonargparse  # noqa: F401  (LightningCLI's dependency: the dev extra)
    except ImportError as exc:  # fail this test only, not every scenario of the job
        return {"error": f"{exc}: install the dev extra (pip install -e '.[dev]')"}
    sys.path.insert(0, str(ROOT / "examples"))
    import lightning_gpt

    from fsdp_overlap_plugin.models import GPT as GPTModel
    from fsdp_overlap_plugin.models import GPTConfig

    torch._dynamo.reset()
    args = [
        "fit",
        "--config",
        str(ROOT / "configs/lightning.yaml"),
        "--trainer.max_steps=3",
        "--trainer.strategy.init_args.backend=aot_eager",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={root}",
        "--model.n_layer=2",
        "--data.samples=16",
        "--data.seq_len=16",
    ]
    try:
        cli = lightning_gpt.cli_main(args)
    finally:
        os.environ.pop("PL_GLOBAL_SEED", None)  # seed_everything: 0 sets it; later scenarios must not see it
    strategy = cli.trainer.strategy
    data = TensorDataset(*lightning_gpt.token_sequences(16, 16, 256, seed=1234))
    batches = rank_batches(data, rank, world, epochs=2, batch=4)[:3]  # 2 steps per epoch
    torch.manual_seed(0)  # seed_everything: 0
    model = GPTModel(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, d_model=64))
    plan = [["tok_emb", "pos_emb"], "blocks.*", ["norm", "head"]]
    core = core_run(model, batches, optimizer="adamw", lr=0.003, weight_decay=0.0, clip=1.0, bucket_plans=plan, **FAST)
    return {
        "losses": cli.model.losses,
        "core": core["losses"],
        "strategy": type(strategy).__name__,
        "bucket_plans": strategy.overlap_config.bucket_plans,
        "plan": strategy.schedule_report["plan"],
        "clip": cli.trainer.gradient_clip_val,
    }


def _bypass(rank: int, world: int, root: str) -> dict:
    """module="" compiles the LightningModule's forward; a training_step that calls
    self.model(x) bypasses it: the strategy says so after the first step."""
    import warnings

    class Direct(LitGPT):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return loss_fn(self.model(x), y)

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(root, max_steps=1, strategy=_strategy(module="")).fit(Direct(seed=0, **GPT), loader(dataset(8)))
    return {"warnings": [str(w.message) for w in caught if "fsdp_overlap" in str(w.message)]}


def _all(rank: int, world: int, root: str) -> dict:
    import time

    out, seconds = {}, {}
    for name, fn in [
        ("basic", _basic_and_resume),
        ("clipping", _clipping),
        ("accumulation", _accumulation),
        ("precision", _precision),
        ("checkpointing", _checkpointing),
        ("configure_model", _configure_model),
        ("compiled_child", _compiled_child),
        ("plain", _plain_string),
        ("bypass", _bypass),
        ("cli", _lightning_cli),
    ]:
        start = time.perf_counter()
        out[name] = fn(rank, world, f"{root}/{name}")
        seconds[name] = round(time.perf_counter() - start, 1)
    out["seconds"] = seconds
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = run_ranks(_all, str(tmp_path_factory.mktemp("lightning")), timeout=900)
    print("scenario seconds (rank 0):", out[0]["seconds"])
    return out


# ------------------------------------------------------------------------------- tests
def test_trainer_losses_equal_core_parallelize(results):
    for r in results:
        basic = r["basic"]
        assert len(basic["losses"]) == 6
        assert basic["losses"] == basic["core"], (basic["losses"], basic["core"])  # bitwise
        assert basic["param_type"] == "DTensor"
    assert results[0]["basic"]["losses"] != results[1]["basic"]["losses"]  # each rank read its own data


def test_schedule_report_logged_as_metrics_at_first_step(results):
    basic = results[0]["basic"]
    report, metrics = basic["report"], basic["metrics"]
    assert report["mode"] == "compiled" and report["backend"] == "aot_eager"
    assert metrics["fsdp_overlap/buckets"] == len(report["plan"]) == 4  # emb, 2 blocks, norm+head
    assert metrics["fsdp_overlap/world_size"] == 2
    assert metrics["fsdp_overlap/forward_all_gathers_before"] == report["forward"]["before"]["all_gather"] == 29
    assert metrics["fsdp_overlap/backward_reduce_scatters_before"] == 29  # one per parameter
    assert metrics["fsdp_overlap/backward_reduce_scatters_after"] == report["backward"]["after"]["reduce_scatter"]


def test_resume_from_sharded_checkpoint_reproduces_losses(results):
    for r in results:
        basic = r["basic"]
        assert basic["resumed_sharded"] == basic["losses"][3:], (basic["resumed_sharded"], basic["losses"])
    files = results[0]["basic"]["sharded_files"]
    assert {"__0_0.distcp", "__1_0.distcp", "meta.pt"} <= set(files), files  # one shard file per rank


def test_resume_from_full_checkpoint_reproduces_losses(results):
    for r in results:
        basic = r["basic"]
        assert basic["full_is_file"]
        assert basic["full_first_epoch"] == basic["losses"][:3]
        assert basic["resumed_full"] == basic["losses"][3:], (basic["resumed_full"], basic["losses"])
    shapes = results[0]["basic"]["full_shapes"]
    assert shapes["model.tok_emb.weight"] == (256, 64)  # gathered, not a (128, 64) shard
    assert shapes["model.head.weight"] == (256, 64)


def test_gradient_clipping_by_norm_matches_unsharded_reference(results):
    clip = results[0]["clipping"]
    assert clip["trainer"].startswith("pytorch_lightning")  # the standalone package's Trainer
    ref, unclipped = clip["ref"], clip["unclipped"]
    assert len(ref["norms"]) == 2 and min(ref["norms"]) > 2 * clip["clip"], ref["norms"]  # clipping is active
    assert close(clip["losses"], ref["losses"]), (clip["losses"], ref["losses"])
    for name, want in ref["params"].items():
        torch.testing.assert_close(clip["params"][name], want, rtol=1e-5, atol=1e-6, msg=name)
    changed = max((ref["params"][n] - unclipped["params"][n]).abs().max().item() for n in ref["params"])
    assert changed > 1e-3  # the clip made a difference the comparison above would have seen


def test_uncompiled_training_step_is_reported(results):
    warned = results[0]["bypass"]["warnings"]
    assert any("did not run the compiled forward" in w and "module=" in w for w in warned), warned
    assert results[1]["bypass"]["warnings"] == []  # rank-zero only


def test_gradient_accumulation_matches_one_big_batch(results):
    acc = results[0]["accumulation"]
    assert acc["micro"] == 6 and acc["global_step"] == 3  # 6 micro-batches, 3 optimizer steps
    assert close(acc["losses"], acc["ref"]["losses"]), (acc["losses"], acc["ref"]["losses"])
    for name, want in acc["ref"]["params"].items():
        torch.testing.assert_close(acc["params"][name], want, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_mixed_matches_core_with_same_dtypes(results):
    for r in results:
        mixed = r["precision"]["mixed"]
        assert mixed["config"] == ("bf16", "fp32")
        assert mixed["dtypes"] == {torch.float32}  # master weights stay fp32
        assert mixed["losses"] == mixed["core"], (mixed["losses"], mixed["core"])
        fp32 = r["precision"]["fp32"]
        assert max(abs(a - b) for a, b in zip(mixed["losses"], fp32)) > 1e-4  # bf16 really was used
        assert all(math.isfinite(x) for x in mixed["losses"])


def test_bf16_mixed_with_activation_checkpointing_matches_core(results):
    for r in results:
        run = r["checkpointing"]
        assert run["losses"] == run["core"], (run["losses"], run["core"])
        assert run["losses"] == r["precision"]["mixed"]["losses"]  # recomputing changes no number
        assert run["checkpointing"]["modules"] == ["blocks.0", "blocks.1"]  # the LightningModule's model
        assert run["checkpointing"]["traced"] == run["checkpointing"]["modules"]


def test_validation_during_fit_and_trainer_validate(results):
    for r in results:
        val = r["precision"]["val"]
        assert len(val["losses"]) == 4  # 2 samples per rank, at the end of fit and in validate()
        assert close(val["losses"], val["expected"]), val
    logged = results[0]["precision"]["val"]["logged"]
    assert math.isclose(
        logged,
        sum(results[0]["precision"]["val"]["expected"][:2] + results[1]["precision"]["val"]["expected"][:2]) / 4,
        rel_tol=1e-5,
    )


def test_bf16_true_matches_core_with_bf16_weights(results):
    for r in results:
        true = r["precision"]["true"]
        assert true["config"] == ("bf16", "bf16")
        assert true["dtypes"] == {torch.bfloat16}
        assert true["losses"] == true["core"], (true["losses"], true["core"])


def test_configure_model_on_meta_matches_core_materialize(results):
    for r in results:
        cm = r["configure_model"]
        core = cm["core"]
        assert cm["losses"] == core["losses"], (cm["losses"], core["losses"])
        for name, want in core["initial"].items():
            assert torch.equal(cm["initial"][name], want), name
    initial = results[0]["configure_model"]["initial"]
    assert torch.equal(initial["blocks.0.ln1.weight"], torch.ones(64))  # reset_parameters ran on the shards
    assert torch.equal(initial["blocks.0.attn.qkv.bias"], torch.zeros(192))
    std = initial["blocks.0.mlp.fc.weight"].std().item()
    assert 0.017 < std < 0.023, std  # GPT init, std 0.02


def test_a_compiled_child_is_taken_over_and_trains_like_core(results):
    for r in results:
        run = r["compiled_child"]
        assert run["losses"] == run["core"], (run["losses"], run["core"])  # bitwise: the plugin's graphs
        assert run["child"] == "GPT" and all("_orig_mod" not in k for k in run["keys"])
    report = results[0]["compiled_child"]["report"]
    assert all(not fqn.startswith("_orig_mod") for entry in report["plan"] for fqn in entry)
    assert report["forward"]["after"]["all_gather"] == len(report["plan"])  # bucketed by the passes
    assert report["adjustments"][0] == "torch.compile(...) around model: replaced by the module inside"


def test_plain_string_inductor_matches_core(results):
    for r in results:
        plain = r["plain"]
        assert plain["losses"] == plain["core"], (plain["losses"], plain["core"])
    report = results[0]["plain"]["report"]
    assert report["backend"] == "inductor"
    assert report["passes"] == {"manual_bucketing": True, "overlap_grad_reduce": True}
    assert report["config"]["bucket_plans"] == "auto"


def test_lightning_cli_yaml_matches_core(results):
    for r in results:
        cli = r["cli"]
        assert "error" not in cli, cli.get("error")
        assert cli["strategy"] == "FSDPOverlapStrategy"
        assert cli["clip"] == 1.0
        assert len(cli["losses"]) == 3
        assert cli["losses"] == cli["core"], (cli["losses"], cli["core"])
    cli = results[0]["cli"]
    assert cli["bucket_plans"] == [["tok_emb", "pos_emb"], "blocks.*", ["norm", "head"]]  # from the YAML
    assert cli["plan"] == [["tok_emb", "pos_emb"], ["blocks.0"], ["blocks.1"], ["norm", "head"]]
