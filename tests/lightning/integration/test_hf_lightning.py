"""``Trainer(strategy="fsdp_overlap", precision="bf16-mixed")`` with a Hugging Face Llama
(tied embeddings, from tests/_hf.py) as ``self.model`` of examples/hf_lightning.py's
LightningModule, on 2 real gloo ranks: losses bitwise equal to the core's
``parallelize()`` with the config the strategy resolves, and the passes' bucket counts
equal to what the plan says, for the auto plan and for a plan that gives the tied
``lm_head`` an entry of its own; and the same comparison for every other family of
tests/_hf.py (Qwen2, GPT-2, Mixtral, GPT-NeoX) with the auto plan.

One ``run_ranks`` job runs every scenario; ``backend="aot_eager"`` (inductor takes about
2.5 minutes to compile this model twice on this 2-core machine; passes run either way).
Apart from it, the example itself runs once on 1 rank, for what it prints.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import _hf
import pytest
import torch
import torch._dynamo
from _accelerate import _launch, output
from _dist import run_ranks
from _lightning import rank_batches, trainer
from torch.utils.data import DataLoader, TensorDataset

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.lightning import FSDPOverlapStrategy

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
SAMPLES = 16
PER_RANK = 2  # 4 steps per rank
LR = 3e-3
CLIP = 1.0
# what precision="bf16-mixed" must resolve to (docs: gather in bf16, reduce in fp32)
CONFIG = {"backend": "aot_eager", "param_dtype": "bf16", "reduce_dtype": "fp32"}
TIED_HEAD_PLAN = [["model.embed_tokens"], "model.layers.*", ["model.norm"], ["lm_head"]]
OTHER_FAMILIES = [f for f in _hf.FAMILIES if f != "llama"]


def _example():
    sys.path.insert(0, str(ROOT / "examples"))
    import hf_lightning

    return hf_lightning


def _core(batches: list[torch.Tensor], config: dict, family: str = "llama") -> dict:
    """The Trainer's training through the core: the same seeded model, this rank's
    batches, Lightning's autocast (bf16-mixed), clipping and AdamW."""
    torch._dynamo.reset()
    model = _hf.build(family, seed=0)
    fo.parallelize(model, config)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _hf.loss(model, ids)
        losses.append(loss.detach().float().item())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "report": fo.schedule_report(model)}


def _fit(root: str, data: TensorDataset, family: str = "llama", **strategy) -> dict:
    torch._dynamo.reset()
    lit = _example().CausalLMModule(_hf.config(family), lr=LR, seed=0)
    tr = trainer(
        root,
        max_epochs=1,
        strategy=FSDPOverlapStrategy(backend="aot_eager", **strategy),
        precision="bf16-mixed",
        gradient_clip_val=CLIP,
    )
    tr.fit(lit, DataLoader(data, batch_size=PER_RANK))
    return {
        "losses": lit.losses,
        "all_losses": lit.all_losses,
        "report": tr.strategy.schedule_report,
        "config": tr.strategy.overlap_config.to_dict(),
        "model": type(lit.model).__name__,
        "dtypes": {p.dtype for p in lit.parameters()},
        "param_type": type(next(lit.model.parameters())).__name__,
    }


def _all(rank: int, world: int, root: str) -> dict:
    data = TensorDataset(_hf.batches(1, SAMPLES)[0])
    batches = [ids for (ids,) in rank_batches(data, rank, world, batch=PER_RANK)]
    plain = _hf.build("llama", seed=0)  # unsharded, for the plan's expectations
    out: dict = {"seconds": {}}
    for name, fn in (
        ("auto", lambda: _fit(f"{root}/auto", data)),
        ("core", lambda: _core(batches, CONFIG)),
        ("tied_head", lambda: _fit(f"{root}/tied", data, bucket_plans=TIED_HEAD_PLAN)),
    ):
        start = time.perf_counter()
        out[name] = fn()
        out["seconds"][name] = round(time.perf_counter() - start, 1)
        out[name]["expected"] = _hf.expected_collectives(plain, out[name]["report"]["plan"])
    for family in OTHER_FAMILIES:  # the Trainer against the core for every other family too
        plain = _hf.build(family, seed=0)
        for name, fn in (
            (f"auto_{family}", lambda f=family: _fit(f"{root}/{f}", data, f)),
            (f"core_{family}", lambda f=family: _core(batches, CONFIG, f)),
        ):
            start = time.perf_counter()
            out[name] = fn()
            out["seconds"][name] = round(time.perf_counter() - start, 1)
            out[name]["expected"] = _hf.expected_collectives(plain, out[name]["report"]["plan"])
    plain = _hf.build("llama", seed=0)
    out["params"] = len(list(plain.parameters()))  # tied: one parameter
    out["uses"] = len(list(plain.named_parameters(remove_duplicate=False)))  # tied: two
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    start = time.perf_counter()
    out = run_ranks(_all, str(tmp_path_factory.mktemp("hf_lightning")), timeout=900)
    print(f"hf lightning: {time.perf_counter() - start:.0f} s; scenario seconds (rank 0):", out[0]["seconds"])
    print("losses per rank:", [r["auto"]["losses"] for r in out])
    return out


