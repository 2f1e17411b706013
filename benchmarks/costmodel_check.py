"""How good the cost model's predictions are: predicted against measured step time on every
run we can measure.

    sudo python benchmarks/step_time.py --rate 300mbit --modes $M --json gpt-300.json   # M below
    python benchmarks/costmodel_check.py gpt-300.json llama-300.json gpt-100.json llama-100.json
    python benchmarks/costmodel_check.py --fit gpt-300.json ...    # fit the host terms on the first file

    M=fsdp2-eager,compiled,both,both+prefetch-2,compute-only,compute-only-eager,comm-only

CPU rows (``benchmarks/step_time.py --json`` files, which hold each sharded mode's schedule
report). Each mode's step is predicted by ``costmodel.simulate`` from the schedule its
compiled graphs recorded, with rates measured apart from that mode:

- compute: the compute-only step (unsharded, compiled; ``compute-only-eager`` for the eager
  mode), i.e. the achieved FLOP/s that ``fsdp-overlap profile`` measures, over the FLOPs the
  schedule records;
- link: the comm-only replay of the defaults' collectives (the same bytes, no compute): the
  link's achieved bytes/s, about 88% of the tc rate;
- two host terms for gloo on a 2-core machine, fitted once on the first file and then used
  unchanged on every file: ``latency`` (seconds per collective: launch skew between the
  ranks, gloo's per-call cost) and ``contention`` (compute runs this much slower while the
  link is busy: gloo's TCP threads take the same two cores).

What each mode runs: ``both`` / ``both+prefetch-2``: their own recorded schedule after the
passes; ``compiled``: the defaults' schedule before the passes (one collective per
parameter, each waited at once), with gloo's reduce-scatter (a full all-reduce);
``fsdp2-eager``: FSDP2's order on a CPU (each forward gather waited before its layer
computes: no stream runs ahead; backward gathers prefetched one layer ahead, reduce-scatters
waited at once), at the eager compute rate.

GPU rows: one H200, torch 2.11 (issue 42's run): each step predicted from a compute rate
measured on a different model (the Llama3-8B-shaped world-8 step) and the FLOPs of this one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from _harness.costmodel import HOST, fsdp2_on_cpu, gloo_native, schedule  # noqa: E402

from fsdp_overlap_plugin.config.hardware import _GPU_FLOPS  # noqa: E402
from fsdp_overlap_plugin.report.costmodel import simulate  # noqa: E402

LINK_RATES = {"300mbit": 300e6 / 8, "100mbit": 100e6 / 8}
PREDICTED_MODES = ("fsdp2-eager", "compiled", "both", "both+prefetch-2")
# gloo's all-gather and all-reduce send before they receive: on 2 ranks over one link, one
# direction at a time, so they take twice the time of the receive-first all-to-alls
# (benchmarks/RESULTS.md, "receive_first by default"). Not fitted: the half-duplex factor.
SEND_FIRST = 2.0
TOLERANCE = 0.10
# The rates the cpu predictions used before this calibration (the tc rate as the link, one
# core's rough compute, no host terms): the table's "before" column.
ROUGH = {"flops": 5e10, "mem": 1e10, "link": 300e6 / 8}

# One H200, torch 2.11.0+cu130 (issue 42's gpu_check run): gpt_1b (1.35B), batch 8 x 2048,
# AdamW, bf16 params / fp32 reduce, median step s. FLOPs per step: 8.86e9 per token (6 per
# matmul parameter plus attention) x 16384 tokens.
GPU_RUNS = {
    "gpt_1b eager fully_shard (compile: false)": (0.291, True),
    "gpt_1b compiled, passes off": (0.279, False),
    "gpt_1b compiled, passes on": (0.277, False),
}
GPU_FLOPS_PER_STEP = 8.86e9 * 16384
GPU_PARAMS = 1_347_014_656
GPU_MEM = 4.8e12  # H200 HBM3e bytes/s, for the AdamW step (28 bytes per parameter)
EAGER_COMPUTE = 0.291 / 0.277  # predict_scale.py's eager factor: measured on these same rows


def play(graphs: dict[str, list[dict]], rates: dict) -> float:
    return sum(simulate(events, world=2, **rates)["total_s"] for events in graphs.values())


def load_run(path: str) -> dict:
    """A step_time JSON -> its measured medians, the schedules each mode runs, and the rates
    measured apart from the predicted modes."""
    data = json.loads(Path(path).read_text())
    rows = data["summary"]["rows"]
    reports = data["raw"][0]["reports"]
    after = schedule(reports["both"], "after")
    flops = sum(e.get("flops", 0) for events in after.values() for e in events if e["op"] == "compute")
    nominal = {"flops": 1e30, "mem": 1e30, "link": LINK_RATES[data["rate"]], "send_first": SEND_FIRST}
    link_s = sum(simulate(events, world=2, **nominal)["comm_s"] for events in after.values())
    compute = rows["compute-only"]["median_s"]
    eager_compute = rows.get("compute-only-eager", {}).get("median_s")
    # the link as the replay of the defaults' collectives measured it (queued back to back)
    measured_link = LINK_RATES[data["rate"]] * link_s / rows["comm-only"]["median_s"]
    graphs = {
        "both": after,
        "both+prefetch-2": schedule(reports["both+prefetch-2"], "after"),
        "compiled": {k: gloo_native(v) for k, v in schedule(reports["both"], "before").items()},
        "fsdp2-eager": fsdp2_on_cpu(after),
    }
    header = data["header"]
    model = "hf-llama" if "LlamaForCausalLM" in header else "gpt"
    return {
        "path": path,
        "label": f"{model} small, {data['rate']}",
        "rate": data["rate"],
        "measured": {m: rows[m]["median_s"] for m in PREDICTED_MODES if m in rows},
        "graphs": graphs,
        "flops_per_s": flops / compute,
        "eager_flops_per_s": flops / eager_compute if eager_compute else None,
        "link": measured_link,
        "link_share": link_s / rows["comm-only"]["median_s"],
        "compute_s": compute,
        "comm_s": rows["comm-only"]["median_s"],
    }


def rates(run: dict, mode: str, host: dict) -> dict:
    flops = run["eager_flops_per_s"] if mode == "fsdp2-eager" and run["eager_flops_per_s"] else run["flops_per_s"]
    return {"flops": flops, "mem": 1e18, "link": run["link"], **host}


def predictions(run: dict, host: dict) -> dict[str, float]:
    return {m: play(run["graphs"][m], rates(run, m, host)) for m in run["measured"]}


def fit(run: dict) -> dict:
    """The host terms that minimise the largest relative error on ``run``."""
    best = None
    for latency in [i * 0.5e-3 for i in range(7)]:
        for contention in [i * 0.25 for i in range(21)]:
            for send_first in (SEND_FIRST,):
                host = {"latency": latency, "contention": contention, "send_first": send_first}
                pred = predictions(run, host)
                err = max(abs(pred[m] / run["measured"][m] - 1) for m in pred)
                if best is None or err < best[0]:
                    best = (err, host)
    return best[1]


def gpu_rows() -> list[dict]:
    rows = []
    optimizer_s = 28 * GPU_PARAMS / GPU_MEM
    for label, (measured, eager) in GPU_RUNS.items():
        predicted = GPU_FLOPS_PER_STEP / (_GPU_FLOPS / (EAGER_COMPUTE if eager else 1.0)) + optimizer_s
        rows.append({"run": f"H200, 1 rank: {label}", "measured": measured, "predicted": predicted})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", help="benchmarks/step_time.py --json files")
    p.add_argument("--fit", action="store_true", help="fit the host terms on the first file instead of HOST")
    p.add_argument("--json", default=None, help="also write the table here")
    args = p.parse_args(argv)
    runs = [load_run(path) for path in args.runs]
    host = fit(runs[0]) if args.fit and runs else dict(HOST)
    print(
        f"host terms: latency {host['latency'] * 1e3:.1f} ms per collective, contention {host['contention']:.2f}, "
        f"send-first collectives x{host['send_first']:.2f}"
    )
    table = []
    for run in runs:
        print(
            f"{run['label']}: compute-only {run['compute_s']:.3f} s -> {run['flops_per_s']:.3g} FLOP/s"
            + (f" (eager {run['eager_flops_per_s']:.3g})" if run["eager_flops_per_s"] else "")
            + f"; comm-only replay {run['comm_s']:.3f} s -> link {run['link'] * 8 / 1e6:.0f} Mbit/s "
            f"({run['link_share'] * 100:.0f}% of the tc rate)"
        )
        pred = predictions(run, host)
        rough = dict(ROUGH, link=LINK_RATES[run["rate"]])
        default = {m: play(g, rough) for m, g in run["graphs"].items() if m in run["measured"]}
        for mode, measured in run["measured"].items():
            table.append(
                {
                    "run": f"{run['label']}: {mode}",
                    "measured": measured,
                    "predicted": pred[mode],
                    "uncalibrated": default[mode],
                }
            )
    table += gpu_rows()
    print(f"{'run':<44} {'measured s':>10} {'predicted s':>11} {'error':>7}  {'before (rough rates)':>20}")
    misses = 0
    for row in table:
        err = row["predicted"] / row["measured"] - 1
        row["error"] = err
        misses += abs(err) > TOLERANCE
        before = row.get("uncalibrated")
        print(
            f"{row['run']:<44} {row['measured']:10.3f} {row['predicted']:11.3f} {err * 100:+6.1f}%  "
            + (f"{before:9.3f} ({(before / row['measured'] - 1) * 100:+.0f}%)" if before else "")
        )
    print(f"{len(table) - misses} of {len(table)} within {TOLERANCE * 100:.0f}%")
    if args.json:
        Path(args.json).write_text(json.dumps({"host": host, "rows": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
