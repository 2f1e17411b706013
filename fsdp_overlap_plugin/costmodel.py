"""The cost model: how long a recorded schedule takes on a two-lane machine, how much of
its communication is exposed, and the timeline picture of both lanes.

A model for comparing schedules (before and after the passes), with rough default rates
per device type, not a measurement. Reads the schedules ``passes/events.py`` records;
``report.schedule_report`` adds ``predicted`` from here, and ``fsdp-overlap timeline`` /
``explain --png`` draw with ``draw_timeline``.
"""

from __future__ import annotations

from .records import KINDS, current

__all__ = ["DEFAULT_RATES", "draw_timeline", "predicted", "rates_for", "simulate"]

# A bucket number is written on a communication bar wider than 1/60 of the time axis:
# narrower bars cannot hold it legibly at the figure's width.
_LABELLED_BARS_PER_AXIS = 60

# Rough rates per device type for the *predicted* timeline: a model to compare schedules,
# not a measurement. FLOP/s, memory bytes/s, and link bytes/s per rank.
DEFAULT_RATES = {
    "cpu": {"flops": 5e10, "mem": 1e10, "link": 300e6 / 8},  # one core; the 300 Mbit benchmark link
    "cuda": {"flops": 4e14, "mem": 3e12, "link": 2.5e10},  # H100-class bf16, NVLink-ish
    "npu": {"flops": 3e14, "mem": 1.6e12, "link": 2.5e10},
}


def rates_for(device_type: str | None) -> dict:
    """The rates the predictions use for a device type (cpu's for an unknown one)."""
    return dict(DEFAULT_RATES.get(device_type or "cpu", DEFAULT_RATES["cpu"]))


def simulate(events: list[dict], *, world: int, flops: float, mem: float, link: float) -> dict:
    """Play a schedule on a two-lane machine: compute runs items in order; one link runs
    collectives in issue order, each taking the bytes a ring collective sends per rank
    ((world-1)/world of the full tensor) over ``link`` bytes/s; a wait blocks compute until
    its collective is done. Returns the lanes and the predicted exposed communication
    (time compute spent blocked in waits)."""
    t_compute = t_link = 0.0
    done: dict[str, float] = {}
    compute, comm, blocked = [], [], []
    exposed = 0.0
    share = (world - 1) / world if world > 1 else 0.0
    for ev in events:
        op = ev["op"]
        if op == "compute":
            dur = max(ev.get("flops", 0) / flops, ev.get("bytes", 0) / mem)
            compute.append((t_compute, t_compute + dur, ev.get("module")))
            t_compute += dur
        elif op == "wait":
            end = done.get(ev.get("of") or "", t_compute)
            if end > t_compute:
                blocked.append((t_compute, end, ev.get("bucket")))
                exposed += end - t_compute
                t_compute = end
        else:
            start = max(t_compute, t_link)
            dur = ev.get("bytes", 0) * share / link
            comm.append((start, start + dur, op, ev.get("bucket")))
            t_link = start + dur
            done[ev["name"]] = t_link
    total = max([t_compute] + [end for end in done.values()])
    busy = sum(b - a for a, b, *_ in comm)
    return {
        "total_s": total,
        "exposed_comm_s": exposed,
        "comm_s": busy,
        "compute_s": sum(b - a for a, b, _ in compute),
        "compute": compute,
        "comm": comm,
        "blocked": blocked,
    }


def predicted(report: dict, rates: dict | None = None) -> dict:
    """Predicted total and exposed-communication seconds per kind of graph, before/after
    the passes: the sum over that kind's training graphs that run now (one, without graph
    breaks; the latest compile when a new sequence length compiled the forward again)."""
    rates = rates or rates_for(report.get("device_type"))
    keys = ("total_s", "exposed_comm_s", "comm_s", "compute_s")
    out: dict = {}
    running = current(report.get("graphs") or [], (report.get("config") or {}).get("fullgraph", True))
    for kind in KINDS:
        records = [r for r in running if r["graph"] == kind and not r.get("inference") and "schedule" in r]
        if not records and (report.get(kind) or {}).get("schedule"):
            records = [report[kind]]  # a report written before per-graph records
        if not records:
            continue
        out[kind] = {}
        for phase in ("before", "after"):
            sims = [simulate(r["schedule"][phase], world=report["world_size"], **rates) for r in records]
            out[kind][phase] = {k: round(sum(sim[k] for sim in sims), 6) for k in keys}
    return out


def draw_timeline(report: dict, path: str, rates: dict | None = None) -> str:
    """Draw compute and communication lanes of each graph before and after the passes
    (the cost model of ``simulate``) as a PNG. Needs matplotlib (the ``viz`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("the timeline needs matplotlib: pip install 'fsdp-overlap-plugin[viz]'") from None
    rates = rates or rates_for(report.get("device_type"))
    rows = [
        (kind, phase) for kind in KINDS if (report.get(kind) or {}).get("schedule") for phase in ("before", "after")
    ]
    if not rows:
        raise ValueError("the report has no recorded schedules (run a training step first)")
    sims = {row: simulate(report[row[0]]["schedule"][row[1]], world=report["world_size"], **rates) for row in rows}
    horizon = max(s["total_s"] for s in sims.values()) or 1.0
    colors = {
        "all_gather": "#4c72b0",
        "reduce_scatter": "#dd8452",
        "all_to_all": "#dd8452",
        "all_reduce": "#8172b3",
        "collective": "#937860",
    }
    fig, axes = plt.subplots(len(rows), 1, figsize=(12, 1.35 * len(rows) + 0.8), sharex=True, squeeze=False)
    for ax, row in zip(axes[:, 0], rows):
        sim = sims[row]
        ax.broken_barh([(a, b - a) for a, b, _ in sim["compute"]], (10, 8), facecolors="#55a868")
        ax.broken_barh([(a, b - a) for a, b, *_ in sim["blocked"]], (10, 8), facecolors="#c44e52", hatch="//")
        for a, b, op, bucket in sim["comm"]:
            ax.broken_barh([(a, b - a)], (0, 8), facecolors=colors.get(op, "#937860"), edgecolor="white", linewidth=0.4)
            if bucket is not None and (b - a) > horizon / _LABELLED_BARS_PER_AXIS:
                ax.text((a + b) / 2, 4, str(bucket), ha="center", va="center", fontsize=6, color="white")
        ax.set_yticks([4, 14], ["comm", "compute"], fontsize=8)
        ax.set_xlim(0, horizon * 1.01)
        ax.set_title(
            f"{row[0]} graph, {row[1]} the passes: {sim['total_s'] * 1e3:.1f} ms predicted, "
            f"{sim['exposed_comm_s'] * 1e3:.1f} ms of communication exposed",
            fontsize=9,
            loc="left",
        )
    axes[-1, 0].set_xlabel(
        "seconds (cost model: green compute, red = compute waiting, blue all-gather, orange reduce-scatter; "
        "numbers = bucket)",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
