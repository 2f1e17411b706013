"""gpu_check.py's torch-passes phase (issue 57): inductor's own distributed passes against
ours, on world8's setup (a fake process group of 8 ranks, Llama3-8B layer shapes, fewer
layers), all in one process. Five settings:

    defaults   our passes, inductor_overlap: off (the plugin's defaults)
    simple     our passes + inductor_overlap: simple (torch 2.14+; absent before: recorded so)
    auto       our passes off + inductor_overlap: auto (torch's overlap scheduler and
               collective bucketing), native reduce-scatter
    manual     our passes off + torch's ``manual_overlap_bucketing`` with our plan, installed
               as inductor's post_grad_custom_post_pass (as torchtitan's graph trainer does)
    baseline   our passes off, nothing of torch's

Each setting is built, compiled (its first step) and then timed in blocks, the settings
taking turns block by block (drift in clocks or heat spreads over all of them). Per
setting: compile time, median step time, the step's peak memory, the collectives in
inductor's generated code, and any error (a setting that fails is recorded, the others
still run). On a fake process group collectives move nothing: step times are the compute
side only (copy-in/out, casts, kernels, and what the schedule does to them); compile time
and memory are real.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

SETTINGS = {
    "defaults": "our passes, inductor_overlap: off (the defaults)",
    "simple": "our passes + inductor_overlap: simple",
    "auto": "our passes off + inductor_overlap: auto (torch's scheduler, native reduce-scatter)",
    "manual": "our passes off + torch's manual_overlap_bucketing with our plan",
    "baseline": "our passes off, nothing of torch's",
}
# The baseline compiles first, into a cold kernel cache: the others reuse the kernels they
# share with it, so their compile times compare with each other (the baseline's carries the
# cold kernels). auto last: torch's whole-graph scheduler is the likeliest to run long, and
# a phase stopped at its limit keeps the settings it finished.
RUN_ORDER = ("baseline", "defaults", "simple", "manual", "auto")
LAYERS = 2  # of Llama3-8B's 32: a compile of every setting fits the phase's few minutes

PASSES_OFF = {"manual_bucketing": False, "overlap_grad_reduce": False, "separate_gather_group": False}

# A collective launch in inductor's generated code (Python wrapper): c10d functional ops,
# bucketed ones included (they write into a buffer: *_out)
_LAUNCH = re.compile(
    r"torch\.ops\._c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor|all_reduce)(?:_out|_)?\.default\("
)
_KINDS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce"}


def setting_config(name: str, base: dict[str, Any]) -> dict[str, Any]:
    """The OverlapConfig of a setting: ``base`` (world8's plugin config) with our passes on
    or off and the ``inductor_overlap`` value it names."""
    if name == "defaults":
        return {**base, "inductor_overlap": "off"}
    if name == "simple":
        return {**base, "inductor_overlap": "simple"}
    off = {**base, **PASSES_OFF, "reduce_scatter_impl": "native", "inductor_overlap": "off"}
    if name == "auto":
        return {**off, "inductor_overlap": "auto"}
    if name in ("manual", "baseline"):
        return off
    raise ValueError(f"unknown torch-passes setting {name!r}; valid: {', '.join(SETTINGS)}")


def code_collectives(codes: list[str]) -> list[dict[str, int]]:
    """Collective launches per generated module (forward, backward): all-gathers,
    reduce-scatters and all-reduces, bucketed ones counted once per bucket."""
    out = []
    for code in codes:
        counts = dict.fromkeys(_KINDS.values(), 0)
        for m in _LAUNCH.finditer(code):
            counts[_KINDS[m.group(1)]] += 1
        out.append(counts)
    return out


def module_stack(node: Any) -> list[tuple[str, type]]:
    """For torch's graph view: a node's module scopes as paths from the compiled root,
    whatever Dynamo called the root (transformers' models take ``self`` through ``*args``:
    ``L['args'][0].model.layers.0``, which torch's own cleaner leaves unmatched). Scopes that
    are not a plain chain of attributes are left out."""
    from fsdp_overlap_plugin.passes.graph import clean_module_path

    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    out = []
    for key, klass in stack.values():
        path = clean_module_path(key)
        if path is not None:
            out.append((path, klass))
    return out


def manual_bucketing_pass(plan: list[list[str]], record: dict[str, Any]) -> Any:
    """A ``CustomGraphPass`` that runs torch's ``manual_overlap_bucketing`` with ``plan`` on
    each post-grad graph (insert_overlap_deps, as torchtitan's inductor path does), and
    records per graph the collectives before and after in ``record`` (checked by the phase:
    fewer all-gathers after, or it did not bucket)."""
    import json

    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.fx_passes.overlap_manual_scheduling import manual_overlap_bucketing

    from fsdp_overlap_plugin.passes.graph import collective_counts, graph_kind

    class ManualBucketing(CustomGraphPass):
        def __call__(self, graph: Any) -> None:
            gm = graph.owning_module
            kind = graph_kind(graph)
            before = collective_counts(graph)
            start = time.perf_counter()
            result = manual_overlap_bucketing(gm, plan, insert_overlap_deps=True, module_stack_fn=module_stack)
            if result is not gm:  # inductor compiles the graph it handed over: it must change in place
                raise RuntimeError("manual_overlap_bucketing returned a new module; the post-grad pass needs in place")
            record.setdefault("graphs", []).append(
                {
                    "kind": kind,
                    "before": before,
                    "after": collective_counts(gm.graph),
                    "pass_s": time.perf_counter() - start,
                }
            )

        def uuid(self) -> str:
            return "gpu-check-manual-overlap-bucketing-" + json.dumps(plan)

    return ManualBucketing()


def _peak_tracker(cuda: bool) -> tuple[Callable[[], None], Callable[[], int | None]]:
    """``start()`` resets the peak; ``peak()`` is the largest allocation above what was
    allocated at ``start()`` (the other settings' models stay resident in between)."""
    import torch

    base = [0]

    def start() -> None:
        if cuda:
            torch.cuda.synchronize()
            base[0] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def peak() -> int | None:
        return torch.cuda.max_memory_allocated() - base[0] if cuda else None

    return start, peak


def run_settings(
    *,
    shape: dict[str, Any],
    base_config: dict[str, Any],
    device: str,
    warmup: int,
    steps: int,
    reps: int,
    lr: float,
    seed: int,
    build_model: Callable[[dict[str, Any], str], Any],
    batches: list[Any],
    mesh: Any,
    on_progress: Callable[[dict[str, Any]], None] = lambda result: None,
) -> dict[str, Any]:
    """Every setting this torch can run, on ``mesh`` (a fake process group): build with
    ``build_model(shape, device)`` (same seed), parallelize with the setting's config, run
    ``warmup`` steps (the first compiles, in the setting's inductor config; its generated
    code is counted), then ``reps`` rounds in which each setting in turn runs ``steps``
    timed steps. ``on_progress(result)`` after each setting's compile and each round."""
    import torch

    from fsdp_overlap_plugin import _torch_compat as compat
    from fsdp_overlap_plugin.config.inductor_overlap import device_error, setting_error

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    have = compat.inductor_distributed_passes()
    result: dict[str, Any] = {
        "torch": torch.__version__,
        "passes_in_torch": have,
        "settings": {},
        "order": list(RUN_ORDER),
        "note": "collectives move no data, so step times are the compute side only (copy-in/out, casts, "
        "kernels, and the order the schedule gives them); compile time and memory are real",
    }
    live: dict[str, dict[str, Any]] = {}  # the settings that compiled, with their model and step
    track_start, track_peak = _peak_tracker(cuda)
    torch._dynamo.reset()
    for name in RUN_ORDER:
        config = setting_config(name, base_config)
        r: dict[str, Any] = {"label": SETTINGS[name], "config": {k: config[k] for k in sorted(config)}}
        result["settings"][name] = r
        why = setting_error(config["inductor_overlap"], _passes_on(config), config["backend"])
        if why is not None:
            r.update(status="absent", error=f"absent on torch {torch.__version__}: {why}")
        elif (why := device_error(config["inductor_overlap"], device)) is not None:
            r.update(status="unsupported", error=f"not on {device} with torch {torch.__version__}: {why}")
        if why is not None:
            print(f"[torch-passes] {name}: {r['error']}", flush=True)
            continue
        try:
            live[name] = _compile_setting(
                name, r, config, shape, device, warmup, lr, seed, build_model, batches, mesh, sync, track_start
            )
        except Exception as exc:  # recorded; the next setting still runs
            traceback.print_exc()
            r.update(status="failed", error=f"{type(exc).__name__}: {exc}"[:2000])
        on_progress(result)
    for rep in range(reps):
        for name in [n for n in RUN_ORDER if n in live]:
            entry, r = live[name], result["settings"][name]
            try:
                track_start()
                for i in range(steps):
                    sync()
                    start = time.perf_counter()
                    loss = entry["step"](warmup + rep * steps + i)
                    sync()
                    entry["times"].append(time.perf_counter() - start)
                    entry["losses"].append(loss.item())
                peak = track_peak()
                if peak is not None:
                    r["step_peak_bytes"] = max(peak, r.get("step_peak_bytes") or 0)
            except Exception as exc:
                traceback.print_exc()
                r.update(status="failed", error=f"step, round {rep}: {type(exc).__name__}: {exc}"[:2000])
                del live[name]
                continue
            times = entry["times"]
            r.update(step_s=statistics.median(times), step_times=times, timed_steps=len(times))
            r["compile_s"] = max(r["first_step_s"] - r["step_s"], 0.0)
            print(f"[torch-passes] round {rep} {name}: median {r['step_s']:.4f} s over {len(times)}", flush=True)
        on_progress(result)
    for name, entry in live.items():
        result["settings"][name]["losses"] = entry["losses"]
    return result


@contextlib.contextmanager
def _generated_code() -> Iterator[list[str]]:
    """The Python modules inductor generates while it lasts, in order (forward, then
    backward). torch's ``run_and_get_code`` does the same but resets Dynamo first, which
    would throw away the settings compiled before this one."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", codes.append):
        yield codes


def _manual_patch(device: str, graph_pass: Any) -> Any:
    """The inductor config of the manual setting, as torchtitan's graph trainer sets it for
    this pass (no reordering for peak memory or overlap, no buffer reuse). Off CUDA torch's
    scheduler (which manual_overlap_bucketing builds on) has no rates of its own: it gets the
    device type's preset through the plugin's helpers, as ``inductor_overlap: auto`` does."""
    import torch

    from fsdp_overlap_plugin.compile import torch_passes
    from fsdp_overlap_plugin.config.hardware import resolve_rates

    options = {
        "post_grad_custom_post_pass": graph_pass,
        "reorder_for_peak_memory": False,
        "reorder_for_compute_comm_overlap": False,
        "allow_buffer_reuse": False,
    }
    stack = contextlib.ExitStack()
    if device != "cuda":
        rates = resolve_rates(device)["rates"]
        options.update(torch_passes.auto_patches(device, rates))
        stack.enter_context(torch_passes.estimates(rates))
    stack.enter_context(torch._inductor.config.patch(options))
    return stack


def _passes_on(config: dict[str, Any]) -> bool:
    return bool(config.get("manual_bucketing", True) or config.get("overlap_grad_reduce", True))


def _compile_setting(
    name: str,
    r: dict[str, Any],
    config: dict[str, Any],
    shape: dict[str, Any],
    device: str,
    warmup: int,
    lr: float,
    seed: int,
    build_model: Callable[[dict[str, Any], str], Any],
    batches: list[Any],
    mesh: Any,
    sync: Callable[[], None],
    track_start: Callable[[], None],
) -> dict[str, Any]:
    """Build, parallelize and run the warm-up steps of one setting (the first compiles);
    fills ``r`` with setup, compile and memory numbers and the generated code's collectives."""
    import torch

    import fsdp_overlap_plugin as fo
    from fsdp_overlap_plugin.runtime.state import get_state

    cuda = device == "cuda"
    before = torch.cuda.memory_allocated() if cuda else 0
    torch.manual_seed(seed)
    model = build_model(shape, device)
    start = time.perf_counter()
    fo.parallelize(model, config, mesh=mesh)
    r["setup_s"] = time.perf_counter() - start
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    plan = get_state(model).plan
    record: dict[str, Any] = {}
    patch: Any = contextlib.nullcontext()
    if name == "manual":
        r["plan"] = plan
        # torchtitan's inductor path: its order kept (no reordering for peak memory or overlap)
        patch = _manual_patch(device, manual_bucketing_pass(plan, record))

    def step(i: int) -> Any:
        ids = batches[i % len(batches)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    track_start()
    times, losses = [], []
    for i in range(warmup):
        sync()
        start = time.perf_counter()
        if i == 0:
            with patch, _generated_code() as codes:
                loss = step(i)
            counts = code_collectives(codes)
            r["code_collectives"] = dict(zip(("forward", "backward"), counts)) if len(counts) == 2 else counts
        else:
            loss = step(i)
        sync()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    r["first_step_s"] = times[0]
    if cuda:
        r["first_step_peak_bytes"] = torch.cuda.max_memory_allocated() - before
        r["resident_bytes"] = torch.cuda.memory_allocated() - before  # its sharded state and optimizer
    if name == "manual":
        graphs = record.get("graphs") or []
        r["manual_pass"] = graphs
        gathers = [(g["before"]["all_gather"], g["after"]["all_gather"]) for g in graphs]
        r["bucketed"] = sum(a for _, a in gathers) < sum(b for b, _ in gathers)
        if not r["bucketed"]:
            raise RuntimeError(
                f"manual_overlap_bucketing did not bucket: all-gathers before -> after per graph {gathers}"
            )
    report = fo.schedule_report(model)
    r["torch_passes"] = report.get("torch_passes")  # which of torch's passes ran, as the report says
    if _passes_on(config):  # our passes' record of the graphs after them
        r["collectives"] = {k: (report.get(k) or {}).get("after") for k in ("forward", "backward")}
    r["status"] = "ok"
    print(f"[torch-passes] {name}: compiled, first step {times[0]:.2f} s", flush=True)
    return {"model": model, "optimizer": optimizer, "step": step, "times": [], "losses": losses}


# --------------------------------------------------------------------------- the parent's side


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def _code_cell(counts: Any) -> str:
    """``forward AG / backward AG / backward RS`` launches in the generated code."""
    if not isinstance(counts, dict) or set(counts) != {"forward", "backward"}:
        return "-"
    f, b = counts["forward"], counts["backward"]
    return f"{f['all_gather']} / {b['all_gather']} / {b['reduce_scatter']}"


def summary_lines(result: dict[str, Any], phase_status: str) -> list[str]:
    """The torch-passes section of summary.md: what ran, the table, what a fake process
    group measures, and each setting's error or absence in words."""
    settings = result.get("settings") or {}
    if not settings:
        return [f"(not run: {phase_status}{': ' + result['error'] if result.get('error') else ''})"]
    shape = result.get("shape") or {}
    have = result.get("passes_in_torch") or {}
    lines = [
        f"- torch {result.get('torch', '?')} on {result.get('device', '?')}; inductor's distributed passes in this "
        "torch: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in have.items()),
        f"- LlamaForCausalLM, {shape.get('n_layer', '?')} layers, hidden {shape.get('hidden', '?')}, intermediate "
        f"{shape.get('intermediate', '?')}, vocab {shape.get('vocab', '?')} (world8's layers: Llama3-8B's), batch "
        f"{shape.get('batch', '?')} x {shape.get('seq', '?')}, a fake process group of {result.get('world', '?')} "
        "ranks; each setting built and compiled in turn (baseline first, into a cold kernel cache: the others "
        "reuse the kernels they share with it), then timed in rounds, the settings taking turns",
        "- compile s: first step - median step; vs baseline: median step over the baseline's; step peak: the "
        "most a timed step allocated above what was resident before it (every setting's model stays resident); "
        "AG / RS: all-gather and reduce-scatter launches in inductor's generated code (a bucket counts once)",
        "",
        "| setting | status | compile s | step s | vs baseline | step peak GiB | first step peak GiB "
        "| AG fwd / AG bwd / RS bwd in code |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = (settings.get("baseline") or {}).get("step_s")
    for name in SETTINGS:
        r = settings.get(name)
        if r is None:
            continue
        step = r.get("step_s")
        ratio = f"{step / base:.3f}" if step and base else "-"
        cells = [
            f"{name}: {r.get('label', SETTINGS[name])}",
            r.get("status", "not run"),
            "-" if r.get("compile_s") is None else f"{r['compile_s']:.1f}",
            "-" if step is None else f"{step:.4f}",
            ratio,
            _gib(r.get("step_peak_bytes")),
            _gib(r.get("first_step_peak_bytes")),
            _code_cell(r.get("code_collectives")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"On a fake process group: {result.get('note', '')}."]
    manual = settings.get("manual") or {}
    if manual.get("manual_pass"):
        per = "; ".join(
            f"{g['kind']} all-gathers {g['before']['all_gather']} -> {g['after']['all_gather']}"
            + (
                f", reduce-scatters {g['before']['reduce_scatter']} -> {g['after']['reduce_scatter']}"
                if g["before"]["reduce_scatter"]
                else ""
            )
            + f" ({g['pass_s']:.1f} s)"
            for g in manual["manual_pass"]
        )
        lines.append(f"manual_overlap_bucketing on our graphs ({len(manual.get('plan') or [])} plan entries): {per}.")
    for name in SETTINGS:
        r = settings.get(name) or {}
        if r.get("error"):
            lines.append(f"- {name}: {r['error'].splitlines()[0]}")
    return lines


def checks(result: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """The phase's checks: our defaults and the baseline ran (they are our code); torch's
    manual pass, where it ran, bucketed our plan. A setting of torch's that fails or is
    absent is a finding, shown in the table, not a failed check."""
    settings = result.get("settings") or {}
    out = []
    for name in ("defaults", "baseline"):
        r = settings.get(name) or {}
        detail = f"median step {r['step_s']:.4f} s" if r.get("step_s") else r.get("error") or r.get("status", "not run")
        out.append((f"torch-passes: {name} ran", r.get("status") == "ok" and bool(r.get("step_s")), detail))
    manual = settings.get("manual") or {}
    if manual.get("manual_pass"):
        before = sum(g["before"]["all_gather"] for g in manual["manual_pass"])
        after = sum(g["after"]["all_gather"] for g in manual["manual_pass"])
        out.append(
            (
                "torch-passes: manual_overlap_bucketing bucketed our plan",
                bool(manual.get("bucketed")),
                f"all-gathers {before} -> {after} over {len(manual['manual_pass'])} graphs",
            )
        )
    return out
