"""Inductor's own distributed passes on our graphs: ``inductor_overlap``.

Since torch 2.14 inductor runs its simple overlap pass by default, in the scheduler after
our post-grad passes: it moves collective launches earlier and waits later. Here:

- the setting's config patches and errors, on this torch (quick);
- the order of launches and waits in inductor's generated code, against the order our
  passes decided (the FX graph after them), with ``inductor_overlap: off`` and ``simple``,
  on the fake process group: the repo GPT (default and receive-first reduce-scatters), the
  tied transformers Llama, HSDP 2 x 2. With ``off`` the code keeps our order exactly; with
  ``simple`` every move is classified: a launch earlier or a wait later (a longer overlap
  window) is a win if the gathered bytes in flight stay within what ours kept, a loss
  otherwise. Slow; CI runs them on 2.14.1 and 2.15 (``newest_torch`` and the 2.14 leg's
  own file list), where the pass exists; on 2.11 and 2.13 only ``off`` can be checked;
- our custom ops communicate nothing (so the pass, which cannot see a collective inside a
  custom op, hides none behind them), and the receive-first all-to-alls lower as
  collectives it sees and never reorders;
- two real gloo ranks train with each value as one process does (``newest_torch``).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch._dynamo
from _dist import run_ranks
from _fake import fake_world
from _train import full_params, make_model, train_reference, train_sharded

import fsdp_overlap_plugin as fo
import fsdp_overlap_plugin.compile.backends as fo_compile
from fsdp_overlap_plugin import _torch_compat as compat
from fsdp_overlap_plugin.compile import torch_passes
from fsdp_overlap_plugin.config import inductor_overlap
from fsdp_overlap_plugin.config.schema import OverlapConfig, OverlapConfigError
from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn
from fsdp_overlap_plugin.passes.graph import collective_of_wait, is_all_gather, is_collective, is_wait

# quick tests: probes of inductor's distributed passes on this torch, run on every torch of CI's matrix
pytestmark = [pytest.mark.torch_sensitive, pytest.mark.feature_probes]

HAS = compat.inductor_distributed_passes()
PREFIX = "aten_distributed_optimizations."


# ----------------------------------------------------------------------------- the setting
def test_off_holds_every_distributed_pass_of_this_torch_off():
    patches = torch_passes.config_patches("off")
    config = compat.inductor_config()
    for key, value in patches.items():  # every key exists in this torch: config.patch takes it
        section, _, name = key.rpartition(".")
        assert hasattr(getattr(config, section) if section else config, name), key
        assert value in (False, "none"), (key, value)
    assert (PREFIX + "enable_simple_overlap" in patches) == HAS["simple_overlap"]
    assert patches[PREFIX + "enable_overlap_scheduling"] is False
    assert patches["reorder_for_compute_comm_overlap"] is False


def test_simple_and_auto_patches():
    simple = torch_passes.config_patches("simple")
    auto = torch_passes.config_patches("auto")
    if HAS["simple_overlap"]:
        assert simple[PREFIX + "enable_simple_overlap"] is True
        assert auto[PREFIX + "enable_simple_overlap"] is True  # torch's default beside its scheduler
    assert simple[PREFIX + "enable_overlap_scheduling"] is False
    assert auto[PREFIX + "enable_overlap_scheduling"] is True and auto[PREFIX + "collective_bucketing"] is True


def test_auto_off_cuda_gets_our_rates():
    rates = {"link": 1e6, "latency": 1e-3, "flops": 1e9, "mem": 1e9}
    patches = torch_passes.auto_patches("cpu", rates)
    assert torch_passes.auto_patches("cuda", rates) == {}
    estimate = patches[PREFIX + "custom_runtime_estimation"]
    graph = torch.fx.Graph()
    a = graph.placeholder("a")
    mm = graph.call_function(torch.ops.aten.mm.default, (a, a))
    gather = graph.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, (a, 2, "0"))
    a.meta["val"] = torch.empty(64, 64)
    mm.meta["val"] = torch.empty(64, 64)
    gather.meta["val"] = torch.empty(128, 64)
    # a collective: latency + its bytes at the link rate (ms)
    assert estimate(gather) == pytest.approx((1e-3 + 128 * 64 * 4 / 1e6) * 1e3)
    # a matmul: 2 * 64^3 FLOPs at 1 GFLOP/s against 3 * 16 KiB at 1 GB/s: the FLOPs win
    assert estimate(mm) == pytest.approx(max(2 * 64**3 / 1e9, 3 * 64 * 64 * 4 / 1e9) * 1e3)


def test_roofline_rates_are_put_back():
    import torch.utils._runtime_estimation as estimation

    names = [n for n in ("get_device_tflops", "get_gpu_dram_gbps", "get_device_dram_gbps") if hasattr(estimation, n)]
    before = {n: getattr(estimation, n) for n in names}
    assert names
    with compat.roofline_rates(2e12, 3e9):
        assert estimation.get_device_tflops(torch.float32) == pytest.approx(2.0)
    assert {n: getattr(estimation, n) for n in names} == before


def test_config_errors_name_the_key_and_the_way_out(monkeypatch):
    with pytest.raises(OverlapConfigError, match="inductor_overlap: unknown value 'simpel'.*Did you mean 'simple'"):
        OverlapConfig(inductor_overlap="simpel")
    with pytest.raises(OverlapConfigError, match="only with backend: inductor .*backend: aot_eager"):
        OverlapConfig(inductor_overlap="auto", backend="aot_eager", manual_bucketing=False, overlap_grad_reduce=False)
    with pytest.raises(OverlapConfigError, match="set manual_bucketing: false and overlap_grad_reduce: false"):
        OverlapConfig(inductor_overlap="auto")
    OverlapConfig(inductor_overlap="auto", manual_bucketing=False, overlap_grad_reduce=False)
    OverlapConfig(inductor_overlap="simple", compile=False)  # not read without compile, as the other compile keys
    monkeypatch.setattr(
        compat, "inductor_distributed_passes", lambda: {"simple_overlap": False, "overlap_scheduling": True}
    )
    with pytest.raises(OverlapConfigError, match="inductor_overlap: simple needs torch 2.14 or newer"):
        OverlapConfig(inductor_overlap="simple")
    monkeypatch.setattr(compat, "TORCH_VERSION", "2.11.0+cu130")
    assert "needs torch 2.13 or newer" in inductor_overlap.device_error("auto", "cpu")
    assert inductor_overlap.device_error("auto", "cuda") is None
    assert inductor_overlap.device_error("off", "cpu") is None


def test_report_names_what_ran():
    off = inductor_overlap.describe("off", "inductor")
    assert off["ran"] == [] and "overlap_scheduling" in off["held_off"]
    assert ("simple_overlap" in off["absent"]) != HAS["simple_overlap"]
    line = inductor_overlap.summary_line(off)
    assert line.startswith("  torch's distributed passes (inductor_overlap: off): none ran; held off:")
    auto = inductor_overlap.describe("auto", "inductor")
    assert "overlap_scheduling" in auto["ran"] and ("simple_overlap" in auto["ran"]) == HAS["simple_overlap"]
    assert "ran: " in inductor_overlap.summary_line(auto)
    assert inductor_overlap.describe("off", "aot_eager")["ran"] == []


# ------------------------------------------------------------------------- our custom ops
def test_our_custom_ops_communicate_nothing():
    """simple overlap never moves a collective past another one, but it cannot see a
    collective inside a custom op (pytorch issue 189454). Ours only copy: run each under
    a dispatch mode that records every op they call."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    from fsdp_overlap_plugin.passes import ops

    # each op's own Python body (``_init_fn``), so the mode sees every op it calls inside
    a, b = torch.randn(4, 3), torch.randn(2, 3)
    with Record() as rec:
        slot = ops.fill_slot._init_fn([a, b], 2, 1, torch.float32)
        ops.pack_rows._init_fn([torch.randn(4, 3), torch.randn(2, 3)], 2, torch.float32)
        ops.split_gathered._init_fn(slot.view(2, -1), [12, 6])
    called = set(rec.ops)
    assert any(op.startswith("aten.") for op in called), called  # the mode saw inside them
    assert not [op for op in called if "c10d" in op or not op.startswith("aten.")], called


