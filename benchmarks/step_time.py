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
    torch-auto         torch's own overlap scheduler and collective bucketing on our
                       sharded graphs: inductor_overlap: auto with our passes off
                       (manual_bucketing and overlap_grad_reduce false, gloo's
                       reduce-scatter), costed by the package from hardware: the cpu preset
                       with its link at --rate (cpu-gloo-300mbit,link=37.5MB/s at 300mbit;
                       latency and compute rates the preset's)
    torch-manual       our sharding compiled, our passes off (gloo's reduce-scatter), and
                       torch's own manual_overlap_bucketing (torch._inductor.fx_passes.
                       overlap_manual_scheduling) as inductor's post-grad custom pass with
                       `both`'s bucket plan, set as torchtitan's SimpleFSDP sets it
                       (insert_overlap_deps, no reorder for peak memory, no buffer reuse);
                       after the table, each graph's collectives before -> after it. If
                       torch's pass fails on our graphs, the row says "failed: <error>" and
                       the other modes run on (only with --modes)
    compiled+simple    compiled, our passes off (gloo's reduce-scatter), inductor_overlap:
                       simple: torch 2.14+'s simple overlap pass, what a torch user gets by
                       default without our passes (torch >= 2.14; only with --modes)
    both+simple        the defaults with inductor_overlap: simple (torch >= 2.14; only
                       with --modes)
    both+suggest       the defaults with the bucket plan and prefetch depth that
                       `fsdp-overlap suggest` picks for this model, world and batch at
                       --rate (the same hardware as torch-auto's), printed when it is built
                       (only with --modes)
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
    hf-qwen2   a transformers ``Qwen2ForCausalLM`` of hf-llama's sizes, with q/k/v biases and a
               tied head (the cost model's held-out third model)

Losses agree across modes (the table's last column: the largest difference from
fsdp2-eager over the timed steps, which see the same batches in every mode).

Compile time (``compile s``): each mode's first warm-up step (Dynamo, AOT autograd and
inductor for the forward and backward graphs, and that step), the slower rank's. The workers
share one fresh inductor cache per run (``TORCHINDUCTOR_CACHE_DIR`` from the environment if
set): the first compiled mode builds kernels a later mode may find in it, so compare compile
times in ``--memory`` runs (each mode in fresh processes with its own fresh cache).

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
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from _harness.launch import run_workers
from _harness.memory import MMAP_THRESHOLD, measure_step_memory
from _harness.models import BATCH_PER_RANK, MODEL_SIZES, MODELS, _data, describe_model, parse_lengths, vocab_and_seq
from _harness.netns import Namespaces, parse_rate
from _harness.runners import (
    A2A_MODES,
    ALL_MODES,
    CONCURRENT,
    EXTRA_MODES,
    OWN_REPLAY,
    QUICK_MODES,
    REPLAYS,
    ModelRunner,
    dynamo_graphs,
    make_runner,
    mode_torch_error,
    use_recv_first_kernels,
)
from _harness.steps import timed_steps
from _harness.tables import time_stats
from _harness.trace import LinkSampler, link_phases, print_trace, trace_step, trace_summary

# =============================================================================== parent

# the user's inductor cache, read before anything imports torch: torch's cache_dir() writes its
# default into os.environ, which would then pass for the user's choice
USER_CACHE_DIR = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def parse_mode_configs(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, dict]:
    """``--mode-config NAME=YAML``: mode name -> the plugin config keys in YAML (checked
    by OverlapConfig before anything starts)."""
    from fsdp_overlap_plugin.config.parse import read_yaml
    from fsdp_overlap_plugin.config.schema import OverlapConfig

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


def launch_on_link(args: argparse.Namespace, out_dir: Path, use_netns: bool) -> list[dict]:
    """``launch`` over the shaped veth (the namespaces made before and removed after, also
    on failure) or, without namespaces, over loopback."""
    if not use_netns:
        return launch(args, out_dir, False)
    with Namespaces(args.rate):
        return launch(args, out_dir, True)


def launch(args: argparse.Namespace, out_dir: Path, use_netns: bool) -> list[dict]:
    env = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)} if "--memory" in args.worker_args else {}
    # a fresh inductor cache per launch: compile times are cold ones, and no graph of an
    # earlier run skips a mode's post-grad passes (torch-manual's counts come from its pass)
    fresh = out_dir / "inductor_cache"
    env["TORCHINDUCTOR_CACHE_DIR"] = USER_CACHE_DIR or str(fresh)
    try:
        return run_workers(__file__, args.worker_args, out_dir, args.timeout, use_netns, env)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)  # the logs stay


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
            "compile_s": _max_or_none(res["modes"][mode].get("compile_s") for res in results),
            "failed": next((res["modes"][mode]["failed"] for res in results if res["modes"][mode].get("failed")), None),
            "torch_pass": data.get("torch_pass"),
            "suggest": data.get("suggest"),
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
        if row["failed"]:  # its "steps" did nothing: no ratios
            row.update(x_eager=None, x_transport=None, x_ideal=None, x_overlap=None, x_recv_first=None)
            continue
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


