"""HSDP: every bucket's replica all-reduce but the last runs behind later backward work.

Each bucket's gradient reduce-scatter result is all-reduced over the replicas; the
bucketing merges a bucket's all-reduces into one and waits it only after the next
bucket's all-reduce has launched (``passes/bucketing.py``). Counted here on the backward
graph after our passes and on inductor's generated code, on the fake process group (one
process, any world), for the repo GPT and transformers' Llama (tied), Qwen2 (untied) and
GPT-2 (tied), at 2 x 2 with the auto plan and at 2 x 4 with one bucket per module.

Before: a bucket with one reduce-scatter (an embedding alone in its entry; the tied
Llama's ``[norm, lm_head]``, whose head gradient the tied pass moved to the embedding's
bucket) had no all-reduces to merge, so it was no unit of the deferral: its all-reduce was
waited at once and the bucket before it could not wait past it. A tied Llama at 2 x 2
showed 1 of 4, Qwen2 2 of 4; now every model shows all but one.
"""

from __future__ import annotations

import re

import _hf
import pytest
import torch
from _fake import fake_world

import fsdp_overlap_plugin as fo
import fsdp_overlap_plugin.compile.backends as fo_compile
from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn
from fsdp_overlap_plugin.passes.graph import collective_of_wait, is_all_reduce, is_wait
from fsdp_overlap_plugin.passes.pin import is_anchor
from fsdp_overlap_plugin.report.schedule_text import _replica_all_reduce_overlap, _replica_all_reduces_behind

pytestmark = pytest.mark.torch_sensitive  # traces and compiles: also on every torch of the CI matrix

FAMILIES = ("gpt", "llama", "qwen2", "gpt2")
# name: (world, replicas, config); bucket_bytes=1 gives every module outside the blocks
# its own bucket (a tied head's entry then reduces nothing of its own)
LAYOUTS = {"2x2-auto": (4, 2, {}), "2x4-per-module": (8, 2, {"bucket_bytes": 1})}


def _build(family: str) -> torch.nn.Module:
    if family == "gpt":
        torch.manual_seed(0)
        return gpt_small()
    model = _hf.build(family)
    model.loss_type = "ForCausalLM"  # GPT-2 has none: a graph break (docs: PITFALLS)
    return model


def _step(family: str, model: torch.nn.Module) -> None:
    if family == "gpt":
        x, y = fixed_batches(1, 2, 16, 256)[0]
        loss_fn(model(x), y).backward()
    else:
        _hf.loss(model, _hf.batches(1, 2)[0]).backward()


def _event(node: torch.fx.Node) -> tuple[str, str, str | None] | None:
    """``(kind, name, of)`` for an all-reduce launch, a wait (``of``: its launch) or a
    matmul; None for anything else."""
    if is_all_reduce(node):
        return ("launch", node.name, None)
    if is_wait(node):
        launch = collective_of_wait(node)
        return ("wait", node.name, launch.name if launch is not None else None)
    return ("compute", node.name, None) if is_anchor(node) else None


def _run(monkeypatch, family: str, layout: str, backend: str) -> dict:
    """Compile and step ``family`` on the fake process group; the backward graph after
    the passes as ``[(kind, name, of)]`` (all-reduce launches, waits, matmuls), the
    report, and inductor's generated code (None on aot_eager)."""
    world, replicas, config = LAYOUTS[layout]
    graphs: list[list[tuple]] = []
    original = fo_compile.run_passes

    def capturing(gm, kind, state, **kwargs):
        record = original(gm, kind, state, **kwargs)
        if kind == "backward":
            graphs.append([event for event in map(_event, gm.graph.nodes) if event is not None])
        return record

    monkeypatch.setattr(fo_compile, "run_passes", capturing)
    with fake_world(world):
        model = _build(family)
        fo.parallelize(model, backend=backend, mesh={"replicate": replicas}, **config)
        code = None
        if backend == "inductor":
            from torch._inductor.utils import run_and_get_code

            _, codes = run_and_get_code(lambda: _step(family, model))
            assert len(codes) == 2, len(codes)  # the forward and the backward
            code = codes[1]
        else:
            _step(family, model)
        report = fo.schedule_report(model)
    assert len(graphs) == 1, len(graphs)
    return {"graph": graphs[0], "report": report, "code": code, "model": model}


def windows(events: list[tuple[str, str, str | None]]) -> list[dict]:
    """Per all-reduce, in launch order: where it launches, where the next one launches,
    where it is waited, and the compute (matmuls) between its launch and its wait and
    after its launch. ``events``: ``(kind, name, of)``, ``kind`` one of launch, wait,
    compute; ``of``: the launch a wait waits on."""
    launches = [(i, name) for i, (kind, name, _) in enumerate(events) if kind == "launch"]
    compute = [i for i, (kind, _, _) in enumerate(events) if kind == "compute"]
    out = []
    for k, (start, name) in enumerate(launches):
        # the first wait after the launch: in generated code an all-reduce in place on the
        # reduce-scatter's output names the buffer that reduce-scatter's wait named
        wait = next(i for i, (kind, _, of) in enumerate(events) if i > start and kind == "wait" and of == name)
        out.append(
            {
                "launch": start,
                "next": launches[k + 1][0] if k + 1 < len(launches) else None,
                "wait": wait,
                "compute": sum(1 for i in compute if start < i < wait),
                "compute_after": sum(1 for i in compute if i > start),
            }
        )
    return out


