"""2-D step time: data-parallel 2 x tensor-parallel 2 over a capped link, the plugin against
torchtitan's recipe.

Four gloo ranks, one thread each, on a (dp 2, tp 2) mesh. The tensor dimension is innermost
(``fo.parallelize(model, mesh={"tensor": 2})``, as torchtitan's ``(dp_shard, tp)`` mesh): ranks
0-1 and 2-3 are the tensor-parallel pairs, 0-2 and 1-3 the data-parallel pairs. Each pair of
tensor-parallel ranks runs in one network namespace ("node"), and the namespaces are joined
by one veth pair whose both ends are shaped with ``tc ... tbf rate <rate>``:

    namespace fo2d0: ranks 0, 1 on veth fo2dv0 (10.79.1.1)
    namespace fo2d1: ranks 2, 3 on veth fo2dv1 (10.79.1.2)

gloo binds every rank to the address of the interface ``GLOO_SOCKET_IFNAME`` names (its
namespace's veth), and the ranks meet at ``MASTER_ADDR`` (namespace 0's address: only the
store's few bytes cross there). The two ranks of a namespace share that address, and the
kernel carries a connection between two local addresses over loopback, past the veth and
its qdisc: the tensor-parallel pair talks fast, and only data-parallel traffic crosses the
shaped link, which both data-parallel pairs share, as the GPUs of a node share its NIC.
Before the modes run, every rank checks that (``probe_links``): one all-reduce of 4 MiB on
the tensor-parallel groups, then on the data-parallel groups (every group of a kind at
once, median of 3), each timed and with the veth's byte counters read around it; the
results open with both.

The repo GPT (``--model-size``, default small: d=256, 4 blocks, vocab 512, seq 128) with
its MLPs split the Megatron way (``PLAN``: ``blocks.*.mlp.fc`` colwise, ``blocks.*.mlp.proj``
rowwise; the fused ``qkv`` cannot be split by columns, docs/tensor-parallel.md) trains with
SGD on the same fixed batches in every mode, both ranks of a tensor-parallel pair on their
data-parallel rank's 8 sequences. Each mode is built and warmed up on its first use, then
timed step by step between barriers, the modes interleaved over the repetitions so that
drift hits them alike:

    defaults                fo.parallelize(model, mesh={"tensor": 2}, tp_plan=PLAN): both
                            passes (manual bucketing + prefetch, gradient reduce-scatter
                            overlap), the whole model compiled with --backend (inductor, as
                            step_time.py's compiled modes)
    passes-off              the same with manual_bucketing: false, overlap_grad_reduce:
                            false and reduce_scatter_impl: native (step_time.py's
                            `compiled`, hsdp_step.py's `passes-off`: gloo's own
                            reduce-scatter, no pass of ours)
    torchtitan-eager-order  torchtitan's recipe without the plugin (``parallelize_llama``
                            in torchtitan/models/llama3/infra/parallelize.py): ``apply_tp``
                            (``parallelize_module`` of each block over the tp submesh with
                            the same plan as ColwiseParallel / RowwiseParallel), then
                            ``apply_compile`` (``torch.compile`` of each block, fullgraph,
                            registered in its place; "after AC wrapping and before FSDP"),
                            then ``apply_fsdp`` over the dp submesh: ``fully_shard`` of the
                            token embedding, of each block, of [final norm, head] with
                            reshard_after_forward false, and of the root (which keeps the
                            GPT's position embedding; torchtitan's Llama has none). FSDP2's
                            hooks run outside the compiled blocks: its eager order
    compute-only            the same split model, compiled whole, no data-parallel
                            sharding or gradient reduction: the step with a free dp link
                            (the tensor-parallel all-reduces stay)

The table gives each mode's median step, its ratio to torchtitan-eager-order's (ratios of
medians), the exposure (median - compute-only's median: the data-parallel communication
left on the critical path, and its share of the step), its peak memory per rank and that
against torchtitan-eager-order's, and its losses against torchtitan-eager-order's.

Peak memory (after the timed steps, per sharded mode, ``_harness.memory.measure_step_memory``):
parameter shards, gradients and buffers held when a step starts, plus the most resident
memory a step added (VmHWM after a reset minus VmRSS at its start, worst of 2 steps; the
workers run with ``MALLOC_MMAP_THRESHOLD_=65536`` so RSS follows the bytes alive), the
largest over the four ranks.

Losses (``loss_agreement``): every rank's loss on its data-parallel rank's batch at every
timed step, against torchtitan-eager-order's at the same step and rank (every mode trains
the same batches in the same order from the same seed), and the two ranks of each
tensor-parallel pair against each other (they see the same batch). The modes compute the
same fp32 math in other orders (inductor's fusions, bucketed gathers, the reduce-scatter as
an all-to-all and a local sum); the 1-D benchmark's compiled modes stay within 1.4e-6 of
eager FSDP2 (RESULTS.md), and the three modes here agreed bitwise on the tiny GPT (aot_eager
and inductor). ``LOSS_TOL`` = 1e-4 allows 70 times the 1-D spread, while a mode that drops
the data-parallel gradient reduction drifts off by the training itself: compute-only is
such a mode (each data-parallel rank trains on its own batch, no averaging), and it was
5.7e-3 off torchtitan-eager-order's losses within 6 steps of the tiny GPT at 300 Mbit
(57 x the tolerance). A mode outside the tolerance is marked in the table and the script
exits 1, so a broken mode cannot look fast. compute-only's losses differ by design and
are not compared.

    sudo python benchmarks/step_time_2d.py --reps 10 --steps 3      # 300 Mbit, GPT small
    sudo python benchmarks/step_time_2d.py --rate 1gbit --model-size medium --json 2d.json
    python benchmarks/step_time_2d.py --loopback --model-size tiny --backend aot_eager --reps 1 --steps 2

Without root (or without iproute2) it runs all four ranks on loopback, uncapped, and says
so. The namespaces are removed on exit, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run from a checkout without installing the package

from _harness import launch, netns  # noqa: E402
from _harness.memory import MMAP_THRESHOLD, measure_step_memory  # noqa: E402
from _harness.models import BATCH_PER_RANK, MODEL_SIZES, _data, build_gpt, loss_for  # noqa: E402
from _harness.netns import parse_rate, rank_namespaces  # noqa: E402
from _harness.runners import ModelRunner  # noqa: E402
from _harness.steps import timed_steps  # noqa: E402
from _harness.tables import time_stats  # noqa: E402

REFERENCE = "torchtitan-eager-order"
MODES = ["defaults", "passes-off", REFERENCE, "compute-only"]
SHARDED = ("defaults", "passes-off", REFERENCE)
DP, TP = 2, 2
WORLD = DP * TP
PLAN = {"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}
NETNS = ("fo2d0", "fo2d1")
VETH = ("fo2dv0", "fo2dv1")
ADDRS = ("10.79.1.1", "10.79.1.2")
PORT = "29673"
# step_time's GPT sizes, and a tiny one for the smoke tests (its MLP, 256 wide, splits in two)
SIZES = {**MODEL_SIZES, "tiny": (64, 2, 4, 128, 32)}
PROBE_BYTES = 4 * 2**20
PROBE_REPS = 3
LOSS_TOL = 1e-4  # the docstring: 70 x the 1-D benchmark's spread; dropping the dp reduction moved 5.7e-3
MEMORY_STEPS = 3  # measure_step_memory: 2 steps for RSS, 1 profiled


# =============================================================================== parent
def dp_rank_of(rank: int) -> int:
    """The data-parallel rank (the batch slice) of a rank: its row of the (dp, tp) mesh."""
    return rank // TP


def mesh_groups() -> tuple[list[list[int]], list[list[int]]]:
    """``(tensor-parallel groups, data-parallel groups)`` of the (dp, tp) mesh, as
    ``init_device_mesh`` lays it out: rows tensor-parallel, columns data-parallel."""
    rows = [[d * TP + t for t in range(TP)] for d in range(DP)]
    return rows, [list(col) for col in zip(*rows)]


class Namespaces(netns.Namespaces):
    """Two network namespaces joined by one shaped veth pair (this script's names: NETNS,
    VETH, ADDRS); removed on every exit path."""

    def __init__(self, rate: str):
        super().__init__(rate, NETNS, VETH, ADDRS)


def run_workers(worker_args: list[str], out_dir: Path, timeout: float, use_netns: bool) -> list[dict]:
    """This script's ``--worker`` as ranks 0-3 (a tensor-parallel pair per namespace, or all
    on loopback); their ``rank<r>.json`` back, or SystemExit with the tails of their logs."""
    cache = out_dir / "inductor_cache"  # cold compiles, and no other run's graphs
    env = {
        "TORCHINDUCTOR_COMPILE_THREADS": "1",  # four ranks on few cores: no compile pools
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(cache),
        "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
    }
    try:
        return launch.run_workers(
            __file__,
            worker_args,
            out_dir,
            timeout,
            use_netns,
            env,
            "step_time_2d",
            nodes=rank_namespaces(WORLD, TP),
            netns=NETNS,
            veth=VETH,
            master_addr=ADDRS[0],
            port=PORT,
        )
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def describe_model(size: str) -> str:
    d, layers, heads, vocab, seq = SIZES[size]
    return f"GPT {size} (d={d}, {layers} blocks, {heads} heads, vocab {vocab}, seq {seq})"


# ------------------------------------------------------------------------------- summary
def loss_agreement(per_rank: dict[str, list[list[float]]], reference: str, tol: float = LOSS_TOL) -> dict:
    """Per mode (compute-only left out): the largest ``|loss - reference's|`` over every rank
    and timed step (``max_diff``), the largest difference between the two ranks of a
    tensor-parallel pair (``tp_pair_diff``), and ``agree``: both within ``tol``, the same
    number of steps as the reference, every loss finite. ``per_rank[mode][r]``: rank r's
    losses in step order."""
    ref = per_rank.get(reference)
    tp_groups, _ = mesh_groups()
    out: dict = {"reference": reference, "tol": tol, "modes": {}}
    for mode, ranks in per_rank.items():
        if mode == "compute-only":
            continue
        finite = all(math.isfinite(x) for losses in ranks for x in losses)
        same_len = ref is not None and [len(x) for x in ranks] == [len(x) for x in ref]
        diff = (
            max((abs(a - b) for mine, theirs in zip(ranks, ref) for a, b in zip(mine, theirs)), default=0.0)
            if same_len and finite
            else None
        )
        pair = max(
            (
                abs(a - b)
                for group in tp_groups
                if max(group) < len(ranks)
                for other in group[1:]
                for a, b in zip(ranks[group[0]], ranks[other])
            ),
            default=0.0,
        )
        row = {
            "max_diff": diff,
            "tp_pair_diff": pair if finite else None,
            "steps": len(ranks[0]) if ranks else 0,
            "finite": finite,
        }
        row["agree"] = bool(finite and same_len and diff <= tol and pair <= tol)
        out["modes"][mode] = row
    out["all_agree"] = all(row["agree"] for row in out["modes"].values())
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(results: list[dict], loss_tol: float = LOSS_TOL) -> dict:
    """Per mode: step time median / min / max (rank 0's: every rank steps between the same
    barriers), ratio of medians to torchtitan-eager-order, exposure over compute-only, peak
    memory (largest over the ranks) and its ratio; the losses' agreement; the link probe."""
    r0 = results[0]
    modes = list(r0["modes"])
    reference = REFERENCE if REFERENCE in modes else next((m for m in modes if m in SHARDED), modes[0])
    rows: dict[str, dict] = {}
    for mode in modes:
        data = r0["modes"][mode]
        mem = [res.get("memory", {}).get(mode) for res in results]
        compile_s = [res["modes"][mode].get("compile_s") for res in results]
        rows[mode] = {
            **time_stats(data["times"]),
            "losses": data["losses"],
            "compile_s": max((c for c in compile_s if c is not None), default=None),
            "peak_mib": max(m["peak_bytes"] for m in mem) / 2**20 if mem and all(mem) else None,
            "held_mib": max(m["state_bytes"] for m in mem) / 2**20 if mem and all(mem) else None,
        }
    compute = rows.get("compute-only", {}).get("median_s")
    ref_row = rows[reference]
    for mode, row in rows.items():
        row["x_reference"] = _ratio(row["median_s"], ref_row["median_s"])
        row["x_reference_peak"] = _ratio(row["peak_mib"], ref_row["peak_mib"])
        exposed = row["median_s"] - compute if compute is not None and mode != "compute-only" else None
        row["exposed_s"] = exposed
        row["exposed_fraction"] = _ratio(exposed, row["median_s"])
    losses = loss_agreement({m: [res["modes"][m]["losses"] for res in results] for m in modes}, reference, loss_tol)
    for mode, check in losses["modes"].items():
        rows[mode]["loss_check"] = check
    return {
        "reference": reference,
        "rows": rows,
        "losses": losses,
        "probe": link_verdict(r0.get("probe")),
        "process_peak_rss_mib": [round(res.get("process_peak_rss_mib", 0)) for res in results],
    }


