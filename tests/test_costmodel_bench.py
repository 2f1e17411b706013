"""The cost model's two benchmark scripts (issue 42): the Llama3-8B scale prediction and the
predicted-against-measured check, on inputs small enough for CI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import costmodel_check  # noqa: E402
import predict_scale  # noqa: E402


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


def _run_json(tmp_path: Path) -> str:
    """A step_time JSON in miniature: one bucket gathered and reduced, both modes' reports."""

    def report(after: list[dict], before: list[dict]) -> dict:
        record = {"graph": "forward", "label": "forward", "schedule": {"before": before, "after": after}}
        empty = {"graph": "backward", "label": "backward", "schedule": {"before": [], "after": []}}
        return {"graphs": [record, empty]}

    ag = {"op": "all_gather", "name": "ag", "bytes": 8e6}
    wait = {"op": "wait", "name": "w", "of": "ag"}
    compute = {"op": "compute", "name": "c", "flops": 1e9, "bytes": 0}
    after = [ag, compute, wait, dict(compute, name="c2")]
    before = [ag, wait, compute, dict(compute, name="c2")]
    rows = {
        m: {"median_s": s}
        for m, s in {
            "fsdp2-eager": 0.5,
            "compiled": 0.45,
            "both": 0.3,
            "both+prefetch-2": 0.3,
            "compute-only": 0.2,
            "compute-only-eager": 0.25,
            "comm-only": 0.2,
        }.items()
    }
    reports = {"both": report(after, before), "both+prefetch-2": report(after, before)}
    data = {
        "header": "step_time: ... model gpt small ...",
        "rate": "300mbit",
        "summary": {"rows": rows},
        "raw": [{"reports": reports}],
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_check_calibrates_on_compute_only_and_the_replay(tmp_path, capsys):
    run = costmodel_check.load_run(_run_json(tmp_path))
    assert run["flops_per_s"] == pytest.approx(2e9 / 0.2) and run["eager_flops_per_s"] == pytest.approx(2e9 / 0.25)
    # the replay's 0.2 s carries one send-first gather of 4 MB per rank (x2): 8 MB / 0.2 s
    assert run["link"] == pytest.approx(4e6 * costmodel_check.SEND_FIRST / 0.2)
    # FSDP2's eager order on a CPU: the forward's gather waited before its compute
    eager = [e["op"] for e in run["graphs"]["fsdp2-eager"]["forward"]]
    assert eager == ["compute", "all_gather", "wait", "compute"]
    host = {"latency": 0.0, "contention": 0.0, "send_first": costmodel_check.SEND_FIRST}
    pred = costmodel_check.predictions(run, host)
    assert pred["compiled"] == pytest.approx(0.2 + 0.2)  # gather alone, then both computes
    assert pred["both"] == pytest.approx(0.2 + 0.1)  # the gather hides behind the first compute
    assert costmodel_check.main([_run_json(tmp_path)]) == 0
    assert "within 10%" in capsys.readouterr().out
