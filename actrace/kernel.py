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


def reduce_f32(x3: np.ndarray, centre: float, histogram: bool, relu: bool = False) -> dict:
    """Per-unit sums, sums of squares, extremes, min |h - centre|, zero and finite counts, the
    histogram, and NaN/Inf totals of a C-contiguous float32 (before, units, after) array; with
    `relu`, also the per-unit sums and sums of squares of relu(x) and how many finite values are <= 0
    (`relu_sum`, `relu_sumsq`, `relu_zero`), all over finite values."""
    before, units, after = x3.shape
    out = {"sum": np.zeros(units), "sumsq": np.zeros(units), "min": np.full(units, np.inf, np.float32),
           "max": np.full(units, -np.inf, np.float32), "min_dev": np.full(units, np.inf, np.float32),
           "zero": np.zeros(units, np.int64), "finite": np.zeros(units, np.int64),
           "hist": np.zeros(bins.N_BINS, np.int64) if histogram else None, "nan_inf": np.zeros(2, np.int64),
           "relu_sum": np.zeros(units) if relu else None, "relu_sumsq": np.zeros(units) if relu else None,
           "relu_zero": np.zeros(units, np.int64) if relu else None}
    ptr = lambda a: None if a is None else a.ctypes.data  # noqa: E731
    _fn(x3.ctypes.data, before, units, after, centre, _TABLE.ctypes.data, SHIFT, _EDGES.ctypes.data, len(_EDGES),
        bins.ZERO_BIN, bins.N_BINS, *(ptr(out[k]) for k in ("sum", "sumsq", "min", "max", "min_dev", "zero",
                                                              "finite", "hist", "nan_inf", "relu_sum",
                                                              "relu_sumsq", "relu_zero")))
    empty = out["finite"] == 0  # spec: a unit with no finite value has NaN extremes
    for k in ("min", "max", "min_dev"):
        out[k][empty] = np.nan
    return out
