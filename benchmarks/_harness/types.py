"""What the probes need of a runner, as a type: ``memory`` and ``trace`` measure a step of
``runners.ModelRunner``, which imports them; they name this protocol instead, so no module
of ``_harness`` imports one that imports it back (tests/bench/test_harness_layout.py holds that)."""

from __future__ import annotations

from typing import Any, Protocol


class StepRunner(Protocol):
    """A mode's model and its training step (``runners.ModelRunner`` is one)."""

    model: Any

    def step(self, batch: Any, marks: list | None = None, t0: float = 0.0) -> float | None: ...
