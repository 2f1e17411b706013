"""HSDP step time on two "nodes": eager ``fully_shard`` against the compiled defaults.

Four ranks, one thread each, on a 2 x 2 (replicate x shard) mesh. The mesh puts ranks
0-1 and 2-3 in the shard groups and 0-2, 1-3 in the replicate groups (``build_mesh``:
``init_device_mesh((replicate, shard))``), so the ranks sit on two "nodes":

    namespace fohsdp0: ranks 0, 1 on veth fohv0 (10.78.1.1)
    namespace fohsdp1: ranks 2, 3 on veth fohv1 (10.78.1.2)

joined by one veth pair whose both ends are shaped with ``tc ... tbf rate <rate>``. gloo
binds every rank to its namespace's veth address (``GLOO_SOCKET_IFNAME``): the two ranks
of a namespace share that address, and the kernel routes a connection to a local address
over loopback, unshaped: the shard link is fast, the replica link is the capped veth,
which both replicate groups (0-2 and 1-3) share, as two GPUs of a node would share one
NIC. Every mode trains the repo GPT with SGD on the same fixed batches, warmed up, then
timed, interleaved with the other modes over repetitions:

    hsdp-eager           fully_shard per plan bucket on the same 2-D mesh (parallelize with
                         compile: false): what users run today
    passes-off           our sharding, compiled with inductor, no passes (step_time.py's
                         `compiled`: gloo's own reduce-scatter)
    defaults             the plugin's defaults: bucketing, gradient overlap, each bucket's
                         replica all-reduce launched after its reduce-scatter and waited
                         after the next bucket's all-reduce launch
    compute-only         the same model and per-rank batch, unsharded, compiled, all four
                         ranks computing at once (the prediction's compute rate)
    compute-only-eager   the same, not compiled (the eager prediction's compute rate)

After the timed steps each rank measures its links with no compute (both groups of a
kind at once, as a step runs them): the shard groups' all-to-all and the replicate
groups' all-reduce; then the peak memory of each sharded mode's step
(``_harness.memory.measure_step_memory``: parameter shards, gradients and buffers held, plus
the most resident memory the step added: VmHWM after a reset minus VmRSS at the step's
start; the workers run with ``MALLOC_MMAP_THRESHOLD_=65536``, as step_time's
``--memory`` does, so RSS follows the bytes alive).

Predicted steps (``costmodel.simulate``): each compiled mode's recorded schedule (rank 0's
report), the replica all-reduces on the cost model's inter-node lane (``inter_link``),
the shard collectives on its link lane; hsdp-eager as FSDP2 runs on a CPU
(``_harness.costmodel.fsdp2_on_cpu``: forward gathers waited before their layer, backward
gathers one ahead, each reduce-scatter then its replica all-reduce waited at once).
Compute: the FLOPs the schedule records over the compute-only step (eager: the
compute-only-eager step); host terms: ``_harness.costmodel.HOST`` (fitted on the 2-rank
runs). Two link sets: ``measured`` (each lane at the rate its probe achieved, in the
model's units) and ``nominal`` (inter_link from the tc rate: the cpu-gloo-300mbit
preset's link calibration, 425/300 of the tc rate, halved for the two replicate groups
sharing the veth; the shard link at the probe's rate).

    python benchmarks/hsdp_step.py --reps 16 --steps 1          # 300 Mbit, GPT small, modes alternating
                                                                # every step (RESULTS.md: on a shared
                                                                # machine, drift stays out of the ratios)
    python benchmarks/hsdp_step.py --rate 100mbit --reps 3 --steps 8 --json hsdp100.json
    python benchmarks/hsdp_step.py --loopback --steps 2 --reps 1  # no namespaces: a smoke run

Without root (or without iproute2) it runs all four ranks on loopback, uncapped, and says
so. The namespaces are removed on exit, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
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
from _harness.costmodel import HOST, fsdp2_on_cpu, gloo_native, schedule  # noqa: E402
from _harness.memory import MMAP_THRESHOLD, measure_step_memory  # noqa: E402
from _harness.models import BATCH_PER_RANK, MODEL_SIZES, _data, build_gpt, loss_for  # noqa: E402
from _harness.netns import parse_rate  # noqa: E402
from _harness.runners import ModelRunner  # noqa: E402
from _harness.steps import timed_steps  # noqa: E402

from fsdp_overlap_plugin.config.hardware import HARDWARE  # noqa: E402

MODES = ["hsdp-eager", "passes-off", "defaults", "compute-only", "compute-only-eager"]
SHARDED = ("hsdp-eager", "passes-off", "defaults")
MESH = {"replicate": 2, "shard": 2}
WORLD = MESH["replicate"] * MESH["shard"]
NETNS = ("fohsdp0", "fohsdp1")
VETH = ("fohv0", "fohv1")
ADDRS = ("10.78.1.1", "10.78.1.2")
PORT = "29657"
# the cpu-gloo-300mbit preset's link in the model's lane over its 300 Mbit tc link (1.377 since
# issue 56's refit; 425 / 300 when RESULTS.md's HSDP table was measured)
PRESET_LINK_SHARE = HARDWARE["cpu-gloo-300mbit"].link / (300e6 / 8)
# step_time's GPT sizes, and a tiny one for the smoke test
SIZES = {**MODEL_SIZES, "tiny": (64, 2, 4, 128, 32)}
PROBE_BYTES = 4 * 2**20
PROBE_REPS = 3


# =============================================================================== parent
def node_of(rank: int) -> int:
    """The namespace ("node") a rank runs in: its row of the (replicate, shard) mesh, so a
    shard group stays inside one node and a replicate group spans both."""
    return rank // MESH["shard"]


def mesh_groups() -> tuple[list[list[int]], list[list[int]]]:
    """``(shard groups, replicate groups)`` of the 2 x 2 mesh, as ``init_device_mesh`` lays
    it out: rows shard, columns replicate."""
    rows = [[r * MESH["shard"] + s for s in range(MESH["shard"])] for r in range(MESH["replicate"])]
    return rows, [list(col) for col in zip(*rows)]


class Namespaces(netns.Namespaces):
    """Two network namespaces joined by one shaped veth pair (this script's names: NETNS,
    VETH, ADDRS); removed on every exit path."""

    def __init__(self, rate: str):
        super().__init__(rate, NETNS, VETH, ADDRS)


def run_workers(worker_args: list[str], out_dir: Path, timeout: float, use_netns: bool) -> list[dict]:
    """This script's ``--worker`` as ranks 0-3 (two per namespace, or all on loopback):
    _harness.launch.run_workers with this script's namespaces; their ``rank<r>.json`` back, or
    SystemExit with the tails of their logs."""
    env = {
        "TORCHINDUCTOR_COMPILE_THREADS": "1",  # four ranks on few cores: no compile pools
        "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
    }
    return launch.run_workers(
        __file__,
        worker_args,
        out_dir,
        timeout,
        use_netns,
        env,
        "hsdp_step",
        nodes=[node_of(rank) for rank in range(WORLD)],
        netns=NETNS,
        veth=VETH,
        master_addr=ADDRS[0],
        port=PORT,
    )


# ---------------------------------------------------------------------------- prediction
def describe_model(size: str) -> str:
    d, layers, heads, vocab, seq = SIZES[size]
    return f"GPT {size} (d={d}, {layers} blocks, {heads} heads, vocab {vocab}, seq {seq})"


def on_lanes(events: list[dict]) -> list[dict]:
    """A recorded HSDP schedule on the cost model's two lanes, as the report plays it
    (``costmodel.hsdp_lanes``): the replica all-reduces on the inter-node lane, every
    other collective on the shard link (an event's own ``lane`` first: gloo's
    reduce-scatter, played as an all-reduce, stays on the shard link)."""
    from fsdp_overlap_plugin.report.costmodel import hsdp_lanes

    return hsdp_lanes(events, [MESH["replicate"], MESH["shard"]])


def eager_hsdp(after: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """FSDP2's eager HSDP order on a CPU, from the defaults' schedule: ``fsdp2_on_cpu``
    (forward gathers waited before their layer, backward gathers one ahead, each gradient
    reduce-scatter gloo's own and waited at once), each followed by its replica all-reduce
    of the reduced shard, waited at once; the defaults' deferred all-reduces dropped."""
    replica = {ev["name"] for ev in after["backward"] if ev["op"] == "all_reduce"}
    shard_rs = {ev["name"] for ev in after["backward"] if ev["op"] in ("all_to_all", "reduce_scatter")}
    dropped = replica | {ev["name"] for ev in after["backward"] if ev["op"] == "wait" and ev.get("of") in shard_rs}
    backward = [ev for ev in after["backward"] if ev.get("name") not in dropped and ev.get("of") not in replica]
    backward = [dict(ev, lane="link") if ev.get("name") in shard_rs else ev for ev in backward]
    cpu = fsdp2_on_cpu({"forward": after["forward"], "backward": backward})
    out: list[dict] = []
    for ev in cpu["backward"]:
        out.append(ev)
        if ev["op"] == "wait" and ev.get("of") in shard_rs:
            launch = next(e for e in backward if e.get("name") == ev["of"])
            name = f"replica_{ev['of']}"
            out.append(
                {
                    "op": "all_reduce",
                    "name": name,
                    "bucket": launch.get("bucket"),
                    "bytes": launch["bytes"] // MESH["shard"],
                    "of": None,
                }
            )
            out.append({"op": "wait", "name": f"wait_{name}", "of": name, "bucket": launch.get("bucket")})
    return {"forward": cpu["forward"], "backward": out}


def native(events: list[dict]) -> list[dict]:
    """gloo's reduce_scatter_tensor as it runs (a clone plus a full all-reduce), kept on
    the shard link."""
    return gloo_native([dict(ev, lane="link") if ev["op"] == "reduce_scatter" else ev for ev in events])


def play(graphs: dict[str, list[dict]], rates: dict) -> dict:
    """Predicted seconds per graph and in all, each graph played on the two lanes."""
    from fsdp_overlap_plugin.report.costmodel import simulate

    out = {kind: simulate(on_lanes(events), world=MESH["shard"], **rates) for kind, events in graphs.items()}
    return {
        "step_s": sum(sim["total_s"] for sim in out.values()),
        "exposed_comm_s": sum(sim["exposed_comm_s"] for sim in out.values()),
        "compute_s": sum(sim["compute_s"] for sim in out.values()),
    }


def probe_rates(probe: dict, latency: float, send_first: float) -> dict:
    """The lanes' rates in the cost model's units from the probes' seconds: the inverse of
    ``costmodel._link_time`` for a 2-rank all-to-all (shard) and all-reduce (replica)."""
    nbytes = probe["bytes"]
    shard = nbytes * 0.5 / max(probe["shard_all_to_all_s"] - latency, 1e-9)
    inter = nbytes * 1.0 * send_first / max(probe["replica_all_reduce_s"] - latency, 1e-9)
    return {"link": shard, "inter_link": inter}


def predictions(summary_rows: dict, reports: dict, probe: dict | None, rate_bps: float | None) -> dict:
    """Predicted step per sharded mode, with ``measured`` and (capped link only) ``nominal``
    lane rates; ``{}`` where the compute-only rows or the reports are missing."""
    compute = summary_rows.get("compute-only", {}).get("mean_s")
    eager_compute = summary_rows.get("compute-only-eager", {}).get("mean_s")
    if not compute or "defaults" not in reports or not probe:
        return {}
    after = schedule(reports["defaults"], "after")
    flops = sum(e.get("flops", 0) for events in after.values() for e in events if e["op"] == "compute")
    graphs = {"defaults": after, "hsdp-eager": eager_hsdp(after)}
    if "passes-off" in summary_rows:  # no pass ran there, so no schedule: the defaults' before the passes
        graphs["passes-off"] = {k: native(v) for k, v in schedule(reports["defaults"], "before").items()}
    host = dict(HOST)
    measured = probe_rates(probe, host["latency"], host["send_first"])
    links = {"measured": measured}
    if rate_bps:
        links["nominal"] = {"link": measured["link"], "inter_link": rate_bps / 8 * PRESET_LINK_SHARE / 2}
    out: dict = {"flops_per_step": flops, "host": host, "links": links, "modes": {}}
    for mode, graph in graphs.items():
        rate = flops / (eager_compute if mode == "hsdp-eager" and eager_compute else compute)
        measured_s = summary_rows.get(mode, {}).get("mean_s")
        row = {}
        for name, link in links.items():
            pred = play(graph, {"flops": rate, "mem": 1e18, **link, **host})
            row[name] = {**pred, "error": pred["step_s"] / measured_s - 1 if measured_s else None}
        out["modes"][mode] = row
    return out


# ------------------------------------------------------------------------------- summary
def summarize(results: list[dict], rate_bps: float | None) -> dict:
    """Per mode: step time mean / std / median (rank 0's, every rank steps between the same
    barriers), ratio to hsdp-eager, losses and their largest difference from hsdp-eager's,
    peak memory (largest over the ranks); the link probe; the predictions."""
    r0 = results[0]
    rows: dict[str, dict] = {}
    for mode, data in r0["modes"].items():
        times = data["times"]
        mem = [res.get("memory", {}).get(mode) for res in results]
        rows[mode] = {
            "mean_s": statistics.fmean(times),
            "std_s": statistics.stdev(times) if len(times) > 1 else 0.0,
            "median_s": statistics.median(times),
            "steps": len(times),
            "rep_means_s": data.get("rep_means_s"),
            "losses": data["losses"],
            "peak_mib": max(m["peak_bytes"] for m in mem) / 2**20 if all(mem) else None,
            "held_mib": max(m["state_bytes"] for m in mem) / 2**20 if all(mem) else None,
            "step_add_mib": [
                m["rss_hwm_increase_bytes"] / 2**20 if m and m["rss_hwm_increase_bytes"] is not None else None
                for m in mem
            ],
        }
    eager = rows.get("hsdp-eager", {})
    for mode, row in rows.items():
        pairs = list(zip(eager.get("losses") or [], row["losses"] or []))
        row["max_loss_diff_vs_eager"] = (
            max(abs(a - b) for a, b in pairs) if pairs and not mode.startswith("compute-only") else None
        )
        row["x_eager"] = row["mean_s"] / eager["mean_s"] if eager.get("mean_s") else None
        row["x_eager_median"] = row["median_s"] / eager["median_s"] if eager.get("median_s") else None
        row["x_eager_peak_mib"] = (
            row["peak_mib"] / eager["peak_mib"] if row["peak_mib"] and eager.get("peak_mib") else None
        )
    probe = r0.get("probe")
    return {
        "rows": rows,
        "probe": probe,
        "prediction": predictions(rows, r0.get("reports") or {}, probe, rate_bps),
        "deferred_ar_waits": r0.get("deferred_ar_waits"),
        "process_peak_rss_mib": [round(res.get("process_peak_rss_mib", 0)) for res in results],
    }


def print_table(summary: dict) -> None:
    rows = summary["rows"]
    pred = summary["prediction"].get("modes", {})
    print(
        f"{'mode':<19} {'mean s':>7} {'std':>6} {'x eager':>7} {'median':>7} {'x eager':>7} {'peak MiB':>8} {'x eager':>7}"
        f" {'pred s':>7} {'error':>7}  loss first -> last  max |loss - eager|"
    )
    for mode, row in rows.items():
        ratio = f"{row['x_eager']:.2f}" if row["x_eager"] else "-"
        mratio = f"{row['x_eager_median']:.2f}" if row["x_eager_median"] else "-"
        peak = f"{row['peak_mib']:.1f}" if row["peak_mib"] else "-"
        xpeak = f"{row['x_eager_peak_mib']:.2f}" if row["x_eager_peak_mib"] else "-"
        p = pred.get(mode, {}).get("measured")
        pcol = f"{p['step_s']:>7.3f} {p['error'] * 100:>+6.1f}%" if p else f"{'-':>7} {'-':>7}"
        losses = row["losses"]
        loss = f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "-"
        diff = row["max_loss_diff_vs_eager"]
        loss += f"  {diff:.1e}" if diff is not None else ""
        print(
            f"{mode:<19} {row['mean_s']:>7.3f} {row['std_s']:>6.3f} {ratio:>7} {row['median_s']:>7.3f} {mratio:>7}"
            f" {peak:>8} {xpeak:>7} {pcol}  {loss}"
        )
    print("mean / std over every timed step of every repetition (rank 0; all ranks step between the same barriers)")
    print("peak MiB: parameter shards + gradients + buffers held, plus the most resident memory one step added")
    print("(VmHWM - VmRSS at its start, worst of 2 steps), largest over the 4 ranks; compute-only rows: unsharded")
    print("max |loss - eager|: rank 0's loss on its quarter of each batch, the same batches in every mode")
    if summary.get("deferred_ar_waits") is not None:
        print(f"defaults: deferred_ar_waits = {summary['deferred_ar_waits']} (backward graph, rank 0)")
    probe = summary.get("probe")
    if probe:
        print(
            f"link probe ({probe['bytes'] / 2**20:.0f} MiB, both groups of a kind at once): shard all-to-all "
            f"{probe['shard_all_to_all_s'] * 1e3:.1f} ms, replica all-reduce {probe['replica_all_reduce_s'] * 1e3:.1f} ms"
        )
    prediction = summary["prediction"]
    if prediction:
        host = prediction["host"]
        print(
            f"prediction (costmodel.simulate, replica all-reduces on the inter lane): {prediction['flops_per_step']:.3g}"
            f" FLOPs/step over the compute-only steps; host terms latency {host['latency'] * 1e3:.1f} ms,"
            f" contention {host['contention']:.2f}, send-first x{host['send_first']:.1f}"
        )
        for name, link in prediction["links"].items():
            errs = ", ".join(
                f"{mode} {row[name]['step_s']:.3f} s ({row[name]['error'] * 100:+.1f}%)"
                for mode, row in prediction["modes"].items()
                if name in row and row[name]["error"] is not None
            )
            print(
                f"  {name:<8} link {link['link'] * 8 / 1e6:.0f} Mbit/s, inter_link {link['inter_link'] * 8 / 1e6:.0f}"
                f" Mbit/s: {errs}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="300mbit", help="tc tbf rate of the replica link, both ends (300mbit)")
    parser.add_argument(
        "--model-size", default="small", choices=list(SIZES), help="GPT size: step_time.py's, or tiny (a smoke test)"
    )
    parser.add_argument(
        "--backend", default="inductor", help="compile backend of the compiled modes (aot_eager: a faster smoke test)"
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps per mode per repetition")
    parser.add_argument("--reps", type=int, default=3, help="repetitions; modes are interleaved within each")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode (the first compiles)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES))
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory steps")
    parser.add_argument("--no-probe", action="store_true", help="skip the link probe (then no prediction)")
    parser.add_argument("--loopback", action="store_true", help="all ranks on loopback, even as root")
    parser.add_argument("--json", help="write the summary and the ranks' raw results here")
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; valid: {', '.join(MODES)}")
    if args.steps < 1 or args.reps < 1:
        parser.error("--steps and --reps must be at least 1")
    ok, why = Namespaces.available()
    use_netns = ok and not args.loopback
    rate_bps = parse_rate(args.rate)
    where = (
        f"2 namespaces (ranks 0-1 | 2-3), replica link a veth shaped to {args.rate} each way, shard link loopback"
        if use_netns
        else f"LOOPBACK, uncapped ({why or '--loopback'}): the replica link is free, ratios mean little"
    )
    header = (
        f"hsdp_step: 4 ranks, mesh replicate 2 x shard 2, over {where}; "
        f"{describe_model(args.model_size)}, batch {BATCH_PER_RANK}/rank, SGD, {args.backend}; "
        f"{args.reps} x {args.steps} timed steps per mode"
    )
    print(header, flush=True)
    worker_args = ["--model-size", args.model_size, "--steps", str(args.steps), "--reps", str(args.reps)]
    worker_args += ["--backend", args.backend]
    worker_args += ["--warmup", str(args.warmup), "--modes", ",".join(modes)]
    worker_args += ["--no-memory"] * args.no_memory + ["--no-probe"] * args.no_probe
    out_dir = Path(tempfile.mkdtemp(prefix="fsdp_overlap_hsdp_"))
    for sig in (signal.SIGTERM, signal.SIGHUP):  # unwind like Ctrl-C: the namespaces go
        signal.signal(sig, lambda *_: sys.exit(130))
    start = time.time()
    if use_netns:
        with Namespaces(args.rate):
            results = run_workers(worker_args, out_dir, args.timeout, True)
    else:
        results = run_workers(worker_args, out_dir, args.timeout, False)
    summary = summarize(results, rate_bps if use_netns else None)
    print(f"\nresults ({time.time() - start:.0f} s in all):")
    print_table(summary)
    if args.json:
        payload = {
            "header": header,
            "command": " ".join(sys.argv),
            "rate": args.rate,
            "loopback": not use_netns,
            "summary": summary,
            "raw": results,
        }
        Path(args.json).write_text(json.dumps(payload, indent=1))
        print(f"json written to {args.json}")
    return 0


# =============================================================================== worker
def build_model(size: str):
    """The repo GPT of ``SIZES[size]``, seeded: identical on every rank and in every mode."""
    return build_gpt(*SIZES[size], seed=0)


def make_runner(mode: str, size: str, world: int, backend: str = "inductor") -> ModelRunner:
    import fsdp_overlap_plugin as fo

    model = build_model(size)
    loss = loss_for("gpt", model)
    if mode == "compute-only-eager":
        return ModelRunner(model, world=1, loss=loss)
    if mode == "compute-only":
        model.compile(backend=backend, fullgraph=True)
        return ModelRunner(model, world=1, loss=loss)
    config = {
        "hsdp-eager": {"compile": False},
        "passes-off": {"manual_bucketing": False, "overlap_grad_reduce": False, "reduce_scatter_impl": "native"},
        "defaults": {},
    }[mode]
    fo.parallelize(model, {**config, "mesh": dict(MESH), "backend": backend})
    return ModelRunner(model, world, loss=loss)


def probe_links(groups: tuple[list[list[int]], list[list[int]]], rank: int) -> dict:
    """Seconds of one shard-group all-to-all and one replica-group all-reduce of
    ``PROBE_BYTES``, no compute, every group of a kind at once (median of a few)."""
    import torch
    import torch.distributed as dist

    shard_groups, replica_groups = groups
    shard, _ = dist.new_subgroups_by_enumeration(shard_groups, backend="gloo")
    replica, _ = dist.new_subgroups_by_enumeration(replica_groups, backend="gloo")
    numel = PROBE_BYTES // 4
    src, dst = torch.randn(numel), torch.empty(numel)
    out = {"bytes": PROBE_BYTES}
    for key, run in (
        ("shard_all_to_all_s", lambda: dist.all_to_all_single(dst, src, group=shard)),
        ("replica_all_reduce_s", lambda: dist.all_reduce(dst, group=replica)),
    ):
        run()  # connect
        times = []
        for _ in range(PROBE_REPS):
            dist.barrier()
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        out[key] = statistics.median(times)
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8)
    modes = args.modes.split(",")
    vocab, seq = SIZES[args.model_size][3:]
    extra = 0 if args.no_memory else 3 * len(SHARDED)
    data = _data(vocab, seq, world, args.warmup + args.reps * args.steps + extra + 1)
    results = {m: {"times": [], "losses": [], "rep_means_s": []} for m in modes}
    out: dict = {"rank": rank, "modes": results}

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    runners, index = timed_steps(
        modes,
        lambda mode, _: make_runner(mode, args.model_size, world, args.backend),
        data,
        results,
        reps=args.reps,
        steps=args.steps,
        warmup=args.warmup,
        barrier=dist.barrier,
        log=log,
        on_rep=lambda mode, times: results[mode]["rep_means_s"].append(statistics.fmean(times)),
    )
    if rank == 0:
        import fsdp_overlap_plugin as fo

        out["reports"] = {m: fo.schedule_report(runners[m].model) for m in ("defaults",) if m in runners}
        if "defaults" in out["reports"]:
            backward = out["reports"]["defaults"].get("backward") or {}
            out["deferred_ar_waits"] = ((backward.get("passes") or {}).get("manual_bucketing") or {}).get(
                "deferred_ar_waits"
            )
    if not args.no_probe:
        out["probe"] = probe_links(mesh_groups(), rank)
        log(f"link probe: {out['probe']}")
    if not args.no_memory:
        out["memory"] = {}
        for mode in [m for m in modes if m in SHARDED]:
            batches = data[index[mode] : index[mode] + 3]
            out["memory"][mode] = measure_step_memory(runners[mode], batches, dist.barrier)
            log(f"[{mode}] peak {out['memory'][mode]['peak_bytes'] / 2**20:.1f} MiB (rank 0)")
    import resource

    out["process_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(args.out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