def deferred(found: list[dict]) -> int:
    """All-reduces waited only after the next one launched."""
    return sum(1 for w in found if w["next"] is not None and w["launch"] < w["next"] < w["wait"])


# inductor's code: an all-reduce is in place on a buffer it copied the gradient into
# (``all_reduce_``) or returns a new one; a wait names the buffer
_AR = re.compile(r"(?:(buf\d+) = )?torch\.ops\._c10d_functional\.all_reduce_?\.default\((buf\d+)")
_WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((buf\d+)\)")
_MM = re.compile(r"extern_kernels\.(mm|addmm|bmm|baddbmm)\(")


def code_events(code: str) -> list[tuple[str, str, str | None]]:
    """Generated code as ``windows`` reads it: all-reduce launches, waits, matmuls."""
    events = []
    for line in code.splitlines():
        if m := _AR.search(line):
            buf = m.group(1) or m.group(2)
            events.append(("launch", buf, None))
        elif m := _WAIT.search(line):
            events.append(("wait", m.group(1), m.group(1)))
        elif _MM.search(line):
            events.append(("compute", "mm", None))
    return events


def _check(found: list[dict], buckets: int) -> None:
    assert len(found) == buckets >= 2, found
    assert deferred(found) == buckets - 1, found
    for w in found:
        assert w["launch"] < w["wait"], w
        # behind the matmuls that run after it launched, where any are left
        assert (w["compute"] > 0) == (w["compute_after"] > 0) or w["next"] is None, w


WITHOUT_COMPUTE = {"2x2-auto": 1, "2x4-per-module": 2}


def _all_reduce_buckets(report: dict) -> int:
    """One all-reduce per bucket that reduces gradients: as many as reduce-scatters."""
    after = report["backward"]["after"]
    assert after["all_reduce"] == after["reduce_scatter"], after
    return after["all_reduce"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_every_replica_all_reduce_but_the_last_is_deferred_in_the_graph(monkeypatch, family, layout):
    run = _run(monkeypatch, family, layout, "aot_eager")
    report = run["report"]
    buckets = _all_reduce_buckets(report)
    # one per plan entry that holds a parameter of its own (a tied head's entry does not)
    assert buckets == _hf.expected_collectives(run["model"], report["plan"])[1], report["plan"]
    _check(windows(run["graph"]), buckets)
    backward = report["backward"]
    assert backward["passes"]["manual_bucketing"]["deferred_ar_waits"] == buckets - 1
    # the summary counts the same on the recorded schedule, and says so
    assert _replica_all_reduces_behind(backward) == buckets - 1
    text = fo.format_report(report)
    assert f"{buckets - 1} of {buckets} are waited only after the next one starts;" in text, text
    # and how many have backward compute (any operation but a view) between launch and wait:
    # all but the last with the auto plan; one bucket per module leaves the last two without
    # (each all-reduce starts when its reduce-scatter is waited, after the next bucket's
    # backward, so the second last starts after the backward's last compute)
    assert _replica_all_reduce_overlap(backward) == (buckets - 1, buckets - WITHOUT_COMPUTE[layout])
    assert f"{buckets - WITHOUT_COMPUTE[layout]} of the {buckets} have backward compute in flight" in text
    assert "the others are waited" not in text


# inductor's code: every family at 2 x 2 (the auto plan, tied heads included); at 2 x 4 with a
# bucket per module, the repo GPT and GPT-2 (a tied head: its entry reduces nothing of its
# own). The graph tests above run all eight cases everywhere.
CODE_CASES = [(f, "2x2-auto") for f in FAMILIES] + [("gpt", "2x4-per-module"), ("gpt2", "2x4-per-module")]


@pytest.mark.slow
@pytest.mark.oldest_torch  # CI: on 2.11, what the GPU machines carry (131 s there); the graph tests above run everywhere
@pytest.mark.parametrize(("family", "layout"), CODE_CASES, ids=[f"{f}-{lay}" for f, lay in CODE_CASES])
def test_every_replica_all_reduce_but_the_last_is_deferred_in_inductors_code(monkeypatch, tmp_path, family, layout):
    """At 2 x 2 on gloo the reduce-scatters go as all-to-alls and each all-reduce reads a
    copy; at 2 x 4 they are native and inductor all-reduces the reduce-scatter's buffer in
    place (the two waits name one buffer)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    run = _run(monkeypatch, family, layout, "inductor")
    buckets = _all_reduce_buckets(run["report"])
    _check(windows(run["graph"]), buckets)
    found = windows(code_events(run["code"]))
    _check(found, buckets)
    # the first all-reduce runs behind the backward matmuls of the bucket two on
    assert found[0]["compute"] > 0, found
