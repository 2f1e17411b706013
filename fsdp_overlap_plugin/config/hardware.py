"""The machines a prediction can assume: hardware presets (links, compute, memory rates,
each with its source), the ``hardware`` and ``compute_profile`` settings' readers, and the
rates they resolve to. Read by the config's validation and by the cost model
(``report/costmodel.py``), so it sits below both."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_RATES",
    "HARDWARE",
    "Hardware",
    "load_profile",
    "parse_hardware",
    "parse_rate",
    "rates_for",
    "resolve_rates",
]

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
            link=413e6 / 8,
            link_source="measured: the benchmark's 300 Mbit/s tc link as its comm-only replays move queued "
            "collectives (both directions busy): 413 Mbit/s in this model's one link lane (1.377 x the tc rate, "
            "benchmarks/costmodel_check.py's in-sample runs); a send-first collective alone takes twice as long "
            "(send_first 2)",
            flops=7.6e10,
            flops_source="measured: the benchmark GPT's compiled step on one thread of the 2-vCPU development "
            "machine (step_time.py's compute-only; measure your own with fsdp-overlap profile)",
            mem=_PROFILE_MEM,
            latency=0.5e-3,
            contention=3.25,
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
        + (
            ": fitted on four benchmarks/step_time.py runs (GPT and transformers Llama, 300 and 100 Mbit), benchmarks/costmodel_check.py"
            if hw.contention
            else ""
        ),
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