def link_verdict(probe: dict | None) -> dict | None:
    """The probe with ``tp_off_link``: over the namespaces, whether the tensor-parallel
    all-reduce left the veth (under 1% of its bytes there per repetition) while the
    data-parallel one crossed it (at least its bytes); None on loopback (no veth)."""
    if not probe:
        return probe
    tp_bytes, dp_bytes = probe.get("tp_link_bytes"), probe.get("dp_link_bytes")
    off = None
    if probe.get("ifname", "lo") != "lo" and tp_bytes is not None and dp_bytes is not None:
        off = tp_bytes < 0.01 * probe["bytes"] and dp_bytes >= probe["bytes"]
    return {**probe, "tp_off_link": off, "dp_over_tp": _ratio(probe["dp_all_reduce_s"], probe["tp_all_reduce_s"])}


def probe_lines(probe: dict | None) -> list[str]:
    if not probe:
        return ["link check: not run"]

    def carried(key: str) -> str:
        value = probe.get(key)
        return "" if value is None else f", {probe['ifname']} carried {value / 2**20:.2f} MiB per all-reduce"

    verdict = {
        True: "the tensor-parallel pairs stay off the shaped link",
        False: "WARNING: tensor-parallel traffic crossed the shaped link (or data-parallel traffic did not)",
        None: "loopback: no shaped link to check",
    }[probe.get("tp_off_link")]
    ratio = probe.get("dp_over_tp")
    return [
        f"link check ({probe['bytes'] / 2**20:.0f} MiB all-reduce, every group of a kind at once, median of "
        f"{PROBE_REPS}):",
        f"  tensor-parallel pairs (0-1, 2-3): {probe['tp_all_reduce_s'] * 1e3:8.1f} ms{carried('tp_link_bytes')}",
        f"  data-parallel pairs   (0-2, 1-3): {probe['dp_all_reduce_s'] * 1e3:8.1f} ms{carried('dp_link_bytes')}",
        f"  dp / tp time {ratio:.1f}x: {verdict}" if ratio else f"  {verdict}",
    ]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(summary: dict) -> None:
    ref = summary["reference"]
    for line in probe_lines(summary.get("probe")):
        print(line)
    print(
        f"{'mode':<23} {'median s':>8} {'min s':>6} {'max s':>6} {'x ref':>6} {'exposed s':>9} {'exp %':>6}"
        f" {'peak MiB':>8} {'x ref':>6} {'compile s':>9}  loss first -> last  max |loss - ref|  tp pair"
    )
    for mode, row in summary["rows"].items():
        check = row.get("loss_check")
        losses = row["losses"]
        loss = f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "-"
        if check:
            loss += f"  {_fmt(check['max_diff'], '.1e'):>8}  {_fmt(check['tp_pair_diff'], '.1e'):>8}"
            loss += "" if check["agree"] else "  DISAGREE"
        exposed = row["exposed_fraction"]
        print(
            f"{mode:<23} {row['median_s']:>8.3f} {row['min_s']:>6.3f} {row['max_s']:>6.3f}"
            f" {_fmt(row['x_reference'], '.2f'):>6} {_fmt(row['exposed_s'], '.3f'):>9}"
            f" {_fmt(None if exposed is None else exposed * 100, '.0f'):>6} {_fmt(row['peak_mib'], '.1f'):>8}"
            f" {_fmt(row['x_reference_peak'], '.2f'):>6} {_fmt(row['compile_s'], '.1f'):>9}  {loss}"
        )
    losses = summary["losses"]
    print(f"x ref: ratio of medians to {ref}'s. median / min / max over every timed step (rank 0; all ranks")
    print("step between the same barriers). exposed s: median - compute-only's median (the data-parallel")
    print("communication on the critical path), exp %: its share of the step.")
    print("peak MiB: parameter shards + gradients + buffers held, plus the most resident memory one step added")
    print("(VmHWM - VmRSS at its start, worst of 2 steps), largest over the 4 ranks.")
    print(
        f"losses: rank 0's first -> last timed step; max |loss - ref| over all 4 ranks and every timed step, "
        f"tp pair: the two ranks of a tensor-parallel pair; tolerance {losses['tol']:.0e}: "
        + ("all agree" if losses["all_agree"] else "SOME MODE DISAGREES (its times mean nothing)")
    )
    print(f"process peak RSS per rank (MiB): {summary['process_peak_rss_mib']}")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="300mbit", help="tc tbf rate of the data-parallel link, both ends (300mbit)")
    parser.add_argument(
        "--model-size", default="small", choices=list(SIZES), help="GPT size: step_time.py's, or tiny (a smoke test)"
    )
    parser.add_argument(
        "--backend", default="inductor", help="compile backend of every mode (aot_eager: a faster smoke test)"
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode per repetition")
    parser.add_argument("--reps", type=int, default=10, help="repetitions; the modes are interleaved within each")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode (the first compiles)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES))
    parser.add_argument("--loss-tol", type=float, default=LOSS_TOL, help=f"loss agreement tolerance ({LOSS_TOL:g})")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory steps")
    parser.add_argument("--loopback", action="store_true", help="all ranks on loopback, even as root")
    parser.add_argument("--json", help="write the summary and the ranks' raw results here")
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return parser, args
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; valid: {', '.join(MODES)}")
    if not any(m in SHARDED for m in modes):
        parser.error(f"--modes: name at least one of {', '.join(SHARDED)}")
    if args.steps < 1 or args.reps < 1 or args.warmup < 1:
        parser.error("--steps, --reps and --warmup must be at least 1 (the first warm-up step compiles)")
    parse_rate(args.rate)  # a typo fails here, not in tc
    args.modes = ",".join(modes)
    return parser, args