# ------------------------------------------------------------ the order in generated code
_LAUNCH = re.compile(
    r"(?:(buf\d+) = )?torch\.ops\._c10d_functional\.(all_gather_into_tensor_out|all_gather_into_tensor|"
    r"reduce_scatter_tensor|all_reduce_|all_reduce|all_to_all_single)\.default\((.*)"
)
_WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((buf\d+)\)")
_OUT = re.compile(r"out=(buf\d+)")
_FIRST_BUF = re.compile(r"(?:reinterpret_tensor\()?(buf\d+)")
_COMPUTE = re.compile(r"^\s+(?:cpp_fused_\w+\(|extern_kernels\.\w+\(|buf\d+ = torch\.ops\.(?:fsdp_overlap|aten)\.)")


def code_schedule(code: str) -> dict:
    """Inductor's generated ``call``: per collective in launch order, its op, where it
    launches and where it is waited, both counted in compute calls (kernels, extern
    kernels, our custom ops: what the pass moves launches and waits past)."""
    body = code[code.index("def call(") :]
    compute = 0
    launches: list[dict] = []
    by_buf: dict[str, dict] = {}
    for seq, line in enumerate(body.splitlines()):
        if m := _LAUNCH.search(line):
            entry = {"op": m.group(2).rstrip("_"), "launch": compute, "wait": None, "lines": [seq]}
            launches.append(entry)
            out = _OUT.search(m.group(3))
            # in place (all_reduce_, the _out gather) the wait names the buffer it writes
            buf = m.group(1) or (out.group(1) if out else _FIRST_BUF.match(m.group(3)).group(1))
            by_buf[buf] = entry
        elif m := _WAIT.search(line):
            entry = by_buf.get(m.group(1))
            assert entry is not None and entry["wait"] is None, line
            entry["wait"] = compute
            entry["lines"].append(seq)
        elif _COMPUTE.search(line):
            compute += 1
    assert all(e["wait"] is not None for e in launches), launches
    return {"collectives": launches, "compute": compute}


