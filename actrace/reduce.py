"""Reference reductions: a tensor, its unit axis and its kind → one mergeable Reading.

Implements spec/trace-v1.md §Units and §Columns: float32 goes through the fused kernel
(`actrace.kernel`) when it is built, anything else (or float32 without it) through numpy; the
tests hold the two, and every adapter's fast path, to each other. `merge` combines readings of
batch chunks: counts, extremes and histograms exactly, sums to float rounding.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from . import bins, kernel
from .schema import STREAMS, bounds_for


class ReductionError(ValueError):
    """A tensor that cannot be reduced (empty, not floating point, bad unit axis)."""


@dataclass
class Reading:
    """One layer's reductions for one stream; per-unit arrays and hist may be None."""

    layer: str
    kind: str
    stream: str
    dtype: str
    shape: tuple[int, ...]
    unit_axis: int | None
    units: int
    count: int
    nan_count: int
    inf_count: int
    zero_count: int
    sum: float
    sumsq: float
    min: float
    max: float
    bounds: tuple[float, float] | None = None
    param: str | None = None
    update_norm: float | None = None
    unit_count: np.ndarray | None = None
    unit_zero: np.ndarray | None = None
    unit_sum: np.ndarray | None = None
    unit_sumsq: np.ndarray | None = None
    unit_min: np.ndarray | None = None
    unit_max: np.ndarray | None = None
    unit_min_dev: np.ndarray | None = None
    hist: np.ndarray | None = None


def centre(bounds: tuple[float, float] | None) -> float:
    """The point `unit_min_dev` is measured from: the middle of the bounds, else 0."""
    return 0.0 if bounds is None else (bounds[0] + bounds[1]) / 2.0


def _as_float(x, layer: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype.name == "bfloat16":  # ml_dtypes' bfloat16 is not a numpy float kind
        x = x.astype(np.float32)
    if x.dtype.kind != "f":
        raise ReductionError(f"layer {layer!r}: cannot reduce a {x.dtype} tensor, only floating point")
    if x.size == 0:
        raise ReductionError(f"layer {layer!r}: cannot reduce an empty tensor of shape {x.shape}")
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


def reduce_array(x, unit_axis: int | None, kind: str, *, layer: str = "?", stream: str = "activation",
                 bounds: tuple[float, float] | None = None, param: str | None = None,
                 per_unit: bool = True, histogram: bool = True) -> Reading:
    """Reduce `x` over every axis but `unit_axis` (None: the whole tensor is one unit)."""
    if stream not in STREAMS:
        raise ReductionError(f"layer {layer!r}: unknown stream {stream!r}; expected one of {STREAMS}")
    dtype = str(np.asarray(x).dtype)
    xw = _as_float(x, layer)
    bounds = bounds_for(kind, bounds)
    if unit_axis is not None:
        if not -xw.ndim <= unit_axis < xw.ndim:
            raise ReductionError(f"layer {layer!r}: unit axis {unit_axis} out of range for shape {xw.shape}")
        unit_axis %= xw.ndim
    units = 1 if unit_axis is None else xw.shape[unit_axis]
    # a (before, units, after) view: reducing over axes 0 and 2 needs no transposed copy (NCHW)
    before = 1 if unit_axis is None else int(np.prod(xw.shape[:unit_axis]))
    x3 = xw.reshape(before, units, -1)

    c = centre(bounds)
    if kernel.available and x3.dtype == np.float32:
        st = kernel.reduce_f32(np.ascontiguousarray(x3), c, histogram)
    else:
        st = _numpy_stats(x3, c, histogram)
    unit_count, unit_zero = st["finite"], st["zero"]
    reading = Reading(
        layer=layer, kind=kind, stream=stream, dtype=dtype, shape=tuple(int(s) for s in xw.shape),
        unit_axis=unit_axis, units=int(units), count=int(xw.size), nan_count=int(st["nan_inf"][0]),
        inf_count=int(st["nan_inf"][1]), zero_count=int(unit_zero.sum()),
        sum=float(st["sum"].sum()), sumsq=float(st["sumsq"].sum()),
        # units with no finite value hold NaN extremes, which fmin/fmax pass over
        min=float(np.fmin.reduce(st["min"])), max=float(np.fmax.reduce(st["max"])),
        bounds=bounds, param=param, hist=st["hist"],
    )
    if per_unit:
        reading = replace(
            reading, unit_count=unit_count, unit_zero=unit_zero, unit_sum=st["sum"],
            unit_sumsq=st["sumsq"], unit_min=st["min"].astype(np.float32),
            unit_max=st["max"].astype(np.float32), unit_min_dev=st["min_dev"].astype(np.float32))
    return reading


def _numpy_stats(x3: np.ndarray, c: float, histogram: bool) -> dict:
    """The statistics of `kernel.reduce_f32` with numpy alone (any float dtype), NaN extremes for
    a unit with no finite value included."""
    axes = (0, 2)

    def square(b, out):
        return np.square(b, out=out, dtype=out.dtype)

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
    return {"sum": unit_sum, "sumsq": unit_sumsq, "min": unit_min, "max": unit_max, "min_dev": unit_min_dev,
            "zero": unit_zero, "finite": unit_count, "hist": bins.histogram(x3, zeros) if histogram else None,
            "nan_inf": [nan_count, x3.size - int(unit_count.sum()) - nan_count]}


_ADD = ("count", "nan_count", "inf_count", "zero_count", "sum", "sumsq")
_ARRAY_ADD = ("unit_count", "unit_zero", "unit_sum", "unit_sumsq", "hist")
_UNIT_MIN = ("unit_min", "unit_min_dev")


def merge(a: Reading, b: Reading, *, batch_axis: int = 0) -> Reading:
    """Combine the readings of two chunks of one tensor split along `batch_axis`."""
    same = ("layer", "kind", "stream", "unit_axis", "units", "bounds", "param")
    for name in same:
        if getattr(a, name) != getattr(b, name):
            raise ReductionError(f"layer {a.layer!r}: cannot merge readings whose {name} differ "
                                 f"({getattr(a, name)!r} vs {getattr(b, name)!r})")
    shape = list(a.shape)
    if shape:
        shape[batch_axis] += b.shape[batch_axis]
    out = replace(a, shape=tuple(shape), update_norm=None,
                  min=float(np.fmin(a.min, b.min)), max=float(np.fmax(a.max, b.max)))
    for name in _ADD:
        setattr(out, name, getattr(a, name) + getattr(b, name))
    for name in _ARRAY_ADD + _UNIT_MIN + ("unit_max",):
        va, vb = getattr(a, name), getattr(b, name)
        if va is None or vb is None:
            setattr(out, name, None)
        elif name in _ARRAY_ADD:
            setattr(out, name, va + vb)
        else:
            setattr(out, name, (np.fmin if name in _UNIT_MIN else np.fmax)(va, vb))
    return out