def worker_args(args: argparse.Namespace) -> list[str]:
    out = ["--model-size", args.model_size, "--backend", args.backend, "--modes", args.modes]
    out += ["--steps", str(args.steps), "--reps", str(args.reps), "--warmup", str(args.warmup)]
    return out + ["--no-memory"] * args.no_memory


def main(argv: list[str] | None = None) -> int:
    _, args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    ok, why = Namespaces.available()
    use_netns = ok and not args.loopback
    where = (
        f"2 namespaces (tensor-parallel pairs 0-1 | 2-3 inside, on loopback), the data-parallel link a veth "
        f"shaped to {args.rate} each way"
        if use_netns
        else f"LOOPBACK, uncapped ({why or '--loopback'}): the data-parallel link is free, ratios mean little"
    )
    header = (
        f"step_time_2d: 4 ranks, mesh dp {DP} x tp {TP}, over {where}; {describe_model(args.model_size)}, "
        f"MLPs split colwise/rowwise, batch {BATCH_PER_RANK}/dp rank, SGD, {args.backend}; "
        f"{args.reps} x {args.steps} timed steps per mode, interleaved"
    )
    print(header, flush=True)
    out_dir = Path(tempfile.mkdtemp(prefix="fsdp_overlap_2d_"))
    for sig in (signal.SIGTERM, signal.SIGHUP):  # unwind like Ctrl-C: the namespaces go
        signal.signal(sig, lambda *_: sys.exit(130))
    start = time.time()
    if use_netns:
        with Namespaces(args.rate):
            results = run_workers(worker_args(args), out_dir, args.timeout, True)
    else:
        results = run_workers(worker_args(args), out_dir, args.timeout, False)
    summary = summarize(results, args.loss_tol)
    print(f"\nresults ({time.time() - start:.0f} s in all; worker logs in {out_dir}):")
    print_table(summary)
    if args.json:
        payload = {
            "header": header,
            "command": " ".join(sys.argv),
            "rate": args.rate,
            "backend": args.backend,
            "loopback": not use_netns,
            "summary": summary,
            "raw": results,
        }
        Path(args.json).write_text(json.dumps(payload, indent=1))
        print(f"json written to {args.json}")
    return 0 if summary["losses"]["all_agree"] else 1


