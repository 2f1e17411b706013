"""Step time over a bandwidth-capped link: how much communication the passes hide.

Two ranks (one thread each) in two network namespaces joined by a veth pair whose both
ends are shaped with ``tc ... tbf rate <rate>``; gloo talks over that link
(``GLOO_SOCKET_IFNAME``). A model trains with SGD on fixed data in every mode, each mode
warmed up, then timed, interleaved with the others over repetitions so that drift hits
all modes alike. Every sharded mode uses the same bucket plan: ``--plan auto`` (default;
one bucket per block, the modules before and after the blocks in buckets of about a
block's size) or ``--plan blocks`` (one bucket per block; embeddings, final norm and head
left to the root).

    fsdp2-eager        fully_shard per plan bucket (per block / decoder layer) + root, via
                       parallelize(compile: false): what users run today
    compiled           our sharding, compiled with inductor, no passes
    bucketing          + manual bucketing
    grad-overlap       + gradient reduce-scatter overlap only
    both               + both passes: the defaults (on 2 gloo ranks reduce_scatter_impl: auto
                       runs gradient reduce-scatters as all-to-all plus a local sum, half
                       the bytes of gloo's own, each all-to-all posting its receives before
                       its sends: receive_first)
    both+native        the same with reduce_scatter_impl: native (gloo's reduce-scatter)
    both+all-to-all    the same with reduce_scatter_impl: all_to_all (the all-to-alls on
                       gloo's own group, which sends before it receives; the default
                       before receive_first; only with --modes)
    both+prefetch-2    the defaults with prefetch_depth: 2
    both+gather-group  + parameter all-gathers on their own gloo group (only with --modes)
    both+fsdp2-order   the defaults with a memory budget too large to limit any prefetch
                       (max_prefetch_bytes: 1024GiB), which selects FSDP2's memory order:
                       each prefetch after the previous bucket's copy-out, each gradient
                       reduce-scatter waited before the next one's copy-in (only with
                       --modes)
    torch-auto         torch's own overlap scheduler (aten_distributed_optimizations),
                       made to run on CPU (roofline estimates from measured CPU rates,
                       collectives costed at the link rate)
    compute-only       the same model and per-rank batch, unsharded, compiled: no comm
    compute-only-eager the same, not compiled: the eager modes' compute (only with --modes)
    comm-only          the collectives of one `both` step (forward and backward graphs,
                       launches and waits in graph order) replayed with no compute, each
                       as `both` runs it (its all-to-alls receive-first)
    comm-only+all-to-all
                       the same for `both+all-to-all` (gloo's all-to-alls; only with
                       --modes, after both+all-to-all)
    comm-only+native   the same for `both+native`
    comm-only+recv-first
                       the same collectives' bytes as point-to-point exchanges, each rank
                       posting all its receives before its sends (gloo's all_gather and
                       all_to_all send first; only with --modes, after both)
    comm+compute       the comm-only replay in a second thread while the compute-only step
                       runs in the main thread: the same link, CPUs, collectives and compute
                       as a perfectly overlapped `both` step, with no dependency between
                       them (only with --modes, after comm-only and compute-only)

Models (``--model``, sized by ``--model-size``, default ``small``):

    gpt        the repo's GPT (MODEL_SIZES; small: d=256, 4 blocks, vocab 512, seq 128,
               3.4M parameters); the default
    hf-llama   a transformers ``LlamaForCausalLM`` built from a ``LlamaConfig``, nothing
               downloaded (HF_LLAMA_SIZES): sdpa attention, which compiles in one graph with
               the plugin, untied head, no KV cache, its own causal-LM loss (labels = inputs).
               small: hidden 256, 4 decoder layers, 8 heads / 4 kv heads, MLP 768, vocab
               512, seq 128, 3.4M parameters: chosen to compute what the GPT small does.
               Compiled, unsharded, one thread, batch 8 x 128 (compute-only), measured
               interleaved with the GPT small on the 2-vCPU development machine: 1.00 x the
               GPT's step (0.35 s each there while the machine was shared; an MLP of 688
               gave 0.94 x, 5 layers 1.10 x). Sizes medium (8 layers) and large (hidden
               384, MLP 1024, vocab 1024, 8 layers) mirror the GPT's.

Losses agree across modes (the table's last column: the largest difference from
fsdp2-eager over the timed steps, which see the same batches in every mode).

Variable sequence lengths (``--lengths 64,96,128``): step k of every mode, warm-up steps
included, trains on a batch of length ``lengths[k % len(lengths)]`` (the fixed batches cut
to that length), so every mode sees the same sequence of lengths and the same batches.
With at least 2 warm-up steps on 2 different lengths, each compiled mode's dynamic graph
(``dynamic: auto``: a static graph for the first length, one with a symbolic length at the
second) is compiled before timing. The table is followed by each compiled mode's Dynamo
graphs (after warm-up, and after the timed steps: equal when no timed step recompiled).
Dynamo remembers per code object which sizes changed, so a compiled mode that runs the
same forward code as an earlier one (the same model class) may compile its dynamic
graph at its first length: 1 graph. Not with ``--memory``.

Lower bounds: transport = max(compute-only, comm-only) for the rows that reduce-scatter
as receive-first all-to-all (both, both+prefetch-2, both+gather-group, both+fsdp2-order),
max(compute-only, comm-only+all-to-all) for both+all-to-all, max(compute-only,
comm-only+native) for the others; ideal = max(compute-only, ideal bytes / link rate), where ideal
bytes are what a ring all-gather and a reduce-scatter must send per rank. gloo's
reduce_scatter_tensor is a clone plus a full all-reduce (about twice the ideal bytes),
which is why the two bounds differ. With comm+compute listed, the overlap bound is its
median: what the link and the CPUs allow when no collective waits for compute (the rows
that reduce-scatter as all-to-all are printed against it too).

``--recv-first`` (an experiment, not a plugin feature): in the worker processes only, the
CPU kernels of torch's functional ``all_gather_into_tensor_out`` and ``all_to_all_single``
(what the compiled modes' graphs call) are replaced by that receive-first exchange, so the
same schedule runs with receives posted first. gloo posts a collective's send before its
receive (``gloo/allgather.cc``, ``gloo/alltoall.cc``) and a receive's ready-notice travels
behind this rank's own bytes on the same connection: the peer cannot send until they
have drained. fsdp2-eager and the comm-only replay call gloo's collectives directly and
keep them; the sharded modes' own bound is then comm-only+recv-first.

Where a step loses time against its bounds (``--trace-dir DIR``): after the timed steps each
rank runs one more `both` step (or ``--trace-mode``'s: a mode whose bound is comm-only, such
as both+prefetch-2) under torch.profiler and writes ``DIR/trace<rank>.json``
(chrome trace); the script prints every collective's launch on each rank and the skew
between them, each rank's time blocked in waits, and the CPU time of the step's threads
(the main thread, gloo's TCP loop and its worker threads). The link lines also give the
share of each phase in which both directions moved data, for the `both` step and for the
comm-only replay. With comm-only in the run, ``schedule_sim.py`` then replays the traced
step's schedule (each rank's compute between collective calls, as traced) over a
modelled link (one collective at a time at the replay's rate), once with the ranks in
step and once with each rank's own compute, and prints both and the traced step against
the bound max(traced compute, replay), then the in-step model with its compute scaled to
the compute-only step and to the main threads' CPU time (see schedule_sim.py).

    sudo python benchmarks/step_time.py                  # 300 Mbit, default model, all modes
    python benchmarks/step_time.py --quick               # < 3 minutes, fewer modes and steps
    python benchmarks/step_time.py --rate 1gbit --model-size medium --steps 20 --json out.json
    sudo python benchmarks/step_time.py --model hf-llama # the transformers Llama, all modes
    python benchmarks/step_time.py --model hf-llama --quick --loopback
    sudo python benchmarks/step_time.py --modes fsdp2-eager,both --lengths 64,96,128,80,112

Peak memory per mode (``--memory``): for each mode, a fresh 2-rank run of that mode alone,
over the same shaped link as the time table (loopback with ``--loopback`` or without root):
how long a prefetched all-gather or a deferred reduce-scatter is in flight decides which of
their buffers are alive at a step's worst moment. No other mode's model, compiled code or
allocator state is in the process. After the warm-up steps it measures, per rank:

    peak MiB   = held + step +MiB: the most bytes of parameters + gradients + activations
                 (+ gathered parameters and communication buffers) alive at once in a step
    held       parameter shards, gradients and buffers the model holds when a step starts
                 (each storage once, as allocated: padded shards); 0 gradients, since every
                 step ends with zero_grad(set_to_none=True)
    step +MiB  what the step added to resident memory at its worst moment: VmHWM (reset via
                 /proc/self/clear_refs after malloc_trim) minus VmRSS at the step's start,
                 the larger of two unprofiled steps. The workers run with glibc's
                 MALLOC_MMAP_THRESHOLD_=65536: every tensor of 64 KiB or more is its own
                 mapping, unmapped when freed, so RSS follows the live bytes of every thread
                 (gloo's staging buffers, allocated on its worker threads, included)
    profiler   cross-check on a third step: the peak of torch.profiler(profile_memory=True)'s
                 allocation events summed in time order. It is not the measure: it only sees
                 threads that carry the profiler's state, so a tensor freed on a backend's
                 worker thread stays in its sum (the step then "ends" MiBs above zero) and a
                 staging buffer is counted or not depending on how the collective was issued

The table gives the largest peak over the ranks and its ratio to fsdp2-eager's. The
comm-only modes are skipped (they replay collectives on preallocated buffers).

    python benchmarks/step_time.py --memory                        # every mode, GPT small
    python benchmarks/step_time.py --memory --model hf-llama --json mem.json
    python benchmarks/step_time.py --memory --quick                # fsdp2-eager, both, both+prefetch-2, compute-only
    python benchmarks/step_time.py --memory --modes fsdp2-eager,both

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

import schedule_sim

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
MODEL_SIZES = {
    # name: (d_model, n_layer, n_head, vocab, seq); ~parameters in the comment
    "small": (256, 4, 8, 512, 128),  # 3.4M
    "medium": (256, 8, 8, 512, 128),  # 6.6M
    "large": (384, 8, 8, 1024, 128),  # 15M
}
MODELS = ("gpt", "hf-llama")
HF_LLAMA_SIZES = {
    # name: (hidden, layers, heads, kv_heads, intermediate, vocab, seq); ~parameters in the comment
    # small: the GPT small's compute (one thread: 1.00 x its compiled step, measured interleaved)
    "small": (256, 4, 8, 4, 768, 512, 128),  # 3.4M
    "medium": (256, 8, 8, 4, 768, 512, 128),  # 6.6M
    "large": (384, 8, 8, 4, 1024, 1024, 128),  # 13.8M
}
BLOCKS = {"gpt": "blocks", "hf-llama": "model.layers"}  # container of the repeated blocks
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


def parse_mode_configs(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, dict]:
    """``--mode-config NAME=YAML``: mode name -> the plugin config keys in YAML (checked
    by OverlapConfig before anything starts)."""
    from fsdp_overlap_plugin.config import OverlapConfig, read_yaml

    out: dict[str, dict] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            parser.error(f"--mode-config {item!r}: expected NAME=path/to/config.yaml")
        if name in ALL_MODES + EXTRA_MODES:
            parser.error(f"--mode-config {item!r}: {name} is a built-in mode; pick another name")
        try:
            keys = read_yaml(path) or {}
            OverlapConfig.from_dict(keys, source=path)
        except (OSError, ValueError) as exc:
            parser.error(f"--mode-config {item!r}: {exc}")
        out[name] = keys
    return out


def time_stats(times: list[float]) -> dict:
    """Median, fastest and slowest step time, and how many steps."""
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "steps": len(times)}


def parse_lengths(text: str) -> list[int]:
    """'64,96,128' -> [64, 96, 128]."""
    return [int(x) for x in text.split(",") if x.strip()]


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


def _free_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def launch_on_link(args: argparse.Namespace, out_dir: Path, use_netns: bool) -> list[dict]:
    """``launch`` over the shaped veth (the namespaces made before and removed after, also
    on failure) or, without namespaces, over loopback."""
    if not use_netns:
        return launch(args, out_dir, False)
    with Namespaces(args.rate):
        return launch(args, out_dir, True)


def launch(args: argparse.Namespace, out_dir: Path, use_netns: bool) -> list[dict]:
    env = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)} if "--memory" in args.worker_args else {}
    return run_workers(__file__, args.worker_args, out_dir, args.timeout, use_netns, env)


def run_workers(
    script: str,
    worker_args: list[str],
    out_dir: Path,
    timeout: float,
    use_netns: bool = False,
    env_extra: dict | None = None,
    what: str = "benchmark",
    *,
    nodes: list[int] | None = None,
    netns: tuple[str, ...] = NETNS,
    veth: tuple[str, ...] = VETH,
    master_addr: str = ADDRS[0],
    port: str = "29631",
) -> list[dict]:
    """``script --worker`` as ranks 0 and 1 (in the namespaces, or on loopback); their
    ``rank<r>.json`` back, or SystemExit with the tails of their logs. ``nodes``: the
    namespace index of each rank, one per rank (default: rank r in namespace r), with
    ``netns`` / ``veth`` / ``master_addr`` / ``port`` for another script's namespaces
    (hsdp_step.py: 4 ranks, two per namespace)."""
    nodes = list(range(2)) if nodes is None else nodes
    world = len(nodes)
    port = port if use_netns else _free_port()  # loopback is shared with whatever else runs here
    procs = []
    for rank, node in enumerate(nodes):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR=master_addr if use_netns else "127.0.0.1",
            MASTER_PORT=port,
            GLOO_SOCKET_IFNAME=veth[node] if use_netns else "lo",
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            **(env_extra or {}),
        )
        cmd = [sys.executable, script, "--worker", "--out-dir", str(out_dir), *worker_args]
        if use_netns:
            cmd = ["ip", "netns", "exec", netns[node], *cmd]
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.time() + timeout
    failed = None
    try:
        while any(p.poll() is None for p, _ in procs):
            if time.time() > deadline:
                failed = f"timed out after {timeout:.0f} s"
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
        tails = "\n".join(f"--- rank {r} ---\n" + (out_dir / f"rank{r}.log").read_text()[-3000:] for r in range(world))
        raise SystemExit(f"{what} {failed or 'failed'}:\n{tails}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


def summarize(results: list[dict], rate_bps: float | None) -> dict:
    r0 = results[0]
    modes = r0["modes"]
    rows = {}
    for mode, data in modes.items():
        rows[mode] = {
            **time_stats(data["times"]),
            "peak_rss_mib": [res["modes"][mode]["peak_rss_mib"] for res in results],  # per-step increase
            "losses": data.get("losses"),
            "lengths": data.get("lengths"),
            "compiles_warm": [res["modes"][mode].get("compiles_warm") for res in results],
            "compiles": [res["modes"][mode].get("compiles") for res in results],
        }
    eager_losses = rows.get("fsdp2-eager", {}).get("losses")
    for row in rows.values():  # the same batches in every mode: step i of each is comparable
        pairs = list(zip(eager_losses or [], row["losses"] or []))
        row["max_loss_diff_vs_eager"] = max(abs(a - b) for a, b in pairs) if pairs else None
    eager = rows.get("fsdp2-eager", {}).get("median_s")
    compute = rows.get("compute-only", {}).get("median_s")
    comm = rows.get("comm-only", {}).get("median_s")
    comm_native = rows.get("comm-only+native", {}).get("median_s")
    overlap = rows.get("comm+compute", {}).get("median_s")
    recv_first = rows.get("comm-only+recv-first", {}).get("median_s")
    transport = max(compute, comm) if compute and comm else None  # the defaults' collectives
    recv_first_bound = max(compute, recv_first) if compute and recv_first else None
    transport_native = max(compute, comm_native) if compute and comm_native else None
    replays = {name: rows[name]["median_s"] for name in REPLAYS if name in rows}
    ideal_bytes = r0.get("ideal_bytes")
    ideal = max(compute, ideal_bytes * 8 / rate_bps) if compute and ideal_bytes and rate_bps else None
    for mode, row in rows.items():
        own = replays.get(OWN_REPLAY.get(mode, "comm-only+native"))
        bound = max(compute, own) if compute and own else None
        row["x_eager"] = row["median_s"] / eager if eager else None
        row["x_transport"] = row["median_s"] / bound if bound else None
        row["x_ideal"] = row["median_s"] / ideal if ideal else None
        row["x_overlap"] = row["median_s"] / overlap if overlap and mode in A2A_MODES else None
        row["x_recv_first"] = row["median_s"] / recv_first_bound if recv_first_bound and mode in A2A_MODES else None
    return {
        "rows": rows,
        "process_peak_rss_mib": [round(res.get("process_peak_rss_mib", 0)) for res in results],
        "transport_bound_s": transport,
        "transport_bound_native_s": transport_native,
        "overlap_bound_s": overlap,
        "recv_first_bound_s": recv_first_bound,
        "ideal_bound_s": ideal,
        "ideal_bytes": ideal_bytes,
        "link": r0.get("link"),
        "link_replay": r0.get("link_replay"),
        "trace": trace_summary(results, comm, compute),
    }


def print_table(summary: dict, header: str) -> None:
    print(header)
    cols = f"{'mode':<20} {'median s':>9} {'min s':>7} {'max s':>7} {'x eager':>8} {'x transp.':>9} {'x ideal':>8}"
    print(cols + f" {'step RSS +MiB r0/r1':>20}  loss first -> last  max |loss - eager|")
    for mode, row in summary["rows"].items():

        def ratio(key: str, row: dict = row) -> str:
            return f"{row[key]:.2f}" if row[key] else "-"

        losses = row["losses"]
        loss = f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "-"
        diff = row.get("max_loss_diff_vs_eager")
        loss += f"  {diff:.1e}" if diff is not None else ""
        rss = "/".join(f"{x:.0f}" for x in row["peak_rss_mib"])
        print(
            f"{mode:<20} {row['median_s']:>9.3f} {row['min_s']:>7.3f} {row['max_s']:>7.3f} {ratio('x_eager'):>8} "
            f"{ratio('x_transport'):>9} {ratio('x_ideal'):>8} {rss:>20}  {loss}"
        )
    t, i = summary["transport_bound_s"], summary["ideal_bound_s"]
    compiled = {m: r for m, r in summary["rows"].items() if any(c is not None for c in r.get("compiles") or [])}
    if compiled:
        counts = "; ".join(
            f"{mode} {'/'.join(map(str, row['compiles_warm']))} -> {'/'.join(map(str, row['compiles']))}"
            for mode, row in compiled.items()
        )
        print(f"Dynamo graphs per compiled mode r0/r1 (after warm-up -> after the timed steps): {counts}")
    print("max |loss - eager|: over the timed steps (same batches in every mode); compute-only trains each rank")
    print("on its half batch without averaging, so it differs by design.")
    print("step RSS +MiB: the largest increase of resident memory during one step (gathered parameters,")
    print(f"activations, buffers) over the RSS at its start; process peak RSS r0/r1: {summary['process_peak_rss_mib']}")
    print(
        f"transport bound max(compute-only, comm-only) = {t:.3f} s (rows {', '.join(sorted(A2A_MODES))}; "
        "both+all-to-all against comm-only+all-to-all)"
        if t
        else "transport bound: n/a"
    )
    if summary.get("transport_bound_native_s"):
        print(
            "transport bound with gloo's reduce-scatter max(compute-only, comm-only+native) = "
            f"{summary['transport_bound_native_s']:.3f} s (the other rows)"
        )
    if summary.get("overlap_bound_s"):
        both = summary["rows"].get("both", {}).get("x_overlap")
        print(
            f"overlap bound comm+compute (the replay and the compute at once, no dependencies) = "
            f"{summary['overlap_bound_s']:.3f} s" + (f"; both at {both:.2f}x of it" if both else "")
        )
    if summary.get("recv_first_bound_s"):
        both = summary["rows"].get("both", {}).get("x_recv_first")
        print(
            f"receive-first transport bound max(compute-only, comm-only+recv-first) = "
            f"{summary['recv_first_bound_s']:.3f} s" + (f"; both at {both:.2f}x of it" if both else "")
        )
    if i:
        mb = summary["ideal_bytes"] / 2**20
        print(f"ideal bound max(compute-only, {mb:.1f} MiB sent per rank / link rate) = {i:.3f} s")
    else:
        print("ideal bound: n/a (uncapped link)")
    for key, what in (("link", "one `both` step"), ("link_replay", "the comm-only replay of it")):
        link = summary.get(key)
        if not link:
            continue
        print(f"link activity during {what} (rank 0, busy = sending or receiving):")
        for phase in link["phases"]:
            both = phase.get("both_fraction")
            print(
                f"  {phase['name']:<28} {phase['duration_s']:.3f} s, link busy {phase['busy_fraction'] * 100:5.1f}%"
                + (f" (both directions {both * 100:5.1f}%)" if both is not None else "")
                + f", idle {phase['idle_s']:.3f} s"
            )
    if summary.get("trace"):
        print_trace(summary["trace"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="300mbit", help="tc tbf rate on both veth ends (default 300mbit)")
    parser.add_argument("--model", default="gpt", choices=MODELS, help="the repo GPT (default) or hf-llama")
    parser.add_argument(
        "--model-size", default="small", choices=sorted(MODEL_SIZES), help="MODEL_SIZES / HF_LLAMA_SIZES entry"
    )
    parser.add_argument(
        "--plan",
        default="auto",
        choices=("auto", "blocks"),
        help="bucket plan of every sharded mode: auto (default) or one bucket per block / decoder layer",
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="measure peak memory per mode instead of time: a fresh 2-rank loopback run per mode",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode per repetition (>= 10)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions; modes are interleaved within each")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per mode (the first compiles)")
    parser.add_argument(
        "--modes", default=",".join(ALL_MODES), help="comma-separated subset of: " + ", ".join(ALL_MODES)
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer modes, 1 repetition, 10 steps (< 3 minutes; with --memory: fewer modes)",
    )
    parser.add_argument("--loopback", action="store_true", help="skip the namespaces even as root")
    parser.add_argument(
        "--lengths",
        help="comma-separated sequence lengths (at most the model's seq), cycled: step k of every mode uses "
        "lengths[k %% n]; the first two differ (the warm-up compiles the dynamic graph)",
    )
    parser.add_argument("--json", help="write the summary and raw step times here")
    parser.add_argument("--timeline-png", help="draw rank 0's link activity during one `both` step")
    parser.add_argument("--report-json", help="write the `both` model's schedule report (for `fsdp-overlap timeline`)")
    parser.add_argument(
        "--recv-first",
        action="store_true",
        help="experiment: the compiled graphs' all-gathers and all-to-alls post receives before sends",
    )
    parser.add_argument(
        "--trace-dir",
        help="profile one more `both` step per rank: chrome traces here, and per collective the ranks' launch skew",
    )
    parser.add_argument(
        "--trace-mode",
        default="both",
        choices=sorted(A2A_MODES),
        help="with --trace-dir, the mode to trace instead of `both` (one whose bound is comm-only's replay)",
    )
    parser.add_argument(
        "--mode-config",
        action="append",
        default=[],
        metavar="NAME=YAML",
        help="one more mode NAME (list it in --modes): the defaults with the plugin config keys of YAML on top "
        "(e.g. what `fsdp-overlap suggest` printed); repeatable",
    )
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    modes = (
        QUICK_MODES
        if args.quick and args.modes == ",".join(ALL_MODES)
        else [m.strip() for m in args.modes.split(",") if m.strip()]
    )
    custom = parse_mode_configs(parser, args.mode_config)
    unknown = [m for m in modes if m not in ALL_MODES + EXTRA_MODES + list(custom)]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; valid: {', '.join(ALL_MODES + EXTRA_MODES)}")
    for replay, source in REPLAYS.items():  # (--memory skips the replays)
        if not args.memory and replay in modes and (source not in modes or modes.index(source) > modes.index(replay)):
            parser.error(f"{replay} replays the collectives of a `{source}` step: list `{source}` before it")
    for mode, parts in CONCURRENT.items():
        if mode in modes and any(p not in modes or modes.index(p) > modes.index(mode) for p in parts):
            parser.error(f"{mode} runs {' and '.join(parts)} at once: list both before it")
    if args.quick:
        args.reps, args.steps = 1, 10
    if args.steps < 10 and not args.quick:
        parser.error("--steps must be at least 10")
    if args.lengths:
        lengths = parse_lengths(args.lengths)
        if args.memory:
            parser.error("--lengths: not with --memory")
        if len(lengths) < 2 or lengths[0] == lengths[1] or min(lengths) < 2:
            parser.error("--lengths: at least two lengths (>= 2), the first two different")
        if max(lengths) > vocab_and_seq(args.model, args.model_size)[1]:
            parser.error(f"--lengths: at most {vocab_and_seq(args.model, args.model_size)[1]} (the model's seq)")
        if args.warmup < 2:
            parser.error("--lengths needs --warmup 2 or more (a static and a dynamic compile before timing)")
    rate_bps = parse_rate(args.rate)
    args.worker_args = [
        "--model",
        args.model,
        "--model-size",
        args.model_size,
        "--plan",
        args.plan,
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
    if args.trace_mode != "both" and not args.trace_dir:
        parser.error("--trace-mode needs --trace-dir")
    if args.trace_dir and args.trace_mode not in modes:
        parser.error(f"--trace-mode {args.trace_mode}: list it in --modes")
    if args.trace_dir:
        args.worker_args += ["--trace-dir", str(Path(args.trace_dir).resolve()), "--trace-mode", args.trace_mode]
    if args.recv_first:
        args.worker_args.append("--recv-first")
    for item in args.mode_config:
        name, _, path = item.partition("=")
        args.worker_args += ["--mode-config", f"{name}={Path(path).resolve()}"]
    if args.lengths:
        args.worker_args += ["--lengths", ",".join(map(str, parse_lengths(args.lengths)))]
    ok, why = Namespaces.available()
    use_netns = ok and not args.loopback
    if args.memory:
        return run_memory(args, modes, use_netns, why)
    where = (
        f"two network namespaces, veth shaped to {args.rate} each way"
        if use_netns
        else f"LOOPBACK, uncapped ({why or '--loopback'}): communication is nearly free, ratios mean little"
    )
    header = (
        f"step_time: 2 ranks over {where}; {describe_model(args.model, args.model_size)}, batch {BATCH_PER_RANK}"
        f"/rank), {args.plan} plan, SGD; {args.reps} x {args.steps} timed steps per mode"
        + (f"; sequence lengths cycled {args.lengths}" if args.lengths else "")
    )
    print(header, flush=True)
    out_dir = Path(tempfile.mkdtemp(prefix="fsdp_overlap_bench_"))
    # SIGTERM/SIGHUP unwind like Ctrl-C, so the namespaces are removed on the way out
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(130))
    start = time.time()
    results = launch_on_link(args, out_dir, use_netns)
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


def run_memory(args: argparse.Namespace, modes: list[str], use_netns: bool, why: str | None) -> None:
    """``--memory``: per mode, a fresh 2-rank run of that mode alone, over the shaped link
    (or loopback)."""
    skipped = [m for m in modes if m in REPLAYS]
    modes = [m for m in modes if m not in REPLAYS]
    where = f"over the veth shaped to {args.rate}" if use_netns else f"on loopback ({why or '--loopback'})"
    header = (
        f"peak memory: 2 ranks {where}, one process per rank per mode; {describe_model(args.model, args.model_size)}"
        f", batch {BATCH_PER_RANK}/rank), {args.plan} plan, SGD; {args.warmup} warm-up steps, then two measured steps (RSS) and one profiled"
    )
    print(header, flush=True)
    if skipped:
        print(
            f"skipped {', '.join(skipped)}: they replay collectives on preallocated buffers (no parameters, "
            "gradients or activations)"
        )
    start = time.time()
    results: dict[str, list[dict]] = {}
    for mode in modes:
        t = time.time()
        out_dir = Path(tempfile.mkdtemp(prefix="fsdp_overlap_mem_"))
        worker_args = list(args.worker_args)
        worker_args[worker_args.index("--modes") + 1] = mode
        args_mode = argparse.Namespace(**{**vars(args), "worker_args": [*worker_args, "--memory"]})
        results[mode] = launch_on_link(args_mode, out_dir, use_netns)
        peak = max(r["memory"]["peak_bytes"] for r in results[mode]) / 2**20
        print(f"[{mode}] peak {peak:.1f} MiB/rank ({time.time() - t:.0f} s)", flush=True)
    summary = summarize_memory(results)
    print()
    print_memory_table(summary, f"peak memory per mode ({time.time() - start:.0f} s in all):")
    if args.json:
        payload = {"header": header, "summary": summary, "raw": results, "skipped": skipped}
        Path(args.json).write_text(json.dumps(payload, indent=1))
        print(f"json written to {args.json}")


def summarize_memory(results: dict[str, list[dict]]) -> dict:
    mib = 2**-20
    rows = {}
    for mode, ranks in results.items():
        mem = [r["memory"] for r in ranks]
        rss = [m["rss_hwm_increase_bytes"] for m in mem]
        rows[mode] = {
            "peak_mib": max(m["peak_bytes"] for m in mem) * mib,
            "peak_mib_per_rank": [m["peak_bytes"] * mib for m in mem],
            "state_mib": max(m["state_bytes"] for m in mem) * mib,
            "step_peak_mib": max(m["step_peak_bytes"] for m in mem) * mib,
            "rss_hwm_increase_mib": [x * mib if x is not None else None for x in rss],
            "source": mem[0].get("peak_source", "profiler"),
        }
    eager = rows.get("fsdp2-eager", {}).get("peak_mib")
    for row in rows.values():
        row["x_eager"] = row["peak_mib"] / eager if eager else None
    return {"rows": rows}


def print_memory_table(summary: dict, header: str) -> None:
    print(header)
    print(
        f"{'mode':<20} {'peak MiB':>9} {'r0/r1':>13} {'x eager':>8} {'held MiB':>9} {'step +MiB r0/r1':>16}"
        f" {'profiler +MiB':>14}"
    )
    sources = set()
    for mode, row in summary["rows"].items():
        ranks = "/".join(f"{x:.1f}" for x in row["peak_mib_per_rank"])
        ratio = f"{row['x_eager']:.2f}" if row["x_eager"] else "-"
        rss = "/".join("-" if x is None else f"{x:.1f}" for x in row["rss_hwm_increase_mib"])
        sources.add(row.get("source", "profiler"))
        print(
            f"{mode:<20} {row['peak_mib']:>9.1f} {ranks:>13} {ratio:>8} {row['state_mib']:>9.1f}"
            f" {rss:>16} {row['step_peak_mib']:>14.1f}"
        )
    if sources == {"rss"}:
        print("peak MiB = held + step +MiB, max over ranks. held: parameter shards, gradients and buffers at a")
        print("step's start. step +MiB: the most resident memory a step added (VmHWM - VmRSS at its start, worst")
        print(f"of 2 steps; MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}: tensors are mapped and unmapped, every thread")
        print("counted). profiler +MiB: torch.profiler's running sum on another step; it misses frees on backend")
        print("worker threads, so it reads high for modes whose collectives complete there (docstring).")
    else:
        print("peak MiB = held + profiler +MiB (the RSS high-water mark could not be reset here), max over ranks.")


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


# =============================================================================== models
def model_shape(model: str, size: str) -> tuple:
    """The size's tuple for ``model`` (``MODEL_SIZES`` or ``HF_LLAMA_SIZES``)."""
    return (MODEL_SIZES if model == "gpt" else HF_LLAMA_SIZES)[size]


