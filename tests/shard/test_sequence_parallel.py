"""Sequence parallelism (a ``tp_plan`` with ``sequence_parallel`` entries), in one process
on a fake process group of 4 ranks (data-parallel 2 x tensor-parallel 2): the plan's
collectives in the graphs (all-gathers and reduce-scatters on the tensor group, counted
per layer), the data-parallel ones still bucketed and the passes leaving the plan's alone;
and the errors for what cannot be made right, each naming the module and the entry.

The numerics (4 gloo ranks, like one process) are in
``integration/test_sequence_parallel_training.py``.
"""

from __future__ import annotations

import pytest
import torch
from _fake import collectives_by_group, fake_world, tensor_parallel_order
from _hf import SP_PLAN
from torch.distributed.tensor import Replicate, Shard

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.config.schema import OverlapConfig, OverlapConfigError
from fsdp_overlap_plugin.models import gpt_small
from fsdp_overlap_plugin.runtime.state import get_state

pytestmark = pytest.mark.torch_sensitive  # DTensor placements and parallel styles move between torches

#: Megatron's sequence parallelism for a transformers Llama / Qwen2, as a user writes it
#: (the plan's patterns are globs per dot-separated name: one entry per projection name)
LAYERS = 2
#: the tests' transformers models (tests/_hf.py) with a vocabulary the tensor group divides
#: (their own 97 rows cannot be split over 2 ranks: an error, tested below)
VOCAB = 96


def _build(family: str) -> torch.nn.Module:
    import _hf
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_hf.config(family, vocab_size=VOCAB))


def _batch(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1234))


@pytest.fixture
def world4():
    with fake_world(4):
        yield


# ---------------------------------------------------------------- the config


def test_the_config_takes_sequence_parallel_and_still_suggests_the_nearest_style():
    config = OverlapConfig.from_dict({"tp_plan": SP_PLAN, "mesh": {"tensor": 2}})
    assert config.tp_plan["model.norm"] == "sequence_parallel"
    with pytest.raises(
        OverlapConfigError,
        match=r"tp_plan\['model.norm'\]: unknown style 'sequence_paralel'; valid: colwise, rowwise, replicate, "
        r"sequence_parallel. Did you mean 'sequence_parallel'",
    ):
        OverlapConfig.from_dict({"tp_plan": {"model.norm": "sequence_paralel"}, "mesh": {"tensor": 2}})


# ---------------------------------------------------------------- the graphs


class _Summaries:
    """Each graph's collectives by group and the tensor group's order against the matmuls,
    before and after the passes (a transformers model's graphs hold fake constants that a
    deepcopy cannot copy, so they are summarised as the passes run)."""

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


