"""Variable sequence lengths through the frameworks, on 2 gloo ranks: tests/_hf.py's Llama (tied
embeddings, vocabulary 97) trained by ``Trainer(strategy="fsdp_overlap")`` and by
``accelerate launch`` with the plugin's YAML, from a DataLoader whose ``collate_fn`` pads each
batch to its own longest sequence (tests/fixtures/dynamic_data.py: 16 batches, 16 padded
lengths, the two ranks at different lengths at every step).

Under ``dynamic: auto`` (the default) the forward is compiled twice on each rank (the first
length as constants, then once with the length symbolic, which serves every later length);
under ``dynamic: true`` once. Either way the mean loss over the ranks at each step equals a
one-process reference (the same initial weights, SGD on the union of the ranks' batches) to
1e-6, and the graph that runs still holds one all-gather and one reduce-scatter per bucket.

``dynamic`` reaches the frameworks as Lightning's strategy argument (and LightningCLI's
``init_args``) and as ``fsdp_overlap_dynamic`` in the Accelerate YAML. ``backend="aot_eager"``
throughout (the passes run the same; inductor would take minutes on this 2-core machine).
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
import torch.nn.functional as F
from _accelerate import ROOT, accelerate_launch, copy_yaml, output
from _dist import run_ranks
from _lightning import trainer
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.accelerate import load_config
from fsdp_overlap_plugin.compile.diagnostics import RecompileLimitError
from fsdp_overlap_plugin.config.schema import OverlapConfigError
from fsdp_overlap_plugin.lightning import FSDPOverlapStrategy
from fsdp_overlap_plugin.lightning.config import read_lightning_yaml
from fsdp_overlap_plugin.runtime.state import get_state

# tests/fixtures/dynamic_data.py, shared with the launch script (by path: a package named
# ``fixtures`` on PyPI, testtools' dependency, would win over a namespace import)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import dynamic_data  # noqa: E402

SCRIPT = ROOT / "tests" / "fixtures" / "dynamic_accelerate.py"
STEPS = len(dynamic_data.LENGTHS) // (2 * dynamic_data.PER_RANK)  # per rank: 8
BUCKETS = 4  # the auto plan: embeddings, two decoder layers, norm + (tied) head
TOLERANCE = 1e-6
# graphs of the forward Dynamo compiles per rank for each value of `dynamic`
COMPILES = {"auto": 2, True: 1}


# ------------------------------------------------------------------ the reference
def reference_losses(per_rank: list[list[tuple]], lr: float = dynamic_data.LR) -> list[float]:
    """One process, no sharding, no compile: SGD on each step's union of the ranks' batches,
    padded to the longest of them and concatenated into one batch. The loss is what the
    ranks optimise together: each rank's mean over its real tokens, averaged over the ranks
    (gradients are averaged over ranks), so a rank's padding changes nothing."""
    model = _hf.build("llama", seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for parts in zip(*per_rank):
        longest = max(ids.shape[1] for ids, _, _ in parts)
        padded = [
            tuple(F.pad(t, (0, longest - t.shape[1]), value=fill) for t, fill in zip(part, (0, 0, -100)))
            for part in parts
        ]
        ids, mask, labels = (torch.cat(ts) for ts in zip(*padded))
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        targets = labels[:, 1:]
        per_token = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none")
        loss, row = 0.0, 0
        for part in parts:
            rows = slice(row, row + part[0].shape[0])
            loss = loss + per_token[rows].sum() / (targets[rows] != -100).sum()
            row = rows.stop
        loss = loss / len(parts)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def mean_over_ranks(per_rank: list[list[float]]) -> list[float]:
    return [sum(step) / len(step) for step in zip(*per_rank)]


def lengths(batches: list[tuple]) -> list[int]:
    return [ids.shape[1] for ids, _, _ in batches]


def assert_trained_like_reference(results: list[dict], dynamic: str | bool, label: str) -> None:
    """Each rank's forward compiled as often as ``dynamic`` says, at lengths that changed
    every step and differed between the ranks; the mean loss per step the reference's."""
    per_rank = [r["batches"] for r in results]
    seen = [lengths(b) for b in per_rank]
    print(f"{label}: padded lengths per rank {seen}")
    assert [len(s) for s in seen] == [STEPS, STEPS]
    assert len({n for s in seen for n in s}) == 2 * STEPS >= 12  # every batch its own length
    assert all(a != b for a, b in zip(*seen))  # the ranks at different lengths at every step
    for r in results:
        assert (r["model"], r["param_type"], r["dynamic"]) == ("LlamaForCausalLM", "DTensor", dynamic)
        assert r["dynamo_graphs"] == COMPILES[dynamic], (label, r["dynamo_graphs"], r["recompiles"])
        assert len(r["recompiles"]) == COMPILES[dynamic] - 1, r["recompiles"]
    losses = mean_over_ranks([r["losses"] for r in results])
    expected = reference_losses(per_rank)
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    print(f"{label}: losses {losses}\n  reference {expected}\n  largest difference {worst:.2e}")
    assert all(math.isfinite(x) for x in losses)
    assert len(losses) == len(expected) == STEPS
    assert worst <= TOLERANCE, (losses, expected)
    assert results[0]["losses"] != results[1]["losses"]  # each rank trained on its own batches


def assert_bucketed_at_every_length(report: dict, dynamic: str | bool) -> None:
    """Every compile of the forward (static or symbolic length) has one all-gather per bucket,
    its backward one reduce-scatter per bucket; the graph that runs last keeps the sequence
    length symbolic."""
    assert report["plan"] == [["model.embed_tokens"], ["model.layers.0"], ["model.layers.1"], ["model.norm", "lm_head"]]
    training = [g for g in report["graphs"] if not g.get("inference")]
    forwards = [g for g in training if g["graph"] == "forward"]
    backwards = [g for g in training if g["graph"] == "backward"]
    assert len(forwards) == len(backwards) == COMPILES[dynamic]
    assert [g["after"]["all_gather"] for g in forwards] == [BUCKETS] * COMPILES[dynamic]
    assert [g["after"]["reduce_scatter"] for g in backwards] == [BUCKETS] * COMPILES[dynamic]
    assert report["forward"]["after"]["all_gather"] == BUCKETS  # the one that runs now
    assert report["backward"]["after"]["reduce_scatter"] == BUCKETS
    symbolic = {(s["input"], s["dim"]) for s in report["dynamic_sizes"]}
    assert any("input_ids" in name and dim == 1 for name, dim in symbolic), report["dynamic_sizes"]


# --------------------------------------------------------------------- Lightning
class LitLlama(LightningModule):
    """``self.model``: tests/_hf.py's Llama, seeded; the model's own loss on padded batches.
    Records each batch (as trained on) and its loss."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _hf.build("llama", seed=0)
        self.batches: list[tuple] = []
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = dynamic_data.loss(self.model, batch)
        self.batches.append(tuple(t.detach().clone() for t in batch))
        self.losses.append(loss.detach().item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=dynamic_data.LR)


def _fit(root: str, **strategy) -> dict:
    torch._dynamo.reset()
    lit = LitLlama()
    tr = trainer(root, max_epochs=1, strategy=FSDPOverlapStrategy(backend="aot_eager", **strategy))
    loader = DataLoader(dynamic_data.samples(), batch_size=dynamic_data.PER_RANK, collate_fn=dynamic_data.pad_batch)
    start = time.perf_counter()
    error = None
    try:
        tr.fit(lit, loader)
    except RecompileLimitError as exc:  # reported as a result: the test says what happened
        error = str(exc)
    state = get_state(lit.model)
    assert state is not None and tr.strategy._parallelized is lit.model
    return {
        "seconds": round(time.perf_counter() - start, 1),
        "error": error,
        "batches": lit.batches,
        "losses": lit.losses,
        "dynamo_graphs": state.dynamo_graphs,
        "recompiles": list(state.recompiles),
        "dynamic": tr.strategy.overlap_config.dynamic,
        "model": type(lit.model).__name__,
        "param_type": type(next(lit.model.parameters())).__name__,
        "report": fo.schedule_report(lit.model),
    }


def _lightning_ranks(rank: int, world: int, root: str, dynamic: str | bool) -> dict:
    return _fit(root) if dynamic == "auto" else _fit(root, dynamic=dynamic)  # auto: the default, unset


def _lightning(tmp_path_factory, dynamic: str | bool) -> list[dict]:
    start = time.perf_counter()
    out = run_ranks(_lightning_ranks, str(tmp_path_factory.mktemp("dynamic_lightning")), dynamic, timeout=600)
    print(f"lightning (dynamic {dynamic}): {time.perf_counter() - start:.0f} s; fit {out[0]['seconds']} s (rank 0)")
    return out


@pytest.mark.slow
def test_lightning_auto_compiles_twice_for_every_length_and_matches_one_process(tmp_path_factory):
    results = _lightning(tmp_path_factory, "auto")
    for r in results:
        assert r["error"] is None, r["error"]  # no RecompileLimitError
    assert_trained_like_reference(results, "auto", "lightning auto")
    for r in results:
        assert_bucketed_at_every_length(r["report"], "auto")


@pytest.mark.slow
def test_lightning_dynamic_true_strategy_argument_compiles_once(tmp_path_factory):
    results = _lightning(tmp_path_factory, True)
    for r in results:
        assert r["error"] is None, r["error"]
        assert r["recompiles"] == []
    assert_trained_like_reference(results, True, "lightning dynamic=True")
    for r in results:
        assert_bucketed_at_every_length(r["report"], True)


# --------------------------------------------------------------------- Accelerate
@pytest.mark.slow
def test_accelerate_launch_pads_per_rank_and_matches_one_process(tmp_path):
    """configs/overlap.yaml's ``dynamic`` (auto). ``fsdp_overlap_dynamic`` is read as every other
    plugin key is (test_dynamic_in_the_accelerate_yaml below); ``dynamic: true`` is trained
    through Lightning above."""
    yaml_path = copy_yaml(tmp_path / "dynamic.yaml", fsdp_overlap_backend="aot_eager")
    out = tmp_path / "out"
    out.mkdir()
    start = time.perf_counter()
    proc = accelerate_launch(yaml_path, str(out), script=SCRIPT, timeout=300)
    text = output(proc)
    print(f"accelerate launch: {time.perf_counter() - start:.0f} s")
    assert "RecompileLimitError" not in text, text[-6000:]
    assert proc.returncode == 0, text[-6000:]
    assert f"trained {STEPS} steps; forward compiled {COMPILES['auto']} times" in proc.stdout
    results = [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    assert_trained_like_reference(results, "auto", "accelerate auto")


# ------------------------------------------------------- the key, read where users write it
@pytest.mark.parametrize("value, expected", [(True, True), (False, False), ("auto", "auto"), ("true", True)])
def test_dynamic_in_a_lightning_cli_yaml(value, expected):
    data = {
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "strategy": {
                "class_path": "fsdp_overlap_plugin.lightning.FSDPOverlapStrategy",
                "init_args": {"dynamic": value},
            },
        }
    }
    assert read_lightning_yaml(data, "cli.yaml").config.dynamic == expected  # jsonargparse: "true" is a bool
    assert FSDPOverlapStrategy(dynamic=expected).overlap_config.dynamic == expected  # the keyword argument
    assert FSDPOverlapStrategy().overlap_config.dynamic == "auto"


def test_dynamic_in_a_lightning_cli_yaml_rejects_other_values():
    data = {
        "trainer": {
            "strategy": {
                "class_path": "fsdp_overlap_plugin.lightning.FSDPOverlapStrategy",
                "init_args": {"dynamic": "sometimes"},
            }
        }
    }
    with pytest.raises(OverlapConfigError, match=r"trainer\.strategy\.init_args\.dynamic: unknown value 'sometimes'"):
        read_lightning_yaml(data, "cli.yaml")
    with pytest.raises(OverlapConfigError, match="dynamic: unknown value 'sometimes'"):
        FSDPOverlapStrategy(dynamic="sometimes")


@pytest.mark.parametrize("value", [True, False, "auto"])
def test_dynamic_in_the_accelerate_yaml(tmp_path, value):
    path = copy_yaml(tmp_path / "overlap.yaml", fsdp_overlap_dynamic=value)
    assert load_config(None, path, environ={}).config.dynamic == value
    assert load_config(None, copy_yaml(tmp_path / "default.yaml"), environ={}).config.dynamic == "auto"


def test_dynamic_in_the_accelerate_yaml_rejects_other_values(tmp_path):
    path = copy_yaml(tmp_path / "overlap.yaml", fsdp_overlap_dynamic="sometimes")
    with pytest.raises(OverlapConfigError, match="fsdp_config.fsdp_overlap_dynamic: unknown value 'sometimes'"):
        load_config(None, path, environ={})
