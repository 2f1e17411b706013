"""Sequence parallelism (a ``tp_plan`` with ``sequence_parallel`` norms) x FSDP on four
gloo ranks (data-parallel 2 x tensor-parallel 2) trains like one process.

One 4-rank job runs every scenario; each compares the global mean loss per step and the
final full parameters with a single-process reference on the union of the data-parallel
ranks' batches (the two tensor-parallel ranks of a data-parallel rank see the same batch):

* a tied transformers Llama (embedding and head share the split vocabulary rows), aot_eager;
* an untied Qwen2 (attention biases, its own head), aot_eager;
* the tied Llama under inductor;
* the tied Llama on steps of 16, 15, 12 and 15 tokens: 15 the two tensor-parallel ranks
  split unevenly (8 and 7); every length after the first runs a graph of a symbolic length,
  one for lengths the pair divides and one for those it does not (three compiles in all).

The graph structure (which collectives, on which group) is in
``tests/shard/test_sequence_parallel.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from _dist import run_ranks
from _hf import SP_PLAN
from _train import LR, full_params, local_slice

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.runtime.state import get_state

pytestmark = [pytest.mark.slow, pytest.mark.middle_torch]

WORLD, TP = 4, 2
DP = WORLD // TP
STEPS = 4
#: tests/_hf.py's models with a vocabulary the tensor group divides (97 rows cannot be split over 2 ranks)
VOCAB = 96
TOL = 1e-5
ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
SCENARIOS = {
    # name: (family, backend, sequence length of each step)
    "llama_tied_aot_eager": ("llama", "aot_eager", (16,) * STEPS),
    "qwen2_untied_aot_eager": ("qwen2", "aot_eager", (16,) * STEPS),
    "llama_tied_inductor": ("llama", "inductor", (16,) * STEPS),
    # 15 tokens split 8 / 7 over the tensor pair, among other lengths: the first compiles
    # static, then symbolic graphs (dynamic: auto), one for lengths the pair does not divide
    "llama_tied_uneven_sequence": ("llama", "aot_eager", (16, 15, 12, 15)),
}


def _build(family: str) -> torch.nn.Module:
    import _hf
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_hf.config(family, vocab_size=VOCAB))


def _loss(model, ids, dp_rank: int | None = None):
    if dp_rank is not None:
        ids = local_slice(ids, dp_rank, DP)
    return model(input_ids=ids, labels=ids).loss


def _train(model, data, *, dp_rank: int | None = None) -> list[float]:
    """SGD; the global mean loss per step (each data-parallel rank's loss counted once per
    tensor-parallel rank: the mean over all ranks is the mean over data-parallel ranks)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids in data:
        value = _loss(model, ids, dp_rank)
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = value.detach().float().clone()
        if dp_rank is not None:
            dist.all_reduce(value)
            value /= WORLD
        losses.append(value.item())
    return losses


def _scenario(rank: int, name: str) -> dict:

    torch._dynamo.reset()
    family, backend, lengths = SCENARIOS[name]
    g = torch.Generator().manual_seed(1234)
    data = [torch.randint(0, VOCAB, (4, seq), generator=g) for seq in lengths]
    model, sharded = _build(family), _build(family)
    fo.parallelize(sharded, backend=backend, mesh={"tensor": TP}, tp_plan=SP_PLAN)
    out = {"losses": _train(sharded, data, dp_rank=rank // TP), "params": full_params(sharded)}
    out["tp_plan"] = dict(get_state(sharded).tp_plan)
    out["dynamo_graphs"] = get_state(sharded).dynamo_graphs
    out["recompiles"] = list(get_state(sharded).recompiles)
    if rank == 0:
        out["ref_losses"] = _train(model, data)
        out["ref_params"] = full_params(model)
        out["report"] = fo.schedule_report(sharded)
    return out


def _all(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {name: _scenario(rank, name) for name in SCENARIOS}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_all, world=WORLD, env=ENV, timeout=900)


@pytest.mark.parametrize("name", SCENARIOS)
def test_trains_like_one_process(results, name):
    ours = results[0][name]
    assert len(ours["losses"]) == len(ours["ref_losses"]) == STEPS
    worst_loss = max(abs(got - want) for got, want in zip(ours["losses"], ours["ref_losses"]))
    assert worst_loss <= TOL, (ours["losses"], ours["ref_losses"])
    assert ours["params"].keys() == ours["ref_params"].keys()
    worst = max((ours["params"][k] - ours["ref_params"][k]).abs().max().item() for k in ours["params"])
    print(
        f"{name}: losses {ours['losses']}; worst loss difference {worst_loss:.2e}, worst weight difference {worst:.2e}"
    )
    assert worst <= TOL, worst
    # every rank holds the same full parameters (the tensor-parallel ranks too)
    for other in results[1:]:
        for k, v in other[name]["params"].items():
            assert torch.equal(v, ours["params"][k]), k


def test_other_lengths_share_symbolic_graphs_one_for_lengths_the_group_divides(results):
    """Sequence shards of a symbolic length (16, then 15, 12 and 15 tokens): the first length
    compiles static; the later ones run symbolic graphs, one for lengths the tensor group does
    not divide (DTensor pads their uneven shards: its guard ``s % 2 != 0``) and one for those it
    does; the second 15 compiles nothing. Without sequence parallelism it is two graphs
    (test_tensor_parallel_training.py). The losses above match one process at every length."""
    assert [r["llama_tied_uneven_sequence"]["dynamo_graphs"] for r in results] == [3] * WORLD
    reasons = [entry["reason"] for entry in results[0]["llama_tied_uneven_sequence"]["recompiles"]]
    assert len(reasons) == 2 and "% 2" in reasons[1], reasons
    assert [r["llama_tied_aot_eager"]["dynamo_graphs"] for r in results] == [1] * WORLD


@pytest.mark.parametrize("name", ["llama_tied_aot_eager", "qwen2_untied_aot_eager", "llama_tied_inductor"])
def test_the_plans_collectives_are_gathers_and_reduce_scatters_and_the_passes_bucket_the_rest(results, name):
    report = results[0][name]["report"]
    assert report["tensor_parallel"]["size"] == TP
    layers = 2
    forward = report["forward"]["tensor_parallel"]["after"]
    # per layer: the attention's and the MLP's input gathered once each, o_proj's and down_proj's
    # output reduce-scattered; the embedding's reduce-scatter, the head's two gathers
    assert forward["all_gather"] == 2 * layers + 2 and forward["reduce_scatter"] == 2 * layers + 1, forward
    assert forward["all_reduce"] == 0
    assert report["forward"]["tensor_parallel"]["before"] == forward
    backward = report["backward"]["tensor_parallel"]["after"]
    assert backward["reduce_scatter"] == 2 * layers + 1 and backward["all_gather"] == 2 * layers + 1, backward
    assert backward["all_reduce"] == 2 * layers + 1  # one per norm: its whole weight's gradient
    # the data-parallel collectives: fewer after the passes than before (bucketed)
    assert report["forward"]["after"]["all_gather"] < report["forward"]["before"]["all_gather"]
    assert report["backward"]["after"]["reduce_scatter"] < report["backward"]["before"]["reduce_scatter"]
