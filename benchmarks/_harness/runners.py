"""step_time.py's modes and what runs them: one mode's model, parallelized, with its
optimizer and step (``ModelRunner``); the comm-only replay of a step's collectives
(``CommReplay``); both at once (``Concurrent``); the receive-first kernels.

torch's own overlap passes as modes: ``torch-auto`` is the package's ``inductor_overlap:
auto`` (torch's overlap scheduler and collective bucketing on our sharded graphs, our passes
off, gloo's reduce-scatter), costed by the package from ``hardware`` = the cpu preset with
its link at the benchmark's ``--rate`` (``link_hardware``; it no longer patches torch's
globals); ``compiled+simple`` / ``both+simple`` set ``inductor_overlap: simple`` (torch
2.14+); ``torch-manual`` runs torch's ``manual_overlap_bucketing`` with `both`'s bucket plan
as a post-grad pass (``torch_manual_pass``), our passes off; ``both+suggest`` takes the plan
and prefetch depth ``fsdp-overlap suggest`` picks at the benchmark's link
(``suggested_plan``). ``mode_torch_error`` says before any worker starts which of them this
torch cannot run."""

from __future__ import annotations

import json
import threading
import time

from _harness.memory import rss_mib
from _harness.models import BATCH_PER_RANK, LR, block_plan, build_model, loss_for, vocab_and_seq
from _harness.trace import schedule_order

ALL_MODES = [
    "fsdp2-eager",
    "compiled",
    "bucketing",
    "grad-overlap",
    "both+native",
    "both",
    "both+prefetch-2",
    "torch-auto",
    "compute-only",
    "comm-only",
    "comm-only+native",
]
# all-to-all gradient reductions (on 2 gloo ranks auto runs them receive-first)
A2A_MODES = {"both", "both+prefetch-2", "both+gather-group", "both+fsdp2-order"}
# the replay that is each other mode's transport bound (the rest: comm-only+native)
OWN_REPLAY = {**{mode: "comm-only" for mode in A2A_MODES}, "both+all-to-all": "comm-only+all-to-all"}
# only when named in --modes (gather-group did not help on gloo: RESULTS.md; the simple modes
# need torch 2.14)
EXTRA_MODES = [
    "compiled+simple",
    "both+simple",
    "torch-manual",
    "both+suggest",
    "both+gather-group",
    "both+fsdp2-order",
    "both+all-to-all",
    "comm-only+all-to-all",
    "comm-only+recv-first",
    "comm+compute",
    "compute-only-eager",
]
QUICK_MODES = ["fsdp2-eager", "both", "both+prefetch-2", "compute-only", "comm-only"]
REPLAYS = {
    "comm-only": "both",
    "comm-only+native": "both+native",
    "comm-only+all-to-all": "both+all-to-all",
    "comm-only+recv-first": "both",
}
CONCURRENT = {"comm+compute": ("comm-only", "compute-only")}  # run at once, in two threads


def dynamo_graphs(runner) -> int | None:
    """The graphs Dynamo compiled for a compiled mode's model so far; None for the others
    (fsdp2-eager, compute-only, the replays)."""
    from fsdp_overlap_plugin.runtime.state import get_state

    state = get_state(getattr(runner, "model", None)) if isinstance(runner, ModelRunner) else None
    return state.dynamo_graphs if state is not None and state.config.compile else None


