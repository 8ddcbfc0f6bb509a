"""The per-layer non-finite check in pure PyTorch (imports only torch): the reference of ``nonfinite.py``.

A layer keeps, for its output and for its input gradient, the time of the first NaN/±Inf it saw: a float64 0-d
tensor ``kept`` holding a time, or ``NEVER`` (2**62) when nothing was seen. One check of a tensor t at time τ is

    kept <- min(kept, τ if t holds a NaN or ±Inf else NEVER)

with no host sync. Two clocks give τ:

- host clock (:func:`track_nonfinite_ref`): τ = ``now``, a host int (exact in float64 below 2**53). ``kept`` None
  (nothing kept since a reset) starts a new tensor; otherwise ``kept`` is updated in place. 4 launches:
  max|t| (NaN or +Inf exactly when t is not finite), ``kept + 0·max|t|`` (NaN exactly then: 0·Inf and 0·NaN are
  NaN; float64 by type promotion), ``nan_to_num`` (NaN -> τ) and ``minimum`` with ``kept``; a new ``kept``
  takes ``full(NEVER)`` instead of the ``minimum``.
- device clock (:func:`track_nonfinite_clocked_ref`): ``clock`` is a 0-d float64 device counter shared by a
  model's layers; every check advances it by one in place first and τ is the advanced value, so no host value
  enters a launch (CUDA graphs replay it). 5 launches: ``clock += 1``, max|t|, ``isfinite``, ``where``,
  ``minimum`` into ``kept``.

An empty tensor holds nothing non-finite: no launch (the device clock still advances: it counts checks).
``arrivals`` is the Triton kernel's counter of finished programs (``nonfinite.py``); it is unused here and
taken for the same signature.

A kernel that reads a tensor for its own purpose can run the check of it in the same launch
(``squared_relu.py``); :class:`NonfiniteCheck` carries one check's state (either clock) to it, and
:func:`track_nonfinite_check_ref` is that check here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["NEVER", "NonfiniteCheck", "track_nonfinite_ref", "track_nonfinite_clocked_ref",
           "track_nonfinite_check_ref"]

NEVER = 2**62  # the time kept while no non-finite value was seen
_NEVER_F = float(NEVER)
_INF = float("inf")


def _abs_max(t: torch.Tensor) -> torch.Tensor:
    """max |t| in t's dtype, no copy of t; detached (one more op) only when t is in an autograd graph."""
    return torch.linalg.vector_norm(t.detach() if t.requires_grad else t, _INF)


def track_nonfinite_ref(kept: torch.Tensor | None, t: torch.Tensor, now: int,
                        arrivals: torch.Tensor | None = None) -> torch.Tensor | None:
    """``min(kept, now if t has a NaN/±Inf else NEVER)``: ``kept`` updated in place and returned, a new float64
    0-d tensor on t's device when ``kept`` is None (None again for an empty t)."""
    if t.numel() == 0:  # nothing to check (and max|t| has no identity): finite
        return kept
    amax = _abs_max(t)
    base = torch.full((), _NEVER_F, dtype=torch.float64, device=t.device) if kept is None else kept
    # base + 0·max|t|: base when t is finite, NaN when not; then NaN -> now
    hit = torch.nan_to_num(torch.add(base, amax, alpha=0), nan=float(now))
    return hit if kept is None else torch.minimum(kept, hit, out=kept)


def track_nonfinite_clocked_ref(kept: torch.Tensor, t: torch.Tensor, clock: torch.Tensor,
                                arrivals: torch.Tensor | None = None) -> None:
    """``clock += 1``, then ``kept = min(kept, clock if t has a NaN/±Inf else NEVER)``, both in place."""
    clock.add_(1.0)
    if t.numel() == 0:
        return
    hit = torch.where(torch.isfinite(_abs_max(t)), _NEVER_F, clock)
    torch.minimum(kept, hit, out=kept)


@dataclass(eq=False)
class NonfiniteCheck:
    """One check, for a kernel that folds it into a launch of its own: the arguments of
    :func:`track_nonfinite_ref` (``clock`` None: the host clock's ``now``) or :func:`track_nonfinite_clocked_ref`
    (``clock``, advanced by the check). After the check ``kept`` is the result: updated in place, or (host clock,
    ``kept`` None) the new tensor."""

    kept: torch.Tensor | None
    arrivals: torch.Tensor | None = None
    now: int = 0
    clock: torch.Tensor | None = None


def track_nonfinite_check_ref(check: NonfiniteCheck, t: torch.Tensor) -> None:
    """``check`` of ``t`` by :func:`track_nonfinite_ref` or :func:`track_nonfinite_clocked_ref` (by its clock)."""
    if check.clock is None:
        check.kept = track_nonfinite_ref(check.kept, t, check.now, check.arrivals)
    else:
        track_nonfinite_clocked_ref(check.kept, t, check.clock, check.arrivals)