def vocab_and_seq(model: str, size: str) -> tuple[int, int]:
    shape = model_shape(model, size)
    return shape[-2], shape[-1]


def describe_model(model: str, size: str) -> str:
    if model == "gpt":
        d, layers, heads, vocab, seq = MODEL_SIZES[size]
        return f"model gpt {size} (d={d}, {layers} blocks, {heads} heads, vocab {vocab}, seq {seq}"
    hidden, layers, heads, kv, inter, vocab, seq = HF_LLAMA_SIZES[size]
    return (
        f"model hf-llama {size} (transformers LlamaForCausalLM, sdpa attention, hidden {hidden}, {layers} layers, "
        f"{heads} heads / {kv} kv heads, MLP {inter}, vocab {vocab} untied, seq {seq}"
    )


def build_model(model: str, size: str):
    """The model, seeded: identical on every rank and in every mode."""
    import torch

    torch.manual_seed(0)
    if model == "gpt":
        from fsdp_overlap_plugin.models import GPT, GPTConfig

        d, layers, heads, vocab, seq = MODEL_SIZES[size]
        return GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, d_model=d))
    return build_hf_llama(*HF_LLAMA_SIZES[size])


def build_hf_llama(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int, seq: int):
    """A transformers ``LlamaForCausalLM`` from a ``LlamaConfig`` (nothing downloaded):
    sdpa attention (one graph under our compile, as the tests' Llama uses), untied head,
    no KV cache, dropout off (Llama's default); in train mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    model.train()
    return model


def loss_for(model_name: str, model):
    """``loss(x, y)`` for one batch: the GPT's cross-entropy against ``y``; the transformers
    model's own causal-LM loss (``labels=x``, shifted inside: the same targets as ``y``)."""
    if model_name == "gpt":
        from fsdp_overlap_plugin.models import loss_fn

        return lambda x, y: loss_fn(model(x), y)
    return lambda x, y: model(input_ids=x, labels=x).loss