class ModelRunner:
    """One mode's model, optimizer and step. ``patch``: inductor config active around
    every step (so also around a recompile at a new length); ``may_fail``: a mode whose
    compile may fail on our graphs (torch-manual runs torch's pass on them): the first
    failing step's error is kept in ``failed`` and every later step does nothing, so the
    other modes still run (every rank compiles the same graphs, so all fail alike).
    ``first_step_s``: the first step's wall time (it compiles)."""

    def __init__(self, model, world: int, patch: dict | None = None, loss=None, may_fail: bool = False):
        import torch

        self.model = model
        self.loss = loss
        self.opt = torch.optim.SGD(model.parameters(), lr=LR)
        self.world = world
        self.patch = patch
        self.may_fail = may_fail
        self.failed: str | None = None
        self.first_step_s: float | None = None
        self.info: dict = {}
        self.peak_rss = 0.0

    def _slice(self, t):
        import torch.distributed as dist

        rank = dist.get_rank() if self.world > 1 else 0
        return t[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]

    def step(self, batch, marks: list | None = None, t0: float = 0.0) -> float | None:
        if self.failed is not None:
            return None
        start = time.perf_counter()
        if not self.may_fail:
            loss = self._step(batch, marks, t0)
        else:
            try:
                loss = self._step(batch, marks, t0)
            except Exception as exc:  # noqa: BLE001 - recorded for the table, the other modes go on
                self.failed = f"{type(exc).__name__}: {exc}".strip()
                self.opt.zero_grad(set_to_none=True)
                return None
        if self.first_step_s is None:
            self.first_step_s = time.perf_counter() - start
        return loss

    def _step(self, batch, marks: list | None, t0: float) -> float:
        import torch

        ctx = torch._inductor.config.patch(self.patch) if self.patch else _nullcontext()
        x, y = (self._slice(t) for t in batch)
        base = rss_mib()
        with ctx:
            if marks is not None:
                marks.append(("forward", time.perf_counter() - t0))
            loss = self.loss(x, y)
            self.peak_rss = max(self.peak_rss, rss_mib() - base)
            if marks is not None:
                marks.append(("backward", time.perf_counter() - t0))
            loss.backward()
        self.peak_rss = max(self.peak_rss, rss_mib() - base)
        if marks is not None:
            marks.append(("optimizer step", time.perf_counter() - t0))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if marks is not None:
            marks.append(("end", time.perf_counter() - t0))
        return loss.item()

    def traced_step(self, batch, t0: float) -> list:
        marks: list = []
        self.step(batch, marks, t0)
        return marks

    def ideal_bytes(self, world: int) -> int:
        """Bytes one rank must send per step for this model's collectives, as an ideal
        ring all-gather / reduce-scatter would: (world-1)/world of each full tensor."""
        import fsdp_overlap_plugin as fo

        report = fo.schedule_report(self.model)
        total = 0
        for kind in ("forward", "backward"):
            for event in report[kind]["schedule"]["after"]:
                if event["op"] in ("all_gather", "reduce_scatter", "all_to_all"):
                    total += event["bytes"] * (world - 1) // world
        return total


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class CommReplay:
    """The collectives of one `both` step, launched and waited in graph order, no compute,
    each as that step runs it (all-to-alls receive-first where its ``reduce_scatter_impl``
    resolved to ``receive_first``); with ``recv_first``, all of them as receive-first
    point-to-point exchanges (``exchange``), all-gathers included."""

    def __init__(self, both: ModelRunner, world: int, recv_first: bool = False):
        import torch

        import fsdp_overlap_plugin as fo

        report = fo.schedule_report(both.model)
        self.plan: list[tuple] = []
        for planned in schedule_order(report):
            if planned[0] == "wait":
                self.plan.append(("wait", None, planned[1], None))
                continue
            _, name, op, nbytes = planned
            numel = nbytes // 4
            if recv_first and op == "reduce_scatter":
                raise SystemExit("comm-only+recv-first replays all-gathers and all-to-alls only")
            if op == "all_gather":
                bufs = (torch.randn(numel // world), torch.empty(numel))
            elif op == "reduce_scatter":
                bufs = (torch.randn(numel), torch.empty(numel // world))
            else:
                bufs = (torch.randn(numel), torch.empty(numel))
            self.plan.append(("launch", op, name, bufs))
        self.peak_rss = 0.0
        self.recv_first = recv_first
        self.a2a_first = report["reduce_scatter"]["impl"] == "receive_first"

    def step(self, batch) -> None:
        import torch.distributed as dist

        from fsdp_overlap_plugin.runtime.exchange import exchange

        base = rss_mib()
        works = {}
        group = dist.group.WORLD
        for action, op, name, bufs in self.plan:
            if action == "launch":
                src, dst = bufs
                if self.recv_first or (op == "all_to_all" and self.a2a_first):
                    size = dist.get_world_size()
                    ins = [src] * size if op == "all_gather" else list(src.chunk(size))
                    works[name] = exchange(list(dst.chunk(size)), ins, group)
                    continue
                fn = {
                    "all_gather": dist.all_gather_into_tensor,
                    "reduce_scatter": dist.reduce_scatter_tensor,
                    "all_to_all": dist.all_to_all_single,
                }[op]
                works[name] = fn(dst, src, async_op=True)
            elif name in works:
                works.pop(name).wait()
        for work in works.values():
            work.wait()
        self.peak_rss = max(self.peak_rss, rss_mib() - base)
        return None


class Concurrent:
    """The comm-only replay in a second thread while the compute-only step runs in this
    one: both share the link and the CPUs, and neither waits for the other."""

    def __init__(self, replay: CommReplay, compute: ModelRunner):
        self.replay, self.compute = replay, compute
        self.peak_rss = 0.0

    def step(self, batch) -> float:
        failed: list[BaseException] = []

        def run() -> None:
            try:
                self.replay.step(None)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                failed.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        loss = self.compute.step(batch)
        thread.join()
        if failed:
            raise failed[0]
        return loss


def use_recv_first_kernels() -> object:
    """``--recv-first``: this process's CPU kernels of the functional all-gather (out=
    variant, what the bucketed graphs call) and all-to-all become ``exchange``. Returns
    the library object (the kernels stay registered while it lives)."""
    import torch
    import torch.distributed.distributed_c10d as c10d

    from fsdp_overlap_plugin.runtime.exchange import exchange

    def all_gather_out(input, group_size, group_name, *, out):
        group = c10d._resolve_process_group(group_name)
        src = input.contiguous().view(-1)
        outs = list(out.view(-1).chunk(group_size))
        torch._C._distributed_c10d._register_work(out, exchange(outs, [src] * group_size, group))
        return out

    def all_to_all(input, output_split_sizes, input_split_sizes, group_name):
        group = c10d._resolve_process_group(group_name)
        size, rows = group.size(), input.shape[0]
        out_sizes = list(output_split_sizes) or [rows // size] * size
        in_sizes = list(input_split_sizes) or [rows // size] * size
        out = input.new_empty((sum(out_sizes), *input.shape[1:]))
        work = exchange(list(out.split(out_sizes)), list(input.contiguous().split(in_sizes)), group)
        torch._C._distributed_c10d._register_work(out, work)
        return out

    lib = torch.library.Library("_c10d_functional", "IMPL")
    lib.impl("all_gather_into_tensor_out", all_gather_out, "CPU")
    lib.impl("all_to_all_single", all_to_all, "CPU")
    return lib


# The modes that set inductor_overlap (our package applies it per compile): the setting, and
# whether our passes are on with it
INDUCTOR_OVERLAP = {
    "compiled+simple": ("simple", False),
    "both+simple": ("simple", True),
    "torch-auto": ("auto", False),
}
# the preset whose latency and compute rates torch-auto's cost model keeps (its link: the --rate)
LINK_PRESET = "cpu-gloo-300mbit"


def link_hardware(rate_bps: float) -> str:
    """The ``hardware`` setting that costs collectives at the benchmark's link: the cpu
    preset with ``link`` the tc rate in bytes/s per rank (``cpu-gloo-300mbit,link=37.5MB/s``
    at 300 Mbit). Without a rate (``alloc_peak.py`` passes 0), the preset alone."""
    if not rate_bps or rate_bps <= 0:
        return LINK_PRESET
    return f"{LINK_PRESET},link={rate_bps / 8 / 1e6:g}MB/s"


def mode_torch_error(mode: str) -> str | None:
    """Why ``mode`` cannot run on this torch, or None: the package's own verdict on the
    mode's ``inductor_overlap`` (simple needs torch 2.14, auto on a CPU 2.13), or, for
    torch-manual, torch's ``manual_overlap_bucketing`` missing. Asked at argument check
    time, before any worker starts."""
    from fsdp_overlap_plugin.config.inductor_overlap import device_error, setting_error

    if mode in INDUCTOR_OVERLAP:
        setting, passes_on = INDUCTOR_OVERLAP[mode]
        why = setting_error(setting, passes_on, "inductor") or device_error(setting, "cpu")
        return f"mode {mode}: {why}" if why else None
    if mode == "torch-manual":
        try:
            from torch._inductor.fx_passes.overlap_manual_scheduling import manual_overlap_bucketing  # noqa: F401
        except ImportError as exc:
            import torch

            return f"mode torch-manual: torch {torch.__version__} has no manual_overlap_bucketing ({exc})"
    return None


def _module_stack(node) -> list[tuple[str, type]]:
    """``module_stack_fn`` for torch's graph view: every module scope Dynamo recorded for
    ``node``, as plan FQNs. torch's own reader strips only an ``L['self']`` root, so on a
    transformers model (which Dynamo sees as ``L['args'][0]``: its forward is decorated)
    no node would match the plan and the pass would do nothing; the package's
    ``clean_module_path`` reads any root."""
    from fsdp_overlap_plugin.passes.graph import clean_module_path

    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    out = []
    for value in stack.values():
        key, klass = value if isinstance(value, tuple) else (str(value), object)
        path = clean_module_path(key)
        if path is not None:
            out.append((path, klass))
    return out


def torch_manual_pass(plan: list[list[str] | str]):
    """torch-manual's post-grad pass: torch's own ``manual_overlap_bucketing`` on each of
    our compiled graphs with ``plan`` (the bucket plan `both` resolves), as torchtitan's
    SimpleFSDP runs it under inductor (``insert_overlap_deps=True``). A ``CustomGraphPass``
    whose uuid holds the plan, so the FX graph cache keys on it. Each call appends the
    graph's collectives before and after to ``runs``: that the pass ran, and what it did."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from fsdp_overlap_plugin.passes.graph import collective_counts, graph_kind

    class TorchManualBucketing(CustomGraphPass):
        def __init__(self) -> None:
            self.plan = plan
            self.runs: list[dict] = []

        def __call__(self, graph) -> None:
            from torch._inductor.fx_passes import overlap_manual_scheduling

            before = collective_counts(graph)
            gm = overlap_manual_scheduling.manual_overlap_bucketing(
                graph.owning_module, self.plan, insert_overlap_deps=True, module_stack_fn=_module_stack
            )
            self.runs.append({"graph": graph_kind(graph), "before": before, "after": collective_counts(gm.graph)})

        def uuid(self) -> str:
            return "step_time-torch-manual-" + json.dumps(self.plan)

    return TorchManualBucketing()


def torch_manual_patch(plan: list[list[str] | str]) -> dict:
    """The inductor config active around torch-manual's steps: torch's pass after the
    post-grad passes, and the settings torchtitan's SimpleFSDP sets with it (no reorder for
    peak memory, which would undo the overlap order; no buffer reuse: `both` sets the
    same two)."""
    return {
        "post_grad_custom_post_pass": torch_manual_pass(plan),
        "reorder_for_peak_memory": False,
        "allow_buffer_reuse": False,
    }


def suggested_plan(model_name: str, model, seq: int, world: int, rate_bps: float, current_plan: str) -> dict:
    """What ``fsdp-overlap suggest`` picks for this model on ``world`` ranks at the
    benchmark's link (``link_hardware``), a rank's batch of BATCH_PER_RANK sequences of the
    model's length, from the defaults with ``current_plan`` ("auto" or "blocks"): the
    chosen candidate's words, plan (as ``bucket_plans`` takes it), prefetch depth and
    predicted step."""
    from fsdp_overlap_plugin.cli.analysis import analyze
    from fsdp_overlap_plugin.cli.predict import suggest
    from fsdp_overlap_plugin.config.schema import OverlapConfig

    keys = {"bucket_plans": block_plan(model_name, model)} if current_plan == "blocks" else {}
    config = OverlapConfig.from_dict(keys)
    current = [bucket["modules"] for bucket in analyze(model, config, world=world)["plan"]["buckets"]]
    found = suggest(
        model,
        config,
        current,
        world=world,
        batch=BATCH_PER_RANK,
        seq=seq,
        hardware=link_hardware(rate_bps),
        device_type="cpu",
    )
    if found["chosen"] is None:
        raise SystemExit("both+suggest: fsdp-overlap suggest found no candidate")
    pick = found["candidates"][found["chosen"]]
    return {
        "words": pick["words"],
        "plan": pick["plan"],
        "depth": pick["depth"],
        "predicted_step_s": pick["step_s"],
        "speedup_vs_current": found["speedup"],
        "hardware": link_hardware(rate_bps),
    }


def mode_config(mode: str, rate_bps: float, custom: dict | None = None) -> dict:
    """The plugin config keys of a sharded mode (before ``--plan blocks``, both+suggest's
    plan and ``alloc_peak.py``'s overrides); ``custom``: the ``--mode-config`` modes."""
    native = {"reduce_scatter_impl": "native"}
    passes = {"manual_bucketing": False, "overlap_grad_reduce": False, **native}
    config = {
        "fsdp2-eager": {"compile": False},
        "compiled": passes,
        "compiled+simple": {**passes, "inductor_overlap": "simple"},
        "bucketing": {"manual_bucketing": True, "overlap_grad_reduce": False, **native},
        "grad-overlap": {"manual_bucketing": False, "overlap_grad_reduce": True, **native},
        "both": {},
        "both+simple": {"inductor_overlap": "simple"},
        "both+suggest": {},
        "both+native": native,
        "both+prefetch-2": {"prefetch_depth": 2},
        "both+gather-group": {"separate_gather_group": True},
        "both+fsdp2-order": {"max_prefetch_bytes": "1024GiB"},
        "both+all-to-all": {"reduce_scatter_impl": "all_to_all"},
        "torch-auto": {**passes, "inductor_overlap": "auto", "hardware": link_hardware(rate_bps)},
        "torch-manual": passes,
        **(custom or {}),
    }.get(mode)
    if config is None:
        raise ValueError(f"mode {mode!r} has no plugin config")
    return config


def make_runner(
    mode: str,
    model_name: str,
    size: str,
    runners: dict,
    rate_bps: float,
    world: int,
    plan: str = "auto",
    overrides: dict | None = None,
    custom: dict | None = None,
    log=None,
):
    """One mode's model, parallelized and ready to step. ``overrides``: config keys set
    on top of a compiled mode's own (``alloc_peak.py --set``); ``custom``: the config keys
    of the ``--mode-config`` modes, by name; ``log``: rank 0's printer (both+suggest says
    which plan it picked)."""
    import fsdp_overlap_plugin as fo

    if mode in REPLAYS:
        return CommReplay(runners[REPLAYS[mode]], world, recv_first=mode.endswith("recv-first"))
    if mode in CONCURRENT:
        return Concurrent(*(runners[m] for m in CONCURRENT[mode]))
    model = build_model(model_name, size)
    loss = loss_for(model_name, model)
    if mode == "compute-only-eager":  # the eager modes' compute: unsharded, not compiled
        return ModelRunner(model, world=1, loss=loss)
    if mode == "compute-only":
        from fsdp_overlap_plugin.shard.hf import prepare_for_compile

        prepare_for_compile(model)
        model.compile(backend="inductor", fullgraph=True)
        return ModelRunner(model, world=1, loss=loss)
    info: dict = {}
    if mode == "both+suggest":
        info["suggest"] = suggested_plan(model_name, model, vocab_and_seq(model_name, size)[1], world, rate_bps, plan)
        if log is not None:
            pick = info["suggest"]
            log(
                f"[both+suggest] fsdp-overlap suggest at {pick['hardware']}: {pick['words']}, prefetch_depth "
                f"{pick['depth']} (predicted {pick['predicted_step_s']:.3f} s/step): bucket_plans {pick['plan']}"
            )
    config = mode_config(mode, rate_bps, custom)
    if plan == "blocks":
        config = {**config, "bucket_plans": block_plan(model_name, model)}
    if mode == "both+suggest":  # what the user pastes from `fsdp-overlap suggest`: plan and depth
        config = {**config, "bucket_plans": info["suggest"]["plan"], "prefetch_depth": info["suggest"]["depth"]}
    if overrides and mode != "fsdp2-eager":
        config = {**config, **overrides}
    fo.parallelize(model, config)
    patch = None
    if mode == "torch-manual":  # the plan our `both` resolves for this model (--plan included)
        from fsdp_overlap_plugin.runtime.state import get_state

        info["plan"] = get_state(model).plan
        patch = torch_manual_patch(info["plan"])
    runner = ModelRunner(model, world, patch, loss=loss, may_fail=mode == "torch-manual")
    runner.info = info
    return runner
