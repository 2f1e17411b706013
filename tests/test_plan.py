"""resolve_plan / auto_plan: explicit FQN buckets from the config, with no process group."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from fsdp_overlap_plugin import OverlapConfigError, PlanWarning, auto_plan, resolve_plan
from fsdp_overlap_plugin.models import gpt_small
from fsdp_overlap_plugin.plan import expand_pattern, find_repeated_blocks


def plan(model, plans):
    return resolve_plan(model, {"bucket_plans": plans})


def test_auto_plan_gpt():
    assert auto_plan(gpt_small()) == [
        ["tok_emb", "pos_emb"],
        ["blocks.0"],
        ["blocks.1"],
        ["blocks.2"],
        ["blocks.3"],
        ["norm", "head"],
    ]


def test_auto_plan_tied_head_stays_after_blocks():
    assert auto_plan(gpt_small(tie_weights=True))[-1] == ["norm", "head"]


class Nested(nn.Module):
    """HF-GPT-2-like nesting with a bare root parameter and a parameterless module."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(10, 8)
        self.transformer.drop = nn.Dropout()
        self.transformer.h = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.transformer.ln_f = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 10)


def test_auto_plan_nested_model():
    assert auto_plan(Nested()) == [
        ["transformer.wte"],
        ["transformer.h.0"],
        ["transformer.h.1"],
        ["transformer.h.2"],
        ["transformer.ln_f", "lm_head"],
    ]


def test_auto_plan_sequential_and_no_repeats():
    seq = nn.Sequential(nn.Embedding(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    assert auto_plan(seq) == [["0"], ["1"], ["2"], ["3"]]
    flat = nn.Module()
    flat.a, flat.b = nn.Linear(2, 2), nn.Conv1d(2, 2, 1)
    assert find_repeated_blocks(flat) is None
    assert auto_plan(flat) == [["a"], ["b"]]


def test_largest_repeated_container_wins():
    m = nn.Module()
    m.small = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
    m.big = nn.ModuleList(nn.Linear(2, 2) for _ in range(5))
    assert find_repeated_blocks(m) == ("big", [f"big.{i}" for i in range(5)])


def test_explicit_plan_with_patterns_and_ranges():
    m = gpt_small(n_layer=12)
    assert plan(m, ["blocks.[0-3]"]) == [[f"blocks.{i}"] for i in range(4)]
    assert plan(m, [["blocks.[8-11]"]]) == [[f"blocks.{i}" for i in range(8, 12)]]
    assert plan(m, ["tok_emb", "blocks.*", ["norm", "head"]])[1:3] == [["blocks.0"], ["blocks.1"]]
    assert plan(m, ["blocks.1?"]) == [["blocks.10"], ["blocks.11"]]


def test_expand_pattern_respects_segments():
    names = ["blocks", "blocks.0", "blocks.0.attn", "blocks.1", "blocks.10"]
    assert expand_pattern("blocks.*", names) == ["blocks.0", "blocks.1", "blocks.10"]
    assert expand_pattern("blocks.[1-9]", names) == ["blocks.1"]


def test_unknown_fqn_suggests_nearest():
    with pytest.raises(OverlapConfigError) as info:
        plan(gpt_small(), ["blocks.0", "block.1"])
    msg = str(info.value)
    assert "bucket_plans[1]" in msg and "'block.1'" in msg and "'blocks.1'" in msg


def test_unknown_fqn_in_list_entry_names_position():
    with pytest.raises(OverlapConfigError, match=r"bucket_plans\[0\]\[1\]: no module named 'haed'.*'head'"):
        plan(gpt_small(), [["norm", "haed"]])


def test_pattern_matching_nothing():
    with pytest.raises(OverlapConfigError, match=r"pattern 'layers\.\*' matches no module"):
        plan(gpt_small(), ["layers.*"])


def test_empty_range():
    with pytest.raises(OverlapConfigError, match="empty range"):
        plan(gpt_small(), ["blocks.[3-1]"])


@pytest.mark.parametrize("plans", [["blocks.0", "blocks.0.attn"], ["blocks.*", ["blocks.2", "head"]], ["head", "head"]])
def test_overlapping_entries(plans):
    with pytest.raises(OverlapConfigError, match="overlap"):
        plan(gpt_small(), plans)


def test_entry_without_parameters_warns():
    m = Nested()
    with pytest.warns(PlanWarning, match="owns no parameters"):
        plan(m, ["transformer.drop", "transformer.wte"])


def test_valid_plan_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan(gpt_small(), ["blocks.*"])


def test_meta_model_costs_nothing():
    with torch.device("meta"):
        m = gpt_small(n_layer=48, d_model=1024)
    assert len(auto_plan(m)) == 50
