"""Helpers more than one rule reads: a layer still getting worse, and what the logged loss did."""
from __future__ import annotations

import numpy as np
import polars as pl

from ..trends import onset, recent, theil_sen
from ._base import Rule, make


def growing(rule: Rule, run, layer, s, v, need: float, what: str, index: int, advice=None):
    """`rule` where `v`'s robust rise over the recent readings is `need` or more and its last two
    values at least half that above the value where they start: a layer still getting worse (one
    reading off its history is no trend yet: a batch that corrupted BatchNorm's statistics for a few
    steps); the finding starts where the rise starts (`onset`)."""
    i = recent(s)
    rise = theil_sen(s[i:], v[i:]) * (s[-1] - s[i])
    if rise < need or min(v[-1], v[-2]) - v[i] < need / 2:
        return None
    start = onset(s, v)
    return make(rule, run, layer, s[start],
                f"{what} rose from {v[start]:.0%} at step {s[start]} to {v[-1]:.0%} at step {s[-1]}, {rise:+.0%} "
                f"over the last {len(s) - i} readings (since step {s[i]})", score=1 + rise, value=rise,
                threshold=need, first=s[i], last=s[-1], index=index, advice=advice)


def rising(steps: np.ndarray, v: np.ndarray) -> bool:
    """A positive robust slope over the recent readings (of 3 or more)."""
    start = recent(steps)
    return len(v) >= 3 and theil_sen(steps[start:], v[start:]) > 0


def solving(loss: pl.DataFrame | None, since: int, last: int) -> bool:
    """Whether the logged loss over steps [since, last] has a median under half its median over as
    long a span before `since` (all of it finite, and that one above 0): the loss still falling steeply."""
    if loss is None:
        return False
    steps, values = loss["step"].to_numpy(), loss["value"].to_numpy()
    span = max(last - since, 1)
    before, now = values[(steps >= since - span) & (steps < since)], values[(steps >= since) & (steps <= last)]
    if not len(before) or not len(now) or not np.isfinite(now).all() or np.median(before) <= 0:
        return False  # (a loss below 0, a log-likelihood's, falls by no ratio)
    return bool(np.median(now) < np.median(before) / 2)


def loss_rose(loss: pl.DataFrame | None, lo: int, mid: int, hi: int,
              catastrophic: float) -> tuple[bool | None, str] | None:
    """Whether the logged loss over steps [mid, hi] rose above its values over [lo, mid): True where
    its median is above theirs by more than their spread about it (their median absolute deviation: a
    minibatch loss's noise is no rise), where one step's loss is `catastrophic`× their median and beyond
    that spread (a median ignores one catastrophic step), or where it is no number; False where the
    median fell by as much; None where it held level; with the evidence. None where no loss was
    logged in either span."""
    if loss is None:
        return None
    steps, values = loss["step"].to_numpy(), loss["value"].to_numpy()
    before, now = values[(steps >= lo) & (steps < mid)], values[(steps >= mid) & (steps <= hi)]
    if not len(before) or not len(now):
        return None
    if not np.isfinite(now).all():
        return True, "; the loss is no longer finite"
    b, n = np.median(before), np.median(now)
    spread = np.median(np.abs(before - b)) if np.isfinite(before).all() else 0.0
    shown = f"its median {b:.3g} before, {n:.3g} since"
    peak = int(np.argmax(now))
    if b > 0 and now[peak] >= catastrophic * b and now[peak] > b + spread:
        at = steps[(steps >= mid) & (steps <= hi)][peak]
        return True, f"; the loss hit {now[peak]:.3g} at step {at}, {now[peak] / b:.3g}× its median {b:.3g} before"
    if n > b + spread and f"{n:.3g}" != f"{b:.3g}":  # as the medians read
        return True, f"; the loss rose: {shown}"
    if n < b - spread and f"{n:.3g}" != f"{b:.3g}":  # as the medians read
        return False, f"; the loss still falls: {shown}"
    return None, f"; the loss held level: {shown}" + (f", within the spread of its values before (±{spread:.2g})"
                                                      if spread else "")


def layers_named(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"the {len(names)} layers {names[0]} … {names[-1]} (median)"
