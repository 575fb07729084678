"""The fused float32 reduction kernel (actrace/_kernel.c) through ctypes, with its lookup table.

Optional: where the compiled module is missing, `available` is False and `actrace.reduce` uses
its numpy path, which gives the same numbers (the tests hold the two to each other).
"""
from __future__ import annotations

import ctypes
import importlib.util

import numpy as np

from . import bins

SHIFT = 14  # key = float32 bits >> SHIFT: 2^18 keys, a 512 KiB table of bins


def _load():
    spec = importlib.util.find_spec("actrace._kernel")
    if spec is None or not spec.origin:
        return None
    lib = ctypes.CDLL(spec.origin)
    fn = lib.actrace_reduce_f32
    ptr = ctypes.c_void_p
    fn.argtypes = [ptr, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ptr, ctypes.c_int, ptr,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int] + [ptr] * 12
    fn.restype = ctypes.c_int
    return fn


def _key_table() -> np.ndarray:
    """Each key's bin where every float32 with that key lands in one bin, else -1 (exact path)."""
    assert bins.N_BINS <= 160, "MAX_BINS in _kernel.c"
    keys = np.arange(1 << (32 - SHIFT), dtype=np.uint64)
    first = (keys << SHIFT).astype(np.uint32).view(np.float32)
    last = ((keys << SHIFT) | ((1 << SHIFT) - 1)).astype(np.uint32).view(np.float32)
    with np.errstate(invalid="ignore"):
        same = ~np.isnan(first) & ~np.isnan(last)
        b_first = np.where(same, bins.bin_index(np.where(same, first, 0)), -1)
        b_last = np.where(same, bins.bin_index(np.where(same, last, 0)), -1)
    table = np.where(same & (b_first == b_last), b_first, -1).astype(np.int16)
    table[[0, 1 << (31 - SHIFT)]] = bins.ZERO_BIN  # ±0's keys; the kernel sends their subnormals the exact way
    return table


_fn = _load()
available = _fn is not None
_TABLE = _key_table() if available else None
_EDGES = np.ascontiguousarray(bins.MAGNITUDE_EDGES, dtype=np.float64)
_TABLES = (_TABLE.ctypes.data, SHIFT, _EDGES.ctypes.data, len(_EDGES), bins.ZERO_BIN, bins.N_BINS) if available else ()


def reduce_f32(x3: np.ndarray, centre: float, histogram: bool, relu: bool = False) -> dict:
    """Per-unit sums, sums of squares, extremes, min |h - centre|, zero and finite counts, the
    histogram, and NaN/Inf totals of a C-contiguous float32 (before, units, after) array; with
    `relu`, also the per-unit sums and sums of squares of relu(x) and how many finite values are <= 0
    (`relu_sum`, `relu_sumsq`, `relu_zero`), all over finite values."""
    before, units, after = x3.shape
    # three buffers for every output (a ctypes pointer costs a microsecond; small tensors feel it)
    f64 = np.zeros((4, units))
    f32 = np.full((3, units), np.inf, np.float32)
    f32[1] = -np.inf
    i64 = np.zeros(3 * units + bins.N_BINS + 2, np.int64)
    d, f, i = f64.ctypes.data, f32.ctypes.data, i64.ctypes.data
    hist = i + 24 * units
    _fn(x3.ctypes.data, before, units, after, centre, *_TABLES, d, d + 8 * units, f, f + 4 * units, f + 8 * units,
        i, i + 8 * units, hist if histogram else None, hist + 8 * bins.N_BINS, d + 16 * units if relu else None,
        d + 24 * units if relu else None, i + 16 * units if relu else None)
    out = {"sum": f64[0], "sumsq": f64[1], "min": f32[0], "max": f32[1], "min_dev": f32[2], "zero": i64[:units],
           "finite": i64[units: 2 * units], "hist": i64[3 * units: -2] if histogram else None, "nan_inf": i64[-2:],
           "relu_sum": f64[2] if relu else None, "relu_sumsq": f64[3] if relu else None,
           "relu_zero": i64[2 * units: 3 * units] if relu else None}
    if not out["finite"].all():  # spec: a unit with no finite value has NaN extremes
        f32[:, out["finite"] == 0] = np.nan
    return out