def _max_or_none(values) -> float | None:
    found = [v for v in values if v is not None]
    return max(found) if found else None


def _first_lines(text: str, lines: int = 3, width: int = 400) -> str:
    """An error's first lines, joined, cut at ``width`` characters (the JSON keeps it whole)."""
    short = " | ".join(line.strip() for line in text.strip().splitlines()[:lines] if line.strip())
    return short if len(short) <= width else short[: width - 3] + "..."


def torch_pass_lines(rows: dict) -> list[str]:
    """Per torch-manual row, what torch's pass did to each compiled graph (rank 0): its
    all-gathers and reduce-scatters before -> after; and the plan both+suggest took."""
    lines = []
    for mode, row in rows.items():
        runs = row.get("torch_pass")
        if runs is not None and not row.get("failed"):
            if not runs:
                lines.append(f"{mode}: torch's manual_overlap_bucketing did NOT run on any graph (a graph cache hit?)")
            else:
                graphs = "; ".join(
                    f"{run['graph']} all-gathers {run['before']['all_gather']} -> {run['after']['all_gather']}, "
                    f"reduce-scatters {run['before']['reduce_scatter']} -> {run['after']['reduce_scatter']}"
                    for run in runs
                )
                lines.append(f"{mode}: torch's manual_overlap_bucketing ran on {len(runs)} graphs: {graphs}")
        pick = row.get("suggest")
        if pick:
            lines.append(
                f"{mode}: fsdp-overlap suggest at {pick['hardware']} picked {pick['words']}, prefetch_depth "
                f"{pick['depth']} (predicted {pick['predicted_step_s']:.3f} s/step): bucket_plans {pick['plan']}"
            )
    return lines


def print_torch_pass_lines(rows: dict) -> None:
    for line in torch_pass_lines(rows):
        print(line)