def block_plan(model_name: str, model) -> list[list[str]]:
    """One bucket per repeated block (embeddings, final norm and head left to the root)."""
    container = BLOCKS[model_name]
    return [[f"{container}.{i}"] for i in range(len(model.get_submodule(container)))]


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
    """Per phase: duration, fraction of time the link moved data (in either direction,
    and in both at once), idle seconds."""
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
        both = sum(
            max(0.0, min(t1, end) - max(t0, start)) for t0, t1, tx, rx in rates if tx > threshold and rx > threshold
        )
        phases.append(
            {
                "name": name,
                "start_s": start,
                "duration_s": end - start,
                "busy_fraction": busy / max(end - start, 1e-9),
                "both_fraction": both / max(end - start, 1e-9),
                "idle_s": max(0.0, end - start - busy),
            }
        )
    series = [((t0 + t1) / 2, tx, rx) for t0, t1, tx, rx in rates]
    return {"phases": phases, "samples": series}


def thread_cpu_ms() -> dict[str, float]:
    """CPU time (user + system) per thread of this process, by thread id and name."""
    tick = 1000 / os.sysconf("SC_CLK_TCK")
    cpu = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu[f"{tid}:{name}"] = (int(fields[11]) + int(fields[12])) * tick
    return cpu


def trace_step(runner: ModelRunner, batch, trace_dir: Path, rank: int) -> dict:
    """``--trace-dir``: one step's threads' CPU time (of ``--trace-mode``, `both` by
    default), then one more step under
    torch.profiler; its chrome trace goes to ``trace_dir`` and its collectives (launch on
    the main thread, run on gloo's worker threads) and waits come back, in epoch ms so
    that the ranks' clocks (one host) line up."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import fsdp_overlap_plugin as fo

    dist.barrier()
    before, start = thread_cpu_ms(), time.perf_counter()
    runner.step(batch)
    wall, after = time.perf_counter() - start, thread_cpu_ms()
    cpu: dict[str, float] = {}
    main = f"{threading.get_native_id()}:"
    for key, ms in after.items():
        name = "main" if key.startswith(main) else key.split(":", 1)[1]
        cpu[name] = cpu.get(name, 0.0) + ms - before.get(key, 0.0)
    trace_dir.mkdir(parents=True, exist_ok=True)
    path = trace_dir / f"trace{rank}.json"
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.time_ns() / 1e6
        runner.step(batch)
        t1 = time.time_ns() / 1e6
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    base_us = trace.get("baseTimeNanoseconds", 0) / 1e3
    launches, runs, calls = [], [], []
    for event in trace["traceEvents"]:
        if event.get("ph") != "X":
            continue
        name, begin, dur = event["name"], (event["ts"] + base_us) / 1e3, event["dur"] / 1e3
        if name.startswith("c10d::") and "barrier" not in name:
            launches.append((begin, name.removeprefix("c10d::").strip("_")))
        elif name.startswith("gloo:"):
            runs.append((begin, begin + dur))
        elif name in schedule_sim.LAUNCHES or name == schedule_sim.WAIT:
            calls.append((begin, begin + dur, name))
    return {
        "path": str(path),
        "step_ms": [t0, t1],
        "launches": sorted(launches),
        "runs": sorted(runs),
        "wait_ms": sum(end - begin for begin, end, name in calls if name == schedule_sim.WAIT),
        "calls": calls,
        "order": schedule_order(fo.schedule_report(runner.model)),
        "cpu_ms": cpu,
        "cpu_wall_ms": wall * 1e3,
    }


def schedule_order(report: dict) -> list[tuple]:
    """The forward's then the backward's collectives in graph order, from a
    ``schedule_report``: ``("launch", name, op, bytes)`` and ``("wait", of)``, what the
    comm-only replay runs and ``schedule_sim.program`` lines a trace up with."""
    order: list[tuple] = []
    for kind in ("forward", "backward"):
        for event in report[kind]["schedule"]["after"]:
            if event["op"] in ("all_gather", "reduce_scatter", "all_to_all"):
                order.append(("launch", event["name"], event["op"], event["bytes"]))
            elif event["op"] == "wait" and event["of"]:
                order.append(("wait", event["of"]))
    return order


def trace_summary(
    results: list[dict], replay_s: float | None = None, compute_only_s: float | None = None
) -> dict | None:
    """Both ranks' traced steps side by side: per collective (in launch order) each
    rank's launch and completion, from the earlier rank's step start, and the skew; with
    the comm-only replay's median (``replay_s``), the traced step split by
    ``schedule_sim.split_step`` into what the schedule leaves exposed and what the host and
    the transport add."""
    traces = [res.get("trace") for res in results]
    if not all(traces):
        return None
    split = None
    if replay_s and all("calls" in t for t in traces):
        try:
            split = schedule_sim.split_step(
                [t["calls"] for t in traces],
                [tuple(t["step_ms"]) for t in traces],
                [tuple(o) for o in traces[0]["order"]],
                replay_s * 1e3,
                len(traces),
                compute_only_s * 1e3 if compute_only_s else None,
                [t["cpu_ms"].get("main", 0.0) for t in traces] if all(t.get("cpu_ms") for t in traces) else None,
            )
        except ValueError as exc:
            split = {"error": str(exc)}
    zero = min(t["step_ms"][0] for t in traces)
    rows = []
    for k, launch in enumerate(traces[0]["launches"]):
        if any(len(t["launches"]) <= k for t in traces):
            break
        at = [t["launches"][k][0] - zero for t in traces]
        done = [t["runs"][k][1] - zero if k < len(t["runs"]) else None for t in traces]
        rows.append({"op": launch[1], "launch_ms": at, "done_ms": done, "skew_ms": at[1] - at[0]})
    skews = sorted(abs(r["skew_ms"]) for r in rows)
    return {
        "mode": traces[0].get("mode", "both"),
        "rows": rows,
        "split": split,
        "max_skew_ms": skews[-1] if skews else None,
        "median_skew_ms": statistics.median(skews) if skews else None,
        "ranks": [
            {
                "step_ms": t["step_ms"][1] - t["step_ms"][0],
                "wait_ms": t["wait_ms"],
                "cpu_ms": t["cpu_ms"],
                "cpu_wall_ms": t["cpu_wall_ms"],
                "path": t["path"],
            }
            for t in traces
        ],
    }


def print_trace(trace: dict) -> None:
    print(
        f"one traced `{trace.get('mode', 'both')}` step (--trace-dir), ms from the earlier rank's start;"
        " skew = rank 1 - rank 0:"
    )
    print(f"  {'#':>3} {'collective':<24} {'launch r0':>10} {'r1':>8} {'skew':>7} {'done r0':>9} {'r1':>8}")
    for k, row in enumerate(trace["rows"]):
        done = ["-" if d is None else f"{d:.1f}" for d in row["done_ms"]]
        print(
            f"  {k:>3} {row['op']:<24} {row['launch_ms'][0]:>10.1f} {row['launch_ms'][1]:>8.1f}"
            f" {row['skew_ms']:>+7.1f} {done[0]:>9} {done[1]:>8}"
        )
    print(f"  launch skew: median {trace['median_skew_ms']:.1f} ms, largest {trace['max_skew_ms']:.1f} ms")
    split = trace.get("split")
    if split and "error" in split:
        print(f"  schedule simulation: not run ({split['error']})")
    elif split:
        x = split["x_bound"]
        compute = "/".join(f"{ms:.0f}" for ms in split["compute_ms"])
        print(
            f"  the traced step against its bound max(mean of the traced compute {compute} ms r0/r1, comm-only replay"
            f" {split['replay_ms']:.0f} ms) = {split['bound_ms']:.0f} ms (benchmarks/schedule_sim.py):"
        )
        print(
            f"    model, ranks in step                 {split['in_step_ms']:>6.0f} ms"
            f"  {x['in_step']:.2f}x  (what the schedule itself leaves exposed)"
        )
        print(
            f"    model, each rank's own compute       {split['own_compute_ms']:>6.0f} ms"
            f"  {x['own_compute']:.2f}x  (the ranks out of step as traced)"
        )
        print(
            f"    traced                               {split['traced_ms']:>6.0f} ms"
            f"  {x['traced']:.2f}x  (the real link and collectives)"
        )
        for label, scaled in split.get("scaled", {}).items():
            print(
                f"    model, ranks in step, compute scaled to {label} ({scaled['compute_ms']:.0f} ms):"
                f" {scaled['in_step_ms']:.0f} ms = {scaled['x_bound']:.2f}x max(that, replay)"
            )
    for rank, info in enumerate(trace["ranks"]):
        cpu = ", ".join(f"{name} {ms:.0f}" for name, ms in sorted(info["cpu_ms"].items(), key=lambda x: -x[1]) if ms)
        print(
            f"  rank {rank}: profiled step {info['step_ms']:.0f} ms, blocked in waits {info['wait_ms']:.0f} ms;"
            f" an unprofiled step ({info['cpu_wall_ms']:.0f} ms) used CPU ms: {cpu}; trace {info['path']}"
        )


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    modes = args.modes.split(",")
    # every compiled mode is its own model instance of one class: dynamo keeps one cache
    # entry per instance on the same forward code, so more than 8 modes (its default
    # recompile_limit) would be refused under fullgraph=True although none recompiles
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(modes))
    kernels = use_recv_first_kernels() if args.recv_first else None  # noqa: F841 - kept alive
    vocab, seq = vocab_and_seq(args.model, args.model_size)
    rate_bps = parse_rate(args.rate)
    if args.memory:
        return memory_worker(args, modes, rank, world, rate_bps)
    custom = {name: fo_read_yaml(path) for name, _, path in (m.partition("=") for m in args.mode_config)}
    lengths = parse_lengths(args.lengths) if args.lengths else None
    data = _data(vocab, seq, world, args.warmup + args.reps * args.steps + 1, lengths)
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
                runners[mode] = make_runner(
                    mode, args.model, args.model_size, runners, rate_bps, world, args.plan, custom=custom
                )
                for _ in range(args.warmup):
                    runners[mode].step(data[step_index[mode]])
                    step_index[mode] += 1
                results[mode]["compiles_warm"] = dynamo_graphs(runners[mode])
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
                if lengths:
                    results[mode].setdefault("lengths", []).append(lengths[step_index[mode] % len(lengths)])
                step_index[mode] += 1
            med = statistics.median(results[mode]["times"][-args.steps :])
            log(f"rep {rep + 1}/{args.reps} {mode:<18} median {med:.3f} s/step")
    for mode, runner in runners.items():
        results[mode]["compiles"] = dynamo_graphs(runner)
    if rank == 0:  # each sharded mode's schedule report: what costmodel_check.py predicts from
        import fsdp_overlap_plugin as fo

        out["reports"] = {
            mode: fo.schedule_report(runner.model)
            for mode, runner in runners.items()
            if isinstance(runner, ModelRunner) and runner.world > 1
        }
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
            if "comm-only" in runners:
                dist.barrier()
                with LinkSampler(ifname) as sampler:
                    start = time.perf_counter() - sampler.t0
                    runners["comm-only"].step(None)
                    end = time.perf_counter() - sampler.t0
                if rank == 0:
                    out["link_replay"] = link_phases(sampler.samples, [("replay", start), ("end", end)], rate_bps)
    if args.trace_dir:
        mode = args.trace_mode
        out["trace"] = trace_step(runners[mode], data[step_index[mode]], Path(args.trace_dir), rank) | {"mode": mode}
    out["process_peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(args.out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def fo_read_yaml(path: str) -> dict:
    from fsdp_overlap_plugin.config import read_yaml

    return read_yaml(path) or {}


def _data(vocab: int, seq: int, world: int, steps: int, lengths: list[int] | None = None):
    """The fixed batches (the same on every rank and in every mode); with ``lengths``,
    batch k cut to ``lengths[k % len(lengths)]`` tokens."""
    from fsdp_overlap_plugin.models import fixed_batches

    batches = fixed_batches(steps, BATCH_PER_RANK * world, seq, vocab, seed=7)
    if not lengths:
        return batches
    cut = [lengths[k % len(lengths)] for k in range(steps)]
    return [(x[:, :n].contiguous(), y[:, :n].contiguous()) for (x, y), n in zip(batches, cut)]


def dynamo_graphs(runner) -> int | None:
    """The graphs Dynamo compiled for a compiled mode's model so far; None for the others
    (fsdp2-eager, compute-only, the replays)."""
    from fsdp_overlap_plugin.state import get_state

    state = get_state(getattr(runner, "model", None)) if isinstance(runner, ModelRunner) else None
    return state.dynamo_graphs if state is not None and state.config.compile else None


# ------------------------------------------------------------------------------- memory
def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _reset_rss_high_water_mark() -> bool:
    """Set VmHWM to the current RSS (Linux: "5" to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    """Give freed heap memory back to the OS (glibc), so that the next step's RSS starts low
    and its high-water mark shows what the step needs rather than what earlier steps left."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def state_bytes(model) -> int:
    """Bytes of the storages the model's parameters (this rank's shards, as allocated,
    padding included), their gradients and its buffers hold, each storage once."""
    seen: dict[int, int] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        for t in (tensor, getattr(tensor, "grad", None)):
            if t is None:
                continue
            local = t.to_local() if hasattr(t, "to_local") else t  # DTensor -> this rank's shard
            storage = local.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def step_allocation_peak(events) -> tuple[int, int]:
    """``(peak, end)`` of the running sum of CPU allocator events ``(time_ns, +/-bytes)``:
    the most bytes allocated during the profiled region and not yet freed, and what is
    still allocated at its end. A block allocated before profiling began is not in the
    events when freed (the allocator does not know its size then), so frees of older
    blocks never lower the sum."""
    running = peak = 0
    for _, nbytes in sorted(events):
        running += nbytes
        peak = max(peak, running)
    return peak, running


MMAP_THRESHOLD = 65536
"""``--memory`` workers run with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed at this: every
allocation of 64 KiB or more is its own mapping, returned to the OS when freed (the default,
dynamic threshold soon serves tensors from the heap, which keeps freed pages). So the
process's resident memory follows the bytes alive, on every thread."""


