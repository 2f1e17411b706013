"""prefetch_depth and max_prefetch_bytes: the rule (passes/prefetch.py), the node order
it gives on hand-built graphs, the values it computes, and what ``fsdp-overlap check``
prints from the same rule. The 2-rank numerics are in test_passes_e2e.py."""

from __future__ import annotations

import json

import pytest
import torch
from _fake import GraphCapture, fake_world
from test_passes import PLAN, sequence, simulate

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin import OverlapConfigError
from fsdp_overlap_plugin.cli import main
from fsdp_overlap_plugin.config.schema import OverlapConfig
from fsdp_overlap_plugin.passes import manual_bucketing
from fsdp_overlap_plugin.passes.prefetch import kept_buckets, prefetch_plan
from fsdp_overlap_plugin.testing import fsdp_backward_graph, fsdp_forward_graph, random_inputs

pytestmark = pytest.mark.torch_sensitive  # CI runs its quick tests on both ends of its torch matrix (2.11, 2.15)


# ------------------------------------------------------------------------- the rule
@pytest.mark.parametrize(
    ("sizes", "depth", "budget", "depths", "peak"),
    [
        ([4, 4, 4, 4], 1, None, [1, 1, 1, 1], 8),
        ([4, 4, 4, 4], 2, None, [1, 2, 2, 2], 12),
        ([4, 4, 4, 4], 3, None, [1, 2, 3, 3], 16),
        ([4, 4, 4, 4], 2, 10, [1, 2, 1, 1], 8),  # bucket 1 at the top, the rest one ahead
        ([4, 4, 4, 4], 1, 6, [1, 0, 0, 0], 4),  # not even one ahead fits: not prefetched
        ([1, 8, 1, 1, 1], 2, 10, [1, 2, 2, 2, 2], 10),
        ([1, 1, 9, 1, 1], 2, 10, [1, 2, 1, 1, 1], 10),  # bucket 4 two ahead would hold 2, 3, 4: 11
        ([], 2, None, [], 0),
        ([4], 1, 3, [0], 4),  # one bucket over the budget: not moved either
    ],
)
def test_prefetch_plan(sizes, depth, budget, depths, peak):
    plan = prefetch_plan(sizes, depth, budget)
    assert (plan.depths, plan.peak_bytes) == (depths, peak)
    # launch points never go backwards: bucket k is never issued before bucket k-1
    points = [k - d for k, d in enumerate(plan.depths)]
    assert points == sorted(points)
    if budget is not None:
        for k, d in enumerate(plan.depths):
            if d:
                assert k == 0 or sum(sizes[max(k - d, 0) : k + 1]) <= budget


def test_kept_buckets_count_at_the_top_of_backward():
    # two buckets kept from the forward: with depth 2 only one re-gather at the top
    plan = prefetch_plan([4, 4, 4], 2, None, kept=(2, 8))
    assert plan.depths == [1, 1, 2] and plan.peak_bytes == 12 and plan.peak_at_top
    # one kept (the default): depth 2 may launch two at the top
    assert prefetch_plan([4, 4, 4], 2, None, kept=(1, 4)).depths == [1, 2, 2]
    # the kept buckets and the first re-gather over the budget: not launched at the top
    assert prefetch_plan([4, 4, 4], 2, 10, kept=(2, 8)).depths == [0, 1, 1]


@pytest.mark.parametrize(
    ("sizes", "depth", "budget", "cover", "kept"),
    [
        ([1, 4, 4, 4, 1], 1, None, True, 2),  # a small head before a block: the block stays too
        ([1, 4, 4, 4, 4], 1, None, True, 1),  # the last bucket hides the next re-gather itself
        ([1, 4, 4, 4, 1], 2, None, True, 2),  # 1 + 4 kept >= 4: depth alone
        ([1, 4, 4, 1, 1], 2, None, True, 3),  # two small ones: one block more
        ([1, 4, 4, 1, 1], 1, None, True, 1),  # the last hides a re-gather of its own size
        ([1, 4, 4, 2, 1], 1, None, True, 2),  # 1 < 2: one more, and at most one (3 < 4)
        ([1, 4, 4, 4, 1], 1, 4, True, 1),  # the block does not fit the budget with the head
        ([1, 4, 4, 4, 1], 1, None, False, 1),  # no bucketing pass: no prefetch to cover
        ([8], 1, 2, True, 1),  # the last bucket stays whatever the budget
        ([], 1, None, True, 0),
    ],
)
def test_kept_buckets(sizes, depth, budget, cover, kept):
    assert kept_buckets(sizes, depth, budget, cover) == kept


