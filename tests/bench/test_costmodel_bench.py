"""The cost model's two benchmark scripts (issue 42): the Llama3-8B scale prediction, and the
predicted-against-measured check on the runs kept in benchmarks/data/costmodel/ (issue 56):
in-sample and held-out rows within costmodel_check.BOUNDS, and each term of the model, moved
by 20%, breaks the check."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import costmodel_check  # noqa: E402
import predict_scale  # noqa: E402
from _harness.costmodel import HOST  # noqa: E402


def test_scale_prediction_is_self_consistent(tmp_path, capsys):
    """A 2-layer Llama3-8B-shaped model: tokens/s is tokens over the step, the passes are
    never slower than compiling without them, and HSDP's replica all-reduce costs the
    defaults (waited at once, issue 43) but not fully_shard (behind compute)."""
    out = tmp_path / "scale.json"
    assert predict_scale.main(["--layers", "2", "--seq", "1024", "--batch", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("PREDICTED (cost model, not measured)") and "6667 TPS/GPU" in text
    result = json.loads(out.read_text())
    rows = {(r["replicas"], r["variant"]): r for r in result["rows"]}
    for r in result["rows"]:
        assert r["tps_per_gpu"] == pytest.approx(1024 / r["step_s"])
    node, hsdp = rows[(1, "the plugin's defaults")], rows[(4, "the plugin's defaults")]
    assert (
        hsdp["comm_s"] > node["comm_s"]
        and hsdp["exposed_comm_s"] > rows[(4, "FSDP2 + torch.compile")]["exposed_comm_s"]
    )
    assert rows[(1, "eager FSDP2")]["step_s"] > rows[(1, "FSDP2 + torch.compile")]["step_s"]
    # calibrated to torchtitan's FSDP2 + torch.compile number, that row lands on it
    fitted = {(r["replicas"], r["variant"]): r for r in result["at_published_compute"]["rows"]}
    assert fitted[(1, "FSDP2 + torch.compile")]["tps_per_gpu"] == pytest.approx(6667, rel=2e-3)


def _run(rate: str = "300mbit", header: str = "model gpt small") -> dict:
    """A step_time JSON in miniature: one bucket gathered and reduced, both modes' reports."""

    def report(after: list[dict], before: list[dict]) -> dict:
        record = {"graph": "forward", "label": "forward", "schedule": {"before": before, "after": after}}
        empty = {"graph": "backward", "label": "backward", "schedule": {"before": [], "after": []}}
        return {"graphs": [record, empty], "mode": "both"}

    ag = {"op": "all_gather", "name": "ag", "bytes": 8e6}
    wait = {"op": "wait", "name": "w", "of": "ag"}
    compute = {"op": "compute", "name": "c", "flops": 1e9, "bytes": 0}
    after = [ag, compute, wait, dict(compute, name="c2")]
    before = [ag, wait, compute, dict(compute, name="c2")]
    medians = {
        "fsdp2-eager": 0.5,
        "compiled": 0.45,
        "both": 0.3,
        "both+prefetch-2": 0.3,
        "compute-only": 0.2,
        "compute-only-eager": 0.25,
        "comm-only": 0.2,
    }
    reports = {"both": report(after, before), "both+prefetch-2": report(after, before)}
    return {
        "header": f"step_time: ... {header} ...",
        "rate": rate,
        "summary": {"rows": {m: {"median_s": s, "min_s": s / 2} for m, s in medians.items()}, "link": {}},
        "raw": [{"reports": reports, "ideal_bytes": 1}],
    }


