"""The fixed histogram bins of spec/trace-v1.md §Histogram, identical in every trace.

Bins are symmetric in magnitude: log-spaced edges, four per decade from 1e-8 to 1e8, plus
the saturation edges 0.9, 0.99, 0.999 and 1; exact zero, ±inf each get a bin of their own.
"""
from __future__ import annotations

import numpy as np

_DECADES = 10.0 ** (np.arange(-32, 33) / 4.0)
MAGNITUDE_EDGES = np.unique(np.concatenate([_DECADES, [0.9, 0.99, 0.999, 1.0]]))
_M = len(MAGNITUDE_EDGES)
# Layout: [-inf] [negative magnitude bins, most negative first] [zero] [positive bins] [+inf]
N_MAG_BINS = _M + 1  # below the first edge, between edges, at or above the last edge
N_BINS = 2 * N_MAG_BINS + 3
ZERO_BIN = 1 + N_MAG_BINS
NEG_INF_BIN, POS_INF_BIN = 0, N_BINS - 1


def bin_bounds() -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper value bound of every bin (the zero bin is [0, 0])."""
    mag_lo = np.concatenate([[0.0], MAGNITUDE_EDGES])
    mag_hi = np.concatenate([MAGNITUDE_EDGES, [np.inf]])
    lo = np.concatenate([[-np.inf], -mag_hi[::-1], [0.0], mag_lo, [np.inf]])
    hi = np.concatenate([[-np.inf], -mag_lo[::-1], [0.0], mag_hi, [np.inf]])
    return lo, hi


def histogram(values: np.ndarray) -> np.ndarray:
    """Counts per bin of the non-NaN values (int64, length N_BINS)."""
    v = np.asarray(values).ravel()
    v = v[~np.isnan(v)] if v.dtype.kind == "f" and np.isnan(v).any() else v
    mag = np.abs(v)
    # |v| in [E_j, E_j+1) -> magnitude bin j+1; below E_0 -> 0; zero is handled apart.
    mag_bin = np.searchsorted(MAGNITUDE_EDGES, mag, side="right")
    idx = np.where(v > 0, ZERO_BIN + 1 + mag_bin, ZERO_BIN - 1 - mag_bin)
    idx = np.where(v == 0, ZERO_BIN, idx)
    idx = np.where(np.isinf(v), np.where(v > 0, POS_INF_BIN, NEG_INF_BIN), idx)
    return np.bincount(idx, minlength=N_BINS).astype(np.int64)