def test_launch_points_stay_in_issue_order_when_a_big_bucket_limits_depth():
    # bucket 2 cannot go 2 ahead (its window is over budget) but bucket 3 could; it must
    # not be issued before bucket 2
    plan = prefetch_plan([1, 1, 9, 1, 1, 1], 3, 11)
    points = [k - d for k, d in enumerate(plan.depths)]
    assert points == sorted(points) and plan.peak_bytes <= 11


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("prefetch_depth", 0, "prefetch_depth: expected an integer >= 1"),
        ("prefetch_depth", "2", "prefetch_depth: expected an integer >= 1"),
        ("prefetch_depth", True, "prefetch_depth: expected an integer >= 1"),
        ("max_prefetch_bytes", "2 gigs", "max_prefetch_bytes: cannot read"),
        ("max_prefetch_bytes", 0, "max_prefetch_bytes: must be a whole number"),
    ],
)
def test_bad_values_name_the_key(key, value, message):
    with pytest.raises(OverlapConfigError, match=message):
        OverlapConfig.coerce(None, **{key: value})


def test_byte_strings_are_read():
    assert OverlapConfig.coerce(None, max_prefetch_bytes="1MiB").max_prefetch_bytes == 2**20


# ---------------------------------------------------------------- hand-built graphs
def test_forward_depth_2_launches_two_buckets_ahead():
    gm = fsdp_forward_graph()
    inputs = random_inputs(gm)
    expected = simulate(gm, inputs)
    stats = manual_bucketing(gm, PLAN, prefetch_depth=2)
    assert sequence(gm) == "AG0 AG1 AG2 W0 mm mm AG3 W1 mm mm W2 mm mm W3 mm mm"
    assert stats["prefetch_depths"] == [1, 2, 2, 2]
    bucket = 2 * 8 * 8 * 4  # two 8x8 fp32 weights gathered
    assert stats["prefetch_peak_bytes"] == 3 * bucket
    assert all(torch.equal(a, b) for a, b in zip(simulate(gm, inputs), expected))


def test_forward_depth_1_is_the_default_order():
    gm = fsdp_forward_graph()
    stats = manual_bucketing(gm, PLAN)
    assert sequence(gm) == "AG0 AG1 W0 mm mm AG2 W1 mm mm AG3 W2 mm mm W3 mm mm"
    assert stats["prefetch_depths"] == [1, 1, 1, 1] and stats["prefetch_peak_bytes"] == 2 * 512


def test_forward_budget_limits_depth_per_bucket():
    gm = fsdp_forward_graph()
    # room for two buckets: depth 2 only where the window (top: buckets 0, 1) fits
    stats = manual_bucketing(gm, PLAN, prefetch_depth=2, max_prefetch_bytes=2 * 512)
    assert stats["prefetch_depths"] == [1, 2, 1, 1]
    # under a budget each launch comes after the copy-out of the bucket it follows
    assert sequence(gm) == "AG0 AG1 W0 mm mm W1 AG2 mm mm W2 AG3 mm mm W3 mm mm"
    assert stats["prefetch_peak_bytes"] == 2 * 512


def test_forward_budget_below_two_buckets_turns_prefetch_off():
    gm = fsdp_forward_graph()
    stats = manual_bucketing(gm, PLAN, max_prefetch_bytes=600)
    assert stats["prefetch_depths"] == [1, 0, 0, 0] and stats["prefetch_peak_bytes"] == 512
    # every later all-gather is launched where its bucket is consumed
    assert sequence(gm) == "AG0 W0 mm mm AG1 W1 mm mm AG2 W2 mm mm AG3 W3 mm mm"


def test_backward_depth_2():
    gm = fsdp_backward_graph()
    inputs = random_inputs(gm)
    expected = simulate(gm, inputs)
    stats = manual_bucketing(gm, PLAN, prefetch_depth=2)
    assert stats["prefetch_depths"] == [1, 2, 2, 2]
    order = sequence(gm).split()
    # buckets 3 and 2 launch at the top, 1 before bucket 3's wait, 0 before bucket 2's
    assert order[:2] == ["AG3", "AG2"]
    assert order.index("AG1") < order.index("W3") and order.index("AG0") < order.index("W2")
    assert all(torch.equal(a, b) for a, b in zip(simulate(gm, inputs), expected))


# --------------------------------------------------------- traced graphs (fake pg)
def test_traced_gpt_forward_depth_2(monkeypatch):
    from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn

    with fake_world(2):
        GraphCapture(monkeypatch)
        torch.manual_seed(0)
        model = gpt_small()
        fo.parallelize(model, backend="aot_eager", prefetch_depth=2)
        x, y = fixed_batches(1, 2, 16, 256)[0]
        loss_fn(model(x), y).backward()
        report = fo.schedule_report(model)
    assert report["prefetch"]["forward"]["depths"] == [1, 2, 2, 2, 2, 2]
    text = fo.format_report(report)
    # the forward keeps buckets 5 and 4 gathered; blocks 2, 1, 0 are re-gathered (the
    # embeddings need no weights in backward); with 2 kept, only one re-gather at the top
    assert report["prefetch"]["backward"]["depths"] == [1, 1, 2]
    assert [b.split(" [")[0] for b in report["reshard"]["kept_buckets"]] == ["bucket 5", "bucket 4"]
    assert "kept (bucket 5 ['norm', 'head']; bucket 4 ['blocks.3'], for prefetch_depth 2)" in text
    assert "prefetch (depth 2, budget none; collectives queued back to back): forward depths 1 2 2 2 2 2" in text
    assert report["prefetch"]["order"] == "queued"


