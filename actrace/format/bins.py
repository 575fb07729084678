"""The fixed histogram bins of spec/trace-v1.md §Histogram, identical in every trace.

Bins are symmetric in magnitude: log-spaced edges, four per decade from 1e-8 to 1e8, plus
the saturation edges 0.9, 0.99, 0.999 and 1; exact zero, ±inf each get a bin of their own.
"""
from __future__ import annotations

import threading

import numpy as np

# The 68 edges exactly as spec/bins-v1.txt lists them (10^(k/4) for k = -32 … 32, and 0.9, 0.99,
# 0.999), written out rather than computed: `10.0 ** x` can differ in the last bit between numpy
# versions and platforms, and the bins must be bit-identical in every trace (a test holds this
# table to the spec's file).
MAGNITUDE_EDGES = np.array([
    1e-08, 1.7782794100389228e-08, 3.162277660168379e-08, 5.6234132519034905e-08,
    1e-07, 1.7782794100389227e-07, 3.162277660168379e-07, 5.62341325190349e-07,
    1e-06, 1.7782794100389227e-06, 3.162277660168379e-06, 5.623413251903491e-06,
    9.999999999999999e-06, 1.778279410038923e-05, 3.1622776601683795e-05, 5.623413251903491e-05,
    0.0001, 0.00017782794100389227, 0.00031622776601683794, 0.0005623413251903491,
    0.001, 0.0017782794100389228, 0.0031622776601683794, 0.005623413251903491,
    0.01, 0.01778279410038923, 0.03162277660168379, 0.056234132519034905,
    0.1, 0.1778279410038923, 0.31622776601683794, 0.5623413251903491,
    0.9, 0.99, 0.999, 1.0,
    1.7782794100389228, 3.1622776601683795, 5.62341325190349, 10.0,
    17.78279410038923, 31.622776601683793, 56.23413251903491, 100.0,
    177.82794100389228, 316.2277660168379, 562.341325190349, 1000.0,
    1778.2794100389228, 3162.2776601683795, 5623.413251903491, 10000.0,
    17782.794100389227, 31622.776601683792, 56234.13251903491, 100000.0,
    177827.94100389228, 316227.7660168379, 562341.3251903491, 1000000.0,
    1778279.410038923, 3162277.660168379, 5623413.251903491, 10000000.0,
    17782794.100389227, 31622776.60168379, 56234132.51903491, 100000000.0,
], dtype=np.float64)
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


def histogram(values: np.ndarray, zeros: int | None = None) -> np.ndarray:
    """Counts per bin of the non-NaN values (int64, length N_BINS); `zeros`, the number of
    exact zeros when the caller knows it, spares the float32 path a re-count."""
    v = np.asarray(values)
    return histogram_float32(v, zeros) if v.dtype == np.float32 else histogram_exact(v)


def histogram_exact(values: np.ndarray) -> np.ndarray:
    """The definition: each value placed by comparison with the edges (any float dtype)."""
    v = np.asarray(values).ravel()
    v = v[~np.isnan(v)] if v.dtype.kind == "f" and np.isnan(v).any() else v
    return np.bincount(bin_index(v), minlength=N_BINS).astype(np.int64)


def bin_index(v: np.ndarray) -> np.ndarray:
    """Each (non-NaN) value's bin, by comparison of its exact value with the edges."""
    mag = np.abs(v)
    # |v| in [E_j, E_j+1) -> magnitude bin j+1; below E_0 -> 0; zero is handled apart.
    mag_bin = np.searchsorted(MAGNITUDE_EDGES, mag, side="right")
    idx = np.where(v > 0, ZERO_BIN + 1 + mag_bin, ZERO_BIN - 1 - mag_bin)
    idx = np.where(v == 0, ZERO_BIN, idx)
    return np.where(np.isinf(v), np.where(v > 0, POS_INF_BIN, NEG_INF_BIN), idx)


