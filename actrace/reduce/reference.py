"""The numpy oracle of the per-unit statistics (spec §Units, §Columns, §Numerics): `reference`,
named as the spec's columns, which every backend (the C kernel, torch, ONNX Runtime) is held to by
tests/test_contract.py; and what every backend shares with it: the (before, units, after) view,
what may be reduced, the centre of `unit_min_dev`, the `sat_counts` of a bounded kind.
"""
from __future__ import annotations

import math

import numpy as np

from actrace.format import bins
from actrace.format.schema import SAT_COUNTS, sat_thresholds

from .reading import ReductionError, centre


def _f32_inward(v: float, up: bool) -> float:
    """The float32 nearest `v` on the side of the values a comparison keeps: for float32 x,
    `x >= v` ⇔ `x >= _f32_inward(v, up=True)` and `x <= v` ⇔ `x <= _f32_inward(v, up=False)`."""
    f = np.float32(v)
    if (float(f) < v) if up else (float(f) > v):  # in float64: numpy 2 compares np.float32 and float in float32
        f = np.nextafter(f, np.float32(np.inf if up else -np.inf))
    return float(f)

def sat_counts(x, bounds: tuple[float, float], lib=np):
    """Non-NaN values at or beyond each of `schema.sat_thresholds` (spec §Columns), thresholds in
    float64 and compared exactly whatever the dtype. `x` is a numpy array or (`lib=torch`) a tensor."""
    lows, highs = sat_levels(bounds, str(x.dtype).endswith("float32"))
    if lib is np:  # the few values near a bound first, then each level on those (on a device: no sync)
        x = x[(x <= lows[-1]) | (x >= highs[0])]
    return lib.stack([(x <= v).sum() for v in lows] + [(x >= v).sum() for v in highs])

def sat_levels(bounds: tuple[float, float], float32: bool) -> tuple[list[float], list[float]]:
    """`sat_counts`' thresholds below and above (x <= low, x >= high counted), as compared with the
    values: float64, or the float32 that keeps the same values where `float32`."""
    thresholds = [float(v) for v in sat_thresholds(bounds)]
    half = len(SAT_COUNTS) // 2
    lows, highs = thresholds[:half], thresholds[half:]
    if float32:
        return [_f32_inward(v, False) for v in lows], [_f32_inward(v, True) for v in highs]
    return lows, highs

def check_reducible(floating: bool, dtype, shape: tuple, layer: str) -> None:
    """Refuse what spec §Numerics says must not be recorded, naming the layer: a tensor that is
    not floating point, or an empty one."""
    if not floating:
        raise ReductionError(f"layer {layer!r}: cannot reduce a {dtype} tensor, only floating point")
    if math.prod(shape) == 0:
        raise ReductionError(f"layer {layer!r}: cannot reduce an empty tensor of shape {tuple(shape)}")

