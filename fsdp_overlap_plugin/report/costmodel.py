"""The cost model: how long a recorded schedule takes on a two-lane machine, how much of
its communication is exposed, and the timeline picture of both lanes.

A model for comparing schedules (before and after the passes), with rough default rates
per device type, not a measurement. Reads the schedules ``passes/events.py`` records;
``report.schedule_report`` adds ``predicted`` from here, and ``fsdp-overlap timeline`` /
``explain --png`` draw with ``draw_timeline``.
"""

from __future__ import annotations

from ..config.hardware import (
    DEFAULT_RATES,
    HARDWARE,
    Hardware,
    load_profile,
    parse_hardware,
    parse_rate,
    rates_for,
    resolve_rates,
)
from ..runtime.records import KINDS, current

__all__ = [
    "DEFAULT_RATES",
    "HARDWARE",
    "Hardware",
    "as_run",
    "draw_timeline",
    "load_profile",
    "parse_hardware",
    "parse_rate",
    "plan_schedule",
    "predict_step",
    "predicted",
    "rates_for",
    "report_rates",
    "resolve_rates",
    "simulate",
    "tensor_buckets",
]

# A bucket number is written on a communication bar wider than 1/60 of the time axis:
# narrower bars cannot hold it legibly at the figure's width.
_LABELLED_BARS_PER_AXIS = 60

# Collectives that a send-first backend (gloo) runs one link direction at a time.
_SEND_FIRST_OPS = ("all_gather", "all_reduce", "reduce_scatter")


def _link_time(op: str, nbytes: float, ranks: int, link: float, latency: float, send_first: float = 1.0) -> float:
    """Seconds one collective holds its link: ring all-gather / reduce-scatter / all-to-all
    move (n-1)/n of the full tensor per rank, an all-reduce twice that; ``send_first``
    multiplies the time of the collectives a backend runs sending before receiving (gloo's
    all-gather and all-reduce on 2 ranks: one direction at a time, 2.0)."""
    if ranks <= 1:
        return 0.0
    share = (ranks - 1) / ranks * (2 if op == "all_reduce" else 1)
    return latency + nbytes * share / link * (send_first if op in _SEND_FIRST_OPS else 1.0)


def simulate(
    events: list[dict],
    *,
    world: int,
    flops: float,
    mem: float,
    link: float,
    inter_link: float | None = None,
    latency: float = 0.0,
    contention: float = 0.0,
    send_first: float = 1.0,
    tensor_link: float | None = None,
) -> dict:
    """Play a schedule on a machine with one compute lane and a link per kind of group:
    compute runs items in order; each link runs its collectives in issue order (an event's
    ``lane`` "inter" is the replicas' link, at ``inter_link``; its ``ranks`` the group size,
    ``world`` by default), each taking ``latency`` plus the bytes a ring collective sends per
    rank (``(n-1)/n`` of the full tensor, twice that for an all-reduce) over the link's
    bytes/s; a wait blocks compute until its collective is done. ``contention``: how much
    slower compute runs while a link is busy (0.25: a quarter slower), for hosts where the
    transport takes the compute's cores (gloo on a CPU; 0 on a GPU, whose collectives run on
    their own engines); ``send_first``: see ``_link_time``; ``tensor_link``: the rate of the
    lane "tensor" (a tensor-parallel group's collectives, inside a node; ``None``: ``link``).
    Returns the lanes (``lane_s``: each link's busy seconds) and the predicted exposed
    communication (time compute spent blocked in waits)."""
    t_compute = 0.0
    # "tensor": a tensor-parallel plan's collectives, inside a node, on their own queue
    t_lane = {"link": 0.0, "inter": 0.0, "tensor": 0.0}
    speed = {"link": link, "inter": inter_link or link, "tensor": tensor_link or link}
    done: dict[str, float] = {}
    compute, comm, blocked = [], [], []
    lane_s = dict.fromkeys(t_lane, 0.0)
    exposed = 0.0
    for ev in events:
        op = ev["op"]
        if op == "compute":
            dur = max(ev.get("flops", 0) / flops, ev.get("bytes", 0) / mem)
            busy = max(t_lane.values()) - t_compute  # collectives queued ahead of this item
            if contention and busy > 0:
                slow = 1.0 + contention
                dur = dur * slow if dur * slow <= busy else busy + (dur - busy / slow)
            compute.append((t_compute, t_compute + dur, ev.get("module")))
            t_compute += dur
        elif op == "wait":
            end = done.get(ev.get("of") or "", t_compute)
            if end > t_compute:
                blocked.append((t_compute, end, ev.get("bucket")))
                exposed += end - t_compute
                t_compute = end
        else:
            lane = ev.get("lane") or "link"
            start = max(t_compute, t_lane[lane])
            dur = _link_time(op, ev.get("bytes", 0), ev.get("ranks") or world, speed[lane], latency, send_first)
            comm.append((start, start + dur, op, ev.get("bucket")))
            lane_s[lane] += dur
            t_lane[lane] = start + dur
            done[ev["name"]] = t_lane[lane]
    total = max([t_compute] + [end for end in done.values()])
    busy = sum(b - a for a, b, *_ in comm)
    return {
        "total_s": total,
        "exposed_comm_s": exposed,
        "comm_s": busy,
        "lane_s": lane_s,
        "compute_s": sum(b - a for a, b, _ in compute),
        "compute": compute,
        "comm": comm,
        "blocked": blocked,
    }


