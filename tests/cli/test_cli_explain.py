"""``fsdp-overlap explain``: the per-bucket order of launches and waits, from hand-written
schedule reports in the format ``schedule_report`` writes (``record["schedule"]``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fsdp_overlap_plugin.cli.explain as explain_module
from fsdp_overlap_plugin.cli import main, summarize_schedule

PLAN = [["tok_emb", "pos_emb"], ["blocks.0"], ["blocks.1"], ["norm", "head"]]


def launch(name, bucket, module, nbytes, op="all_gather"):
    return {"op": op, "name": name, "bucket": bucket, "module": module, "bytes": nbytes, "flops": 0, "of": None}


def wait(name, of, bucket, module):
    return {"op": "wait", "name": name, "bucket": bucket, "module": module, "bytes": 0, "flops": 0, "of": of}


def compute(name, flops, nbytes=0):
    return {"op": "compute", "name": name, "bucket": None, "module": None, "bytes": nbytes, "flops": flops, "of": None}


# forward before the passes: one all-gather per parameter, each waited at once
FWD_BEFORE = [
    launch("ag_tok", 0, "tok_emb", 65536),  # 0
    wait("w_tok", "ag_tok", 0, "tok_emb"),  # 1
    launch("ag_pos", 0, "pos_emb", 16384),  # 2
    wait("w_pos", "ag_pos", 0, "pos_emb"),  # 3
    compute("embed", 40_000),  # 4
    launch("ag_b0", 1, "blocks.0", 199936),  # 5
    wait("w_b0", "ag_b0", 1, "blocks.0"),  # 6
    compute("block0", 6_000_000),  # 7
    launch("ag_b1", 2, "blocks.1", 199936),  # 8
    wait("w_b1", "ag_b1", 2, "blocks.1"),  # 9
    compute("block1", 6_000_000),  # 10
    launch("ag_head", 3, "head", 66048),  # 11
    wait("w_head", "ag_head", 3, "head"),  # 12
    compute("head", 2_000_000),  # 13
]
# after: one all-gather per bucket, the next one launched before the current bucket computes
FWD_AFTER = [
    launch("ag_0", 0, "tok_emb", 81920),  # 0
    wait("w_0", "ag_0", 0, "tok_emb"),  # 1
    launch("ag_1", 1, "blocks.0", 199936),  # 2
    compute("embed", 40_000),  # 3
    wait("w_1", "ag_1", 1, "blocks.0"),  # 4
    launch("ag_2", 2, "blocks.1", 199936),  # 5
    compute("block0", 6_000_000),  # 6
    wait("w_2", "ag_2", 2, "blocks.1"),  # 7
    launch("ag_3", 3, "head", 66048),  # 8
    compute("block1", 6_000_000),  # 9
    wait("w_3", "ag_3", 3, "head"),  # 10
    compute("head", 2_000_000),  # 11
]
# backward: reduce-scatters waited at once before, waits sunk after
BWD_BEFORE = [
    compute("head_bwd", 4_000_000),  # 0
    launch("rs_3", 3, "head", 66048, "reduce_scatter"),  # 1
    wait("w_rs_3", "rs_3", 3, "head"),  # 2
    compute("block1_bwd", 12_000_000),  # 3
    launch("rs_2", 2, "blocks.1", 199936, "reduce_scatter"),  # 4
    wait("w_rs_2", "rs_2", 2, "blocks.1"),  # 5
    compute("block0_bwd", 12_000_000),  # 6
    launch("rs_1", 1, "blocks.0", 199936, "reduce_scatter"),  # 7
    wait("w_rs_1", "rs_1", 1, "blocks.0"),  # 8
]
BWD_AFTER = [
    compute("head_bwd", 4_000_000),  # 0
    launch("rs_3", 3, "head", 66048, "reduce_scatter"),  # 1
    compute("block1_bwd", 12_000_000),  # 2
    launch("rs_2", 2, "blocks.1", 199936, "reduce_scatter"),  # 3
    compute("block0_bwd", 12_000_000),  # 4
    launch("rs_1", 1, "blocks.0", 199936, "reduce_scatter"),  # 5
    wait("w_rs_3", "rs_3", 3, "head"),  # 6
    wait("w_rs_2", "rs_2", 2, "blocks.1"),  # 7
    wait("w_rs_1", "rs_1", 1, "blocks.0"),  # 8
]


def make_report(forward=True, backward=True) -> dict:
    def record(kind, before, after):
        count = lambda items, op: sum(1 for i in items if i["op"] == op)  # noqa: E731
        return {
            "graph": kind,
            "before": {op: count(before, op) for op in ("all_gather", "reduce_scatter", "all_reduce", "wait")},
            "after": {op: count(after, op) for op in ("all_gather", "reduce_scatter", "all_reduce", "wait")},
            "passes": {},
            "schedule": {"before": before, "after": after},
        }

    return {
        "mode": "compiled",
        "world_size": 2,
        "mesh": [2],
        "backend": "inductor",
        "passes": {"manual_bucketing": True, "overlap_grad_reduce": True},
        "plan": PLAN,
        "forward": record("forward", FWD_BEFORE, FWD_AFTER) if forward else None,
        "backward": record("backward", BWD_BEFORE, BWD_AFTER) if backward else None,
    }


def write(tmp_path, report, name="report.json"):
    path = tmp_path / name
    path.write_text(json.dumps(report))
    return str(path)


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def by_bucket(groups):
    return {(g["bucket"], g["op"]): g for g in groups}


def test_summarize_positions_and_compute_between():
    before = by_bucket(summarize_schedule(FWD_BEFORE))
    assert before[(0, "all_gather")]["launches"] == [0, 2] and before[(0, "all_gather")]["waits"] == [1, 3]
    assert before[(0, "all_gather")]["bytes"] == 65536 + 16384
    assert all(not g["overlapped"] and g["compute_between_flops"] == 0 for g in before.values())
    after = by_bucket(summarize_schedule(FWD_AFTER))
    assert after[(1, "all_gather")]["launches"] == [2] and after[(1, "all_gather")]["waits"] == [4]
    assert after[(1, "all_gather")]["compute_between_flops"] == 40_000  # the embedding hides blocks.0's gather
    assert after[(2, "all_gather")]["compute_between_flops"] == 6_000_000
    assert after[(3, "all_gather")]["compute_between_flops"] == 6_000_000
    assert not after[(0, "all_gather")]["overlapped"]  # the first gather can hide behind nothing
    back = by_bucket(summarize_schedule(BWD_AFTER))
    # rs_3 launched at 1, waited at 6: two backward computes in between
    assert back[(3, "reduce_scatter")]["compute_between_flops"] == 24_000_000
    assert back[(2, "reduce_scatter")]["compute_between_flops"] == 12_000_000
    assert back[(1, "reduce_scatter")]["compute_between_flops"] == 0  # the last gradient has nothing left


def test_union_of_intervals_counts_each_compute_once():
    items = [
        launch("a", 0, "x", 10),
        launch("b", 0, "y", 10),
        compute("c", 7),
        wait("wa", "a", 0, "x"),
        compute("d", 100),
        wait("wb", "b", 0, "y"),
    ]
    (g,) = summarize_schedule(items)
    assert g["launches"] == [0, 1] and g["waits"] == [3, 5]
    assert g["compute_between_flops"] == 107 and g["compute_between_items"] == 2


def test_explain_text(capsys, tmp_path):
    code, text, _ = run(capsys, "explain", write(tmp_path, make_report()))
    assert code == 0
    assert "plan    4 buckets: 0 [tok_emb, pos_emb]  1 [blocks.0]  2 [blocks.1]  3 [norm, head]" in text
    fwd = text[text.index("forward graph") : text.index("backward graph")]
    bare_before = 65536 + 16384 + 199936 * 2 + 66048
    assert (
        f"before the passes: 14 items; all_gather 5 launches in 4 buckets, 0 with compute between launch and wait, "
        f"{bare_before / 1024:.1f} KiB of {bare_before / 1024:.1f} KiB without (cannot hide)" in fwd
    )
    assert (
        "after the passes:  12 items; all_gather 4 launches in 4 buckets, 3 with compute between launch and wait, "
        in fwd
    )
    assert f"{81920 / 1024:.1f} KiB of" in fwd  # only bucket 0 has nothing to hide behind
    block0 = fwd[fwd.index("bucket 1 [blocks.0]  all_gather") :].splitlines()[:3]
    assert block0[1].strip() == "before: 1 launch #5, wait #6, 195.2 KiB; nothing in between: cannot hide"
    assert block0[2].strip() == "after:  1 launch #2, wait #4, 195.2 KiB; 40.0 KFLOP of compute in between (1 item)"
    emb = fwd[fwd.index("bucket 0 [tok_emb, pos_emb]") :].splitlines()[1]
    assert "2 launches #0,#2, waits #1,#3, 80.0 KiB" in emb
    bwd = text[text.index("backward graph") :]
    rs3 = bwd[bwd.index("bucket 3 [norm, head]  reduce_scatter") :].splitlines()[2]
    assert "after:  1 launch #1, wait #6" in rs3 and "24.0 MFLOP of compute in between (2 items)" in rs3


def test_explain_json(capsys, tmp_path):
    code, out, _ = run(capsys, "explain", write(tmp_path, make_report()), "--json")
    data = json.loads(out)
    assert code == 0 and data["plan"] == PLAN
    fwd = data["graphs"]["forward"]
    assert fwd["has_schedule"] and fwd["counts"]["after"]["all_gather"] == 4
    assert fwd["after"]["items"] == FWD_AFTER
    after = by_bucket(fwd["after"]["buckets"])
    assert [after[(b, "all_gather")]["launches"] for b in range(4)] == [[0], [2], [5], [8]]
    assert [after[(b, "all_gather")]["waits"] for b in range(4)] == [[1], [4], [7], [10]]
    assert [after[(b, "all_gather")]["compute_between_flops"] for b in range(4)] == [0, 40_000, 6_000_000, 6_000_000]


def test_explain_sequence_and_graph_filter(capsys, tmp_path):
    code, text, _ = run(capsys, "explain", write(tmp_path, make_report()), "--graph", "backward", "--sequence")
    assert code == 0 and "forward graph" not in text
    seq = text[text.index("backward after the passes, in graph order:") :].splitlines()[2:11]
    assert [line.split()[1] for line in seq] == [i["op"] for i in BWD_AFTER]
    assert seq[6].split()[-1] == "rs_3"  # the wait names the collective it waits on


def test_explain_record_without_schedule(capsys, tmp_path):
    report = make_report()
    del report["backward"]["schedule"]
    code, text, _ = run(capsys, "explain", write(tmp_path, report))
    assert code == 0 and "forward graph" in text
    assert "backward: this record has no 'schedule'" in text
    assert "counts only: all_gather 0 -> 0, reduce_scatter 3 -> 3" in text
    del report["forward"]["schedule"]
    code, text, _ = run(capsys, "explain", write(tmp_path, report))
    assert code == 1 and "nothing to explain: no graph record carries a 'schedule'" in text
    code, text, _ = run(capsys, "explain", write(tmp_path, make_report(backward=False)))
    assert code == 0 and "backward: no record (not compiled yet" in text


def test_explain_unbucketed_and_unwaited(capsys, tmp_path):
    items = [
        launch("ag_x", None, "scale", 4),
        wait("w_x", "ag_x", None, "scale"),
        launch("rs_y", 1, "blocks.0", 8, "reduce_scatter"),
        compute("c", 5),
    ]
    report = {"plan": PLAN, "forward": {"before": {}, "after": {}, "schedule": {"before": items, "after": items}}}
    code, text, _ = run(capsys, "explain", write(tmp_path, report), "--graph", "forward")
    assert code == 0
    assert "unbucketed (scale)  all_gather" in text
    assert "never waited in this graph: 1" in text


@pytest.mark.parametrize(
    "content, culprit",
    [
        ("{not json", "not valid JSON"),
        ('{"a": 1}', "not a schedule report"),
        ('{"forward": {"schedule": {"before": [{"name": "x"}], "after": []}}}', "forward.schedule.before"),
    ],
)
def test_explain_bad_report_exits_2(capsys, tmp_path, content, culprit):
    path = tmp_path / "r.json"
    path.write_text(content)
    code, _, err = run(capsys, "explain", str(path))
    assert code == 2 and culprit in err
    code, _, err = run(capsys, "explain", str(tmp_path / "missing.json"))
    assert code == 2 and "does not exist" in err


@pytest.mark.parametrize(
    "wrap",
    [
        lambda r: {"losses": [5.5, 5.4], "report": r},  # examples/accelerate_train.py, hf_accelerate.py --metrics
        lambda r: {"losses": [5.5], "rank_losses": [[5.5], [5.5]], "report": r},  # examples/hf_lightning.py
    ],
    ids=["accelerate", "lightning"],
)
def test_explain_and_timeline_read_the_examples_metrics_files(capsys, tmp_path, monkeypatch, wrap):
    """Issue 55: explain refused a --metrics file, whose report is under "report"."""
    bare = write(tmp_path, make_report())
    metrics = write(tmp_path, wrap(make_report()), "metrics.json")
    code, expected, _ = run(capsys, "explain", bare)
    code, text, err = run(capsys, "explain", metrics)
    assert code == 0 and err == "" and text == expected
    drawn = []
    monkeypatch.setattr(explain_module, "draw_timeline", lambda report, out, rates=None: drawn.append(report))
    code, _, _ = run(capsys, "timeline", metrics, "--out", str(tmp_path / "t.png"))
    assert code == 0 and drawn == [make_report()]


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ({"log_history": [], "world": 2}, "this one has the keys 'log_history', 'world'."),  # hf_trainer's metrics
        ({"losses": [1.0], "report": {"a": 1}}, "and its 'report' is not a schedule report."),
        ([1, 2], "this one is a list, not an object."),
    ],
)
def test_explain_names_the_shapes_it_reads_when_given_another(capsys, tmp_path, content, said):
    path = write(tmp_path, content, "other.json")
    code, _, err = run(capsys, "explain", path)
    assert code == 2
    assert f"{path}: not a schedule report: expected a JSON object with 'forward' / 'backward' graph records" in err
    assert "or one whose 'report' key holds one (the examples' --metrics files)" in err and said in err


def test_explain_png_draws_the_cost_model_timeline(capsys, tmp_path, monkeypatch):
    path = write(tmp_path, make_report())
    png = str(tmp_path / "t.png")
    calls = []
    monkeypatch.setattr(explain_module, "draw_timeline", lambda report, out: calls.append((report, out)))
    code, out, _ = run(capsys, "explain", path, "--png", png, "--json")
    assert code == 0 and json.loads(out)["png"] == png
    assert calls == [(make_report(), png)]

    def no_matplotlib(report, out):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(explain_module, "draw_timeline", no_matplotlib)
    code, text, _ = run(capsys, "explain", path, "--png", png)
    assert code == 1 and "pip install 'fsdp-overlap-plugin[viz]'" in text


def test_shipped_example_report_matches_fixture():
    """tests/fixtures/cli/report.json (used in docs/tuning.md) is this file's report."""
    path = Path(__file__).resolve().parents[1] / "fixtures" / "cli" / "report.json"
    assert json.loads(path.read_text()) == make_report()
