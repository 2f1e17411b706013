"""benchmarks/pass_scaling.py --real: a traced 2-layer Llama's post-grad graphs, captured as
the compile wiring hands them to the passes, run through every applicable pass."""

from __future__ import annotations

import copy

import pytest
from _bench import help_text, load

pytest.importorskip("transformers")


def test_help_names_the_real_mode():
    assert "--real" in help_text("pass_scaling")


@pytest.mark.slow  # tracing and compiling the model's forward: about 30 s on one core
def test_real_graphs_are_captured_and_the_passes_merge_their_collectives():
    bench = load("pass_scaling")
    captured = bench.capture_real(2)
    assert set(captured) == {"forward", "backward"}
    for kind, (gm, state) in captured.items():
        names = [e.name for e in bench.applicable_passes(kind, state)]
        assert "manual_bucketing" in names and "pin_order" in names
        assert ("overlap_grad_reduce" in names) == (kind == "backward")
        work = copy.deepcopy(gm)
        times, stats = bench.run_real_passes(work, kind, state)
        assert set(times) == set(names)
        bucketing = stats["manual_bucketing"]
        if kind == "forward":
            assert bucketing["merged_all_gathers"] > 0
            assert bucketing["all_gathers_after"] < bucketing["all_gathers_before"]
        else:
            assert bucketing["merged_reduce_scatters"] > 0
            assert bucketing["reduce_scatters_after"] < bucketing["reduce_scatters_before"]
            assert stats["tied"]["merged"] == 1  # the tied embedding / head
            assert stats["overlap_grad_reduce"]["matched"] > 0
        assert not bucketing["left_unbucketed"]
        work.graph.lint()
        # the same input graph gives the same output graph (what --check-signature relies on)
        again = copy.deepcopy(gm)
        bench.run_real_passes(again, kind, state)
        assert bench.graph_signature(again) == bench.graph_signature(work)