# =============================================================================== worker
class TensorParallelRunner(ModelRunner):
    """``ModelRunner`` whose rank trains on its data-parallel rank's slice of each batch:
    both ranks of a tensor-parallel pair see the same sequences."""

    def _slice(self, t):
        import torch.distributed as dist

        dp_rank = dp_rank_of(dist.get_rank())
        return t[dp_rank * BATCH_PER_RANK : (dp_rank + 1) * BATCH_PER_RANK]


def torch_tp_plan() -> dict:
    """``PLAN`` inside one block, in torch's styles (torchtitan's ``apply_tp`` per block)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {key.removeprefix("blocks.*."): styles[style]() for key, style in PLAN.items()}


def torchtitan_parallelize(model, mesh, backend: str):
    """torchtitan's ``parallelize_llama`` on the repo GPT, without the plugin: ``apply_tp``,
    ``apply_compile`` (per block, before FSDP), ``apply_fsdp`` (embedding, blocks, [norm,
    head] not resharded after forward, root) over the dp submesh."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    for block in model.blocks:
        parallelize_module(block, mesh["tp"], torch_tp_plan())
    for name, block in model.blocks.named_children():
        model.blocks.register_module(name, torch.compile(block, backend=backend, fullgraph=True))
    dp_mesh = mesh["dp"]
    fully_shard(model.tok_emb, mesh=dp_mesh)
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard([model.norm, model.head], mesh=dp_mesh, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh)
    return model