def measure_step_memory(runner: ModelRunner, batches, barrier, rss_steps: int = 2) -> dict:
    """A step's memory on this rank, after warm-up (see ``--memory`` in the docstring):

    * ``state_bytes``: parameter shards + gradients + buffers held when a step starts;
    * ``rss_hwm_increase_bytes``: the largest, over ``rss_steps`` unprofiled steps, of
      VmHWM (reset just before via /proc/self/clear_refs, after ``malloc_trim``) minus
      VmRSS at the step's start: what the step added at its worst moment, as the OS
      sees it: every thread's allocations (a backend's staging buffers included);
    * ``peak_bytes`` = state + that increase (the table's "peak MiB"); where the high-water
      mark cannot be reset, state + the profiler's peak;
    * ``step_peak_bytes`` / ``step_end_bytes``: the cross-check from ``torch.profiler``
      (``profile_memory=True``), on one more step: the running sum of its ``[memory]``
      events. It records allocations and frees only on threads that carry the profiler's
      state; a tensor freed on a backend's worker thread never leaves the sum (then
      ``step_end_bytes`` stays above 0 and the peak is too high), and gloo's staging
      buffers appear or not depending on how the collective was issued.
    """
    import gc

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    increases = []
    for batch in batches[:rss_steps]:
        gc.collect()
        _malloc_trim()
        barrier()
        rss0 = _proc_status_kib("VmRSS")
        if not _reset_rss_high_water_mark():
            break
        runner.step(batch)
        increases.append((_proc_status_kib("VmHWM") - rss0) * 1024)
    gc.collect()
    barrier()
    state = state_bytes(runner.model)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner.step(batches[rss_steps])
    memory_events = [
        e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    ]
    events = [(e.start_ns(), e.nbytes()) for e in memory_events]
    peak, end = step_allocation_peak(events)
    rss = max(increases) if increases else None
    return {
        "state_bytes": state,
        "rss_hwm_increase_bytes": rss,
        "rss_hwm_increase_per_step": increases,
        "peak_bytes": state + (rss if rss is not None else peak),
        "peak_source": "rss" if rss is not None else "profiler",
        "step_peak_bytes": peak,
        "step_end_bytes": end,
        "allocation_events": len(events),
        "allocation_threads": len({e.start_thread_id() for e in memory_events}),
    }


def memory_worker(args: argparse.Namespace, modes: list[str], rank: int, world: int, rate_bps: float) -> None:
    """``--memory``: this process runs one mode only: build, warm up, measure one step."""
    import torch.distributed as dist

    (mode,) = modes
    vocab, seq = vocab_and_seq(args.model, args.model_size)
    data = _data(vocab, seq, world, args.warmup + 3)
    runner = make_runner(mode, args.model, args.model_size, {}, rate_bps, world, args.plan)
    t = time.perf_counter()
    losses = [runner.step(batch) for batch in data[: args.warmup]]
    warm = time.perf_counter() - t
    memory = measure_step_memory(runner, data[args.warmup :], dist.barrier)
    out = {"rank": rank, "mode": mode, "memory": memory, "warmup_s": warm, "losses": losses}
    Path(args.out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


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

        from fsdp_overlap_plugin.exchange import exchange

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

    from fsdp_overlap_plugin.exchange import exchange

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
        from fsdp_overlap_plugin.hf import prepare_for_compile

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


if __name__ == "__main__":
    main()