SCHEDULES = ("passes", "no-passes", "fsdp2")

# What a tensor-parallel rank holds of a bucket: a 1/tensor slice of each weight, so of
# the bytes its shard group gathers and reduces, and of its matmuls' FLOPs
_TENSOR_SPLIT = ("gather_bytes", "reduce_bytes", "flops_forward", "flops_backward", "recompute_flops")


def tensor_buckets(buckets: list[dict], tensor: int) -> list[dict]:
    """The buckets as one rank of a ``tensor``-rank tensor-parallel group sees them: each
    weight split over the group (colwise/rowwise), so the bytes its FSDP collectives move and
    its FLOPs are 1/``tensor`` of the whole bucket's; a bucket with ``"tensor_split":
    False`` (left whole on every rank of the group, as ``tp_plan: auto`` leaves the
    embedding and the head) keeps them all. New dicts; the input is not changed."""
    out = []
    for b in buckets:
        split = tensor if b.get("tensor_split", True) else 1
        out.append({**b, **{k: b[k] / split for k in _TENSOR_SPLIT if k in b}})
    return out


def plan_schedule(
    buckets: list[dict],
    *,
    schedule: str = "passes",
    depth: int = 1,
    shard: int,
    replicas: int = 1,
    tensor: int = 1,
    tp_overlap: bool = False,
) -> dict[str, list[dict]]:
    """A step's schedule built from a bucket plan instead of a traced graph: what
    ``check``, ``inspect``, ``suggest`` and the scale predictions play with ``simulate``.
    Each bucket: ``gather_bytes`` / ``reduce_bytes`` (the whole bucket, in param / reduce
    dtype), ``flops_forward`` / ``flops_backward`` (one rank's, for its tokens),
    ``collectives`` (its parameters: the collectives without bucketing) and ``regather``
    (re-gathered in backward: reshard after forward, not kept).

    ``schedule``: "passes" (the defaults: one gather per bucket, launched ``depth`` buckets
    ahead, each gradient reduce-scatter launched after its bucket's backward and waited at
    the end; with replicas, as the graph runs: each reduce-scatter waited once the next
    has launched, its replica all-reduce launched right then and waited once the next
    all-reduce has launched); "no-passes" (compiled without
    the passes: one collective per parameter, each waited right away); "fsdp2" (torch's
    ``fully_shard``, eager or compiled per block, on a GPU: one gather per bucket prefetched
    one ahead on its own stream, reduce-scatters and replica all-reduces on theirs, waited
    at the end).

    ``tensor`` > 1: 2-D, each shard group's rank one of a tensor-parallel group of
    ``tensor`` ranks (``tensor_buckets``: its bytes and FLOPs are 1/``tensor`` of a bucket's,
    and a bucket's ``tp_forward`` / ``tp_backward`` collectives run on the lane "tensor"
    between equal pieces of its compute, each waited before the next piece: the matmul after
    it needs its result). ``tp_overlap``: async TP, each runs beside the piece of compute
    next to it and is waited after that piece (what inductor's micro-pipelined TP hides at
    best). ``tensor`` 1 gives the 1-D schedule, whatever the buckets carry."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: valid: {', '.join(SCHEDULES)}")
    tp = tensor > 1
    if tp:
        buckets = tensor_buckets(buckets, tensor)
    fwd: list[dict] = []
    bwd: list[dict] = []
    counter = iter(range(10**9))

    def launch(events: list[dict], op: str, nbytes: float, bucket: int, lane: str = "link") -> str:
        name = f"{op}_{next(counter)}"
        ranks = replicas if lane == "inter" else tensor if lane == "tensor" else shard
        events.append({"op": op, "name": name, "bucket": bucket, "bytes": nbytes, "ranks": ranks, "lane": lane})
        return name

    def wait(events: list[dict], of: str, bucket: int) -> None:
        events.append({"op": "wait", "name": f"wait_{of}", "of": of, "bucket": bucket})

    def work(events: list[dict], flops: float, bucket: int) -> None:
        events.append({"op": "compute", "name": f"compute_{bucket}", "bucket": bucket, "flops": flops, "bytes": 0})

    def compute(events: list[dict], flops: float, bucket: int, collectives=()) -> None:
        if not (tp and collectives):
            work(events, flops, bucket)
            return
        for op, nbytes in collectives:
            if tp_overlap:  # launched beside the matmul it feeds (or drains), waited after it
                name = launch(events, op, nbytes, bucket, "tensor")
                work(events, flops / len(collectives), bucket)
            else:  # the next matmul needs its result: compute stops until it is done
                work(events, flops / len(collectives), bucket)
                name = launch(events, op, nbytes, bucket, "tensor")
            wait(events, name, bucket)

    if schedule == "no-passes":
        for i, b in enumerate(buckets):
            n = max(1, int(b.get("collectives", 1)))
            for _ in range(n):
                wait(fwd, launch(fwd, "all_gather", b["gather_bytes"] / n, i), i)
            compute(fwd, b["flops_forward"], i, b.get("tp_forward", ()))
        for i in reversed(range(len(buckets))):
            b = buckets[i]
            n = max(1, int(b.get("collectives", 1)))
            if b.get("regather", True):
                for _ in range(n):
                    wait(bwd, launch(bwd, "all_gather", b["gather_bytes"] / n, i), i)
            compute(bwd, b["flops_backward"], i, b.get("tp_backward", ()))
            for _ in range(n):
                rs = launch(bwd, "reduce_scatter", b["reduce_bytes"] / n, i)
                wait(bwd, rs, i)
                if replicas > 1:
                    wait(bwd, launch(bwd, "all_reduce", b["reduce_bytes"] / n / shard, i, "inter"), i)
        return {"forward": fwd, "backward": bwd}

    ahead = 1 if schedule == "fsdp2" else max(1, depth)

    def gathered(events: list[dict], order: list[int], flops_key: str, after, tp_key: str) -> None:
        pending: dict[int, str] = {}
        for i in order[:ahead]:
            pending[i] = launch(events, "all_gather", buckets[i]["gather_bytes"], i)
        for k, i in enumerate(order):
            if k + ahead < len(order):
                j = order[k + ahead]
                pending[j] = launch(events, "all_gather", buckets[j]["gather_bytes"], j)
            wait(events, pending.pop(i), i)
            compute(events, buckets[i][flops_key], i, buckets[i].get(tp_key, ()))
            after(i)

    gathered(fwd, list(range(len(buckets))), "flops_forward", lambda i: None, "tp_forward")
    order = list(reversed(range(len(buckets))))
    regathered = [i for i in order if buckets[i].get("regather", True)]
    scatters: list[tuple[int, str]] = []

    replica_passes = replicas > 1 and schedule == "passes"
    in_flight: dict[str, tuple[int, str] | None] = {"scatter": None, "reduce": None}

    def replica_step(last: bool) -> None:
        # HSDP with the passes, as the graph runs it: the previous bucket's reduce-scatter
        # is waited once this one has launched, its replica all-reduce launched at once,
        # and the all-reduce before that waited only then (one waited per launch)
        if in_flight["scatter"] is not None:
            j, rs = in_flight["scatter"]
            wait(bwd, rs, j)
            ar = launch(bwd, "all_reduce", buckets[j]["reduce_bytes"] / shard, j, "inter")
            if in_flight["reduce"] is not None:
                wait(bwd, in_flight["reduce"][1], in_flight["reduce"][0])
            in_flight["reduce"] = (j, ar)
            in_flight["scatter"] = None
        if last and in_flight["reduce"] is not None:
            wait(bwd, in_flight["reduce"][1], in_flight["reduce"][0])

    def after_backward(i: int) -> None:
        rs = launch(bwd, "reduce_scatter", buckets[i]["reduce_bytes"], i)
        if replica_passes:
            replica_step(last=False)
            in_flight["scatter"] = (i, rs)
            return
        scatters.append((i, rs))
        if replicas > 1 and schedule == "fsdp2":  # on the reduce-scatter's stream, right behind it
            scatters.append((i, launch(bwd, "all_reduce", buckets[i]["reduce_bytes"] / shard, i, "inter")))

    # backward: kept buckets compute from their forward gather; the rest are re-gathered
    pending: dict[int, str] = {}
    for i in regathered[:ahead]:
        pending[i] = launch(bwd, "all_gather", buckets[i]["gather_bytes"], i)
    for i in order:
        if i in pending or i in regathered:
            k = regathered.index(i)
            if k + ahead < len(regathered):
                j = regathered[k + ahead]
                pending[j] = launch(bwd, "all_gather", buckets[j]["gather_bytes"], j)
            wait(bwd, pending.pop(i), i)
        compute(bwd, buckets[i]["flops_backward"], i, buckets[i].get("tp_backward", ()))
        after_backward(i)
    if replica_passes:
        replica_step(last=True)
    for i, name in scatters:
        wait(bwd, name, i)
    return {"forward": fwd, "backward": bwd}


def predict_step(
    buckets: list[dict],
    rates: dict,
    *,
    schedule: str = "passes",
    depth: int = 1,
    shard: int,
    replicas: int = 1,
    extra_compute_s: float = 0.0,
    tensor: int = 1,
    tp_overlap: bool = False,
) -> dict:
    """Predicted seconds of one training step from a bucket plan (``plan_schedule``
    played by ``simulate``): ``{"step_s", "forward", "backward", "compute_s", "comm_s",
    "exposed_comm_s", "tensor_comm_s"}``; ``extra_compute_s`` (the optimizer step, say) is
    added as compute that hides nothing. ``tensor`` / ``tp_overlap``: see ``plan_schedule``;
    ``tensor_comm_s`` is the tensor-parallel collectives' share of ``comm_s`` (their lane's
    rate: ``rates["tensor_link"]``, else ``rates["link"]``)."""
    graphs = plan_schedule(
        buckets, schedule=schedule, depth=depth, shard=shard, replicas=replicas, tensor=tensor, tp_overlap=tp_overlap
    )
    out: dict = {}
    for kind, events in graphs.items():
        sim = simulate(events, world=shard, **rates)
        out[kind] = {k: sim[k] for k in ("total_s", "exposed_comm_s", "comm_s", "compute_s")}
        out[kind]["tensor_comm_s"] = sim["lane_s"]["tensor"]
    for key in ("compute_s", "comm_s", "exposed_comm_s", "tensor_comm_s"):
        out[key] = sum(out[k][key] for k in graphs)
    out["step_s"] = sum(out[k]["total_s"] for k in graphs) + extra_compute_s
    return out


def as_run(events: list[dict], device_type: str | None) -> list[dict]:
    """The events as the backend runs them: gloo's reduce_scatter_tensor is a clone plus a
    full all-reduce, so on cpu a reduce-scatter costs what an all-reduce does."""
    if device_type != "cpu":
        return events
    return [dict(ev, op="all_reduce") if ev["op"] == "reduce_scatter" else ev for ev in events]


def hsdp_lanes(events: list[dict], mesh: list[int]) -> list[dict]:
    """A recorded schedule on the lanes of its mesh: on HSDP (``mesh`` = [replicas, shard],
    replicas > 1) every all-reduce not on a lane of its own (a tensor-parallel plan's are on
    ``tensor``) is the replicas' and goes to the ``inter`` lane over ``replicas`` ranks; every other collective to the
    shard link over ``shard`` ranks; an event's own ``lane`` decides where it has one. A 1-D
    mesh's events come back as they are."""
    if len(mesh) != 2 or mesh[0] <= 1:
        return events
    replicas, shard = mesh
    out = []
    for ev in events:
        if ev["op"] in ("compute", "wait"):
            out.append(ev)
        else:
            lane = ev.get("lane") or ("inter" if ev["op"] == "all_reduce" else "link")
            ranks = ev.get("ranks") if lane == "tensor" else replicas if lane == "inter" else shard
            out.append(dict(ev, lane=lane, ranks=ranks))
    return out


