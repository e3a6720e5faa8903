"""How often a training loop checkpoints: `Cadence`, shared by mask training and weight recovery."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Cadence:
    """When a training loop checkpoints: every `every` steps, spaced further apart where saving is slow, so
    that it takes at most `share` of the wall time (LLaMA-2-7B's masks checkpoint is 117 GB: written every 50
    steps of a few seconds, saving would take longer than training).

    Example:
        >>> cadence = Cadence(every=50)
        >>> cadence.due(50), cadence.saved(50, save_seconds=100.0, step_seconds=3.0), cadence.due(100)
        (True, None, False)
        >>> cadence.interval                     # 100 s of saving per 667 steps of 3 s: 5%
        667
    """

    every: int
    share: float = 0.05
    last: int = 0  # the step of the last save (or the one training went on from)
    interval: int = 0  # steps between saves, at least `every`
    first: int = field(init=False)  # the step the loop started from
    started: float = field(init=False)  # when the loop started
    saving: float = 0.0  # seconds spent saving since

    def __post_init__(self) -> None:
        self.first, self.started = self.last, time.perf_counter()

    def due(self, step: int) -> bool:
        """Whether to save after `step` steps."""
        return self.every > 0 and step - self.last >= max(self.every, self.interval)

    def save(self, step: int, write: Callable[[], None], agree: Callable[[Any], Any] = lambda x: x) -> None:
        """`write()` the checkpoint after `step` steps, timed; `agree`: every rank takes rank 0's timings."""
        begun = time.perf_counter()
        write()
        took = time.perf_counter() - begun
        self.saving += took
        step_seconds = (time.perf_counter() - self.started - self.saving) / max(step - self.first, 1)
        self.saved(step, *agree((took, step_seconds)))

    def saved(self, step: int, save_seconds: float, step_seconds: float) -> None:
        """A save after `step` steps took `save_seconds`, a step `step_seconds` on average: space the next one."""
        self.last = step
        wanted = save_seconds / (self.share * max(step_seconds, 1e-9))
        self.interval = max(self.every, math.ceil(wanted))


__all__ = ["Cadence"]
