"""Loss-spike detection: a step whose loss exceeds ``factor`` x the running median of the last ``window``
losses (after ``min_history`` steps) is a spike. The median, not the mean, so one spike does not raise the
bar for the next; non-finite losses are not spikes (the non-finite-step guard handles them) and never
enter the history.

:class:`RecoveryPoint` uses the same window, always on, to know which checkpoint a diverged run should resume
from: the newest one whose weights were followed by a loss inside the window. A checkpoint written after
the loss had left it can hold finite but already ruined weights (``schedule.lr=1e6``: weights of ~1e6),
from which a resume at a sane learning rate diverges again."""

from __future__ import annotations

import math
import os
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SpikeConfig", "SpikeDetector", "RecoveryPoint", "RECOVERY_FACTOR"]

RECOVERY_FACTOR = 2.0
"""The window of :class:`RecoveryPoint` when loss-spike detection is off (``spike.factor=0``): a loss above twice
the running median of the good losses before it has left the window. A language model's loss starts near
ln(vocabulary) and falls, so no healthy step doubles it."""


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


class RecoveryPoint:
    """The checkpoint to resume from after a divergence: the newest checkpoint whose weights were followed by
    a loss inside the window.

    The window: a finite loss at most ``spike.factor`` (else :data:`RECOVERY_FACTOR`) x the running median of
    the last ``spike.window`` losses inside it, from the first step on (``min_history`` 1); a step skipped for
    a non-finite gradient whose loss is inside counts as inside (its weights computed a sound loss). The
    checkpoint of step ``s`` holds the weights step ``s + 1`` computes its loss with; so when a step's loss is
    inside the window, the newest checkpoint saved before that step (or resumed from) is known to be sound, and
    becomes :attr:`checkpoint`. A step outside the window leaves it, and the first such step since the last one
    inside is :attr:`left_at`: the checkpoint saved just before it holds the weights that produced that loss,
    and is passed over. Saved with each checkpoint (:meth:`state_dict`), so a resumed run knows it too."""

    def __init__(self, spike: SpikeConfig) -> None:
        factor = spike.factor if spike.enabled else RECOVERY_FACTOR
        self.window = SpikeDetector(SpikeConfig(factor=factor, window=spike.window, min_history=1))
        self.checkpoint: str | None = None
        """The checkpoint to resume from (a path), None while none is known."""
        self.left_at: int | None = None
        """The first step whose loss was outside the window since the last one inside it (None: inside)."""
        self.left_loss: float | None = None
        self.left_median: float | None = None

    @property
    def factor(self) -> float:
        return self.window.cfg.factor

    def observe(self, step: int, loss: float, checkpoint_before: str | None) -> bool:
        """Record step ``step``'s ``loss``; ``checkpoint_before``: the newest checkpoint saved before the step
        (or resumed from). Returns whether the loss was inside the window."""
        inside = math.isfinite(loss) and not self.window.observe(loss)
        if inside:
            self.left_at = self.left_loss = self.left_median = None
            if checkpoint_before is not None:
                self.checkpoint = checkpoint_before
        elif self.left_at is None:
            self.left_at, self.left_loss, self.left_median = step, loss, self.window.median()
        return inside

    def describe_exit(self) -> str:
        """Where the loss left the window, in words (empty when it is inside)."""
        if self.left_at is None:
            return ""
        if self.left_loss is not None and math.isfinite(self.left_loss) and self.left_median is not None:
            return (f"the loss left its window at step {self.left_at} ({self.left_loss:.4g} > {self.factor:g} x the "
                    f"running median {self.left_median:.4g})")
        return f"the loss left its window at step {self.left_at} (loss {self.left_loss})"

    def state_dict(self) -> dict:
        """JSON-able; the checkpoint by its directory name (resolved against the checkpoint root at load)."""
        return {"window": self.window.state_dict(), "left_at": self.left_at, "left_loss": self.left_loss,
                "left_median": self.left_median,
                "checkpoint": Path(self.checkpoint).name if self.checkpoint else None}

    def load_state_dict(self, state: dict, root: str | os.PathLike) -> None:
        """Restore :meth:`state_dict`; ``root``: the directory of the checkpoint being loaded."""
        self.window.load_state_dict(state["window"])
        self.left_at, self.left_loss, self.left_median = state["left_at"], state["left_loss"], state["left_median"]
        self.checkpoint = str(Path(root) / state["checkpoint"]) if state.get("checkpoint") else None
