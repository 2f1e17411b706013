"""Step time over a bandwidth-capped link: how much communication the passes hide.

Two ranks (one thread each) in two network namespaces joined by a veth pair whose both
ends are shaped with ``tc ... tbf rate <rate>``; gloo talks over that link
(``GLOO_SOCKET_IFNAME``). A GPT-style model trains with SGD on fixed data in every mode,
each mode warmed up, then timed, interleaved with the others over repetitions so that
drift hits all modes alike:

    fsdp2-eager        fully_shard per block: what users run today
    compiled           our sharding, compiled with inductor, no passes
    bucketing          + manual bucketing
    grad-overlap       + gradient reduce-scatter overlap only
    both               + both passes
    both+gather-group  + parameter all-gathers on their own gloo group
    both+all-to-all    + gradient reduce-scatters as all-to-all plus a local sum
                       (reduce_scatter_impl: all_to_all; half the bytes on gloo)
    torch-auto         torch's own overlap scheduler (aten_distributed_optimizations),
                       made to run on CPU (roofline estimates from measured CPU rates,
                       collectives costed at the link rate)
    compute-only       the same model and per-rank batch, unsharded, compiled: no comm
    comm-only          the collectives of one `both` step (forward and backward graphs,
                       launches and waits in graph order) replayed with no compute
    comm-only+all-to-all  the same for `both+all-to-all`

Lower bounds: transport = max(compute-only, comm-only) (for the all-to-all rows,
comm-only+all-to-all); ideal = max(compute-only, ideal bytes / link rate), where ideal
bytes are what a ring all-gather and a reduce-scatter must send per rank. gloo's
reduce_scatter_tensor is a clone plus a full all-reduce (about twice the ideal bytes),
which is why the two bounds differ.

    sudo python benchmarks/step_time.py                  # 300 Mbit, default model, all modes
    python benchmarks/step_time.py --quick               # < 3 minutes, fewer modes and steps
    python benchmarks/step_time.py --rate 1gbit --model-size medium --steps 20 --json out.json

Without root (or without iproute2) it runs both ranks on loopback, uncapped, and says so.
The namespaces are removed on exit, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ALL_MODES = [
    "fsdp2-eager",
    "compiled",
    "bucketing",
    "grad-overlap",
    "both",
    "both+gather-group",
    "both+all-to-all",
    "torch-auto",
    "compute-only",
    "comm-only",
    "comm-only+all-to-all",
]
QUICK_MODES = ["fsdp2-eager", "compiled", "both", "compute-only", "comm-only"]
REPLAYS = {"comm-only": "both", "comm-only+all-to-all": "both+all-to-all"}
MODEL_SIZES = {
    # name: (d_model, n_layer, n_head, vocab, seq); ~parameters in the comment
    "small": (256, 4, 8, 512, 128),  # 3.4M
    "medium": (256, 8, 8, 512, 128),  # 6.6M
    "large": (384, 8, 8, 1024, 128),  # 15M
}
BATCH_PER_RANK = 8
LR = 0.05
NETNS = ("fobench0", "fobench1")
VETH = ("fobv0", "fobv1")
ADDRS = ("10.77.1.1", "10.77.1.2")


# =============================================================================== parent
def parse_rate(text: str) -> float:
    """'300mbit' -> bits per second."""
    text = text.strip().lower()
    for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


class Namespaces:
    """Two network namespaces joined by a shaped veth pair; removed on every exit path."""

    def __init__(self, rate: str):
        self.rate = rate
        self.created = False

    @staticmethod
    def available() -> tuple[bool, str]:
        if os.geteuid() != 0:
            return False, "not root"
        if not shutil.which("ip") or not shutil.which("tc"):
            return False, "iproute2 (ip, tc) not installed"
        return True, ""

    def _run(self, *cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, text=True)

    def __enter__(self) -> Namespaces:
        self.remove()  # leftovers of an interrupted earlier run
        atexit.register(self.remove)
        self.created = True
        for ns in NETNS:
            self._run("ip", "netns", "add", ns)
        self._run("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
        for ns, dev, addr in zip(NETNS, VETH, ADDRS):
            self._run("ip", "link", "set", dev, "netns", ns)
            self._run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            self._run("ip", "-n", ns, "link", "set", dev, "up")
            self._run("ip", "-n", ns, "link", "set", "lo", "up")
            self._run(
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                self.rate,
                "burst",
                "64kb",
                "latency",
                "200ms",
            )
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        for ns in NETNS:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # also deletes its veth end


def launch(args: argparse.Namespace, out_dir: Path, use_netns: bool) -> list[dict]:
    port = "29631"
    procs = []
    for rank in range(2):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR=ADDRS[0] if use_netns else "127.0.0.1",
            MASTER_PORT=port,
            GLOO_SOCKET_IFNAME=VETH[rank] if use_netns else "lo",
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
        )
        cmd = [sys.executable, __file__, "--worker", "--out-dir", str(out_dir), *args.worker_args]
        if use_netns:
            cmd = ["ip", "netns", "exec", NETNS[rank], *cmd]
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.time() + args.timeout
    failed = None
    try:
        while any(p.poll() is None for p, _ in procs):
            if time.time() > deadline:
                failed = f"timed out after {args.timeout} s"
                break
            if any(p.poll() not in (None, 0) for p, _ in procs):
                failed = "a rank failed"
                break
            time.sleep(0.5)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
            log.close()
    if failed or any(p.returncode != 0 for p, _ in procs):
        tails = "\n".join(f"--- rank {r} ---\n" + (out_dir / f"rank{r}.log").read_text()[-3000:] for r in range(2))
        raise SystemExit(f"benchmark {failed or 'failed'}:\n{tails}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


def summarize(results: list[dict], rate_bps: float | None) -> dict:
    r0 = results[0]
    modes = r0["modes"]
    rows = {}
    for mode, data in modes.items():
        times = data["times"]
        rows[mode] = {
            "median_s": statistics.median(times),
            "min_s": min(times),
            "max_s": max(times),
            "steps": len(times),
            "peak_rss_mib": [res["modes"][mode]["peak_rss_mib"] for res in results],  # per-step increase
            "losses": data.get("losses"),
        }
    eager = rows.get("fsdp2-eager", {}).get("median_s")
    compute = rows.get("compute-only", {}).get("median_s")
    comm = rows.get("comm-only", {}).get("median_s")
    comm_a2a = rows.get("comm-only+all-to-all", {}).get("median_s")
    transport = max(compute, comm) if compute and comm else None
    transport_a2a = max(compute, comm_a2a) if compute and comm_a2a else None
    ideal_bytes = r0.get("ideal_bytes")
    ideal = max(compute, ideal_bytes * 8 / rate_bps) if compute and ideal_bytes and rate_bps else None
    for mode, row in rows.items():
        bound = transport_a2a if "all-to-all" in mode else transport
        row["x_eager"] = row["median_s"] / eager if eager else None
        row["x_transport"] = row["median_s"] / bound if bound else None
        row["x_ideal"] = row["median_s"] / ideal if ideal else None
    return {
        "rows": rows,
        "process_peak_rss_mib": [round(res.get("process_peak_rss_mib", 0)) for res in results],
        "transport_bound_s": transport,
        "transport_bound_all_to_all_s": transport_a2a,
        "ideal_bound_s": ideal,
        "ideal_bytes": ideal_bytes,
        "link": r0.get("link"),
    }


def print_table(summary: dict, header: str) -> None:
    print(header)
    cols = f"{'mode':<20} {'median s':>9} {'min s':>7} {'max s':>7} {'x eager':>8} {'x transp.':>9} {'x ideal':>8}"
    print(cols + f" {'step RSS +MiB r0/r1':>20}  loss first -> last")
    for mode, row in summary["rows"].items():

        def ratio(key: str, row: dict = row) -> str:
            return f"{row[key]:.2f}" if row[key] else "-"

        losses = row["losses"]
        loss = f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "-"
        rss = "/".join(f"{x:.0f}" for x in row["peak_rss_mib"])
        print(
            f"{mode:<20} {row['median_s']:>9.3f} {row['min_s']:>7.3f} {row['max_s']:>7.3f} {ratio('x_eager'):>8} "
            f"{ratio('x_transport'):>9} {ratio('x_ideal'):>8} {rss:>20}  {loss}"
        )
    t, i = summary["transport_bound_s"], summary["ideal_bound_s"]
    print("step RSS +MiB: the largest increase of resident memory during one step (gathered parameters,")
    print(f"activations, buffers) over the RSS at its start; process peak RSS r0/r1: {summary['process_peak_rss_mib']}")
    print(f"transport bound max(compute-only, comm-only) = {t:.3f} s" if t else "transport bound: n/a")
    if summary.get("transport_bound_all_to_all_s"):
        print(f"transport bound with all-to-all reduce-scatters = {summary['transport_bound_all_to_all_s']:.3f} s")
    if i:
        mb = summary["ideal_bytes"] / 2**20
        print(f"ideal bound max(compute-only, {mb:.1f} MiB sent per rank / link rate) = {i:.3f} s")
    else:
        print("ideal bound: n/a (uncapped link)")
    link = summary.get("link")
    if link:
        print("link activity during one `both` step (rank 0, busy = sending or receiving):")
        for phase in link["phases"]:
            print(
                f"  {phase['name']:<28} {phase['duration_s']:.3f} s, link busy {phase['busy_fraction'] * 100:5.1f}%"
                f", idle {phase['idle_s']:.3f} s"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="300mbit", help="tc tbf rate on both veth ends (default 300mbit)")
    parser.add_argument("--model-size", default="small", choices=sorted(MODEL_SIZES))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode per repetition (>= 10)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions; modes are interleaved within each")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode (the first compiles)")
    parser.add_argument(
        "--modes", default=",".join(ALL_MODES), help="comma-separated subset of: " + ", ".join(ALL_MODES)
    )
    parser.add_argument("--quick", action="store_true", help="fewer modes, 1 repetition, 10 steps (< 3 minutes)")
    parser.add_argument("--loopback", action="store_true", help="skip the namespaces even as root")
    parser.add_argument("--json", help="write the summary and raw step times here")
    parser.add_argument("--timeline-png", help="draw rank 0's link activity during one `both` step")
    parser.add_argument("--report-json", help="write the `both` model's schedule report (for `fsdp-overlap timeline`)")
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    modes = QUICK_MODES if args.quick else [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; valid: {', '.join(ALL_MODES)}")
    for replay, source in REPLAYS.items():
        if replay in modes and (source not in modes or modes.index(source) > modes.index(replay)):
            parser.error(f"{replay} replays the collectives of a `{source}` step: list `{source}` before it")
    if args.quick:
        args.reps, args.steps = 1, 10
    if args.steps < 10 and not args.quick:
        parser.error("--steps must be at least 10")
    rate_bps = parse_rate(args.rate)
    args.worker_args = [
        "--model-size",
        args.model_size,
        "--steps",
        str(args.steps),
        "--reps",
        str(args.reps),
        "--warmup",
        str(args.warmup),
        "--modes",
        ",".join(modes),
        "--rate",
        args.rate,
    ]
    ok, why = Namespaces.available()
    use_netns = ok and not args.loopback
    where = (
        f"two network namespaces, veth shaped to {args.rate} each way"
        if use_netns
        else f"LOOPBACK, uncapped ({why or '--loopback'}): communication is nearly free, ratios mean little"
    )
    d, layers, _, vocab, seq = MODEL_SIZES[args.model_size]
    header = (
        f"step_time: 2 ranks over {where}; model {args.model_size} (d={d}, {layers} blocks, vocab {vocab}, "
        f"seq {seq}, batch {BATCH_PER_RANK}/rank), SGD; {args.reps} x {args.steps} timed steps per mode"
    )
    print(header, flush=True)
    out_dir = Path(tempfile.mkdtemp(prefix="fsdp_overlap_bench_"))
    # SIGTERM/SIGHUP unwind like Ctrl-C, so the namespaces are removed on the way out
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(130))
    start = time.time()
    if use_netns:
        with Namespaces(args.rate):
            results = launch(args, out_dir, True)
    else:
        results = launch(args, out_dir, False)
    summary = summarize(results, rate_bps if use_netns else None)
    print()
    print_table(summary, f"results ({time.time() - start:.0f} s in all; ratios of medians):")
    if args.timeline_png and summary.get("link"):
        draw_link_timeline(summary["link"], args.timeline_png)
        print(f"link timeline written to {args.timeline_png}")
    if args.report_json and results[0].get("both_report"):
        Path(args.report_json).write_text(json.dumps(results[0]["both_report"]))
        print(f"`both` schedule report written to {args.report_json}")
    if args.json:
        payload = {"header": header, "summary": summary, "raw": results, "loopback": not use_netns, "rate": args.rate}
        Path(args.json).write_text(json.dumps(payload, indent=1))
        print(f"json written to {args.json}")


def draw_link_timeline(link: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = link["samples"]
    t = [s[0] for s in samples]
    fig, ax = plt.subplots(figsize=(11, 3.2))
    ax.plot(t, [s[1] / 1e6 for s in samples], label="sent Mbit/s", lw=1)
    ax.plot(t, [s[2] / 1e6 for s in samples], label="received Mbit/s", lw=1)
    for phase in link["phases"]:
        ax.axvspan(phase["start_s"], phase["start_s"] + phase["duration_s"], alpha=0.08)
        ax.text(phase["start_s"], ax.get_ylim()[1] * 0.92, phase["name"], fontsize=7)
    ax.set_xlabel("seconds into the step")
    ax.set_ylabel("Mbit/s")
    ax.set_title("rank 0 link activity during one `both` step")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# =============================================================================== worker
def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class LinkSampler:
    """Samples the interface's byte counters every few milliseconds in a thread."""

    def __init__(self, ifname: str, period: float = 0.002):
        base = Path("/sys/class/net") / ifname / "statistics"
        self.tx, self.rx = base / "tx_bytes", base / "rx_bytes"
        self.period = period
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()

    def _read(self) -> tuple[int, int]:
        return int(self.tx.read_text()), int(self.rx.read_text())

    def __enter__(self) -> LinkSampler:
        self.t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            tx, rx = self._read()
            self.samples.append((time.perf_counter() - self.t0, tx, rx))
            time.sleep(self.period)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def link_phases(samples, marks: list[tuple[str, float]], rate_bps: float) -> dict:
    """Per phase: duration, fraction of time the link moved data, idle seconds."""
    rates = []
    for (t0, tx0, rx0), (t1, tx1, rx1) in zip(samples, samples[1:]):
        dt = max(t1 - t0, 1e-6)
        rates.append((t0, t1, (tx1 - tx0) * 8 / dt, (rx1 - rx0) * 8 / dt))
    threshold = 0.1 * rate_bps
    phases = []
    for (name, start), (_, end) in zip(marks, marks[1:]):
        busy = sum(
            max(0.0, min(t1, end) - max(t0, start)) for t0, t1, tx, rx in rates if tx > threshold or rx > threshold
        )
        phases.append(
            {
                "name": name,
                "start_s": start,
                "duration_s": end - start,
                "busy_fraction": busy / max(end - start, 1e-9),
                "idle_s": max(0.0, end - start - busy),
            }
        )
    series = [((t0 + t1) / 2, tx, rx) for t0, t1, tx, rx in rates]
    return {"phases": phases, "samples": series}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    modes = args.modes.split(",")
    d, layers, heads, vocab, seq = MODEL_SIZES[args.model_size]
    rate_bps = parse_rate(args.rate)
    data = _data(vocab, seq, world, args.warmup + args.reps * args.steps + 1)
    runners: dict[str, object] = {}
    results: dict[str, dict] = {m: {"times": [], "losses": [], "peak_rss_mib": 0.0} for m in modes}
    step_index = dict.fromkeys(modes, 0)
    out: dict = {"rank": rank, "modes": results}

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    for rep in range(args.reps):
        for mode in modes:
            if mode not in runners:
                t = time.perf_counter()
                runners[mode] = make_runner(mode, (d, layers, heads, vocab, seq), runners, rate_bps, world)
                for _ in range(args.warmup):
                    runners[mode].step(data[step_index[mode]])
                    step_index[mode] += 1
                log(f"[{mode}] ready after {time.perf_counter() - t:.1f} s (compile + {args.warmup} warm-up steps)")
            runner = runners[mode]
            for _ in range(args.steps):
                dist.barrier()
                t = time.perf_counter()
                loss = runner.step(data[step_index[mode]])
                dist.barrier()
                results[mode]["times"].append(time.perf_counter() - t)
                results[mode]["peak_rss_mib"] = max(results[mode]["peak_rss_mib"], runner.peak_rss)
                if loss is not None:
                    results[mode]["losses"].append(loss)
                step_index[mode] += 1
            med = statistics.median(results[mode]["times"][-args.steps :])
            log(f"rep {rep + 1}/{args.reps} {mode:<18} median {med:.3f} s/step")
    if "both" in runners:
        import fsdp_overlap_plugin as fo

        out["ideal_bytes"] = runners["both"].ideal_bytes(world)
        out["both_report"] = fo.schedule_report(runners["both"].model) if rank == 0 else None
        ifname = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
        if Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").exists():
            dist.barrier()
            with LinkSampler(ifname) as sampler:
                marks = runners["both"].traced_step(data[step_index["both"]], sampler.t0)
            if rank == 0:
                out["link"] = link_phases(sampler.samples, marks, rate_bps)
    out["process_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(args.out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def _data(vocab: int, seq: int, world: int, steps: int):
    from fsdp_overlap_plugin.models import fixed_batches

    return fixed_batches(steps, BATCH_PER_RANK * world, seq, vocab, seed=7)


class ModelRunner:
    """One mode's model, optimizer and step."""

    def __init__(self, model, world: int, patch: dict | None = None):
        import torch

        self.model = model
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

        from fsdp_overlap_plugin.models import loss_fn

        ctx = torch._inductor.config.patch(self.patch) if self.patch and not self.compiled else _nullcontext()
        x, y = (self._slice(t) for t in batch)
        base = rss_mib()
        with ctx:
            if marks is not None:
                marks.append(("forward", time.perf_counter() - t0))
            loss = loss_fn(self.model(x), y)
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
    """The collectives of one `both` step, launched and waited in graph order, no compute."""

    def __init__(self, both: ModelRunner, world: int):
        import torch

        import fsdp_overlap_plugin as fo

        report = fo.schedule_report(both.model)
        self.plan: list[tuple] = []
        for kind in ("forward", "backward"):
            for event in report[kind]["schedule"]["after"]:
                if event["op"] in ("all_gather", "reduce_scatter", "all_to_all"):
                    numel = event["bytes"] // 4
                    if event["op"] == "all_gather":
                        bufs = (torch.randn(numel // world), torch.empty(numel))
                    elif event["op"] == "reduce_scatter":
                        bufs = (torch.randn(numel), torch.empty(numel // world))
                    else:
                        bufs = (torch.randn(numel), torch.empty(numel))
                    self.plan.append(("launch", event["op"], event["name"], bufs))
                elif event["op"] == "wait" and event["of"]:
                    self.plan.append(("wait", None, event["of"], None))
        self.peak_rss = 0.0

    def step(self, batch) -> None:
        import torch.distributed as dist

        base = rss_mib()
        works = {}
        for action, op, name, bufs in self.plan:
            if action == "launch":
                src, dst = bufs
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
    import torch.utils._runtime_estimation as runtime_estimation

    from fsdp_overlap_plugin.passes.graph import is_collective

    flops, bw = _cpu_rates()
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


def make_runner(mode: str, shape: tuple, runners: dict, rate_bps: float, world: int):
    import torch

    import fsdp_overlap_plugin as fo
    from fsdp_overlap_plugin.models import GPT, GPTConfig

    if mode in REPLAYS:
        return CommReplay(runners[REPLAYS[mode]], world)
    d, layers, heads, vocab, seq = shape
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, d_model=d))
    if mode == "compute-only":
        model.compile(backend="inductor", fullgraph=True)
        return ModelRunner(model, world=1)
    passes = {"manual_bucketing": False, "overlap_grad_reduce": False}
    config = {
        "fsdp2-eager": {"compile": False},
        "compiled": passes,
        "bucketing": {"manual_bucketing": True, "overlap_grad_reduce": False},
        "grad-overlap": {"manual_bucketing": False, "overlap_grad_reduce": True},
        "both": {},
        "both+gather-group": {"separate_gather_group": True},
        "both+all-to-all": {"reduce_scatter_impl": "all_to_all"},
        "torch-auto": passes,
    }[mode]
    fo.parallelize(model, config)
    patch = torch_auto_patch(rate_bps) if mode == "torch-auto" else None
    return ModelRunner(model, world, patch)


if __name__ == "__main__":
    main()