def fx_schedule(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """Our order: the collective launches and waits of the graph after our passes."""
    out = []
    for node in gm.graph.nodes:
        if is_collective(node):
            out.append(("launch", str(node.target).split(".")[-2].rstrip("_")))
        elif is_wait(node) and collective_of_wait(node) is not None:
            out.append(("wait", ""))
    return out


def code_sequence(schedule: dict) -> list[tuple[str, str]]:
    """The same as ``fx_schedule`` for generated code: launches and waits in line order."""
    events = []
    for e in schedule["collectives"]:
        events.append((e["lines"][0], ("launch", e["op"])))
        events.append((e["lines"][1], ("wait", "")))
    return [event for _, event in sorted(events)]


def gathered_in_flight(schedule: dict, sizes: list[int]) -> int:
    """The most bytes of all-gather outputs launched and not yet waited at any compute call."""
    gathers = [
        (e["launch"], e["wait"], n) for e, n in zip(schedule["collectives"], sizes) if e["op"].startswith("all_gather")
    ]
    return max([sum(n for a, b, n in gathers if a <= c < b) for c in range(schedule["compute"] + 1)] or [0])


def compare(ours: dict, theirs: dict, sizes: list[int]) -> dict:
    """What ``theirs`` (simple overlap on) changed from ``ours`` (off), per collective."""
    assert [e["op"] for e in ours["collectives"]] == [e["op"] for e in theirs["collectives"]]
    assert ours["compute"] == theirs["compute"]
    moves = []
    for k, (a, b) in enumerate(zip(ours["collectives"], theirs["collectives"])):
        if (a["launch"], a["wait"]) != (b["launch"], b["wait"]):
            moves.append(
                {
                    "k": k,
                    "op": a["op"],
                    "bytes": sizes[k],
                    "launch": (a["launch"], b["launch"]),
                    "wait": (a["wait"], b["wait"]),
                }
            )
    bound, now = gathered_in_flight(ours, sizes), gathered_in_flight(theirs, sizes)
    wider = all(m["launch"][1] <= m["launch"][0] and m["wait"][1] >= m["wait"][0] for m in moves)
    return {
        "moves": moves,
        "wider_windows": wider,  # every move a launch earlier or a wait later
        "in_flight": (bound, now),
        "verdict": "unchanged" if not moves else ("win" if wider and now <= bound else "loss"),
    }


def _collective_bytes(gm: torch.fx.GraphModule) -> list[int]:
    sizes = []
    for node in gm.graph.nodes:
        if is_collective(node):
            val = node.meta.get("val")
            sizes.append(int(val.numel()) * val.element_size() if is_all_gather(node) and val is not None else 0)
    return sizes


CASES = {
    # name: (family, world, config)
    "gpt": ("gpt", 2, {}),
    "gpt-receive-first": ("gpt", 2, {"reduce_scatter_impl": "receive_first"}),
    "llama-tied": ("llama", 2, {}),
    "gpt-hsdp-2x2": ("gpt", 4, {"mesh": {"replicate": 2}}),
}


def _compile_case(monkeypatch, case: str, setting: str) -> dict:
    family, world, config = CASES[case]
    graphs: dict[str, torch.fx.GraphModule] = {}
    original = fo_compile.run_passes

    def capturing(gm, kind, state, **kwargs):
        record = original(gm, kind, state, **kwargs)
        graphs[kind] = gm
        return record

    monkeypatch.setattr(fo_compile, "run_passes", capturing)
    from torch._inductor.utils import run_and_get_code

    with fake_world(world):
        if family == "gpt":
            torch.manual_seed(0)
            model = gpt_small()
            x, y = fixed_batches(1, 2, 16, 256)[0]

            def step():
                loss_fn(model(x), y).backward()

        else:
            import _hf

            model = _hf.build(family)
            batch = _hf.batches(1, 2)[0]

            def step():
                _hf.loss(model, batch).backward()

        fo.parallelize(model, backend="inductor", inductor_overlap=setting, **config)
        _, codes = run_and_get_code(step)
        report = fo.schedule_report(model)
    assert len(codes) == 2, len(codes)
    return {"codes": dict(zip(("forward", "backward"), codes)), "graphs": graphs, "report": report}


@pytest.mark.slow
@pytest.mark.middle_torch  # CI: on 2.14, the first torch whose inductor runs simple overlap by default
@pytest.mark.parametrize("case", sorted(CASES))
def test_generated_code_keeps_our_order(monkeypatch, case):
    """With off, the code launches and waits every collective where our passes put it; with
    simple (where this torch has it), every move it makes is classified."""
    off = _compile_case(monkeypatch, case, "off")
    assert off["report"]["torch_passes"]["ran"] == []
    for kind in ("forward", "backward"):
        ours = code_schedule(off["codes"][kind])
        assert code_sequence(ours) == fx_schedule(off["graphs"][kind]), (case, kind)
        if case == "gpt-receive-first" and kind == "backward":
            # the receive-first group's all-to-alls are collectives the pass sees
            assert [e["op"] for e in ours["collectives"]].count("all_to_all_single") >= 2
            assert "'fsdp_overlap_receive_first:" in off["codes"][kind]
    if not HAS["simple_overlap"]:
        with pytest.raises(OverlapConfigError, match="simple needs torch 2.14"):
            OverlapConfig(inductor_overlap="simple")
        return
    torch._dynamo.reset()
    simple = _compile_case(monkeypatch, case, "simple")
    assert simple["report"]["torch_passes"]["ran"] == ["simple_overlap"]
    found = {}
    for kind in ("forward", "backward"):
        sizes = _collective_bytes(off["graphs"][kind])
        found[kind] = compare(code_schedule(off["codes"][kind]), code_schedule(simple["codes"][kind]), sizes)
    EXPECTED[case](found)


def _unchanged(found: dict) -> None:
    # our schedule is already the pass's fixpoint: each launch right after the copy-in it
    # reads (which the pass cannot move), each wait right before its first use
    assert all(f["verdict"] == "unchanged" for f in found.values()), found


def _llama_tied(found: dict) -> None:
    # the [model.norm, lm_head] bucket holds norm.weight alone (the tied head's gradient
    # goes to the embedding's bucket): one all-gather of the parameter itself, with no
    # copy-in to hold it, which the pass hoists up to the previous collective: a prefetch
    # deeper than prefetch_depth, over the gathered bytes our schedule keeps in flight
    assert found["backward"]["verdict"] == "unchanged", found
    forward = found["forward"]
    assert [m["op"] for m in forward["moves"]] == ["all_gather_into_tensor"], forward
    assert forward["wider_windows"], forward
    bound, now = forward["in_flight"]
    assert now > bound, forward
    assert forward["verdict"] == "loss"


EXPECTED = {
    "gpt": _unchanged,
    "gpt-receive-first": _unchanged,
    "gpt-hsdp-2x2": _unchanged,
    "llama-tied": _llama_tied,
}


# ----------------------------------------------------------------- two ranks, each value
def _train(rank: int, world: int, **config) -> dict:
    torch._dynamo.reset()
    model = make_model()
    ref_losses, ref_params = train_reference(model) if rank == 0 else (None, None)
    fo.parallelize(model, backend="inductor", **config)
    losses = train_sharded(model, rank, world)
    report = fo.schedule_report(model)
    return {
        "losses": losses,
        "params": full_params(model),
        "ref_losses": ref_losses,
        "ref_params": ref_params,
        "torch_passes": report["torch_passes"],
        "rs": report["reduce_scatter"]["impl"],
        "summary": fo.format_report(report),
    }


def _each_value(rank: int, world: int) -> dict:
    out = {}
    if HAS["simple_overlap"]:
        out["simple"] = _train(rank, world, inductor_overlap="simple")
    out["auto"] = _train(
        rank,
        world,
        inductor_overlap="auto",
        manual_bucketing=False,
        overlap_grad_reduce=False,
        reduce_scatter_impl="native",
    )
    return out


@pytest.mark.slow
@pytest.mark.newest_torch
def test_each_value_trains_as_one_process():
    """simple (with both passes and receive-first all-to-alls, the gloo defaults) and auto
    (torch's scheduler over our sharding, costed from the cpu preset) on two gloo ranks,
    against one process on the same data; off is the default every other inductor test
    trains with (test_core_numerics.test_inductor_matches_single_process)."""
    results = run_ranks(_each_value)[0]
    assert set(results) == ({"simple", "auto"} if HAS["simple_overlap"] else {"auto"})
    for setting, result in results.items():
        assert result["torch_passes"]["setting"] == setting
        assert f"torch's distributed passes (inductor_overlap: {setting}): ran:" in result["summary"]
        for got, want in zip(result["losses"], result["ref_losses"], strict=True):
            assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-6), (
                setting,
                result["losses"],
                result["ref_losses"],
            )
        for name, want in result["ref_params"].items():
            torch.testing.assert_close(result["params"][name], want, rtol=1e-5, atol=1e-6, msg=f"{setting}: {name}")
    if "simple" in results:
        assert results["simple"]["rs"] == "receive_first"


