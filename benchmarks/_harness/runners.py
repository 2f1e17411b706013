"""step_time.py's modes and what runs them: one mode's model, parallelized, with its
optimizer and step (``ModelRunner``); the comm-only replay of a step's collectives
(``CommReplay``); both at once (``Concurrent``); the receive-first kernels and torch's
own overlap scheduler made to run on CPU."""

from __future__ import annotations

import threading
import time

from _harness.memory import rss_mib
from _harness.models import BATCH_PER_RANK, LR, block_plan, build_model, loss_for
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
# only when named in --modes (gather-group did not help on gloo: RESULTS.md)
EXTRA_MODES = [
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
    """One mode's model, optimizer and step."""

    def __init__(self, model, world: int, patch: dict | None = None, loss=None):
        import torch

        self.model = model
        self.loss = loss
        self.opt = torch.optim.SGD(model.parameters(), lr=LR)
        self.world = world
        self.patch = patch  # inductor config active while the first step compiles
        self.compiled = False
        self.peak_rss = 0.0

    def _slice(self, t):
        import torch.distributed as dist

        rank = dist.get_rank() if self.world > 1 else 0
        return t[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]

    def step(self, batch, marks: list | None = None, t0: float = 0.0) -> float:
        import torch

        ctx = torch._inductor.config.patch(self.patch) if self.patch and not self.compiled else _nullcontext()
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
        self.compiled = True
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


def _cpu_rates() -> tuple[float, float]:
    """Measured single-thread matmul FLOP/s and copy bytes/s (for torch's roofline)."""
    import torch

    a, b = torch.randn(512, 512), torch.randn(512, 512)
    torch.mm(a, b)
    t = time.perf_counter()
    for _ in range(8):
        torch.mm(a, b)
    flops = 8 * 2 * 512**3 / (time.perf_counter() - t)
    x = torch.empty(16 * 2**20 // 4)
    y = torch.empty_like(x)
    y.copy_(x)
    t = time.perf_counter()
    for _ in range(8):
        y.copy_(x)
    bw = 8 * 2 * x.numel() * 4 / (time.perf_counter() - t)
    return flops, bw


def torch_auto_patch(rate_bps: float) -> dict:
    """Make inductor's overlap scheduler run on a CPU-only torch: its roofline estimator
    asks Triton for the GPU's memory bandwidth and peak FLOPs, so give it this CPU's
    measured rates, and cost collectives at the link rate instead of NCCL's."""
    import torch
    import torch.distributed as dist
    import torch.utils._runtime_estimation as runtime_estimation

    from fsdp_overlap_plugin.passes.graph import is_collective

    rates = torch.tensor(_cpu_rates(), dtype=torch.float64)
    if dist.is_initialized():  # rank 0's rates everywhere: different estimates make different schedules
        dist.broadcast(rates, src=0)  # on the ranks, whose collectives then mismatch (seen on hf-llama)
    flops, bw = rates.tolist()
    runtime_estimation.get_gpu_dram_gbps = lambda: bw / 1e9
    runtime_estimation.get_device_tflops = lambda dtype: flops / 1e12

    def estimate(node, size=None):
        if not is_collective(node):
            return None
        val = node.meta.get("val")
        nbytes = size if size else (val.numel() * val.element_size() if val is not None else 0)
        return nbytes * 8 / rate_bps * 1e3  # ms

    return {
        "aten_distributed_optimizations.enable_overlap_scheduling": True,
        "aten_distributed_optimizations.collective_bucketing": True,
        "aten_distributed_optimizations.custom_runtime_estimation": estimate,
        # the default "benchmark" times kernels on a GPU to align ranks' estimates
        "aten_distributed_optimizations.compute_estimator": "analytical",
    }


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
):
    """One mode's model, parallelized and ready to step. ``overrides``: config keys set
    on top of a compiled mode's own (``alloc_peak.py --set``); ``custom``: the config keys
    of the ``--mode-config`` modes, by name."""
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
    native = {"reduce_scatter_impl": "native"}
    passes = {"manual_bucketing": False, "overlap_grad_reduce": False, **native}
    config = {
        "fsdp2-eager": {"compile": False},
        "compiled": passes,
        "bucketing": {"manual_bucketing": True, "overlap_grad_reduce": False, **native},
        "grad-overlap": {"manual_bucketing": False, "overlap_grad_reduce": True, **native},
        "both": {},
        "both+native": native,
        "both+prefetch-2": {"prefetch_depth": 2},
        "both+gather-group": {"separate_gather_group": True},
        "both+fsdp2-order": {"max_prefetch_bytes": "1024GiB"},
        "both+all-to-all": {"reduce_scatter_impl": "all_to_all"},
        "torch-auto": passes,
        **(custom or {}),
    }[mode]
    if plan == "blocks":
        config = {**config, "bucket_plans": block_plan(model_name, model)}
    if overrides and mode != "fsdp2-eager":
        config = {**config, **overrides}
    fo.parallelize(model, config)
    patch = torch_auto_patch(rate_bps) if mode == "torch-auto" else None
    return ModelRunner(model, world, patch, loss=loss)