def make_runner(mode: str, size: str, backend: str, mesh) -> TensorParallelRunner:
    """One mode's model (seeded: the same weights in every mode), split, sharded, compiled."""
    import fsdp_overlap_plugin as fo

    model = build_gpt(*SIZES[size], seed=0)
    if mode == REFERENCE:
        torchtitan_parallelize(model, mesh, backend)
    elif mode == "compute-only":
        from torch.distributed.tensor.parallel import parallelize_module

        for block in model.blocks:
            parallelize_module(block, mesh["tp"], torch_tp_plan())
        model.compile(backend=backend, fullgraph=True)
    else:
        config = {"mesh": {"tensor": TP}, "tp_plan": dict(PLAN), "backend": backend}
        if mode == "passes-off":
            config.update(manual_bucketing=False, overlap_grad_reduce=False, reduce_scatter_impl="native")
        fo.parallelize(model, config)
    return TensorParallelRunner(model, DP, loss=loss_for("gpt", model))


def link_bytes(ifname: str) -> int | None:
    """Bytes the interface has sent plus received (its namespace's counters), or None."""
    base = Path("/sys/class/net") / ifname / "statistics"
    try:
        return int((base / "tx_bytes").read_text()) + int((base / "rx_bytes").read_text())
    except OSError:
        return None


