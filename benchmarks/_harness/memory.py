"""Memory probes of a training process: resident memory (VmRSS, its high-water mark,
reset per step), the bytes a model's state holds, and one step's peak."""

from __future__ import annotations

import resource
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _harness.types import StepRunner


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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


def measure_step_memory(runner: StepRunner, batches, barrier, rss_steps: int = 2) -> dict:
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