def test_traced_gpt_keeps_the_last_block_when_the_head_is_smaller(monkeypatch):
    """Depth 1 (the default): the head bucket gathers less than a block, so blocks.3 stays
    gathered as well and the backward re-gathers blocks 2, 1, 0 while it computes head and
    blocks.3. Without the bucketing pass nothing prefetches, and only the head stays."""
    from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn

    reports = {}
    for name, config in {"default": {}, "no_bucketing": {"manual_bucketing": False}}.items():
        with fake_world(2):
            GraphCapture(monkeypatch)
            torch.manual_seed(0)
            model = gpt_small()
            fo.parallelize(model, backend="aot_eager", **config)
            x, y = fixed_batches(1, 2, 16, 256)[0]
            loss_fn(model(x), y).backward()
            reports[name] = fo.schedule_report(model)
    report = reports["default"]
    assert [b.split(" [")[0] for b in report["reshard"]["kept_buckets"]] == ["bucket 5", "bucket 4"]
    assert report["reshard"]["kept_to_cover"] and report["reshard"]["kept_bytes"] == (16512 + 49984) * 4
    assert report["backward"]["after"]["all_gather"] == 3
    # blocks.2 launches at the top, blocks.1 and .0 one bucket ahead
    assert report["prefetch"]["backward"]["depths"] == [1, 1, 1]
    text = fo.format_report(report)
    assert "for prefetch_depth 1, and one more: the buckets after it gather less" in text
    # 53 gathers in the forward: 15 kept (head bucket 3, blocks.3 12); of the 38 freed the
    # backward re-gathers only what it reads: 8 per re-gathered block under aot_eager, not
    # the embeddings (their backward reads the indices alone)
    assert report["backward"]["before"]["all_gather"] == 3 * 8
    assert (
        "reshard after forward: 38 of the forward's all-gathers freed after use"
        " (the backward re-gathers the 24 it reads), 15 kept (" in text
    )
    plain = reports["no_bucketing"]["reshard"]
    assert [b.split(" [")[0] for b in plain["kept_buckets"]] == ["bucket 5"] and not plain["kept_to_cover"]


# ----------------------------------------------------------- what check prints
def _check(capsys, *extra):
    code = main(["check", "configs/plugin.yaml", "--model", "fsdp_overlap_plugin.models.gpt:gpt_small", *extra])
    return code, capsys.readouterr().out


def test_check_prints_the_peak_of_the_depth_and_budget(tmp_path, capsys):
    block, head = 49984 * 4, 16512 * 4  # one GPT block, and the final norm + head, gathered in fp32
    for depth, budget, held, peak in (
        # the head bucket gathers less than a block, so blocks.3 stays gathered too and the
        # backward's top holds head, blocks.3 and blocks.2's re-gather
        (1, None, 3, 2 * block + head),
        (2, None, 3, 3 * block),
        (2, 2 * block, 2, 2 * block),
        (1, 2 * block, 2, 2 * block),  # within the budget: blocks.2 waits for the head's backward
    ):
        path = tmp_path / f"c{depth}{budget}.yaml"
        path.write_text(json.dumps({"prefetch_depth": depth, "max_prefetch_bytes": budget}))
        code = main(["check", str(path), "--model", "fsdp_overlap_plugin.models.gpt:gpt_small", "--json"])
        out = json.loads(capsys.readouterr().out)
        assert code == 0 and out["memory"]["prefetch_peak_bytes"] == peak, (depth, budget)
        assert len(out["memory"]["prefetch_peak_buckets"]) == held
        main(["check", str(path), "--model", "fsdp_overlap_plugin.models.gpt:gpt_small"])
        text = capsys.readouterr().out
        assert f"holds at most {held} buckets gathered at once" in text
        # a budget selects FSDP2's memory order, and check says which order runs
        order = "queued back to back" if budget is None else "FSDP2's memory order: prefetch after the copy-out"
        assert order in text.split("holds at most")[0], text
        if depth > 1:
            assert "buckets ahead, per bucket as consumed: forward 1 2 " in text
        assert "(after buckets 4-5, kept gathered)" in text
        assert ("bucket 4 stays gathered beyond prefetch_depth" in text) == (depth == 1)