def probe_links(mesh, ifname: str) -> dict:
    """Seconds of one 4 MiB all-reduce on the tensor-parallel groups, then on the
    data-parallel groups (every group of a kind at once: median of ``PROBE_REPS``), and the
    bytes ``ifname`` carried per all-reduce meanwhile (the barriers' few bytes included)."""
    import torch
    import torch.distributed as dist

    buf = torch.ones(PROBE_BYTES // 4)
    out: dict = {"bytes": PROBE_BYTES, "ifname": ifname}
    for kind in ("tp", "dp"):
        group = mesh.get_group(kind)
        dist.all_reduce(buf, group=group)  # connect
        dist.barrier()
        before = link_bytes(ifname)
        times = []
        for _ in range(PROBE_REPS):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(buf, group=group)
            times.append(time.perf_counter() - t)
            buf.fill_(1.0)
        dist.barrier()
        after = link_bytes(ifname)
        out[f"{kind}_all_reduce_s"] = statistics.median(times)
        out[f"{kind}_link_bytes"] = (after - before) / PROBE_REPS if before is not None and after is not None else None
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != WORLD:
        raise SystemExit(f"step_time_2d: {WORLD} ranks expected, got {world}")
    # torchtitan's compiled blocks and the whole-model compiles share forward code objects
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    modes = args.modes.split(",")
    vocab, seq = SIZES[args.model_size][3:]
    extra = 0 if args.no_memory else MEMORY_STEPS * len(modes)
    data = _data(vocab, seq, DP, args.warmup + args.reps * args.steps + extra + 1)
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    results = {m: {"times": [], "losses": []} for m in modes}
    out: dict = {"rank": rank, "modes": results}

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    out["probe"] = probe_links(mesh, os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
    log(f"link probe: {out['probe']}")

    def ready(mode: str, runner) -> None:
        results[mode]["compile_s"] = runner.first_step_s

    runners, index = timed_steps(
        modes,
        lambda mode, _: make_runner(mode, args.model_size, args.backend, mesh),
        data,
        results,
        reps=args.reps,
        steps=args.steps,
        warmup=args.warmup,
        barrier=dist.barrier,
        log=log,
        summary="median",
        on_ready=ready,
    )
    if not args.no_memory:
        out["memory"] = {}
        for mode in modes:
            batches = data[index[mode] : index[mode] + MEMORY_STEPS]
            out["memory"][mode] = measure_step_memory(runners[mode], batches, dist.barrier)
            log(f"[{mode}] peak {out['memory'][mode]['peak_bytes'] / 2**20:.1f} MiB (rank 0)")
    out["process_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(args.out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
