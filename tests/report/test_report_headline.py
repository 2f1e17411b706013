"""The schedule summary's first lines, in plain words (issue 41): what they say on a real
compiled model, in every mode, and that every term of the summary has its entry in
docs/report.md."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import _hf
import pytest
from _fake import fake_world

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.config.parse import format_bytes
from fsdp_overlap_plugin.report.costmodel import rates_for
from fsdp_overlap_plugin.report.schedule_text import _plan_words, headline
from fsdp_overlap_plugin.runtime.records import SUMMARY_STATS

GLOSSARY = Path(__file__).resolve().parents[2] / "docs" / "report.md"


@pytest.fixture(scope="module")
def llama_report():
    """A tied transformers Llama on a fake 2-rank world, one step, aot_eager, with its
    reduce-scatters sent as all-to-alls."""
    with fake_world(2):
        model = _hf.build("llama")
        fo.parallelize(model, {"backend": "aot_eager", "reduce_scatter_impl": "all_to_all"})
        _hf.loss(model, _hf.batches(1, 2)[0]).backward()
        unique = sum(p.numel() for p in model.parameters())
        every = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
        report = fo.schedule_report(model)
    return report, unique, every


def test_headline_of_a_real_run(llama_report):
    report, unique, every = llama_report
    text = fo.format_report(report)
    lines = text.splitlines()
    # the plain words come first, the per-pass counters after, under "details"
    details = lines.index("details (every term is explained in docs/report.md):")
    assert lines[details + 1].startswith("fsdp-overlap schedule: compiled, world 2")
    head = "\n".join(lines[:details])
    assert lines[0] == "fsdp-overlap summary: 2 ranks, compiled with aot_eager, both passes on"
    assert "buckets: 4 (model.embed_tokens; model.layers.0; model.layers.1; model.norm + lm_head)" in head
    fwd, bwd = report["forward"], report["backward"]
    assert (
        f"forward {fwd['before']['all_gather']} -> {fwd['after']['all_gather']} parameter gathers; "
        f"backward {bwd['before']['all_gather']} -> {bwd['after']['all_gather']} parameter re-gathers, "
        f"{bwd['before']['reduce_scatter']} -> {bwd['after']['reduce_scatter']} gradient reduce-scatters "
        "(sent as all-to-alls: half the bytes of gloo's own)"
    ) in head
    assert (fwd["after"]["all_gather"], bwd["after"]["reduce_scatter"]) == (4, 4)
    # the prediction, added up over both graphs, with the rates it used
    pred = report["predicted"]
    comm = sum(p["after"]["comm_s"] for p in pred.values())
    hidden = comm - sum(p["after"]["exposed_comm_s"] for p in pred.values())
    assert (
        f"communication hidden behind compute (predicted): {hidden * 1e3:.1f} of {comm * 1e3:.1f} ms per step" in head
    )
    assert report["cost_model"]["rates"] == rates_for("cpu")
    assert (report["cost_model"]["device_type"], report["cost_model"]["preset"]) == ("cpu", "cpu-gloo-300mbit")
    assert (
        "rates assumed (cpu default cpu-gloo-300mbit, not measured here; set hardware or compute_profile): "
        "76 GFLOP/s compute, 0.413 Gbit/s link per rank"
    ) in head
    # a tiny model computes far less than it communicates: the summary says why little hides
    compute = sum(p["after"]["compute_s"] for p in pred.values())
    assert compute < comm and f"this step computes for {compute * 1e3:.1f} ms against {comm * 1e3:.1f} ms" in head
    # the tied embedding / lm_head weight is one parameter, and nothing gathered ahead
    # exceeds the whole model gathered (padded shards included)
    assert report["params"]["count"] == unique < every
    peak = max(report["prefetch"][k]["peak_bytes"] for k in ("forward", "backward"))
    assert peak <= report["params"]["gathered_bytes"]
    assert f"memory: at most {format_bytes(peak)} of parameters gathered ahead of use (" in head
    assert "prefetch depth 1, no budget" in head
    # no pass jargon in the plain-words part
    for word in ("a2a", "deferred_rs_waits", "gathers_first", "pin_order", "receive_first", "manual_bucketing"):
        assert word not in head, word


def test_padded_shards_count_in_the_whole_model(llama_report):
    report, unique, _ = llama_report
    # vocabulary 97 gathers 98 rows on 2 ranks: the gathered model is larger than its elements
    assert report["params"]["gathered_bytes"] == (unique + _hf.config("llama").hidden_size) * 4


def test_headline_without_overlap(llama_report):
    report = copy.deepcopy(llama_report[0])
    eager = dict(report, mode="eager fully_shard", backend=None)
    eager["passes"] = {"manual_bucketing": False, "overlap_grad_reduce": False}
    assert headline(eager) == [
        "fsdp-overlap summary: 2 ranks, uncompiled (compile: false), plain FSDP2; the passes need compile",
        "  buckets: 4 planned (model.embed_tokens; model.layers.0; model.layers.1; model.norm + lm_head), "
        "not merged: bucketing is off or not compiled",
    ]
    failed = dict(eager, mode="eager after a compile failure", fallback_reason="boom")
    assert "running uncompiled after a compile failure" in headline(failed)[0]
    assert report["called"] is True
    # before the plugin's compiled forward has run: the passes are on but have run on nothing
    fresh = dict(report, forward=None, backward=None, graphs=[], called=False)
    assert headline(fresh)[0] == (
        "fsdp-overlap summary: 2 ranks, compiled with aot_eager; the passes (both on) have not run on anything yet"
    )
    assert headline(fresh)[-1].startswith(
        "  not compiled yet: the plugin's compiled forward has not been called. The numbers come after the first "
        "training step; if one has run, it ran without the plugin"
    )
    assert "passes: manual_bucketing, overlap_grad_reduce (not run on any graph yet)" in fo.format_report(fresh)
    ran_nothing = dict(fresh, called=True)
    assert "have not run on anything yet" in headline(ran_nothing)[0]
    assert headline(ran_nothing)[-1] == "  the compiled forward ran, but no graph of it has reached the passes"
    inference_only = dict(report, forward=None, backward=None, graphs=[dict(report["graphs"][0], inference=True)])
    assert headline(inference_only)[0].endswith("both passes on")
    assert headline(inference_only)[-1].startswith("  no training graph compiled yet (only inference)")
    one = dict(report, passes={"manual_bucketing": False, "overlap_grad_reduce": True})
    assert headline(one)[0].endswith("only overlap_grad_reduce on")


def test_why_not_more_only_when_compute_is_short(llama_report):
    report = copy.deepcopy(llama_report[0])
    for phases in report["predicted"].values():  # compute now longer than communication
        phases["after"]["compute_s"] = 10 * phases["after"]["comm_s"]
    assert not any("why not more" in line for line in headline(report))
    for phases in report["predicted"].values():  # and most of it hidden
        phases["after"]["compute_s"] = phases["after"]["comm_s"] / 10
        phases["after"]["exposed_comm_s"] = phases["after"]["comm_s"] / 20
    assert not any("why not more" in line for line in headline(report))


def test_all_reduces_appear_when_there_are_some(llama_report):
    report = copy.deepcopy(llama_report[0])
    report["mesh"], report["world_size"] = [2, 2], 4  # HSDP: replicas all-reduce their gradient shards
    assert headline(report)[0].startswith("fsdp-overlap summary: 4 ranks (2 replicas of 2 shards), compiled")
    report["backward"]["before"]["all_reduce"], report["backward"]["after"]["all_reduce"] = 21, 4
    assert "; backward 21 -> 4 all-reduces" in "\n".join(headline(report))

    # both groups, and what the replica all-reduces overlap with, counted on the schedule:
    # an all-reduce waited after the next one's launch runs behind that bucket's backward
    def schedule(waited_late: list[bool]) -> list[dict]:
        events = []
        for i, late in enumerate(waited_late):
            events += [{"op": "compute", "name": f"mm{i}"}, {"op": "all_reduce", "name": f"ar{i}", "bucket": i}]
            if i and waited_late[i - 1]:
                events.append({"op": "wait", "name": f"w{i - 1}", "of": f"ar{i - 1}"})
            if not late:
                events.append({"op": "wait", "name": f"w{i}", "of": f"ar{i}"})
        return events

    def groups() -> list[str]:
        return [line for line in headline(report) if line.startswith("  groups: ")]

    report["backward"]["schedule"]["after"] = schedule([True, True, True, False])
    assert groups() == [
        "  groups: each rank shards with 2 ranks (parameter gathers and gradient reduce-scatters) and is one of "
        "2 replicas, which all-reduce only their gradient shards (4 all-reduces, the traffic between nodes): each "
        "bucket's all-reduce starts when its reduce-scatter is done and 3 of 4 are waited only after the next one "
        "starts; 3 of the 4 have backward compute in flight (an all-reduce that starts after the backward's last "
        "compute has none)"
    ], groups()
    report["backward"]["schedule"]["after"] = schedule([False, True, False, False])
    assert groups()[0].endswith(
        "1 of 4 are waited only after the next one starts; the others are waited before the next one starts; "
        "1 of the 4 have backward compute in flight (an all-reduce that starts after the backward's last compute "
        "has none)"
    ), groups()
    # no compute after the last launches: deferred, but nothing in flight with them
    events = schedule([True, True, True, False])
    report["backward"]["schedule"]["after"] = [e for e in events if e["name"] not in ("mm2", "mm3")]
    assert "3 of 4 are waited only after the next one starts; 1 of the 4 have backward compute" in groups()[0]
    report["backward"]["schedule"]["after"] = schedule([False] * 4)
    assert groups()[0].endswith("each is waited before the next one starts"), groups()
    report["passes"]["manual_bucketing"] = False
    assert groups()[0].endswith("each is waited at once (bucketing is off)"), groups()
    report["mesh"], report["world_size"] = [1, 2], 2  # one replica: no groups line
    assert not [line for line in headline(report) if line.startswith("  groups: ")]


def test_plan_words_collapse_runs_of_blocks():
    plan = [["tok_emb", "pos_emb"], *[[f"blocks.{i}"] for i in range(32)], ["norm", "head"]]
    assert _plan_words(plan) == "tok_emb + pos_emb; blocks.0 to blocks.31, one each; norm + head"
    # two in a row stay named; a gap breaks the run
    assert _plan_words([["a.0"], ["a.1"]]) == "a.0; a.1"
    assert _plan_words([["a.0"], ["a.1"], ["a.2"], ["a.4"]]) == "a.0 to a.2, one each; a.4"
    assert _plan_words([["x.0", "x.1"], ["x.2"]]) == "x.0 + x.1; x.2"


def test_every_term_has_a_glossary_entry(llama_report):
    glossary = GLOSSARY.read_text()
    for name, keys in SUMMARY_STATS.items():  # every counter the details show
        assert f"`{name}(" in glossary, name
        for key in keys:
            assert f"`{key}`" in glossary or f"{key}=" in glossary or f", {key}" in glossary, (name, key)
    # every line the summary and the details can start with: the words before its first
    # ":" or "(", a module or parameter name written X, forward and backward alike
    text = fo.format_report(llama_report[0])
    starts = set()
    for line in text.splitlines():
        if re.match(r"\s*(graph\s|details|(forward|backward|inference)\s.*->)", line):
            continue  # the table's header and rows, and the line that opens the details
        head = re.sub(r"\b\w+(\.\w+)+\b", "X", re.split(r"[:(]", line.strip())[0].strip())
        starts.add(head.replace("backward", "forward"))
    assert len(starts) >= 14, starts
    missing = [s for s in starts if f"`{s}" not in glossary]
    assert not missing, missing
    for term in ("a2a", "[from FX graph cache]", "receive_first", "compile cache", "fell back to eager"):
        assert term in glossary, term


def test_report_json_round_trip_keeps_the_headline(llama_report, tmp_path):
    import json

    report = llama_report[0]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report, default=str))
    assert headline(json.loads(path.read_text())) == headline(report)


def test_summary_and_explain_state_the_same_hidden_and_exposed_numbers(llama_report, tmp_path, capsys):
    """Issue 55: the summary said "communication hidden behind compute (predicted): 13.6 of
    67.7 ms per step" while ``explain`` of the same report said "0 B of 917.5 KiB exposed".
    Hidden and exposed are now one thing everywhere, the cost model's predicted time
    (docs/report.md): explain prints the summary's line, and each graph's own figures from
    the same ``report["predicted"]``; its node-order byte count is named otherwise."""
    import json

    from fsdp_overlap_plugin.cli import main

    report = llama_report[0]
    summary = fo.format_report(report).splitlines()
    (hidden,) = [line for line in summary if "communication hidden behind compute (predicted)" in line]
    # the metrics file as examples/accelerate_train.py writes it: explain reads the report inside
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps({"losses": [5.5, 5.4], "report": report}, default=str))
    assert main(["explain", str(metrics)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert f"step    {hidden.strip()}" in lines
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    for kind, phases in report["predicted"].items():
        a, b = phases["after"], phases["before"]
        section = text[text.index(f"{kind} graph") :]
        assert (
            f"  communication hidden behind compute (predicted): {ms(a['comm_s'] - a['exposed_comm_s'])} of "
            f"{ms(a['comm_s'])} ms, {ms(b['comm_s'] - b['exposed_comm_s'])} of {ms(b['comm_s'])} before the passes; "
            f"exposed (compute waiting for it) {ms(a['exposed_comm_s'])} ms, {ms(b['exposed_comm_s'])} before"
        ) == section.splitlines()[1]
    # per step, the summary's total is the graphs' sum: the same numbers, not another measure
    after = [p["after"] for p in report["predicted"].values()]
    assert (
        f"{ms(sum(a['comm_s'] - a['exposed_comm_s'] for a in after))} of {ms(sum(a['comm_s'] for a in after))} ms"
        in (hidden)
    )
    # "exposed" and "hidden" only ever stand beside predicted milliseconds, in both outputs
    for line in lines + summary:
        if re.search(r"\b(exposed|hidden)\b", line) and not re.search(r"[\d.]+ ms|why not more:", line):
            raise AssertionError(f"exposed/hidden without the cost model's time: {line!r}")
    assert "without (cannot hide)" in text  # the node-order count, in its own words
    assert main(["explain", str(metrics), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["predicted"] == json.loads(json.dumps(report["predicted"]))
