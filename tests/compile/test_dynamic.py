"""Variable sequence lengths: one static and one dynamic compile, whatever the lengths.

Before (issue 45): every new length recompiled (a FLOP estimate turned the symbolic length
back into a number), the 9th stopped with a false "graph break", ranks slicing one global
batch stopped at the first recompile (the slice's storage offset became a graph input on
rank 1 only), the report failed on a symbolic size, and ``model.generate`` stopped too.
Each test trains 2 gloo ranks at 12 distinct lengths and compares with one process.

The ranks are costly to start and to warm up, so the scenarios share jobs: one 2-rank job
(``aot_eager_runs``) runs every aot_eager scenario of CI's 2.13 lane in turn (the repo GPT
at twelve lengths, ``dynamic: true``, the recompile limit with and without fullgraph, each
rank at its own length, generate, a different model on one rank: last, as it stops both
ranks), and one (``newest_runs``) those of the 2.15 lane (the Llama under aot_eager, the
Llama and the repo GPT under inductor, generate under inductor); each test asserts on its
scenario's part of the results.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import warnings

import _hf
import pytest
import torch
from _dist import run_ranks

import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.config.schema import OverlapConfig, OverlapConfigError
from fsdp_overlap_plugin.models import gpt_small, loss_fn

pytestmark = pytest.mark.torch_sensitive  # CI runs its quick tests on both ends of its torch matrix (2.11, 2.15)

# 12 distinct lengths (none 0 or 1, which Dynamo always specialises), one repeated
LENGTHS = (32, 48, 40, 64, 33, 17, 56, 24, 45, 29, 61, 37, 48)
BATCH = 4  # global; each of 2 ranks takes 2 rows
LR = 0.1
GPT = dict(n_layer=2, d_model=32, block_size=64)


def _model(kind: str) -> torch.nn.Module:
    if kind == "gpt":
        torch.manual_seed(0)
        return gpt_small(**GPT)
    return _hf.build("llama")  # tied embeddings, vocabulary 97 (odd: uneven shards)


def _vocab(kind: str) -> int:
    return 256 if kind == "gpt" else _hf.VOCAB


def _batches(kind: str, lengths=LENGTHS, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        x = torch.randint(0, _vocab(kind), (BATCH, length), generator=g)
        y = torch.randint(0, _vocab(kind), (BATCH, length), generator=g)
        out.append((x, y))
    return out


def _loss(kind: str, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "gpt":
        return loss_fn(model(x), y)
    return model(input_ids=x, labels=x).loss  # transformers' own shifted causal-LM loss


def _reference(kind: str, batches: list) -> list[float]:
    """One process, the whole batch, the same initial weights."""
    model = copy.deepcopy(_model(kind))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in batches:
        loss = _loss(kind, model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _train(rank: int, world: int, kind: str, backend: str, config: dict, own: bool = False) -> dict:
    """SGD over the 12 lengths, each rank a slice of the global batch (a view at a nonzero
    storage offset on rank 1, as examples/gpt_demo.py takes it); ``own``: over this rank's
    own batches instead (``_own_batches``)."""
    import torch.distributed as dist

    from fsdp_overlap_plugin.runtime.state import get_state

    torch._dynamo.reset()
    model = _model(kind)
    fo.parallelize(model, config, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    per = BATCH // world
    losses = []
    for x, y in _own_batches(rank) if own else _batches(kind):
        mine = slice(None) if own else slice(rank * per, (rank + 1) * per)
        loss = _loss(kind, model, x[mine], y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
    state = get_state(model)
    report = fo.schedule_report(model)
    from fsdp_overlap_plugin.cli.explain import _explain_lines, explain_report

    plain = json.loads(json.dumps(report, default=str))  # as `fsdp-overlap explain` reads it from a file
    return {
        "explain": "\n".join(_explain_lines(plain, explain_report(plain), False)),
        "losses": losses,
        "compiles": state.dynamo_graphs,
        "recompiles": list(state.recompiles),
        "text": fo.format_report(report),
        "graphs": [(g["label"], g["after"], g.get("from_cache", False)) for g in report["graphs"]],
        "forward": report["forward"]["after"],
        "backward": report["backward"]["after"],
        "predicted": report["predicted"],
        "dynamic_sizes": report["dynamic_sizes"],
        "cache": report["compile_cache"],
    }


def _check(results: list[dict], reference: list[float], tol: float, compiles: int = 2) -> None:
    for rank, result in enumerate(results):
        assert result["compiles"] == compiles, (rank, result["compiles"], result["recompiles"])
        assert result["losses"] == pytest.approx(reference, abs=tol, rel=0), rank
    assert results[0]["losses"] == results[1]["losses"]


def _check_dynamic_report(result: dict) -> None:
    # one recompile, at the first new length, and its graph keeps the length symbolic
    (recompile,) = result["recompiles"]
    assert "size mismatch at index 1. expected 32, actual 48" in recompile["reason"], recompile
    assert result["dynamic_sizes"] and all(s["dim"] == 1 for s in result["dynamic_sizes"])
    assert {s["traced_at"] for s in result["dynamic_sizes"]} == {48}
    assert "dynamic sizes:" in result["text"] and "counted at the traced values" in result["text"]
    assert "compiled again (graph 2): tensor" in result["text"]
    assert re.search(r"^sizes   symbolic: L\['\w+'\](\['\w+'\])? dim 1 = s\d+;", result["explain"], re.M), result[
        "explain"
    ]
    # the static and the dynamic graph: the same buckets and collectives after the passes
    forwards = [g for g in result["graphs"] if g[0].startswith("forward")]
    backwards = [g for g in result["graphs"] if g[0].startswith("backward")]
    assert [g[0] for g in forwards] == ["forward (compile 1 of 2)", "forward (compile 2 of 2)"]
    assert forwards[0][1] == forwards[1][1] and backwards[0][1] == backwards[1][1]
    assert result["forward"] == forwards[1][1] and result["backward"] == backwards[1][1]
    assert "total" not in result["text"]  # a recompile is not a piece of the forward
    assert result["predicted"]["forward"]["after"]["comm_s"] > 0


def _own_lengths(rank: int, world: int) -> dict:
    """Each rank pads its own batch: rank 0 cycles through the lengths, rank 1 keeps one
    (it never recompiles while rank 0 does, so no agreement round may wait for it)."""
    return _train(rank, world, "llama", "aot_eager", {"rank_check_timeout": 60}, own=True)


def _own_batches(rank: int) -> list:
    lengths = LENGTHS if rank == 0 else (24,) * len(LENGTHS)
    return [(x[: BATCH // 2], x[: BATCH // 2]) for x, _ in _batches("llama", lengths, seed=7 + rank)]


def _limit(rank: int, world: int) -> dict:
    import torch._dynamo

    try:
        with torch._dynamo.config.patch(recompile_limit=3):
            _train(rank, world, "gpt", "aot_eager", {"dynamic": False})
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"error": None}


def _limit_without_fullgraph(rank: int, world: int) -> dict:
    import torch._dynamo

    with torch._dynamo.config.patch(recompile_limit=3), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _train(rank, world, "gpt", "aot_eager", {"dynamic": False, "fullgraph": False})
    result["warnings"] = [str(w.message) for w in caught]
    return result


def _diverged_dynamic(rank: int, world: int) -> dict:
    import fsdp_overlap_plugin.models.gpt as gpt

    gelu = gpt.F.gelu
    if rank == 1:
        gpt.F.gelu = torch.relu  # rank 1 runs different model code
    try:
        _train(rank, world, "gpt", "aot_eager", {"dynamic": True, "rank_check_timeout": 60})
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        gpt.F.gelu = gelu
    return {"error": None}


def _generate(rank: int, world: int, backend: str) -> dict:
    from fsdp_overlap_plugin.runtime.state import get_state

    torch._dynamo.reset()
    model = _model("llama")
    fo.parallelize(model, backend=backend)
    model.eval()
    prompt = torch.randint(0, _hf.VOCAB, (1, 6), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        tokens = model.generate(prompt, max_new_tokens=16, do_sample=False)
    return {"tokens": tokens.tolist(), "compiles": get_state(model).dynamo_graphs}


def _aot_eager_scenarios(rank: int, world: int) -> dict:
    """Every aot_eager scenario of CI's 2.13 lane, in turn on the same two ranks (each on a
    new model, after ``torch._dynamo.reset()``; what one changes in the process it puts
    back). The recompile limit without fullgraph runs before the one with it (its warning
    is the first of the run), and a different model on one rank last (it stops both)."""
    return {
        "gpt": _train(rank, world, "gpt", "aot_eager", {}),
        "dynamic_true": _train(rank, world, "gpt", "aot_eager", {"dynamic": True}),
        "own_lengths": _own_lengths(rank, world),
        "generate": _generate(rank, world, "aot_eager"),
        "limit_without_fullgraph": _limit_without_fullgraph(rank, world),
        "limit": _limit(rank, world),
        "diverged": _diverged_dynamic(rank, world),
    }


def _use_cache(cache: str) -> None:
    """This rank compiles against the inductor cache in the folder ``cache``, the FX graph
    cache on. Set here, in the rank: ``TORCHINDUCTOR_FX_GRAPH_CACHE`` given to ``run_ranks``
    is read at import, so it would start the ranks with spawn instead of the fork server,
    each importing torch and transformers again (tests/_dist.py, ``NOT_COMPARED``)."""
    import torch._inductor.config

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # read at each use (cache_dir())
    torch._inductor.config.fx_graph_cache = True


def _newest_scenarios(rank: int, world: int, cache: str) -> dict:
    """Every scenario of CI's 2.15 lane but the warm-cache run, in turn on the same two
    ranks, against the empty inductor cache ``cache``: the Llama's inductor run is the
    first inductor compile of the job, so it fills the cache from nothing."""
    _use_cache(cache)
    return {
        "llama_aot_eager": _train(rank, world, "llama", "aot_eager", {}),
        "llama_inductor": _train(rank, world, "llama", "inductor", {}),
        "gpt_inductor": _train(rank, world, "gpt", "inductor", {}),
        "generate": _generate(rank, world, "inductor"),
    }


def _warm_llama(rank: int, world: int, cache: str) -> dict:
    _use_cache(cache)
    return _train(rank, world, "llama", "inductor", {})


@pytest.fixture(scope="module")
def aot_eager_runs() -> list[dict]:
    """Each rank's results of ``_aot_eager_scenarios``: one job for the tests of CI's 2.13 lane."""
    return run_ranks(_aot_eager_scenarios, timeout=900)


@pytest.fixture(scope="module")
def newest_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("inductor_cache"))


@pytest.fixture(scope="module")
def newest_runs(newest_cache) -> list[dict]:
    """Each rank's results of ``_newest_scenarios``: one job for the tests of CI's 2.15 lane."""
    return run_ranks(_newest_scenarios, newest_cache, timeout=900)


def _part(runs: list[dict], scenario: str) -> list[dict]:
    return [run[scenario] for run in runs]


@functools.cache
def _reference_losses(kind: str) -> list[float]:
    """``_reference`` over the twelve lengths, computed once per model."""
    return _reference(kind, _batches(kind))


@pytest.mark.slow
@pytest.mark.parametrize("kind", [pytest.param("llama", marks=pytest.mark.newest_torch), "gpt"])
def test_twelve_lengths_compile_twice_and_match_one_process_aot_eager(kind, request):
    if kind == "llama":  # CI: on 2.15, in the job of the Llama's and the repo GPT's inductor runs
        results = _part(request.getfixturevalue("newest_runs"), "llama_aot_eager")
    else:
        results = _part(request.getfixturevalue("aot_eager_runs"), "gpt")
    _check(results, _reference_losses(kind), 1e-6)
    _check_dynamic_report(results[0])


@pytest.mark.slow
@pytest.mark.newest_torch  # CI: on 2.15, beside the aot_eager Llama's twelve lengths
def test_twelve_lengths_inductor_twice_against_one_cache(newest_runs, newest_cache):
    """The transformers Llama under inductor, run twice against one inductor cache: the
    second run (a new job) loads both graphs from it, with the same losses and compile count."""
    reference = _reference_losses("llama")
    cold = _part(newest_runs, "llama_inductor")
    _check(cold, reference, 1e-4)
    _check_dynamic_report(cold[0])
    warm = run_ranks(_warm_llama, newest_cache, timeout=900)
    _check(warm, reference, 1e-4)
    for result in warm:
        assert all(from_cache for _, _, from_cache in result["graphs"]), result["graphs"]
        assert [c["fx_graph"]["hit"] > 0 for c in result["cache"]] == [True, True], result["cache"]
    assert warm[0]["losses"] == cold[0]["losses"]


@pytest.mark.slow
@pytest.mark.newest_torch  # CI: on 2.15, beside the aot_eager Llama's twelve lengths
def test_repo_gpt_inductor_twelve_lengths(newest_runs):
    _check(_part(newest_runs, "gpt_inductor"), _reference_losses("gpt"), 1e-4)


@pytest.mark.slow
def test_each_rank_pads_to_its_own_length(aot_eager_runs):
    results = _part(aot_eager_runs, "own_lengths")
    assert results[0]["compiles"] == 2 and results[1]["compiles"] == 1
    # one process: the mean of the two ranks' mean losses, as their averaged gradients
    model = _model("llama")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    reference = []
    for (x0, _), (x1, _) in zip(_own_batches(0), _own_batches(1)):
        loss = (_loss("llama", model, x0, x0) + _loss("llama", model, x1, x1)) / 2
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        reference.append(loss.item())
    for result in results:
        assert result["losses"] == pytest.approx(reference, abs=1e-6, rel=0)


@pytest.mark.slow
def test_dynamic_true_compiles_once(aot_eager_runs):
    results = _part(aot_eager_runs, "dynamic_true")
    _check(results, _reference_losses("gpt"), 1e-6, compiles=1)
    assert not results[0]["recompiles"]
    assert results[0]["dynamic_sizes"], "dynamic: true traces symbolic sizes from the first call"


@pytest.mark.slow
def test_recompile_limit_is_named_as_what_it_is(aot_eager_runs):
    """dynamic: false compiles each length anew, until Dynamo's recompile limit: the error
    names the limit, the guard that failed and the fixes; it is no graph break."""
    for rank, result in enumerate(_part(aot_eager_runs, "limit")):
        error = result["error"]
        assert error is not None and error.startswith("RecompileLimitError: "), (rank, error)
        assert "compiled 3 times, Dynamo's recompile limit (3" in error
        assert "size mismatch at index 1. expected 40, actual 64" in error  # the 4th length
        assert "dynamic: true" in error and "pad batches" in error
        assert "graph break" not in error.replace("no graph break", "")


@pytest.mark.slow
def test_recompile_limit_without_fullgraph_warns_instead_of_going_quiet(aot_eager_runs):
    """With fullgraph: false Dynamo runs the forward uncompiled past the limit: training
    goes on, correct, but unbucketed, and the run says so once."""
    results = _part(aot_eager_runs, "limit_without_fullgraph")
    _check(results, _reference_losses("gpt"), 1e-6, compiles=3)
    for result in results:
        limit = [w for w in result["warnings"] if "recompile limit" in w]
        assert len(limit) == 1 and "runs it uncompiled" in limit[0], result["warnings"]


@pytest.mark.slow
def test_a_different_model_on_one_rank_still_stops_every_rank_with_symbolic_sizes(aot_eager_runs):
    for rank, result in enumerate(_part(aot_eager_runs, "diverged")):
        error = result["error"]
        assert error is not None and error.startswith("RankMismatchError"), (rank, error)
        assert "the ranks compiled different graphs (graph 1)" in error
        assert "rank 0 has `call_function gelu (s" in error and "rank 1 has `call_function " in error, error


@pytest.mark.slow
# inductor: CI runs it on 2.15, in the job of the other inductor runs of this file
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.newest_torch)])
def test_generate_on_the_sharded_model_gives_one_process_tokens(backend, request):
    """Greedy generation, as users sample during training: the prompt, then one token at
    a time against a growing KV cache. Three graphs: the prompt, the first token (static),
    every later token (dynamic cache length)."""
    reference = _model("llama").eval()
    prompt = torch.randint(0, _hf.VOCAB, (1, 6), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=16, do_sample=False).tolist()
    runs = request.getfixturevalue("aot_eager_runs" if backend == "aot_eager" else "newest_runs")
    for result in _part(runs, "generate"):
        assert result["tokens"] == expected
        assert len(result["tokens"][0]) == 6 + 16
        assert result["compiles"] <= 3, result["compiles"]


def test_dynamic_key_takes_torch_compiles_values():
    for value in ("auto", True, False):
        assert OverlapConfig.from_dict({"dynamic": value}).dynamic == value
    for bad in ("yes", 1, None):
        with pytest.raises(OverlapConfigError, match=r"dynamic: unknown value .*valid: auto, true, false"):
            OverlapConfig.from_dict({"dynamic": bad})


def test_size_hints_never_guard():
    """The estimates read a symbolic size's hint: no guard is added to the shape env (a
    guard is what turned each length into its own compile)."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from fsdp_overlap_plugin.passes.graph import numel_hint, size_hint

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC, DimDynamic.DYNAMIC])
    fake = mode.from_tensor(torch.empty(2, 48), symbolic_context=context, source=ConstantSource("x"))
    length = fake.shape[1]
    assert isinstance(length, torch.SymInt) and length.node.expr.free_symbols
    assert size_hint(length) == 48 and size_hint(length * 2 + 1) == 97 and size_hint(7) == 7
    assert numel_hint(fake) == 96
    assert not env.guards, env.guards
    assert isinstance(fake.shape[1], torch.SymInt) and fake.shape[1].node.expr.free_symbols  # still symbolic