def test_check_calibrates_on_compute_only_and_the_replay(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_run()))
    run = costmodel_check.load_run(path)
    assert run["flops_per_s"] == pytest.approx(2e9 / 0.2) and run["eager_flops_per_s"] == pytest.approx(2e9 / 0.25)
    # the replay's 0.2 s carries one send-first gather of 4 MB per rank (x2): 8 MB / 0.2 s
    assert run["link_share"] == pytest.approx(4e6 * costmodel_check.SEND_FIRST / 0.2 / (300e6 / 8))
    # FSDP2's eager order on a CPU: the forward's gather waited before its compute
    eager = [e["op"] for e in run["graphs"]["fsdp2-eager"]["forward"]]
    assert eager == ["compute", "all_gather", "wait", "compute"]
    terms = {"latency": 0.0, "contention": 0.0, "send_first": costmodel_check.SEND_FIRST}
    terms["link_factor"] = run["link_share"]  # the link the replay measured
    pred = costmodel_check.predictions(run, terms)
    assert pred["compiled"] == pytest.approx(0.2 + 0.2)  # gather alone, then both computes
    assert pred["both"] == pytest.approx(0.2 + 0.1)  # the gather hides behind the first compute
    # a held-out run takes the fitted link factor, not its own replay's
    own = costmodel_check.predictions(run, dict(terms, link_factor=2.0), own_link=True)
    assert own == pytest.approx(costmodel_check.predictions(run, dict(terms, link_factor=run["link_share"])))


def test_slim_keeps_what_the_check_reads(tmp_path, capsys):
    full, small = tmp_path / "full.json", tmp_path / "slim.json"
    full.write_text(json.dumps(_run(header="Qwen2ForCausalLM")))
    assert costmodel_check.main(["--slim", str(full), str(small)]) == 0
    a, b = costmodel_check.load_run(full), costmodel_check.load_run(small)
    assert b["name"] == "hf-qwen2-300mbit" and "ideal_bytes" not in small.read_text()
    terms = {**HOST, "link_factor": 1.3}
    assert costmodel_check.predictions(a, terms) == costmodel_check.predictions(b, terms)
    assert (a["measured"], a["flops_per_s"], a["link_share"]) == (b["measured"], b["flops_per_s"], b["link_share"])
    # a run without a mode the check needs, or at a rate it has no tc rate for: a clear error
    broken = _run()
    del broken["summary"]["rows"]["comm-only"]
    full.write_text(json.dumps(broken))
    with pytest.raises(SystemExit, match="no comm-only"):
        costmodel_check.main(["--slim", str(full), str(small)])
    full.write_text(json.dumps(_run(rate="10gbit")))
    with pytest.raises(SystemExit, match="rate '10gbit' is not one of 300mbit, 200mbit, 100mbit"):
        costmodel_check.load_run(full)


@pytest.fixture(scope="module")
def stored():
    in_sample, held_out = costmodel_check.stored()
    return in_sample, held_out, {**HOST, "link_factor": costmodel_check.link_factor(in_sample)}


def test_stored_runs_are_the_stated_sets(stored):
    in_sample, held_out, _ = stored
    assert [r["name"] for r in in_sample] == list(costmodel_check.IN_SAMPLE)
    names = [r["name"] for r in held_out]
    assert {"gpt-200mbit", "hf-llama-200mbit", "hf-qwen2-300mbit"} <= set(names)
    assert all(len(r["measured"]) == 4 for r in in_sample + held_out)


def test_stored_runs_within_bounds(stored, capsys):
    """The claim: every in-sample and held-out row within its mode's bound, each set's mean
    |error| within its bound; the script says so and exits 0."""
    in_sample, held_out, terms = stored
    table = costmodel_check.validate(in_sample, held_out, terms)
    assert len(table) == 4 * (len(in_sample) + len(held_out))
    for row in table:
        bound = costmodel_check.BOUNDS["compiled" if row["mode"] == "compiled" else "row"]
        assert abs(row["error"]) <= bound, row
    for which in ("in-sample", "held-out"):
        errors = [abs(r["error"]) for r in table if r["set"] == which]
        assert sum(errors) / len(errors) <= costmodel_check.BOUNDS["mean"], which
    assert costmodel_check.check(table) == []
    assert costmodel_check.main([]) == 0
    out = capsys.readouterr().out
    assert "2 host terms fitted (latency, contention)" in out and "PASS" in out


