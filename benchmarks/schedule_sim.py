"""What one traced step's schedule would take over a modelled link: ``step_time.py --trace-dir``.

The model lives in ``benchmarks/_harness/schedule_sim.py`` (its docstring says what it
models); this name keeps it importable as ``schedule_sim`` from ``benchmarks/``.
"""

from __future__ import annotations

from _harness.schedule_sim import LAUNCHES, WAIT, program, simulate, split_step

__all__ = ["LAUNCHES", "WAIT", "program", "simulate", "split_step"]
