"""The schedule report's cost model, predicted numbers and timeline picture, and the
report's place in the import graph."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_overlap_plugin.report import costmodel as cm
from fsdp_overlap_plugin.report.costmodel import draw_timeline, predicted, simulate

RATES = {"flops": 1e9, "mem": 1e12, "link": 1e6}  # 1 GFLOP/s, memory free, 1 MB/s link


def ev(op, name, **kw):
    return {
        "op": op,
        "name": name,
        "bucket": kw.pop("bucket", None),
        "module": None,
        "bytes": kw.pop("bytes", 0),
        "flops": kw.pop("flops", 0),
        "of": kw.pop("of", None),
    }


def test_simulate_exposed_communication_by_hand():
    # 2 MB all-gather on 2 ranks sends 1 MB: 1 s on the link. 0.4 s of compute hides part.
    hidden = [ev("all_gather", "ag", bytes=2_000_000), ev("compute", "c", flops=4e8), ev("wait", "w", of="ag")]
    sim = simulate(hidden, world=2, **RATES)
    assert sim["comm_s"] == pytest.approx(1.0)
    assert sim["exposed_comm_s"] == pytest.approx(0.6)
    assert sim["total_s"] == pytest.approx(1.0)
    exposed = [ev("all_gather", "ag", bytes=2_000_000), ev("wait", "w", of="ag"), ev("compute", "c", flops=4e8)]
    sim = simulate(exposed, world=2, **RATES)
    assert sim["exposed_comm_s"] == pytest.approx(1.0) and sim["total_s"] == pytest.approx(1.4)


def test_simulate_serializes_the_link():
    events = [ev("all_gather", "a", bytes=2e6), ev("reduce_scatter", "b", bytes=2e6), ev("wait", "wb", of="b")]
    sim = simulate(events, world=2, **RATES)
    assert [(round(a, 6), round(b, 6)) for a, b, *_ in sim["comm"]] == [(0.0, 1.0), (1.0, 2.0)]
    assert sim["exposed_comm_s"] == pytest.approx(2.0)


def _report():
    events_before = [
        ev("all_gather", "a0", bytes=2e6),
        ev("wait", "w0", of="a0"),
        ev("compute", "c0", flops=1e9),
        ev("all_gather", "a1", bytes=2e6),
        ev("wait", "w1", of="a1"),
        ev("compute", "c1", flops=1e9),
    ]
    events_after = [
        ev("all_gather", "a0", bytes=2e6),
        ev("all_gather", "a1", bytes=2e6),
        ev("wait", "w0", of="a0"),
        ev("compute", "c0", flops=1e9),
        ev("wait", "w1", of="a1"),
        ev("compute", "c1", flops=1e9),
    ]
    record = {
        "graph": "forward",
        "before": {},
        "after": {},
        "passes": {},
        "schedule": {"before": events_before, "after": events_after},
    }
    return {"world_size": 2, "device_type": "cpu", "forward": record, "backward": None}


def test_prefetch_shows_up_in_predicted_numbers():
    numbers = predicted(_report(), RATES)["forward"]
    assert numbers["before"]["exposed_comm_s"] == pytest.approx(2.0)
    assert numbers["after"]["exposed_comm_s"] == pytest.approx(1.0)  # the second gather hides behind c0
    assert numbers["after"]["total_s"] < numbers["before"]["total_s"]


def test_draw_timeline_and_cli(tmp_path):
    pytest.importorskip("matplotlib", reason="the timeline picture needs the viz extra")
    png = draw_timeline(_report(), str(tmp_path / "t.png"), RATES)
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report_path = tmp_path / "r.json"
    report_path.write_text(json.dumps(_report()))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsdp_overlap_plugin",
            "timeline",
            str(report_path),
            "--out",
            str(tmp_path / "c.png"),
            "--link",
            "8mbit",
            "--flops",
            "1e9",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    data = json.loads(out.stdout)
    assert data["rates"]["link"] == pytest.approx(1e6)
    # 1 s of bytes at 8 Mbit, as gloo runs that all-gather on a cpu report: one direction at a
    # time (send_first 2) plus 0.5 ms per collective (the cpu preset's host terms)
    rates = cm.rates_for("cpu")
    assert (rates["send_first"], rates["latency"]) == (2.0, 0.0005)
    assert data["predicted"]["forward"]["after"]["exposed_comm_s"] == pytest.approx(2.0005, rel=0.01)


def test_timeline_without_schedules_is_a_clear_error(tmp_path):
    report_path = tmp_path / "r.json"
    report_path.write_text(json.dumps({"world_size": 2, "device_type": "cpu", "forward": None, "backward": None}))
    out = subprocess.run(
        [sys.executable, "-m", "fsdp_overlap_plugin", "timeline", str(report_path)], capture_output=True, text=True
    )
    assert out.returncode == 2 and "no recorded schedules" in out.stderr


def test_reading_a_report_never_imports_the_compile_wiring():
    """report.py reads state, records and the cost model; compile.py imports report code,
    never the other way round. Importing the package (which registers the Lightning
    strategies and imports parallelize) does not load compile.py either."""
    check = (
        "import sys, fsdp_overlap_plugin.report.schedule; "
        "assert 'fsdp_overlap_plugin.compile.compiler' not in sys.modules, "
        "sorted(m for m in sys.modules if m.startswith('fsdp_overlap_plugin'))"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