def report_rates(report: dict) -> dict:
    """The rates a report's predictions use: what it recorded (its hardware and compute
    profile settings), else the device type's default."""
    return dict((report.get("cost_model") or {}).get("rates") or rates_for(report.get("device_type")))


def predicted(report: dict, rates: dict | None = None) -> dict:
    """Predicted total and exposed-communication seconds per kind of graph, before/after
    the passes: the sum over that kind's training graphs that run now (one, without graph
    breaks; the latest compile when a new sequence length compiled the forward again). On
    HSDP the replica all-reduces run on the link between replicas (``hsdp_lanes``)."""
    rates = rates or report_rates(report)
    keys = ("total_s", "exposed_comm_s", "comm_s", "compute_s")
    out: dict = {}
    running = current(report.get("graphs") or [], (report.get("config") or {}).get("fullgraph", True))
    device = report.get("device_type")
    mesh = list(report.get("mesh") or [report["world_size"]])
    shard = mesh[-1]  # the ranks of a shard group: the world on a 1-D mesh
    for kind in KINDS:
        records = [r for r in running if r["graph"] == kind and not r.get("inference") and "schedule" in r]
        if not records and (report.get(kind) or {}).get("schedule"):
            records = [report[kind]]  # a report written before per-graph records
        if not records:
            continue
        out[kind] = {}
        for phase in ("before", "after"):
            sims = [
                simulate(as_run(hsdp_lanes(r["schedule"][phase], mesh), device), world=shard, **rates) for r in records
            ]
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
    rates = rates or report_rates(report)
    rows = [
        (kind, phase) for kind in KINDS if (report.get(kind) or {}).get("schedule") for phase in ("before", "after")
    ]
    if not rows:
        raise ValueError("the report has no recorded schedules (run a training step first)")
    device = report.get("device_type")
    mesh = list(report.get("mesh") or [report["world_size"]])
    sims = {
        row: simulate(as_run(hsdp_lanes(report[row[0]]["schedule"][row[1]], mesh), device), world=mesh[-1], **rates)
        for row in rows
    }
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
