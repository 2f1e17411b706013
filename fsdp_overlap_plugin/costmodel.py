"""The cost model: how long a recorded schedule takes on a two-lane machine, how much of
its communication is exposed, and the timeline picture of both lanes.

A model for comparing schedules (before and after the passes), with rough default rates
per device type, not a measurement. Reads the schedules ``passes/events.py`` records;
``report.schedule_report`` adds ``predicted`` from here, and ``fsdp-overlap timeline`` /
``explain --png`` draw with ``draw_timeline``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .records import KINDS, current

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
]

# A bucket number is written on a communication bar wider than 1/60 of the time axis:
# narrower bars cannot hold it legibly at the figure's width.
_LABELLED_BARS_PER_AXIS = 60

# The rates when nothing better is known: per device type, a hardware preset (below). The
# cpu one is the 300 Mbit benchmark link with one core's rough compute.
_DEVICE_PRESET = {"cpu": "cpu-gloo-300mbit", "cuda": "h100-nvlink", "npu": "ascend-910b-hccs"}


@dataclass(frozen=True)
class Hardware:
    """One machine's rates, each with where its number comes from. ``link``: bytes/s per
    rank that the shard group's collectives move (bus bandwidth, as nccl-tests reports it:
    an all-gather of S bytes over n ranks takes S * (n-1)/n / link); ``inter_link``: the
    same between replicas (HSDP's all-reduce; ``None``: ``link``); ``flops``: FLOP/s the
    compute lane achieves on a training step (not the peak); ``mem``: memory bytes/s;
    ``latency``: seconds each collective costs on top of its bytes."""

    name: str
    what: str
    device_type: str
    link: float
    link_source: str
    flops: float
    flops_source: str
    mem: float
    inter_link: float | None = None
    inter_source: str | None = None
    latency: float = 0.0
    contention: float = 0.0
    send_first: float = 1.0

    def rates(self) -> dict:
        return {
            "flops": self.flops,
            "mem": self.mem,
            "link": self.link,
            "inter_link": self.inter_link or self.link,
            "latency": self.latency,
            "contention": self.contention,
            "send_first": self.send_first,
        }


# With a measured compute rate, memory-bound work is inside the achieved FLOP/s: memory is
# then never the slower lane of a compute item.
_PROFILE_MEM = 1e18

# Compute measured on a GPU (issue 42): a 1.92B Llama with Llama3-8B's layer shapes, 4
# layers, batch 2 x 4096, world 8 on a fake process group (every copy-in/out runs, the
# collectives move nothing), one H200, torch 2.11: 0.152 s per step for 7.53e13 FLOPs
# (6 per matmul parameter per token, plus 12 * layers * hidden * sequence for attention).
_GPU_FLOPS = 4.95e14
_GPU_FLOPS_SOURCE = (
    "measured: 4.95e14 FLOP/s achieved by the compiled step of a Llama3-8B-shaped model on one H200 "
    "(world 8 on a fake process group; 50% of the 989 TFLOP/s bf16 peak, which the H100 SXM shares)"
)
_NVLINK4 = (
    "NVLink 4: 18 links x 50 GB/s = 900 GB/s per GPU, 450 GB/s each way (NVIDIA H100/H200 datasheets); "
    "takes 80% of one way, about what nccl-tests' all-gather bus bandwidth reaches on 8 GPUs"
)


def _hopper(name: str, what: str, mem: float = 3.35e12, **inter: Any) -> Hardware:
    """An H100/H200 SXM preset: NVLink 4 inside a node, the compute rate measured on the H200,
    and (``inter``) the link between nodes with its source and latency."""
    return Hardware(
        name,
        what,
        "cuda",
        link=360e9,
        link_source=_NVLINK4,
        flops=_GPU_FLOPS,
        flops_source=_GPU_FLOPS_SOURCE,
        mem=mem,
        **{"latency": 15e-6, **inter},
    )


HARDWARE: dict[str, Hardware] = {
    hw.name: hw
    for hw in (
        _hopper("h100-nvlink", "8x H100 SXM in one NVLink domain (DGX/HGX H100)"),
        _hopper("h200-nvlink", "8x H200 SXM in one NVLink domain (HGX H200)", mem=4.8e12),
        _hopper(
            "h100-ib400",
            "H100 SXM nodes, NVLink inside a node, one 400 Gbit/s InfiniBand NDR NIC per GPU",
            inter_link=45e9,
            inter_source="InfiniBand NDR: 400 Gbit/s = 50 GB/s each way per GPU (ConnectX-7); takes 90%, "
            "the share nccl-tests' inter-node bus bandwidth typically reaches",
        ),
        _hopper(
            "h100-ib200",
            "H100 SXM nodes, NVLink inside a node, one 200 Gbit/s InfiniBand HDR NIC per GPU",
            inter_link=22.5e9,
            inter_source="InfiniBand HDR: 200 Gbit/s = 25 GB/s each way per GPU (ConnectX-6); takes 90%",
        ),
        _hopper(
            "h100-roce400",
            "H100 SXM nodes, NVLink inside a node, one 400 Gbit/s RoCE v2 NIC per GPU",
            inter_link=40e9,
            inter_source="RoCE v2 at 400 Gbit/s = 50 GB/s each way per GPU; takes 80% (Ethernet fabrics "
            "reach less of the line rate than InfiniBand under congestion control)",
            latency=20e-6,
        ),
        Hardware(
            "ascend-910b-hccs",
            "8x Ascend 910B in one HCCS full mesh (Atlas 800T A2)",
            "npu",
            link=150e9,
            link_source="HCCS: 7 links x 56 GB/s = 392 GB/s per NPU, 196 GB/s each way (Huawei Atlas 800T A2 "
            "specification); takes about 75% of one way (not measured here)",
            flops=2.0e14,
            flops_source="not measured: about 64% of the 910B's ~313 TFLOP/s fp16 peak, the efficiency "
            "measured on the H200 applied to the NPU's vendor peak",
            mem=1.6e12,
            latency=20e-6,
        ),
        Hardware(
            "cpu-gloo-300mbit",
            "2 CPU ranks on gloo over the 300 Mbit/s link of benchmarks/step_time.py",
            "cpu",
            link=425e6 / 8,
            link_source="measured: the benchmark's 300 Mbit/s tc link as its comm-only replay moves queued "
            "collectives (both directions busy): 425 Mbit/s in this model's one link lane; a send-first collective "
            "alone takes twice as long (send_first 2)",
            flops=7.6e10,
            flops_source="measured: the benchmark GPT's compiled step on one thread of the 2-vCPU development "
            "machine (step_time.py's compute-only; measure your own with fsdp-overlap profile)",
            mem=_PROFILE_MEM,
            latency=2e-3,
            contention=5.0,
            send_first=2.0,
        ),
    )
}

# Per device type, the rates a report uses without a hardware setting (kept as a table for
# callers that read it: `fsdp-overlap timeline` starts from it).
DEFAULT_RATES = {device: HARDWARE[name].rates() for device, name in _DEVICE_PRESET.items()}

# Suffixes of rate values (`link=360GB/s`, `flops=400TFLOP/s`, `latency=15us`).
_RATE_UNITS = {
    "gb/s": 1e9,
    "mb/s": 1e6,
    "kb/s": 1e3,
    "tb/s": 1e12,
    "b/s": 1.0,
    "gbit/s": 1e9 / 8,
    "mbit/s": 1e6 / 8,
    "gbit": 1e9 / 8,
    "mbit": 1e6 / 8,
    "tflop/s": 1e12,
    "gflop/s": 1e9,
    "pflop/s": 1e15,
    "flop/s": 1.0,
    "us": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
}
_RATE_KEYS = ("link", "inter_link", "flops", "mem", "latency", "contention", "send_first")


def parse_rate(value: Any, key: str) -> float:
    """``"360GB/s"`` -> 3.6e11, ``"400Gbit/s"`` -> 5e10, ``"400TFLOP/s"``, ``"15us"``, or a
    plain number (bytes/s, FLOP/s, seconds)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    text = str(value).strip().lower().replace(" ", "")
    for unit in sorted(_RATE_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            try:
                return float(text[: -len(unit)]) * _RATE_UNITS[unit]
            except ValueError:
                break
    try:
        return float(text)
    except ValueError:
        raise ValueError(
            f"hardware: {key}={value!r} is not a rate; write a number with a unit such as 360GB/s, 400Gbit/s, "
            "400TFLOP/s or 15us"
        ) from None


def parse_hardware(spec: Any) -> dict:
    """A hardware setting as ``{"preset": name or None, key: number}``: a preset name
    (``"h100-ib400"``), own numbers (``"link=100GB/s,flops=300TFLOP/s"``), both
    (``"h100-nvlink,link=300GB/s"``), or the same as a mapping (``{"preset": ..., "link":
    ...}``). Raises ValueError naming the wrong part and the valid choices."""
    if spec is None or spec == "":
        return {"preset": None}
    if isinstance(spec, str):
        items: dict = {}
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            key, sep, value = part.partition("=")
            if sep:
                items[key.strip()] = value.strip()
            elif "preset" in items:
                raise ValueError(f"hardware: two presets in {spec!r}; name one")
            else:
                items["preset"] = part
        spec = items
    if not isinstance(spec, dict):
        raise ValueError(f"hardware: expected a preset name, key=value pairs or a mapping, got {type(spec).__name__}")
    out: dict = {"preset": spec.get("preset")}
    if out["preset"] is not None and out["preset"] not in HARDWARE:
        import difflib

        near = difflib.get_close_matches(str(out["preset"]), list(HARDWARE), n=1)
        raise ValueError(
            f"hardware: unknown preset {out['preset']!r}."
            + (f" Did you mean {near[0]!r}?" if near else "")
            + f" Presets: {', '.join(HARDWARE)}; or give your own numbers: link=, inter_link=, flops=, mem=, latency="
        )
    for key, value in spec.items():
        if key == "preset":
            continue
        if key not in _RATE_KEYS:
            raise ValueError(f"hardware: unknown key {key!r}; valid: preset, {', '.join(_RATE_KEYS)}")
        out[key] = parse_rate(value, key)
        if out[key] <= 0 and key != "latency":
            raise ValueError(f"hardware: {key} must be positive, got {value!r}")
    return out


def load_profile(profile: str | dict) -> dict:
    """A measured compute profile (``benchmarks/gpu_check.py``'s ``compute_profile.json``,
    or ``measure_compute_profile`` on a CPU): needs ``achieved_flops_per_s``."""
    import json
    from pathlib import Path

    data = profile
    if not isinstance(profile, dict):
        try:
            data = json.loads(Path(profile).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"compute_profile: cannot read {profile!r}: {exc}") from None
    rate = data.get("achieved_flops_per_s") if isinstance(data, dict) else None
    if not isinstance(rate, (int, float)) or rate <= 0:
        raise ValueError(
            f"compute_profile: {profile if not isinstance(profile, dict) else 'the profile'} has no positive "
            "achieved_flops_per_s (write one with benchmarks/gpu_check.py's world8 phase or "
            "`fsdp-overlap profile`)"
        )
    return data


def resolve_rates(device_type: str | None, hardware: Any = None, profile: str | dict | None = None) -> dict:
    """The rates a prediction uses and where each comes from: ``{"rates": {...},
    "preset": name, "sources": {key: words}, "measured": [keys]}``. Order: the device
    type's preset, then the hardware setting's preset, its own numbers, then a compute
    profile's achieved FLOP/s (which replaces both the compute and the memory rate: the
    profile's step time holds the memory-bound work too)."""
    spec = (
        hardware
        if isinstance(hardware, dict)
        and "preset" in hardware
        and all(isinstance(v, (int, float)) for k, v in hardware.items() if k != "preset")
        else parse_hardware(hardware)
    )
    name = spec.get("preset") or _DEVICE_PRESET.get(device_type or "cpu", _DEVICE_PRESET["cpu"])
    hw = HARDWARE[name]
    rates = hw.rates()
    chosen = "hardware preset" if spec.get("preset") else f"the {device_type or 'cpu'} default"
    sources = {
        "link": f"{name} ({chosen}): {hw.link_source}",
        "inter_link": f"{name} ({chosen}): {hw.inter_source or 'the same as link'}",
        "flops": f"{name} ({chosen}): {hw.flops_source}",
        "mem": f"{name} ({chosen})",
        "latency": f"{name} ({chosen})",
        "contention": f"{name} ({chosen})"
        + (": fitted on benchmarks/step_time.py's GPT run, benchmarks/costmodel_check.py" if hw.contention else ""),
        "send_first": f"{name} ({chosen})",
    }
    own = [k for k in _RATE_KEYS if k in spec]
    for key in own:
        rates[key] = spec[key]
        sources[key] = "your own number (hardware setting)"
    if "link" in own and "inter_link" not in own and not hw.inter_link:
        rates["inter_link"] = rates["link"]
    measured = []
    if profile is not None:
        data = load_profile(profile)
        rates["flops"] = float(data["achieved_flops_per_s"])
        rates["mem"] = _PROFILE_MEM
        where = data.get("device") or "this machine"
        sources["flops"] = f"measured compute profile ({where}): {rates['flops']:.3g} FLOP/s achieved"
        sources["mem"] = "in the profile's achieved rate"
        measured.append("flops")
    return {"rates": rates, "preset": name, "sources": sources, "own": own, "measured": measured}


def rates_for(device_type: str | None) -> dict:
    """The rates the predictions use for a device type without a hardware setting (cpu's
    for an unknown one)."""
    return dict(DEFAULT_RATES.get(device_type or "cpu", DEFAULT_RATES["cpu"]))


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
) -> dict:
    """Play a schedule on a machine with one compute lane and a link per kind of group:
    compute runs items in order; each link runs its collectives in issue order (an event's
    ``lane`` "inter" is the replicas' link, at ``inter_link``; its ``ranks`` the group size,
    ``world`` by default), each taking ``latency`` plus the bytes a ring collective sends per
    rank (``(n-1)/n`` of the full tensor, twice that for an all-reduce) over the link's
    bytes/s; a wait blocks compute until its collective is done. ``contention``: how much
    slower compute runs while a link is busy (0.25: a quarter slower), for hosts where the
    transport takes the compute's cores (gloo on a CPU; 0 on a GPU, whose collectives run on
    their own engines); ``send_first``: see ``_link_time``. Returns the lanes and the predicted exposed communication (time
    compute spent blocked in waits)."""
    t_compute = 0.0
    t_lane = {"link": 0.0, "inter": 0.0}
    speed = {"link": link, "inter": inter_link or link}
    done: dict[str, float] = {}
    compute, comm, blocked = [], [], []
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
            t_lane[lane] = start + dur
            done[ev["name"]] = t_lane[lane]
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


SCHEDULES = ("passes", "no-passes", "fsdp2")


def plan_schedule(
    buckets: list[dict],
    *,
    schedule: str = "passes",
    depth: int = 1,
    shard: int,
    replicas: int = 1,
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
    at the end)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: valid: {', '.join(SCHEDULES)}")
    fwd: list[dict] = []
    bwd: list[dict] = []
    counter = iter(range(10**9))

    def launch(events: list[dict], op: str, nbytes: float, bucket: int, lane: str = "link") -> str:
        name = f"{op}_{next(counter)}"
        ranks = replicas if lane == "inter" else shard
        events.append({"op": op, "name": name, "bucket": bucket, "bytes": nbytes, "ranks": ranks, "lane": lane})
        return name

    def wait(events: list[dict], of: str, bucket: int) -> None:
        events.append({"op": "wait", "name": f"wait_{of}", "of": of, "bucket": bucket})

    def compute(events: list[dict], flops: float, bucket: int) -> None:
        events.append({"op": "compute", "name": f"compute_{bucket}", "bucket": bucket, "flops": flops, "bytes": 0})

    if schedule == "no-passes":
        for i, b in enumerate(buckets):
            n = max(1, int(b.get("collectives", 1)))
            for _ in range(n):
                wait(fwd, launch(fwd, "all_gather", b["gather_bytes"] / n, i), i)
            compute(fwd, b["flops_forward"], i)
        for i in reversed(range(len(buckets))):
            b = buckets[i]
            n = max(1, int(b.get("collectives", 1)))
            if b.get("regather", True):
                for _ in range(n):
                    wait(bwd, launch(bwd, "all_gather", b["gather_bytes"] / n, i), i)
            compute(bwd, b["flops_backward"], i)
            for _ in range(n):
                rs = launch(bwd, "reduce_scatter", b["reduce_bytes"] / n, i)
                wait(bwd, rs, i)
                if replicas > 1:
                    wait(bwd, launch(bwd, "all_reduce", b["reduce_bytes"] / n / shard, i, "inter"), i)
        return {"forward": fwd, "backward": bwd}

    ahead = 1 if schedule == "fsdp2" else max(1, depth)

    def gathered(events: list[dict], order: list[int], flops_key: str, after) -> None:
        pending: dict[int, str] = {}
        for i in order[:ahead]:
            pending[i] = launch(events, "all_gather", buckets[i]["gather_bytes"], i)
        for k, i in enumerate(order):
            if k + ahead < len(order):
                j = order[k + ahead]
                pending[j] = launch(events, "all_gather", buckets[j]["gather_bytes"], j)
            wait(events, pending.pop(i), i)
            compute(events, buckets[i][flops_key], i)
            after(i)

    gathered(fwd, list(range(len(buckets))), "flops_forward", lambda i: None)
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
        compute(bwd, buckets[i]["flops_backward"], i)
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
) -> dict:
    """Predicted seconds of one training step from a bucket plan (``plan_schedule``
    played by ``simulate``): ``{"step_s", "forward", "backward", "compute_s", "comm_s",
    "exposed_comm_s"}``; ``extra_compute_s`` (the optimizer step, say) is added as
    compute that hides nothing."""
    graphs = plan_schedule(buckets, schedule=schedule, depth=depth, shard=shard, replicas=replicas)
    out: dict = {}
    for kind, events in graphs.items():
        sim = simulate(events, world=shard, **rates)
        out[kind] = {k: sim[k] for k in ("total_s", "exposed_comm_s", "comm_s", "compute_s")}
    for key in ("compute_s", "comm_s", "exposed_comm_s"):
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
    replicas > 1) every all-reduce is the replicas' (the graph all-reduces nothing else)
    and goes to the ``inter`` lane over ``replicas`` ranks; every other collective to the
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
            out.append(dict(ev, lane=lane, ranks=replicas if lane == "inter" else shard))
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
