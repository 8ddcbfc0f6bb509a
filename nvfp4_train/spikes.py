"""Loss-spike detection: a step whose loss exceeds ``factor`` x the running median of the last ``window``
losses (after ``min_history`` steps) is a spike. The median, not the mean, so one spike does not raise the
bar for the next; non-finite losses are not spikes (the non-finite-step guard handles them) and never
enter the history."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

__all__ = ["SpikeConfig", "SpikeDetector"]


@dataclass(kw_only=True)
class SpikeConfig:
    """Loss-spike detector (the ``spike`` config section, ``configs/spike/``)."""

    factor: float = 0.0
    """A loss above factor x the running median is a spike; 0 turns detection off (e.g. 1.5)."""
    window: int = 50
    """Steps in the running median."""
    min_history: int = 20
    """Steps seen before anything counts as a spike (the early loss falls too fast for a median)."""
    rollback: bool = False
    """On a spike: reload the last checkpoint and skip the data window since it (else: log only)."""
    max_rollbacks: int = 3
    """Rollbacks allowed in a run before a spike stops it."""

    def __post_init__(self) -> None:
        if self.factor != 0 and not self.factor > 1:
            raise ValueError(f"spike.factor={self.factor} must be 0 (off) or > 1")
        if self.window < 1 or self.min_history < 1 or self.max_rollbacks < 0:
            raise ValueError("spike.window and spike.min_history must be >= 1, spike.max_rollbacks >= 0")

    @property
    def enabled(self) -> bool:
        return self.factor > 0


class SpikeDetector:
    def __init__(self, cfg: SpikeConfig) -> None:
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.window)
        self.seen = 0

    def median(self) -> float | None:
        return statistics.median(self.history) if self.history else None

    def observe(self, loss: float) -> bool:
        """Record ``loss``; True when it is a spike (a spike is not added to the history)."""
        if not self.cfg.enabled or not math.isfinite(loss):
            return False
        med = self.median()
        if self.seen >= self.cfg.min_history and med is not None and loss > self.cfg.factor * med:
            return True
        self.history.append(loss)
        self.seen += 1
        return False

    def state_dict(self) -> dict:
        return {"history": list(self.history), "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.history = deque(state["history"], maxlen=self.cfg.window)
        self.seen = int(state["seen"])