def print_table(summary: dict, header: str) -> None:
    print(header)
    cols = f"{'mode':<20} {'median s':>9} {'min s':>7} {'max s':>7} {'x eager':>8} {'x transp.':>9} {'x ideal':>8}"
    print(cols + f" {'compile s':>9} {'step RSS +MiB r0/r1':>20}  loss first -> last  max |loss - eager|")
    for mode, row in summary["rows"].items():
        if row.get("failed"):
            print(f"{mode:<20} failed: {_first_lines(row['failed'])}")
            continue

        def ratio(key: str, row: dict = row) -> str:
            return f"{row[key]:.2f}" if row[key] else "-"

        losses = row["losses"]
        loss = f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "-"
        diff = row.get("max_loss_diff_vs_eager")
        loss += f"  {diff:.1e}" if diff is not None else ""
        rss = "/".join(f"{x:.0f}" for x in row["peak_rss_mib"])
        compile_s = f"{row['compile_s']:.1f}" if row.get("compile_s") is not None else "-"
        print(
            f"{mode:<20} {row['median_s']:>9.3f} {row['min_s']:>7.3f} {row['max_s']:>7.3f} {ratio('x_eager'):>8} "
            f"{ratio('x_transport'):>9} {ratio('x_ideal'):>8} {compile_s:>9} {rss:>20}  {loss}"
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
    print("on its half batch without averaging, so it differs by design. compile s: the first warm-up step,")
    print("the slower rank's (one fresh inductor cache per run: a later mode may reuse an earlier one's kernels).")
    print_torch_pass_lines(summary["rows"])
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
    parser.add_argument("--model", default="gpt", choices=MODELS, help="the repo GPT (default), hf-llama or hf-qwen2")
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
        "--modes",
        default=",".join(ALL_MODES),
        help="comma-separated, in order (default: "
        + ", ".join(ALL_MODES)
        + "); only when named: "
        + ", ".join(EXTRA_MODES),
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
        list(QUICK_MODES)
        if args.quick and args.modes == ",".join(ALL_MODES)
        else [m.strip() for m in args.modes.split(",") if m.strip()]
    )
    custom = parse_mode_configs(parser, args.mode_config)
    unknown = [m for m in modes if m not in ALL_MODES + EXTRA_MODES + list(custom)]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; valid: {', '.join(ALL_MODES + EXTRA_MODES)}")
    for mode in list(modes):  # torch's own passes: this torch must have them (not found out in a worker)
        why = mode_torch_error(mode)
        if why and args.modes == ",".join(ALL_MODES):  # the default list: run what this torch can
            print(f"skipped {why}", flush=True)
            modes.remove(mode)
        elif why:
            parser.error(why)
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
        failed = next((r["failed"] for r in results[mode] if r.get("failed")), None)
        if failed:
            print(f"[{mode}] failed: {_first_lines(failed)} ({time.time() - t:.0f} s)", flush=True)
            continue
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
        failed = next((r["failed"] for r in ranks if r.get("failed")), None)
        if failed:
            rows[mode] = {"failed": failed, "peak_mib": None}
            continue
        mem = [r["memory"] for r in ranks]
        rss = [m["rss_hwm_increase_bytes"] for m in mem]
        rows[mode] = {
            "peak_mib": max(m["peak_bytes"] for m in mem) * mib,
            "peak_mib_per_rank": [m["peak_bytes"] * mib for m in mem],
            "state_mib": max(m["state_bytes"] for m in mem) * mib,
            "step_peak_mib": max(m["step_peak_bytes"] for m in mem) * mib,
            "rss_hwm_increase_mib": [x * mib if x is not None else None for x in rss],
            "source": mem[0].get("peak_source", "profiler"),
            "compile_s": _max_or_none(r.get("compile_s") for r in ranks),
            "torch_pass": ranks[0].get("torch_pass"),
            "suggest": ranks[0].get("suggest"),
        }
    eager = rows.get("fsdp2-eager", {}).get("peak_mib")
    for row in rows.values():
        row["x_eager"] = row["peak_mib"] / eager if eager and row["peak_mib"] is not None else None
    return {"rows": rows}


