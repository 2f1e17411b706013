"""resolve_plan / auto_plan: explicit FQN buckets from the config, with no process group."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn as nn

from fsdp_overlap_plugin import OverlapConfigError, PlanWarning, auto_plan, resolve_plan
from fsdp_overlap_plugin.config.plan import (
    DEFAULT_BUCKET_BYTES,
    auto_plan_info,
    expand_pattern,
    find_repeated_blocks,
    gather_bytes,
)
from fsdp_overlap_plugin.models import gpt_small


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
    # no repeated blocks: the top-level children merge up to DEFAULT_BUCKET_BYTES (16 MiB)
    assert auto_plan(flat) == [["a", "b"]]
    assert auto_plan(flat, {"bucket_bytes": 1}) == [["a"], ["b"]]


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


@pytest.mark.parametrize(
    "pattern, suggestion",
    [("block.*", "'blocks.*'"), ("blocks.*.atn", "'blocks.*.attn'"), ("blocks.[0-1].mlp.fcc", "'blocks.[0-1].mlp.fc'")],
)
def test_pattern_matching_nothing_suggests_a_pattern(pattern, suggestion):
    # the glob segments are kept: a pattern is suggested, not one module it would match
    with pytest.raises(OverlapConfigError, match=rf"Did you mean {re.escape(suggestion)}"):
        plan(gpt_small(), [pattern])


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


def test_the_warning_names_the_caller_of_resolve_plan():
    """The PlanWarning points at the line that called resolve_plan, not inside the package."""
    with pytest.warns(PlanWarning) as record:
        resolve_plan(Nested(), {"bucket_plans": [["transformer.drop"], ["transformer.wte"]]})
    assert record[0].filename == __file__


def test_valid_plan_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan(gpt_small(), ["blocks.*"])


def test_meta_model_costs_nothing():
    with torch.device("meta"):
        m = gpt_small(n_layer=48, d_model=1024)
    assert len(auto_plan(m)) == 50


# ------------------------------------------------------------- byte-balanced auto plans
class Stack(nn.Module):
    """embed (E) -> pre (P) -> blocks (3 x Linear(d, d)) -> norm (N) -> big (B) -> tail (T),
    with sizes chosen so the merge rule has something to decide."""

    def __init__(self, d: int = 16, big: int = 64):
        super().__init__()
        self.embed = nn.Embedding(4, d)  # 4d params
        self.pre = nn.LayerNorm(d)  # 2d
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(3))  # d*d + d each
        self.norm = nn.LayerNorm(d)  # 2d
        self.big = nn.Linear(d, big, bias=False)  # d*big
        self.tail = nn.LayerNorm(d)  # 2d


def test_auto_default_target_is_the_median_block():
    m = Stack()
    info = auto_plan_info(m)
    block = 4 * (16 * 16 + 16)
    assert info.target_bytes == block and info.target_source == "median block"
    assert info.container == "blocks" and info.blocks == ["blocks.0", "blocks.1", "blocks.2"]
    # before: embed (256 B) + pre (128 B) < one block (1088 B): one bucket.
    # after: norm (128 B) + big (4096 B) reaches the target and closes; tail starts the next.
    assert info.buckets == [["embed", "pre"], ["blocks.0"], ["blocks.1"], ["blocks.2"], ["norm", "big"], ["tail"]]
    assert info.bucket_bytes == [4 * (64 + 32), block, block, block, 4 * (32 + 16 * 64), 4 * 32]


def test_auto_merges_until_the_target_and_keeps_blocks_whole():
    m = Stack()
    # a target smaller than a block: the blocks are still one bucket each
    tiny = auto_plan(m, {"bucket_bytes": 200})
    # embed (256 B) reaches 200 B alone; pre (128 B) is last before the blocks: alone;
    # norm (128 B) is below 200 B, so big joins it; tail is left over
    assert tiny == [["embed"], ["pre"], ["blocks.0"], ["blocks.1"], ["blocks.2"], ["norm", "big"], ["tail"]]
    # a large target: each side of the blocks merges into one bucket
    assert auto_plan(m, {"bucket_bytes": "1MiB"}) == [
        ["embed", "pre"],
        ["blocks.0"],
        ["blocks.1"],
        ["blocks.2"],
        ["norm", "big", "tail"],
    ]
    # merging never crosses the blocks: nothing before them joins anything after them
    assert auto_plan(m, {"bucket_bytes": 10**12})[0] == ["embed", "pre"]


def test_auto_target_counts_gathered_bytes_in_param_dtype():
    m = Stack()
    # embed: 256 B in fp32 (reaches a 250 B target alone), 128 B in bf16 (+ pre 64 B = 192 B: merged)
    assert auto_plan(m, {"bucket_bytes": 250})[:2] == [["embed"], ["pre"]]
    assert auto_plan(m, {"bucket_bytes": 250, "param_dtype": "bf16"})[0] == ["embed", "pre"]
    assert gather_bytes(m.big, torch.bfloat16) == 2 * 16 * 64 and gather_bytes(m.big) == 4 * 16 * 64


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)  # 72 params
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))


class WithTower(nn.Module):
    """A large non-block subtree (a 'vision tower') before the repeated blocks."""

    def __init__(self):
        super().__init__()
        self.tower = Tower()  # 216 params, holds none itself
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))  # 20 params each
        self.head = nn.Linear(4, 2)


def test_auto_splits_a_large_non_block_module_into_its_children():
    m = WithTower()
    assert find_repeated_blocks(m) == ("blocks", [f"blocks.{i}" for i in range(4)])
    # target = one block = 80 B; the tower (864 B) is split: proj (288 B) is one bucket,
    # its layers container (576 B) is split again into its two Linear layers
    assert auto_plan(m) == [
        ["tower.proj"],
        ["tower.layers.0"],
        ["tower.layers.1"],
        ["blocks.0"],
        ["blocks.1"],
        ["blocks.2"],
        ["blocks.3"],
        ["head"],
    ]
    # a target above the tower's size keeps it whole
    assert auto_plan(m, {"bucket_bytes": 1000})[0] == ["tower"]


def test_auto_plan_is_deterministic_and_device_independent():
    plans = []
    for device in ("cpu", "meta", "meta"):
        with torch.device(device):
            plans.append(auto_plan(gpt_small(n_layer=6, d_model=32), {"bucket_bytes": "4KiB"}))
    assert plans[0] == plans[1] == plans[2]
    with torch.device("meta"):
        a, b = WithTower(), WithTower()
    assert auto_plan_info(a) == auto_plan_info(b)


def test_auto_plan_gpt_small_default_unchanged_by_target_choice():
    m = gpt_small()
    info = auto_plan_info(m)
    # the embeddings (80 KiB) and norm + head (64.5 KiB) are each below one block (195.2 KiB)
    assert info.bucket_bytes[0] < info.target_bytes and info.bucket_bytes[-1] < info.target_bytes
    assert resolve_plan(m, {"bucket_bytes": None}) == auto_plan(m)


def test_auto_tied_weights_count_once_per_module():
    m = gpt_small(tie_weights=True)
    assert m.head.weight is m.tok_emb.weight
    assert gather_bytes(m.head) == gather_bytes(m.tok_emb) == 4 * 256 * 64  # each gathers it under its name


def test_default_bucket_bytes_without_blocks():
    flat = nn.Module()
    flat.a = nn.Linear(1024, 2048, bias=False)  # 8 MiB
    flat.b = nn.Linear(1024, 2048, bias=False)  # 8 MiB: reaches 16 MiB, closes
    flat.c = nn.Linear(4, 4)
    info = auto_plan_info(flat)
    assert info.target_bytes == DEFAULT_BUCKET_BYTES == 16 * 2**20 and info.container is None
    assert info.buckets == [["a", "b"], ["c"]]


@pytest.mark.parametrize(
    "value, expected",
    [(None, None), (4096, 4096), ("64MiB", 64 * 2**20), ("500 KB", 500_000), ("1GiB", 2**30), ("2e6", 2_000_000)],
)
def test_bucket_bytes_values(value, expected):
    from fsdp_overlap_plugin import OverlapConfig

    assert OverlapConfig(bucket_bytes=value).bucket_bytes == expected


@pytest.mark.parametrize(
    "value, hint",
    [(0, ">= 1"), (-5, ">= 1"), ("64 MeB", "Did you mean '64MB'"), (True, "number of bytes"), ([1], "list")],
)
def test_bad_bucket_bytes_names_the_key(value, hint):
    from fsdp_overlap_plugin import OverlapConfig

    with pytest.raises(OverlapConfigError) as info:
        OverlapConfig(bucket_bytes=value)
    assert str(info.value).startswith("bucket_bytes:") and hint in str(info.value)