def _as_float(x, layer: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype.name == "bfloat16":  # ml_dtypes' bfloat16 is not a numpy float kind
        x = x.astype(np.float32)
    check_reducible(x.dtype.kind == "f", x.dtype, x.shape, layer)
    return x.astype(np.float32) if x.dtype.itemsize < 4 else x

_BLOCK = 1 << 18  # elements per block: temporaries stay in cache and are reused, no page faults

def _blockwise(x3: np.ndarray, op, combine, dtype=None) -> np.ndarray:
    """Reduce op(block) over axes 0 and 2 block by block (sum for np.add, min for np.fmin),
    writing op's full-size temporaries into one small reused buffer."""
    axis = 0 if x3.shape[0] > 1 else 2
    per = x3.shape[1] * (x3.shape[2] if axis == 0 else x3.shape[0])
    step = max(1, _BLOCK // max(per, 1))
    buf = np.empty(min(_BLOCK, x3.size) if per <= _BLOCK else per, dtype=dtype or x3.dtype)
    out = None
    for i in range(0, x3.shape[axis], step):
        b = x3[i: i + step] if axis == 0 else x3[:, :, i: i + step]
        v = op(b, buf[: b.size].reshape(b.shape))
        part = (v.sum(axis=(0, 2), dtype=np.float64) if combine is np.add
                else v.min(axis=(0, 2)).astype(np.float64))
        out = part if out is None else combine(out, part)
    return out

def view3(x, unit_axis: int | None, layer: str = "?") -> np.ndarray:
    """`x` as a float (before, units, after) view, the unit axis in the middle: reducing over axes 0
    and 2 needs no transposed copy (NCHW). Half floats are widened to float32."""
    xw = _as_float(x, layer)
    if unit_axis is None:
        return xw.reshape(1, 1, -1)
    if not -xw.ndim <= unit_axis < xw.ndim:
        raise ReductionError(f"layer {layer!r}: unit axis {unit_axis} out of range for shape {xw.shape}")
    unit_axis %= xw.ndim
    return xw.reshape(math.prod(xw.shape[:unit_axis]), xw.shape[unit_axis], -1)

def reference(x, unit_axis: int | None = None, *, bounds: tuple[float, float] | None = None,
              histogram: bool = True) -> dict:
    """The per-unit statistics of spec §Columns with numpy alone, named as the columns: the oracle
    every backend (C kernel, torch, ONNX Runtime) is tested against. `bounds` (a bounded kind's)
    set the centre of `unit_min_dev` and add `sat_counts`."""
    x3 = view3(x, unit_axis)
    st = _stats(x3, centre(bounds), histogram)
    if bounds is not None:
        st["sat_counts"] = sat_counts(x3, bounds)
    return st

def _stats(x3: np.ndarray, c: float, histogram: bool) -> dict:
    """The statistics of a (before, units, after) float array over axes 0 and 2: sums (of values,
    squares, cubes, fourth powers) in float64 over finite values, extremes and min |h - c| of
    finite values (NaN for a unit with none), zero and finite counts per unit, the histogram, NaN and Inf totals."""
    axes = (0, 2)

    def square(b, out):
        return np.square(b, out=out, dtype=out.dtype)

    def power(n):  # x^n in float64: the sums of cubes and fourth powers (kurtosis, spec 1.3)
        return lambda b, out: np.power(b, n, out=out, dtype=np.float64)

    wide = np.float64 if x3.dtype.itemsize < 8 else None  # float32 squares overflow above 1.8e19
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf in a sum only says: not finite
        unit_sum = x3.sum(axis=axes, dtype=np.float64)
        unit_sumsq = _blockwise(x3, square, np.add, wide)
    # float64 squares of narrower floats cannot overflow: finite sums mean every value was finite
    all_finite = bool(np.isfinite(unit_sumsq).all() and np.isfinite(unit_sum).all())
    if all_finite:
        nan_count = 0
        unit_count = np.full(x3.shape[1], x3.shape[0] * x3.shape[2], dtype=np.int64)
        unit_min = x3.min(axis=axes).astype(np.float64)
        unit_max = x3.max(axis=axes).astype(np.float64)
    else:
        finite = np.isfinite(x3)
        nan_count = int(np.isnan(x3).sum())
        clean = np.where(finite, x3, 0)
        unit_sum = clean.sum(axis=axes, dtype=np.float64)
        unit_sumsq = _blockwise(clean, square, np.add, wide)
        unit_count = finite.sum(axis=axes, dtype=np.int64)
        unit_min = np.where(finite, x3, np.inf).min(axis=axes).astype(np.float64)
        unit_max = np.where(finite, x3, -np.inf).max(axis=axes).astype(np.float64)
    finite_x3 = x3 if all_finite else clean
    unit_sum3, unit_sum4 = (_blockwise(finite_x3, power(n), np.add, np.float64) for n in (3, 4))
    unit_zero = _blockwise(x3, lambda b, out: np.equal(b, 0, out=out), np.add, np.bool_).astype(np.int64)
    # min |h - c|: a unit entirely on one side of c needs no pass (ReLU outputs, say)
    with np.errstate(invalid="ignore"):
        unit_min_dev = np.where(unit_min >= c, unit_min - c, np.where(unit_max <= c, c - unit_max, np.nan))
    mixed = (unit_min < c) & (unit_max > c)
    if mixed.any():
        def dev(b, out):
            d = np.abs(np.subtract(b, x3.dtype.type(c), out=out), out=out)
            return d if all_finite else np.where(np.isfinite(b), d, np.inf)
        unit_min_dev[mixed] = _blockwise(x3, dev, np.fmin)[mixed]
    for arr in (unit_min, unit_max, unit_min_dev):
        arr[unit_count == 0] = np.nan
    zeros = int(unit_zero.sum())
    return {"unit_sum": unit_sum, "unit_sumsq": unit_sumsq, "unit_min": unit_min, "unit_max": unit_max,
            "unit_min_dev": unit_min_dev, "unit_zero": unit_zero, "unit_count": unit_count,
            "unit_sum3": unit_sum3, "unit_sum4": unit_sum4,
            "hist": bins.histogram(x3, zeros) if histogram else None,
            "nan_count": nan_count, "inf_count": x3.size - int(unit_count.sum()) - nan_count}