# float32 fast path: a float32's bit pattern >> _SHIFT is monotonic in magnitude within each sign,
# so every bin is a contiguous range of these keys. One bincount over the keys, sums over the
# ranges, and an exact re-count of the few values whose key straddles an edge give the histogram.
_SHIFT = 14
_HALF = 1 << (31 - _SHIFT)                       # keys per sign
_INF_KEY = int(np.float32(np.inf).view(np.uint32)) >> _SHIFT
_first_f32 = [np.float32(e) if np.float32(e) >= e else np.nextafter(np.float32(e), np.float32(np.inf))
              for e in MAGNITUDE_EDGES]
_edge_bits = np.array([f.view(np.uint32) for f in _first_f32], dtype=np.int64)
# segments: zero key, below E[0], [E[j], E[j+1]) ..., >= E[-1], inf key
_STARTS = np.concatenate([[0, 1], _edge_bits >> _SHIFT, [_INF_KEY]])
_STRADDLING = np.unique(np.concatenate([[_INF_KEY], (_edge_bits >> _SHIFT)[(_edge_bits & ((1 << _SHIFT) - 1)) != 0]]))
_AMBIGUOUS = np.zeros(2 * _HALF, dtype=bool)
_AMBIGUOUS[_STRADDLING] = _AMBIGUOUS[_STRADDLING + _HALF] = True
_WITH_ZERO_KEYS = _AMBIGUOUS.copy()
_WITH_ZERO_KEYS[[0, _HALF]] = True  # zero shares its key with the tiniest subnormals
_AMBIGUOUS_KEYS, _AMBIGUOUS_KEYS_WITH_ZERO = np.flatnonzero(_AMBIGUOUS), np.flatnonzero(_WITH_ZERO_KEYS)


def signed_edges(dtype) -> np.ndarray:
    """Sorted edges S such that #(S < v) is the bin of every non-NaN v of `dtype` (float32, float64):
    −inf, each −E (v < −E ⇔ |v| > E), the largest negative value and 0 (either side of zero's bin),
    below each E (v > below ⇔ v >= E), the largest finite value (+inf above). For float32, the
    float32 edges f with |v| >= f ⇔ |v| >= E. A binary search over them bins values on a device."""
    f = np.array(_first_f32, np.float32) if np.dtype(dtype) == np.float32 else MAGNITUDE_EDGES
    info = np.finfo(f.dtype)
    below = np.nextafter(f, f.dtype.type(-np.inf))
    return np.concatenate([[-np.inf], -f[::-1], [-info.smallest_subnormal, 0.0], below, [info.max]]).astype(f.dtype)


_local = threading.local()


def _scratch(n: int) -> np.ndarray:
    """A reused intp buffer: fresh multi-MiB temporaries cost page faults at every reading."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < n:
        buf = _local.buf = np.empty(n, dtype=np.intp)
    return buf[:n]


def _assemble(pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """Per-sign segment counts (zero, magnitude bins, inf) → the spec's bin order."""
    return np.concatenate([[neg[-1]], neg[-2:0:-1], [pos[0] + neg[0]], pos[1:-1], [pos[-1]]])


def histogram_float32(values: np.ndarray, zeros: int | None = None) -> np.ndarray:
    """Same counts as `histogram_exact` for float32 input, several times faster."""
    bits = np.ascontiguousarray(values).reshape(-1).view(np.uint32)
    keys = _scratch(bits.size)
    np.right_shift(bits, _SHIFT, out=keys, casting="unsafe")
    counts = np.bincount(keys, minlength=2 * _HALF)
    zero_keys_exact = zeros is not None and counts[0] + counts[_HALF] == zeros
    ambiguous_keys = _AMBIGUOUS_KEYS if zero_keys_exact else _AMBIGUOUS_KEYS_WITH_ZERO
    fuzzy = counts[ambiguous_keys]
    counts[ambiguous_keys] = 0  # straddling keys are re-counted exactly below
    pos = np.add.reduceat(counts[: _INF_KEY + 1], _STARTS)
    neg = np.add.reduceat(counts[_HALF: _HALF + _INF_KEY + 1], _STARTS)
    hist = _assemble(pos, neg)
    if fuzzy.any():
        table = _AMBIGUOUS if zero_keys_exact else _WITH_ZERO_KEYS
        hist += histogram_exact(values.reshape(-1)[table[keys]])
    return hist.astype(np.int64)