def test_bf16_mixed_trainer_losses_equal_core_parallelize(results):
    for r in results:
        auto, core = r["auto"], r["core"]
        assert auto["model"] == "LlamaForCausalLM" and auto["param_type"] == "DTensor"
        assert {k: auto["config"][k] for k in CONFIG} == CONFIG  # what bf16-mixed resolved to
        assert auto["config"] == fo.OverlapConfig(**CONFIG).to_dict()  # and nothing else changed
        assert auto["dtypes"] == {torch.float32}  # fp32 master weights
        assert len(auto["losses"]) == SAMPLES // (2 * PER_RANK)
        assert all(math.isfinite(x) for x in auto["losses"])
        assert auto["losses"] == core["losses"], (auto["losses"], core["losses"])  # bitwise
        assert r["tied_head"]["losses"] == auto["losses"]  # buckets change the schedule, not the numbers
    assert results[0]["auto"]["losses"] != results[1]["auto"]["losses"]  # each rank read its own data
    assert results[0]["auto"]["all_losses"] == [results[0]["auto"]["losses"], results[1]["auto"]["losses"]]


def test_auto_plan_buckets_the_transformers_model(results):
    r = results[0]
    report = r["auto"]["report"]
    assert report["plan"] == [["model.embed_tokens"], ["model.layers.0"], ["model.layers.1"], ["model.norm", "lm_head"]]
    assert report["plan"] == r["core"]["report"]["plan"]
    assert report["unbucketed_params"] == []
    forward, backward = r["auto"]["expected"]
    assert (forward, backward) == (4, 4)
    assert report["forward"]["after"]["all_gather"] == forward
    assert report["backward"]["after"]["reduce_scatter"] == backward
    _assert_passes_did_something(report, r)
    for kind in ("forward", "backward"):  # the Trainer's graphs are the core's
        for when in ("before", "after"):
            assert report[kind][when] == r["core"]["report"][kind][when], (kind, when)


def test_entry_holding_only_the_tied_head_moves_nothing_of_its_own(results):
    """lm_head.weight is embed_tokens.weight: one gather and one reduce-scatter (of the
    summed gradients of both reads), both in the embedding's entry."""
    r = results[0]
    report = r["tied_head"]["report"]
    layers = [["model.layers.0"], ["model.layers.1"]]
    assert report["plan"] == [["model.embed_tokens"], *layers, ["model.norm"], ["lm_head"]]
    forward, backward = r["tied_head"]["expected"]
    assert (forward, backward) == (4, 4)  # five entries, the last holding only the tied weight
    assert report["backward"]["passes"]["tied"]["merged"] == 1
    assert report["forward"]["after"]["all_gather"] == forward
    assert report["backward"]["after"]["reduce_scatter"] == backward
    _assert_passes_did_something(report, r)


def _assert_passes_did_something(report: dict, r: dict) -> None:
    """Before the passes: one forward all-gather per parameter (the tied weight's two reads
    merged into one) and one reduce-scatter per parameter use; far more than after."""
    forward, backward = report["forward"], report["backward"]
    assert forward["before"]["all_gather"] == r["params"] == 20
    assert backward["before"]["reduce_scatter"] == r["uses"] == 21
    assert forward["before"]["all_gather"] >= 4 * forward["after"]["all_gather"]
    assert backward["before"]["reduce_scatter"] >= 4 * backward["after"]["reduce_scatter"]
    assert report["mode"] == "compiled" and report["backend"] == "aot_eager"
    assert forward["left_unbucketed"] == [] and backward["left_unbucketed"] == []


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_other_families_through_the_trainer_equal_the_core_and_are_bucketed(results, family):
    for r in results:
        auto, core = r[f"auto_{family}"], r[f"core_{family}"]
        assert auto["config"] == fo.OverlapConfig(**CONFIG).to_dict()
        assert all(math.isfinite(x) for x in auto["losses"])
        assert auto["losses"] == core["losses"], (family, auto["losses"], core["losses"])  # bitwise
    report = results[0][f"auto_{family}"]["report"]
    forward, backward = results[0][f"auto_{family}"]["expected"]
    assert report["forward"]["after"]["all_gather"] == forward == len(report["plan"])
    assert report["backward"]["after"]["reduce_scatter"] == backward == len(report["plan"])
    assert report["forward"]["before"]["all_gather"] > 3 * forward
    assert report["forward"]["left_unbucketed"] == [] and report["backward"]["left_unbucketed"] == []


def test_the_example_prints_the_schedule_summary_once(tmp_path):
    """examples/hf_lightning.py as a user runs it (1 CPU rank here): the strategy prints
    the summary after the first step and the example only adds the losses, as
    examples/lightning_gpt.py does (it printed the summary a second time at the end)."""
    example = [sys.executable, str(ROOT / "examples" / "hf_lightning.py")]
    proc = _launch(
        [*example, "--accelerator", "cpu", "--devices", "1", "--steps", "2", "--backend", "aot_eager"], tmp_path, 300
    )
    text = output(proc)
    assert proc.returncode == 0, text[-4000:]
    assert text.count("fsdp-overlap summary: ") == 1, text[-4000:]
    assert text.count("fsdp-overlap schedule: ") == 1, text[-4000:]
    assert "LlamaForCausalLM: losses " in text
