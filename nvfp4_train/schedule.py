"""Run length, batch and the Warmup-Stable-Decay learning-rate schedule (RECIPE.md §7).

``wsd_lr`` is Megatron's ``OptimizerParamScheduler.get_lr`` with ``lr_decay_style="WSD"`` (a test compares
the two at every position): linear warmup from ``init_lr`` to ``max_lr`` over ``warmup`` (inclusive: the
position ``warmup`` itself gets ``max_lr``), then ``max_lr`` until ``total - decay``, then over the last
``decay`` units, with ``r`` the fraction of the anneal done,

    linear 1 - r,   cosine 0.5 (cos(pi r) + 1),   exponential 2 * 0.5**r - 1,   minus_sqrt 1 - sqrt(r)

and ``lr = min_lr + coeff * (max_lr - min_lr)``; past ``total``: ``min_lr``.

Positions are TOKENS: optimizer step ``k`` (0-based) runs at position ``k * tokens_per_step``, the tokens
consumed before it (Megatron counts samples, and its step ``k`` also runs at the samples consumed before
it). A schedule given in steps is the same schedule: the anneal's ratio ``float(k*T) / float(D*T)`` is the
correctly rounded quotient of the same rational as ``float(k) / float(D)`` (bitwise equal); the warmup keeps
Megatron's ``(max_lr - init_lr) * position / warmup`` order, which rounds the product of a different
position, so there the two agree to within an ulp or two. As in Megatron the
last step runs at ``(N-1) * T < total``: the lr of the last step is one decay unit above ``min_lr``.

One deliberate difference: Megatron does not advance its scheduler on a skipped (non-finite) step; here the
lr follows the step index, so a skipped step does not shift the rest of the schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DECAY_STYLES", "CUDA_GRAPH_MODES", "ScheduleConfig", "ResolvedSchedule", "wsd_lr", "WSDSchedule"]

DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
CUDA_GRAPH_MODES = ("auto", "on", "off")


def wsd_lr(position: int, *, max_lr: float, min_lr: float, init_lr: float, warmup: int, total: int, decay: int,
           style: str) -> float:
    """The WSD learning rate at ``position`` (all of position, warmup, total, decay in one unit)."""
    if warmup > 0 and position <= warmup:
        return init_lr + (max_lr - init_lr) * float(position) / float(warmup)
    if position > total:
        return min_lr
    anneal_start = total - decay
    if position <= anneal_start:
        coeff = 1.0
    else:
        r = float(position - anneal_start) / float(decay)
        if style == "linear":
            coeff = 1.0 - r
        elif style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * r) + 1.0)
        elif style == "exponential":
            coeff = 2.0 * math.pow(0.5, r) - 1.0
        elif style == "minus_sqrt":
            coeff = 1.0 - math.sqrt(r)
        else:
            raise ValueError(f"WSD decay style {style!r} is not one of {DECAY_STYLES}")
    return min_lr + coeff * (max_lr - min_lr)


@dataclass(kw_only=True)
class ScheduleConfig:
    """Run length, batch sizes, learning-rate schedule and evaluation cadence (the ``schedule`` section).

    Lengths are given in steps or in tokens (exactly one of each pair; tokens per step = global_batch_size
    * data.seq_length). The decay length is ``decay_steps``, ``decay_tokens`` or ``decay_fraction`` of the run.
    """

    global_batch_size: int = 8
    """Samples per optimizer step, over all data-parallel ranks and micro-batches."""
    micro_batch_size: int = 2
    """Samples per forward/backward of one rank; global_batch_size / (micro_batch_size * DP) micro-batches
    are accumulated per step (through megatron's pipeline schedule)."""
    train_steps: int | None = None
    """Optimizer steps of the run."""
    train_tokens: int | None = None
    """Tokens of the run (steps = ceil(train_tokens / tokens per step))."""
    lr: float = 3e-4
    """Peak (stable-phase) learning rate, Megatron's max_lr."""
    min_lr: float = 3e-6
    """Learning rate at the end of the decay."""
    init_lr: float = 0.0
    """Learning rate the linear warmup starts from."""
    warmup_steps: int | None = None
    """Warmup length in steps (None and warmup_tokens None: no warmup)."""
    warmup_tokens: int | None = None
    """Warmup length in tokens."""
    decay_steps: int | None = None
    """Length of the final decay in steps."""
    decay_tokens: int | None = None
    """Length of the final decay in tokens."""
    decay_fraction: float | None = 0.2
    """Length of the final decay as a fraction of the run, rounded to whole steps (used when decay_steps and
    decay_tokens are None)."""
    decay_style: str = "linear"
    """Shape of the decay: linear, cosine, exponential, minus_sqrt."""
    eval_interval: int = 100
    """Evaluate on the validation split every this many steps (0: only at the end)."""
    eval_batches: int = 4
    """Global batches of the validation split per evaluation (always the same ones)."""
    cuda_graph: str = "auto"
    """Replay each step's forwards and backwards from a CUDA graph (``nvfp4_train.cuda_graph``; bitwise the
    eager step): ``auto`` on CUDA where the layout allows it (off on CPU), ``on`` (a layout that does not allow
    it runs eager, with one warning naming why), ``off``. docs/training.md, "CUDA graphs"."""

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"schedule.{name}={getattr(self, name)} must be >= 1")
        pairs = (("train_steps", "train_tokens"), ("warmup_steps", "warmup_tokens"))
        for a, b in pairs:
            if getattr(self, a) is not None and getattr(self, b) is not None:
                raise ValueError(f"schedule: give {a} or {b}, not both (got {getattr(self, a)} and {getattr(self, b)})")
        given = [n for n in ("decay_steps", "decay_tokens") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError("schedule: give decay_steps or decay_tokens, not both")
        for name in ("train_steps", "train_tokens", "warmup_steps", "warmup_tokens", "decay_steps", "decay_tokens"):
            v = getattr(self, name)
            if v is not None and v < 0 or (name.startswith("train") and v == 0):
                raise ValueError(f"schedule.{name}={v} must be {'> 0' if name.startswith('train') else '>= 0'}")
        if not given and self.decay_fraction is None:
            raise ValueError("schedule: give decay_steps, decay_tokens or decay_fraction (0 for no decay)")
        if self.decay_fraction is not None and not 0.0 <= self.decay_fraction <= 1.0:
            raise ValueError(f"schedule.decay_fraction={self.decay_fraction} must be in [0, 1]")
        if self.decay_style not in DECAY_STYLES:
            raise ValueError(f"schedule.decay_style={self.decay_style!r} is not one of {DECAY_STYLES}")
        if not 0.0 <= self.min_lr <= self.lr:
            raise ValueError(f"schedule: need 0 <= min_lr <= lr, got min_lr={self.min_lr}, lr={self.lr}")
        if not 0.0 <= self.init_lr <= self.lr:
            raise ValueError(f"schedule: need 0 <= init_lr <= lr, got init_lr={self.init_lr}, lr={self.lr}")
        if self.cuda_graph not in CUDA_GRAPH_MODES:
            raise ValueError(f"schedule.cuda_graph={self.cuda_graph!r} is not one of {CUDA_GRAPH_MODES}")
        if self.eval_interval < 0 or self.eval_batches < 0:
            raise ValueError(f"schedule.eval_interval={self.eval_interval} and eval_batches={self.eval_batches} "
                             f"must be >= 0")

    def resolve(self, seq_length: int) -> ResolvedSchedule:
        """Everything in tokens, for sequences of ``seq_length`` tokens."""
        if self.train_steps is None and self.train_tokens is None:
            raise ValueError("schedule: give the run length, schedule.train_steps=N or schedule.train_tokens=N")
        tps = self.global_batch_size * seq_length
        steps = self.train_steps if self.train_steps is not None else -(-self.train_tokens // tps)
        total = steps * tps
        warmup = (self.warmup_steps or 0) * tps if self.warmup_tokens is None else self.warmup_tokens
        if self.decay_steps is not None:
            decay = self.decay_steps * tps
        elif self.decay_tokens is not None:
            decay = self.decay_tokens
        else:
            decay = round(self.decay_fraction * steps) * tps  # whole steps
        if warmup + decay > total:
            raise ValueError(
                f"schedule: warmup ({warmup} tokens) + decay ({decay} tokens) exceed the run ({total} tokens = "
                f"{steps} steps x {tps} tokens): shorten them or lengthen the run")
        if warmup >= total:
            raise ValueError(f"schedule: warmup ({warmup} tokens) must be shorter than the run ({total} tokens)")
        return ResolvedSchedule(train_steps=steps, tokens_per_step=tps, total_tokens=total, warmup_tokens=warmup,
                                decay_tokens=decay, max_lr=self.lr, min_lr=self.min_lr, init_lr=self.init_lr,
                                style=self.decay_style)


@dataclass(frozen=True, kw_only=True)
class ResolvedSchedule:
    """A schedule with every length in tokens."""

    train_steps: int
    tokens_per_step: int
    total_tokens: int
    warmup_tokens: int
    decay_tokens: int
    max_lr: float
    min_lr: float
    init_lr: float
    style: str

    def lr_at_tokens(self, tokens: int) -> float:
        return wsd_lr(tokens, max_lr=self.max_lr, min_lr=self.min_lr, init_lr=self.init_lr,
                      warmup=self.warmup_tokens, total=self.total_tokens, decay=self.decay_tokens, style=self.style)

    def lr_at_step(self, step: int) -> float:
        """The lr of optimizer step ``step`` (0-based): at the tokens consumed before it."""
        return self.lr_at_tokens(step * self.tokens_per_step)

    def describe(self) -> str:
        t = self.tokens_per_step
        return (f"WSD {self.style}: {self.train_steps} steps x {t} tokens, warmup {self.warmup_tokens / t:g} steps "
                f"from {self.init_lr:g}, peak {self.max_lr:g}, decay to {self.min_lr:g} over the last "
                f"{self.decay_tokens / t:g} steps")


class WSDSchedule:
    """Sets the learning rate and weight decay of an optimizer's param groups for each step (stateless: both
    depend only on the step, which the checkpoint restores).

    As megatron's ``OptimizerParamScheduler`` does, each group gets ``lr * lr_mult`` and
    ``weight_decay * wd_mult``: megatron's parameter groups carry ``wd_mult = 0`` for biases and 1-D
    parameters (norms) and rely on the scheduler to turn that into their weight decay.
    """

    def __init__(self, resolved: ResolvedSchedule, optimizer, *, weight_decay: float) -> None:
        self.resolved = resolved
        self.optimizer = optimizer
        self.weight_decay = weight_decay

    def apply(self, step: int) -> float:
        lr = self.resolved.lr_at_step(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.weight_decay * group.get("wd_mult", 1.0)
        return lr

    def state_dict(self) -> dict:
        return dict(vars(self.resolved))