#: the plan's collectives on the tensor group per step, for 2 layers (see the test's doc)
EXPECTED_TP = {
    "forward": {
        "all_gather_into_tensor": 2 * LAYERS + 2,
        "reduce_scatter_tensor": 2 * LAYERS + 1,
    },
    "backward": {
        "all_gather_into_tensor": 2 * LAYERS + 1,
        "reduce_scatter_tensor": 2 * LAYERS + 1,
        "all_reduce": 2 * LAYERS + 1,
    },
}


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # tied, untied
def test_sequence_parallel_collectives_are_gathers_and_reduce_scatters_on_the_tensor_group(monkeypatch, world4, family):
    """Per layer, forward: the attention and the MLP each all-gather their input from the
    sequence shards once (not once per colwise projection), and o_proj / down_proj
    reduce-scatter to sequence shards (no all-reduce); besides the layers, the embedding's
    reduce-scatter and the head's two gathers (its input, its logits). Backward, the
    mirror image, plus one all-reduce per norm (its whole weight's gradient is partial over
    the sequence shards). The data-parallel collectives are one per bucket on the shard
    group, and the passes move none of the plan's."""
    import _hf

    summaries = _Summaries(monkeypatch)
    model = _build(family)
    fo.parallelize(model, backend="aot_eager", mesh={"tensor": 2}, tp_plan=SP_PLAN, reduce_scatter_impl="native")
    state = get_state(model)
    summaries.groups.update(
        {state.tp_mesh.get_group().group_name: "tensor", state.mesh.get_group(0).group_name: "shard"}
    )
    _hf.loss(model, _batch()).backward()
    gathers, scatters = _hf.expected_collectives(model, state.plan)
    for kind, expected in EXPECTED_TP.items():
        (before, order_before), (after, order_after) = summaries.graphs[kind]["before"], summaries.graphs[kind]["after"]
        tensor = {op: n for (group, op), n in after.items() if group == "tensor"}
        assert tensor == expected, (kind, after)
        assert {op: n for (group, op), n in before.items() if group == "tensor"} == expected
        assert order_after == order_before
        assert not any(group == "other" for group, _ in after), after
    forward = summaries.graphs["forward"]["after"][0]
    merged = forward.get(("shard", "all_gather_into_tensor_out"), 0)
    assert merged >= 2 and merged + forward.get(("shard", "all_gather_into_tensor"), 0) == gathers
    assert summaries.graphs["backward"]["after"][0][("shard", "reduce_scatter_tensor")] == scatters
    # the layouts: vocabulary rows split (a tied head shares the embedding's split weight), norms whole
    params = dict(model.named_parameters(remove_duplicate=False))
    assert params["model.embed_tokens.weight"].placements[-1] == Shard(0)
    assert params["lm_head.weight"].placements[-1] == Shard(0)
    assert (params["lm_head.weight"] is params["model.embed_tokens.weight"]) == _hf.TIED[family]
    assert params["model.layers.0.input_layernorm.weight"].placements[-1] == Replicate()
    assert params["model.layers.0.self_attn.o_proj.weight"].placements[-1] == Shard(1)
    report = fo.schedule_report(model)
    text = fo.format_report(report)
    assert f"the plan's collectives: forward {2 * LAYERS + 2} all-gathers, {2 * LAYERS + 1} reduce-scatters" in text, (
        text
    )


def test_the_plan_is_reported_resolved_with_its_norms(world4):

    model = _build("llama")
    fo.parallelize(model, backend="aot_eager", mesh={"tensor": 2}, tp_plan=SP_PLAN)
    plan = get_state(model).tp_plan
    assert plan["model.norm"] == "sequence_parallel" and plan["model.layers.1.post_attention_layernorm"] == (
        "sequence_parallel"
    )
    assert plan["model.embed_tokens"] == "rowwise" and plan["lm_head"] == "colwise"


# ---------------------------------------------------------------- what cannot be made right


def _without(*keys: str, **extra: str) -> dict:
    return {**{k: v for k, v in SP_PLAN.items() if k not in keys}, **extra}


@pytest.mark.parametrize(
    ("family", "plan", "message"),
    [
        (
            "qwen2",  # untied: a tied Llama says the tie first (the case below)
            _without("model.embed_tokens"),
            r"tp_plan\['model.layers.\*.input_layernorm'\] makes the plan sequence-parallel: .* it starts at the "
            r"token embedding, which the plan must split rowwise \('model.embed_tokens'\): add e.g. "
            r"'model.embed_tokens': rowwise",
        ),
        (
            "llama",
            _without("lm_head"),
            # a tied head left whole while its embedding is split: the tie says it first
            r"tp_plan: 'model.embed_tokens' and 'lm_head' share one weight \(tied\), but the plan gives "
            r"'model.embed_tokens' 'model.embed_tokens' \(rowwise\): rows split, and 'lm_head' no entry \(whole\): whole",
        ),
        (
            "llama",
            _without(**{"model.layers.*.mlp": "sequence_parallel"}),
            r"tp_plan\['model.layers.\*.mlp'\]: sequence_parallel runs a norm on the sequence shards, its weights "
            r"whole; 'model.layers.0.mlp' is a LlamaMLP whose child 'model.layers.0.mlp.gate_proj' holds parameters",
        ),
        (
            "llama",
            _without("lm_head", **{"lm_head": "rowwise"}),
            r"'model.embed_tokens' and 'lm_head' share one weight \(tied\), .* 'lm_head' 'lm_head' \(rowwise\): columns split",
        ),
    ],
)
def test_a_sequence_parallel_plan_missing_a_piece_is_an_error_naming_it(world4, family, plan, message):

    with pytest.raises(OverlapConfigError, match=message):
        fo.parallelize(_build(family), backend="aot_eager", mesh={"tensor": 2}, tp_plan=plan)


