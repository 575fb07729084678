"""Trends of one layer's readings over steps, as the findings rules read them (spec §Metrics, trends'
inputs): a robust slope, where a rise starts, since when a value is stable, the streak a condition
has held to the end. Trend needs more than two points: each helper says nothing on fewer than three.
"""
from __future__ import annotations

import numpy as np
import polars as pl


def series_bounds(frame: pl.DataFrame, *keys: str) -> tuple[np.ndarray, np.ndarray]:
    """(first row, row after the last) of each series of `frame`, sorted by `keys`: the runs of
    consecutive rows that share them, found without a string per row."""
    group = frame.select(pl.struct(*keys).rle_id()).to_series().to_numpy()
    if not len(group):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.concatenate([[0], np.flatnonzero(np.diff(group)) + 1])
    return starts, np.append(starts[1:], len(group))


def theil_sen(steps: np.ndarray, values: np.ndarray) -> float:
    """The median of the pairwise slopes (per step): robust to one odd reading; 0 on fewer than 3."""
    if len(values) < 3:
        return 0.0
    i, j = np.triu_indices(len(values), 1)
    return float(np.median((values[j] - values[i]) / np.maximum(steps[j] - steps[i], 1e-12)))


def recent(steps: np.ndarray) -> int:
    """Where the recent readings start: the last half, or the last three of fewer than six."""
    return len(steps) // 2 if len(steps) >= 6 else max(len(steps) - 3, 0)


def onset(steps: np.ndarray, values: np.ndarray) -> int:
    """The index where a rise starts: the last reading before the ramp of the best fit that is flat,
    rises linearly, then is flat again (a layer dying over some readings, then staying dead)."""
    n = len(values)
    if n < 3:
        return 0
    s, v = steps.astype(np.float64), values.astype(np.float64)
    best, where = np.inf, 0
    for i in range(n - 1):
        x = np.clip(s[None, :] - s[i], 0, (s[i + 1:] - s[i])[:, None])  # one row per end j > i
        xm, vm = x.mean(1), v.mean()
        xx = ((x - xm[:, None]) ** 2).sum(1)
        slope = np.where(xx > 0, ((x - xm[:, None]) * (v - vm)).sum(1) / np.maximum(xx, 1e-300), 0.0)
        sse = (((vm + slope[:, None] * (x - xm[:, None])) - v) ** 2).sum(1)
        sse[slope < 0] = np.inf  # a rise, not a fall
        j = int(np.argmin(sse))
        if sse[j] < best - 1e-12:
            best, where = float(sse[j]), i
    return where


def stable_since(steps: np.ndarray, values: np.ndarray, tolerance: float) -> int:
    """The first step from which `values` stays within `tolerance` of its last value."""
    off = np.nonzero(np.abs(values - values[-1]) > tolerance)[0]
    return int(steps[off[-1] + 1] if len(off) else steps[0])


def held_since(condition: np.ndarray, share: float) -> int | None:
    """The earliest index at which `condition` holds and from which it holds at `share` of the
    readings or more, up to and including the last one (which must hold); None when it does not
    hold at the end."""
    if not len(condition) or not condition[-1]:
        return None
    tail_share = np.cumsum(condition[::-1])[::-1] / np.arange(len(condition), 0, -1)
    return int(np.argmax((tail_share >= share) & condition))  # a streak starts at a reading that holds
