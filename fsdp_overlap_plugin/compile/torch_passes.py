"""What inductor's own distributed passes may do to our graphs: ``inductor_overlap``.

Inductor has scheduling passes of its own for graphs that hold collectives, and they run
after our post-grad passes, on the order our passes chose:

- ``simple``: ``aten_distributed_optimizations.enable_simple_overlap`` (torch 2.14 and
  newer, on by default there). In the scheduler, after fusion, it moves each collective
  launch earlier and each wait later by adjacent swaps, never past another collective or
  wait, and only where the graph's peak memory does not grow. It sees only collectives
  lowered as ``_CollectiveKernel``; a custom op that communicates is invisible to it
  (pytorch issue 189454: the deadlock that made torch consider turning it off again).
- ``auto``: ``enable_overlap_scheduling`` with ``collective_bucketing`` (torch 2.11 and
  newer): torch's automatic bucketing and overlap scheduler, which costs every node and
  reorders the whole graph. It replaces our schedule rather than refining it, so it is
  allowed only with our passes off (``manual_bucketing`` and ``overlap_grad_reduce``
  false): with them on, torch 2.15's scheduler failed to lower our merged graphs
  ("realize NYI on Subgraph"); see docs/performance.md.
- ``off``: neither runs, and neither do inductor's older ones
  (``reorder_for_compute_comm_overlap``, ``bucket_all_gathers_fx``,
  ``bucket_reduce_scatters_fx``): the compiled code keeps the order our passes decided,
  which is the order the schedule report describes.

Applied per compile through the config patches of our inductor backend, never to
inductor's global config. On a CPU, torch's cost model for ``auto`` has no rates (its
roofline asks the accelerator's datasheet, its collective model is NCCL's): we give it the
``hardware`` setting's rates (the device type's preset without one) for the duration of our
compile, the same numbers on every rank, so every rank schedules alike.
"""

from __future__ import annotations

from typing import Any

from .. import _torch_compat as compat
from ..config.inductor_overlap import available

__all__ = ["RuntimeEstimator", "auto_patches", "config_patches", "estimates", "runtime_estimator"]

# inductor config keys (in aten_distributed_optimizations) of the passes each setting names
_SIMPLE = "enable_simple_overlap"
_SCHEDULING = "enable_overlap_scheduling"
_PREFIX = "aten_distributed_optimizations."


def config_patches(setting: str) -> dict[str, Any]:
    """Inductor config patches for ``setting``: only keys this torch has."""
    have = available()
    patches: dict[str, Any] = {}
    if have["simple_overlap"]:
        patches[_PREFIX + _SIMPLE] = setting in ("simple", "auto")  # auto: torch's own default stays
    if have["overlap_scheduling"]:
        patches[_PREFIX + _SCHEDULING] = setting == "auto"
        if setting == "auto":
            patches[_PREFIX + "collective_bucketing"] = True
    if setting != "auto":
        # the older passes, off by default in every torch we support: off here too, so that a
        # global setting cannot move what our passes placed behind the setting's back
        patches["reorder_for_compute_comm_overlap"] = False
        patches["bucket_all_gathers_fx"] = "none"
        patches["bucket_reduce_scatters_fx"] = "none"
    return patches


def _roofline_ms(node: Any, flops_rate: float, mem_rate: float) -> float:
    """A compute node's time: its FLOPs (torch's flop formulas) at ``flops_rate`` or the
    bytes it reads and writes at ``mem_rate``, whichever is longer."""
    from torch.utils.flop_counter import flop_registry

    if node.op != "call_function":
        return 0.0
    (args, kwargs, out), tensors = compat.node_values(node)
    if out is None:
        return 0.0
    flops = 0.0
    formula = flop_registry.get(getattr(node.target, "overloadpacket", node.target))
    if formula is not None:
        try:
            flops = float(formula(*args, **kwargs, out_val=out))
        except Exception:  # a formula that cannot read these values: cost the bytes only
            flops = 0.0
    moved = sum(int(t.numel()) * t.element_size() for t in tensors)
    return max(flops / flops_rate, moved / mem_rate) * 1e3


class RuntimeEstimator:
    """``custom_runtime_estimation`` for torch's scheduler off CUDA, one number (ms) for
    every node, so that torch neither benchmarks a kernel (torch 2.11 would, on a GPU)
    nor asks for an accelerator's rates: each collective from the link rate and latency of
    ``rates``, everything else by a roofline at ``rates``' FLOP/s and memory bytes/s. The
    same rates on every rank: every rank schedules alike. A class of this module holding
    numbers, so that inductor can pickle it into its cache key (a closure cannot be
    pickled: inductor then bypasses the FX graph cache for every such compile)."""

    def __init__(self, rates: dict[str, float]):
        self.link = float(rates["link"])
        self.latency = float(rates.get("latency") or 0.0)
        self.flops = float(rates["flops"])
        self.mem = float(rates["mem"])

    def __call__(self, node: Any, override_size: int | None = None) -> float | None:
        from ..passes.graph import is_collective

        if is_collective(node):
            out = compat.node_values(node)[0][2]
            moved = (
                int(override_size) if override_size else sum(int(t.numel()) * t.element_size() for t in _leaves(out))
            )
            return (self.latency + moved / self.link) * 1e3
        return _roofline_ms(node, self.flops, self.mem)

    def __repr__(self) -> str:  # stable across processes: part of inductor's cache key
        return f"RuntimeEstimator(link={self.link!r}, latency={self.latency!r}, flops={self.flops!r}, mem={self.mem!r})"


def runtime_estimator(rates: dict[str, float]) -> RuntimeEstimator:
    return RuntimeEstimator(rates)


def estimates(rates: dict[str, float]):
    """While our compile runs off CUDA under ``auto``: torch's own roofline (which its
    scheduler runs beside ours, for its logs) reads ``rates`` too."""
    return compat.roofline_rates(float(rates["flops"]), float(rates["mem"]))


def _leaves(value: Any) -> list:
    values = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if hasattr(v, "element_size")]


def auto_patches(device_type: str, rates: dict[str, float]) -> dict[str, Any]:
    """What ``auto`` needs beyond ``config_patches`` on a device torch's cost model does not
    know (anything but CUDA): every node costed by ``runtime_estimator``, compute by the
    roofline (no kernel benchmarking, which needs an accelerator)."""
    if device_type == "cuda":
        return {}
    section = compat.inductor_config().aten_distributed_optimizations
    patches = {"custom_runtime_estimation": runtime_estimator(rates), "compute_estimator": "analytical"}
    # torch 2.11 has no compute_estimator: its scheduler costs compute by the roofline only
    return {_PREFIX + key: value for key, value in patches.items() if hasattr(section, key)}