def print_memory_table(summary: dict, header: str) -> None:
    print(header)
    print(
        f"{'mode':<20} {'peak MiB':>9} {'r0/r1':>13} {'x eager':>8} {'held MiB':>9} {'step +MiB r0/r1':>16}"
        f" {'profiler +MiB':>14} {'compile s':>9}"
    )
    sources = set()
    for mode, row in summary["rows"].items():
        if row.get("failed"):
            print(f"{mode:<20} failed: {_first_lines(row['failed'])}")
            continue
        compile_s = f"{row['compile_s']:.1f}" if row.get("compile_s") is not None else "-"
        ranks = "/".join(f"{x:.1f}" for x in row["peak_mib_per_rank"])
        ratio = f"{row['x_eager']:.2f}" if row["x_eager"] else "-"
        rss = "/".join("-" if x is None else f"{x:.1f}" for x in row["rss_hwm_increase_mib"])
        sources.add(row.get("source", "profiler"))
        print(
            f"{mode:<20} {row['peak_mib']:>9.1f} {ranks:>13} {ratio:>8} {row['state_mib']:>9.1f}"
            f" {rss:>16} {row['step_peak_mib']:>14.1f} {compile_s:>9}"
        )
    if sources == {"rss"}:
        print("peak MiB = held + step +MiB, max over ranks. held: parameter shards, gradients and buffers at a")
        print("step's start. step +MiB: the most resident memory a step added (VmHWM - VmRSS at its start, worst")
        print(f"of 2 steps; MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}: tensors are mapped and unmapped, every thread")
        print("counted). profiler +MiB: torch.profiler's running sum on another step; it misses frees on backend")
        print("worker threads, so it reads high for modes whose collectives complete there (docstring).")
    else:
        print("peak MiB = held + profiler +MiB (the RSS high-water mark could not be reset here), max over ranks.")
    print(
        "compile s: the first warm-up step, the slower rank's (each mode in fresh processes, a fresh inductor cache)."
    )
    print_torch_pass_lines(summary["rows"])


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
    results: dict[str, dict] = {m: {"times": [], "losses": [], "peak_rss_mib": 0.0} for m in modes}
    out: dict = {"rank": rank, "modes": results}

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    def ready(mode: str, runner) -> None:
        results[mode]["compiles_warm"] = dynamo_graphs(runner)
        results[mode]["compile_s"] = getattr(runner, "first_step_s", None)
        results[mode].update(runner_notes(runner))

    def stepped(mode: str, runner, index: int) -> None:
        results[mode]["peak_rss_mib"] = max(results[mode]["peak_rss_mib"], runner.peak_rss)
        if lengths:
            results[mode].setdefault("lengths", []).append(lengths[index % len(lengths)])

    runners, step_index = timed_steps(
        modes,
        lambda mode, built: make_runner(
            mode, args.model, args.model_size, built, rate_bps, world, args.plan, custom=custom, log=log
        ),
        data,
        results,
        reps=args.reps,
        steps=args.steps,
        warmup=args.warmup,
        barrier=dist.barrier,
        log=log,
        summary="median",
        on_ready=ready,
        on_step=stepped,
    )
    for mode, runner in runners.items():
        results[mode]["compiles"] = dynamo_graphs(runner)
        results[mode].update(runner_notes(runner))  # a failure in a timed step (a recompile) too
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


def runner_notes(runner) -> dict:
    """What a mode's runner knows beyond its times: its failure (torch-manual), what torch's
    pass did to each graph, the plan both+suggest took."""
    notes: dict = {}
    if getattr(runner, "failed", None):
        notes["failed"] = runner.failed
    info = getattr(runner, "info", None) or {}
    if "suggest" in info:
        notes["suggest"] = info["suggest"]
    patch = getattr(runner, "patch", None) or {}
    custom = patch.get("post_grad_custom_post_pass")
    if custom is not None and hasattr(custom, "runs"):
        notes["torch_pass"] = list(custom.runs)
        notes["plan"] = info.get("plan")
    return notes


def fo_read_yaml(path: str) -> dict:
    from fsdp_overlap_plugin.config.parse import read_yaml

    return read_yaml(path) or {}


def memory_worker(args: argparse.Namespace, modes: list[str], rank: int, world: int, rate_bps: float) -> None:
    """``--memory``: this process runs one mode only: build, warm up, measure one step."""
    import torch.distributed as dist

    (mode,) = modes
    vocab, seq = vocab_and_seq(args.model, args.model_size)
    data = _data(vocab, seq, world, args.warmup + 3)
    log = (lambda msg: print(msg, flush=True)) if rank == 0 else None
    runner = make_runner(mode, args.model, args.model_size, {}, rate_bps, world, args.plan, log=log)
    t = time.perf_counter()
    losses = [runner.step(batch) for batch in data[: args.warmup]]
    warm = time.perf_counter() - t
    notes = runner_notes(runner)
    memory = None if notes.get("failed") else measure_step_memory(runner, data[args.warmup :], dist.barrier)
    out = {
        "rank": rank,
        "mode": mode,
        "memory": memory,
        "warmup_s": warm,
        "compile_s": getattr(runner, "first_step_s", None),
        "losses": losses,
        **notes,
    }
    Path(args.out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
