"""The first compiled step says, on rank 0 only, that it is compiling, then how long it
took and what the compile cache did (messages.CompileProgress): through ``parallelize``
on 2 gloo ranks, cold and then warm against one TORCHINDUCTOR_CACHE_DIR; a recompile is
announced a bounded number of times; the eager fallback closes the announcement; and the
Lightning Trainer and ``accelerate launch`` paths print the same lines.

The core path is two jobs of 2 ranks (``core_runs``): the cold one then trains a model that
recompiles, the warm one a model whose compile fails on rank 1, each from a fresh Dynamo."""

from __future__ import annotations

import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml
from _accelerate import OVERLAP_YAML, accelerate_launch, launch_env, output
from _dist import run_ranks

from fsdp_overlap_plugin.report.messages import PROGRESS_ENV, CompileProgress

COMPILING = "fsdp-overlap: compiling the model (first step; later steps reuse it)..."
COMPILED = re.compile(r"fsdp-overlap: compiled in \d+\.\d s \((.*)\)")
AGAIN = "fsdp-overlap: compiling the model again ("
VOCAB = 64


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("fsdp-overlap: compil")]


def _train(rank: int, world: int, backend: str, seqs: list[int], config: dict) -> str:
    """parallelize a tiny GPT and take one step per sequence length; what this rank wrote to stderr."""
    import io
    import sys

    import torch

    import fsdp_overlap_plugin as fo
    from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn

    torch.manual_seed(0)
    captured = io.StringIO()
    saved, sys.stderr = sys.stderr, captured
    try:
        model = fo.parallelize(
            gpt_small(n_layer=1, d_model=32, vocab_size=VOCAB, block_size=32), backend=backend, **config
        )
        for seq in seqs:
            x, y = fixed_batches(1, 2, seq, VOCAB, seed=seq)[0]
            loss_fn(model(x), y).backward()
    finally:
        sys.stderr = saved
    return captured.getvalue()


def _broken_rank1(rank: int, world: int) -> str:
    """Compilation fails on rank 1; on_compile_error: eager runs every rank uncompiled."""
    import warnings

    if rank == 1:
        import fsdp_overlap_plugin.compile.backends as fo_compile

        def broken(*args, **kwargs):
            raise RuntimeError("injected compile failure")

        fo_compile.run_passes = broken
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _train(rank, world, "aot_eager", [16, 16], {"on_compile_error": "eager"})


def _inductor_then(rank: int, world: int, then: str) -> dict[str, str]:
    """Three steps under inductor, then (from a fresh Dynamo) ``then``: "recompile" (new
    lengths under aot_eager) or "fallback" (``_broken_rank1``); what each wrote to stderr."""
    import torch._dynamo

    out = {"inductor": _train(rank, world, "inductor", [16, 16, 16], {})}
    torch._dynamo.reset()
    if then == "recompile":
        out[then] = _train(rank, world, "aot_eager", [16, 16, 24, 20, 28], {"fullgraph": False})
    else:
        out[then] = _broken_rank1(rank, world)
    return out


# ----------------------------------------------------------------- the lines themselves
def _fake_state(backend: str = "inductor") -> SimpleNamespace:
    return SimpleNamespace(rank=0, compile_cache=[], dynamo_graphs=0, config=SimpleNamespace(backend=backend))


def _hit(hit: bool) -> dict:
    return {"aot_autograd": "hit" if hit else "miss", "fx_graph": {"hit": int(hit), "miss": int(not hit), "bypass": 0}}


def test_the_lines_of_one_compile_and_of_a_bounded_number_of_recompiles(capsys, monkeypatch):
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    state = _fake_state()
    progress = CompileProgress(state)
    progress.call_started(first=True)
    state.dynamo_graphs, state.compile_cache = 1, [_hit(False)]
    progress.call_finished()
    for step in range(CompileProgress.RECOMPILES + 3):  # a recompile at every step
        progress.call_started(first=False)
        progress.graph_started(f"size of x changed at step {step}")
        state.dynamo_graphs += 1
        state.compile_cache.append(_hit(True))
        progress.call_finished()
    progress.call_started(first=False)  # a step that compiles nothing says nothing
    progress.call_finished()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == COMPILING
    assert COMPILED.fullmatch(lines[1]).group(1) == "forward and backward; 0 of 1 graph from the compile cache"
    again = [line for line in lines if line.startswith(AGAIN)]
    assert len(again) == CompileProgress.RECOMPILES  # then no more, however many follow
    assert again[0] == AGAIN + "size of x changed at step 0)..."
    assert COMPILED.fullmatch(lines[3]).group(1) == "forward and backward; 1 of 1 graph from the compile cache"
    assert len(lines) == 2 + 2 * CompileProgress.RECOMPILES