_AUTO_TWICE = """
import sys, torch
sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
from _fake import fake_world
import fsdp_overlap_plugin as fo
from fsdp_overlap_plugin.models import fixed_batches, gpt_small, loss_fn
with fake_world(2):
    torch.manual_seed(0)
    model = gpt_small(n_layer=1, d_model=32)  # what is cached, not its size, is the point: the smallest GPT
    x, y = fixed_batches(1, 2, 16, 256)[0]
    fo.parallelize(model, backend="inductor", inductor_overlap="auto", manual_bucketing=False, overlap_grad_reduce=False)
    loss_fn(model(x), y).backward()
    print("CACHE", fo.schedule_report(model)["compile_cache"])
"""


@pytest.mark.slow
@pytest.mark.middle_torch  # CI: on 2.14, beside inductor's own passes on our generated code
def test_auto_hits_the_compile_cache_on_a_second_run(tmp_path):
    """auto off CUDA hands torch's scheduler our cost model in inductor's config, which is
    part of the FX graph cache key: it must pickle the same in every process (a closure
    cannot be pickled, and inductor then bypasses the cache on every compile)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = _AUTO_TWICE.format(tests=str(Path(__file__).parents[1]))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "pickle" not in proc.stderr.lower(), proc.stderr[-3000:]
        runs.append(proc.stdout + proc.stderr)
    assert "0 of 1 graph from the compile cache" in runs[0], runs[0][-2000:]
    assert "1 of 1 graph from the compile cache" in runs[1], runs[1][-2000:]