def test_host_terms_are_the_fit_inside_its_grid(stored):
    """HOST is what --fit finds on the in-sample runs, inside its grid: never on the upper
    edge, and on the lower one only at 0 (a term cannot go below none), with the objective
    rising away from it."""
    in_sample, _, terms = stored
    fitted, objective = costmodel_check.fit(in_sample)
    assert {k: fitted[k] for k in costmodel_check.FITTED} == pytest.approx({k: HOST[k] for k in costmodel_check.FITTED})
    best = (fitted["latency"], fitted["contention"])
    assert objective[best] == pytest.approx(costmodel_check.mean_error(in_sample, terms))
    for i, name in enumerate(costmodel_check.FITTED):
        grid = costmodel_check.GRID[name]
        assert fitted[name] < grid[-1], name
        if fitted[name] == grid[0]:
            assert grid[0] == 0.0, name
            step = list(best)
            step[i] = grid[1]
            assert objective[tuple(step)] > objective[best], name


def _drift(table: list[dict]) -> list[str]:
    """Rows whose prediction moved more than PIN from the stored table (the one
    benchmarks/RESULTS.md shows)."""
    pinned = {r["run"]: r["predicted"] for r in json.loads(costmodel_check.TABLE.read_text())["rows"]}
    assert set(pinned) >= {r["run"] for r in table}
    return [r["run"] for r in table if abs(r["predicted"] / pinned[r["run"]] - 1) > costmodel_check.PIN]


def test_stored_table_is_what_the_model_predicts(stored):
    in_sample, held_out, terms = stored
    assert _drift(costmodel_check.validate(in_sample, held_out, terms)) == []


# Each term of the model, 20% down and up; a term fitted to 0 (latency: 20% of none is none)
# one grid step up instead (factor None), which must move the predictions past PIN.
TERMS = ("latency", "contention", "send_first", "link_factor", "compute")
MUTATIONS = [(t, None) if HOST.get(t) == 0.0 else (t, f) for t in TERMS for f in (0.8, 1.2)]
MUTATIONS = list(dict.fromkeys(MUTATIONS))
# The mutations a row or a mean outside BOUNDS catches; the rest only the stored table (PIN).
SEES_BY_BOUNDS = {
    ("contention", 1.2),
    ("send_first", 0.8),
    ("send_first", 1.2),
    ("link_factor", 0.8),
    ("link_factor", 1.2),
    ("compute", 0.8),
}


def _mutate(terms: dict, term: str, factor: float | None) -> dict:
    value = costmodel_check.GRID[term][1] if factor is None else terms.get(term, 1.0) * factor
    return dict(terms, **{term: value})


@pytest.mark.parametrize(("term", "factor"), MUTATIONS, ids=[f"{t}x{f}" if f else f"{t}+1step" for t, f in MUTATIONS])
def test_each_term_moved_20_percent_breaks_the_check(stored, term, factor):
    """The evidence sees every term: 20% either way puts a row or a mean outside BOUNDS
    (SEES_BY_BOUNDS), or, for the terms the bounds cannot see, moves a row's prediction
    more than PIN from the stored table."""
    in_sample, held_out, terms = stored
    table = costmodel_check.validate(in_sample, held_out, _mutate(terms, term, factor))
    if (term, factor) in SEES_BY_BOUNDS:
        assert costmodel_check.check(table) != []
    else:
        assert costmodel_check.check(table) == [] and _drift(table) != []


def test_the_cpu_preset_is_the_fit(stored):
    """The report's cpu default (config/hardware.py's cpu-gloo-300mbit) predicts with the
    terms this check fitted and measured: the host terms of HOST, the link at the in-sample
    link factor times 300 Mbit/s (within 0.5%: the preset rounds to whole Mbit/s)."""
    from fsdp_overlap_plugin.config.hardware import HARDWARE

    preset = HARDWARE["cpu-gloo-300mbit"]
    in_sample, _, terms = stored
    assert (preset.latency, preset.contention, preset.send_first) == (
        HOST["latency"],
        HOST["contention"],
        HOST["send_first"],
    )
    assert preset.link == pytest.approx(terms["link_factor"] * 300e6 / 8, rel=5e-3)