def test_rank_1_and_the_environment_variable_silence_it(capsys, monkeypatch):
    state = _fake_state("aot_eager")
    state.rank = 1
    progress = CompileProgress(state)
    progress.call_started(first=True)
    state.dynamo_graphs = 1
    progress.call_finished()
    state.rank = 0
    monkeypatch.setenv(PROGRESS_ENV, "0")
    progress.call_started(first=True)
    state.dynamo_graphs = 2
    progress.call_finished()
    assert capsys.readouterr().err == ""
    monkeypatch.delenv(PROGRESS_ENV)
    progress.call_started(first=True)
    state.dynamo_graphs = 3
    progress.call_finished()
    err = capsys.readouterr().err.splitlines()
    assert err[0] == COMPILING
    assert COMPILED.fullmatch(err[1]).group(1) == "forward and backward; 1 graph, backend aot_eager: no compile cache"


# --------------------------------------------------------------------------- core path
@pytest.fixture(scope="module")
def core_runs(tmp_path_factory) -> list[list[dict[str, str]]]:
    """The cold job then the warm one against one cache, each rank's ``_inductor_then``."""
    env = {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("cache")),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
    }
    return [run_ranks(_inductor_then, then, env=env) for then in ("recompile", "fallback")]


@pytest.mark.slow
def test_core_cold_then_warm_on_rank_0_only(core_runs):
    for run, cache in zip(core_runs, ("0 of 1 graph", "1 of 1 graph")):
        rank0, rank1 = (_lines(out["inductor"]) for out in run)
        assert rank1 == [], run[1]["inductor"]
        assert len(rank0) == 2, run[0]["inductor"]  # once, not at every step
        assert rank0[0] == COMPILING
        assert COMPILED.fullmatch(rank0[1]).group(1) == f"forward and backward; {cache} from the compile cache"


@pytest.mark.slow
def test_core_recompile_for_a_new_length_and_the_eager_fallback(core_runs):
    # dynamic: auto compiles once more at the first new length (symbolic), then never
    rank0, rank1 = (_lines(out["recompile"]) for out in core_runs[0])
    assert rank1 == []
    assert rank0[0] == COMPILING and COMPILED.fullmatch(rank0[1])
    assert rank0[2].startswith(AGAIN) and COMPILED.fullmatch(rank0[3]), rank0
    assert len(rank0) == 4, rank0
    # on_compile_error: eager: the announcement ends with the fallback, not "compiled in"
    rank0, rank1 = (_lines(out["fallback"]) for out in core_runs[1])
    assert rank1 == []
    assert rank0[0] == COMPILING
    assert rank0[1].startswith("fsdp-overlap: compiling failed after ") and "runs uncompiled" in rank0[1]
    assert len(rank0) == 2, rank0


# --------------------------------------------------------------------- the adapters
# (_lightning imported here, not at the top: the core path's ranks, which start with
# ``spawn`` and import this module, need not import Lightning)
@pytest.mark.slow
def test_lightning_trainer_devices_2_prints_it_once(tmp_path):
    from _lightning import trainer_script

    script = tmp_path / "train.py"
    script.write_text(trainer_script('FSDPOverlapStrategy(backend="aot_eager")', n_layer=1, rows=12, max_steps=3))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=launch_env(), capture_output=True, text=True, timeout=600
    )
    text = output(proc)
    assert proc.returncode == 0, text[-6000:]
    lines = _lines(text)
    assert lines[0] == COMPILING and len(lines) == 2, text[-6000:]
    assert COMPILED.fullmatch(lines[1]).group(1) == "forward and backward; 1 graph, backend aot_eager: no compile cache"


@pytest.mark.slow
def test_accelerate_launch_prints_it_once(tmp_path):
    data = yaml.safe_load(OVERLAP_YAML.read_text())
    data["fsdp_config"]["fsdp_overlap_backend"] = "aot_eager"
    path = tmp_path / "overlap.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    proc = accelerate_launch(path, "--steps", "3")
    text = output(proc)
    assert proc.returncode == 0, text[-6000:]
    lines = _lines(text)
    assert lines[0] == COMPILING and len(lines) == 2, text[-6000:]
    assert COMPILED.fullmatch(lines[1])