def test_an_untied_head_left_whole_is_an_error_naming_it(world4):

    with pytest.raises(
        OverlapConfigError,
        match=r"the head 'lm_head' \(no entry: whole\) reads the last norm's sequence shards: split it colwise "
        r"\('lm_head': colwise\)",
    ):
        fo.parallelize(_build("qwen2"), backend="aot_eager", mesh={"tensor": 2}, tp_plan=_without("lm_head"))


def test_the_repo_gpts_position_embedding_is_an_error_at_startup(world4):
    """The repo GPT adds a learned position embedding (``pos_emb``) to the token embedding:
    under sequence parallelism it would be added whole to sequence shards."""
    plan = {
        "tok_emb": "rowwise",
        "blocks.*.ln[12]": "sequence_parallel",
        "blocks.*.mlp.fc": "colwise",
        "blocks.*.mlp.proj": "rowwise",
        "norm": "sequence_parallel",
        "head": "colwise",
    }
    torch.manual_seed(0)
    with pytest.raises(
        OverlapConfigError,
        match=r"tp_plan\['blocks.\*.ln\[12\]'\] makes the plan sequence-parallel: .*; 'pos_emb' is a second "
        r"nn.Embedding \(no entry: whole\) beside the token embedding 'tok_emb': its output \(learned positions, "
        r"token types\) would be added whole to the sequence shards.* Remove the sequence_parallel entries",
    ):
        fo.parallelize(gpt_small(n_layer=2), backend="aot_eager", mesh={"tensor": 2}, tp_plan=plan)
    # the same check without a process group: fsdp-overlap check's verdict
    from fsdp_overlap_plugin.shard.tensor_parallel import resolve_tp_plan

    with pytest.raises(OverlapConfigError, match=r"'pos_emb' is a second nn.Embedding"):
        resolve_tp_plan(gpt_small(n_layer=2), plan)


def test_a_tied_head_split_without_its_embedding_is_an_error_in_any_plan(world4):
    """Not only under sequence parallelism: torch splits each module's weight on its own,
    and a tied head split colwise beside a whole embedding would silently untie them."""

    with pytest.raises(
        OverlapConfigError,
        match=r"'model.embed_tokens' and 'lm_head' share one weight \(tied\), but the plan gives 'model.embed_tokens' "
        r"no entry \(whole\): whole, and 'lm_head' 'lm_head' \(colwise\): rows split",
    ):
        fo.parallelize(_build("llama"), backend="aot_eager", mesh={"tensor": 2}, tp_plan={"lm_head": "colwise"})


def test_a_vocabulary_the_tensor_group_does_not_divide_is_an_error_naming_it(world4):
    import _hf

    with pytest.raises(
        OverlapConfigError,
        match=r"tp_plan: rowwise splits the 97 rows of model.embed_tokens.weight over the 2 tensor-parallel ranks, "
        r"which is not a multiple of mesh.tensor=2.*pad_to_multiple_of=2",
    ):
        fo.parallelize(_hf.build("llama"), backend="aot_eager", mesh={"tensor": 2}, tp_plan=SP_PLAN)


def test_without_sequence_parallel_the_embedding_takes_whole_ids_and_the_head_gathers_its_logits(world4):
    """The same embedding and head entries in a plain tensor-parallel plan: the embedding's
    ids are whole on every rank (torch's default input layout for rowwise, Shard(-1), would
    gather them into a sequence twice as long), its output all-reduced; the head's logits
    are gathered to the whole vocabulary for the loss."""
    plan = {k: v for k, v in SP_PLAN.items() if v != "sequence_parallel"}
    model = _build("llama")
    fo.parallelize(model, backend="aot_eager", mesh={"tensor": 2}, tp_plan=plan)
    ids = _batch()
    logits = model(input_ids=ids).logits
    assert not isinstance(logits, torch.distributed.tensor.DTensor)
    assert logits.shape == (2, 16, VOCAB)
    report = fo.schedule_report(model)
    forward = report["forward"]["tensor_parallel"]["after"]
    # per layer o_proj and down_proj, and the embedding: all-reduces; the head: one all-gather
    assert forward["all_reduce"] == 2 * LAYERS + 1 and forward["all_gather"] == 1, forward
    assert forward["reduce_scatter"] == 0
