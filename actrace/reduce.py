"""Reference reductions: a tensor, its unit axis and its kind → one mergeable Reading.

Implements spec/trace-v1.md §Units and §Columns. `reference` is the numpy oracle of the per-unit
statistics, named as the spec's columns; float32 goes through the fused kernel (`actrace.kernel`)
when it is built, which gives the same numbers. Every backend's statistics become a `Reading`
through `Reading.from_stats`, and `merge` combines the readings of batch chunks by the schema's
merge rules (tests/test_contract.py holds every backend to the reference).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from . import bins, kernel
from .schema import MERGE, SAT_LEVELS, SCHEMA, STREAMS, UNIT_COLUMNS, bounds_for


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
    sat_counts: np.ndarray | None = None
    value: float | None = None

    @classmethod
    def scalar(cls, name: str, value) -> "Reading":
        """A training-loop value (the loss, the learning rate) as a `scalar` row (spec §Streams): the
        value as given, NaN and ±inf included, and the counts of a one-value tensor."""
        try:
            v = float(value)
        except (TypeError, ValueError):
            raise ReductionError(f"scalar {name!r}: {value!r} is not a number") from None
        finite = math.isfinite(v)
        return cls(layer=name, kind="other", stream="scalar", dtype="float64", shape=(), unit_axis=None, units=1,
                   count=1, nan_count=int(math.isnan(v)), inf_count=int(math.isinf(v)), zero_count=int(v == 0),
                   sum=v if finite else 0.0, sumsq=v * v if finite else 0.0, min=v if finite else math.nan,
                   max=v if finite else math.nan, value=v)

    @classmethod
    def from_stats(cls, stats: dict, *, shape: tuple, unit_axis: int | None, per_unit: bool = True,
                   **meta) -> "Reading":
        """A reading from per-unit statistics named as the spec's columns (`unit_sum` … `unit_count`,
        `hist`, `sat_counts`, `nan_count`, `inf_count`), as every backend gives them; the layer
        totals follow from them (spec §Columns). Without `per_unit` only the totals are kept.
        Float64 extremes are rounded outward to float32, so a nonzero value never becomes 0."""
        v = {k: np.asarray(x) for k, x in stats.items() if x is not None}
        unit_axis = None if unit_axis is None else unit_axis % len(shape)
        r = cls(shape=tuple(int(n) for n in shape), unit_axis=unit_axis,
                units=1 if unit_axis is None else int(shape[unit_axis]), count=math.prod(shape),
                nan_count=int(v["nan_count"].sum()), inf_count=int(v["inf_count"].sum()),
                zero_count=int(v["unit_zero"].sum()), sum=float(v["unit_sum"].sum()),
                sumsq=float(v["unit_sumsq"].sum()),
                # units with no finite value hold NaN extremes, which fmin/fmax pass over
                min=float(np.fmin.reduce(v["unit_min"].ravel())), max=float(np.fmax.reduce(v["unit_max"].ravel())),
                hist=v["hist"].astype(np.int64) if "hist" in v else None,
                sat_counts=v["sat_counts"].astype(np.int64) if "sat_counts" in v else None, **meta)
        if per_unit:
            for name, dtype in _UNIT_DTYPES.items():
                value = v[name].reshape(-1)
                setattr(r, name, outward(value, _OUTWARD[name]) if name in _OUTWARD else value.astype(dtype))
        return r

    @classmethod
    def from_totals(cls, totals: dict[str, np.ndarray], metas: list[dict], scale: float = 1.0) -> list["Reading"]:
        """Layer-level readings (no per-unit columns) of many tensors at once, from arrays of their
        whole-tensor statistics (`kernel.TOTALS`, one row per tensor) and each one's `shape`,
        `unit_axis`, `layer` …; the statistics of values that carry a factor `scale` (a loss
        scaler's) are divided by it. A per-step gradient reading makes dozens of these."""
        rows = zip(*(totals[k].tolist() for k in ("unit_sum", "unit_sumsq", "unit_min", "unit_max", "unit_zero",
                                                  "nan_count", "inf_count")))
        out = []
        for (total, squares, lo, hi, zeros, nans, infs), meta in zip(rows, metas):
            shape = tuple(meta.pop("shape"))
            axis = meta.pop("unit_axis")
            out.append(cls(shape=shape, unit_axis=axis, units=1 if axis is None else shape[axis],
                           count=math.prod(shape), nan_count=nans, inf_count=infs, zero_count=zeros,
                           sum=total / scale, sumsq=squares / scale ** 2, min=lo / scale, max=hi / scale, **meta))
        return out


def outward(v: np.ndarray, toward: float) -> np.ndarray:
    """`v` as float32, each value rounded toward `toward` (-inf for a minimum, +inf for a maximum)
    where float32 cannot hold it: a stored minimum is never above the true one (spec §Numerics)."""
    f = v.astype(np.float32)
    if v.dtype == np.float64:
        with np.errstate(invalid="ignore"):
            off = f > v if toward < 0 else f < v
        f[off] = np.nextafter(f[off], np.float32(toward))
    return f


def _f32_inward(v: float, up: bool) -> float:
    """The float32 nearest `v` on the side of the values a comparison keeps: for float32 x,
    `x >= v` ⇔ `x >= _f32_inward(v, up=True)` and `x <= v` ⇔ `x <= _f32_inward(v, up=False)`."""
    f = np.float32(v)
    if (f < v) if up else (f > v):
        f = np.nextafter(f, np.float32(np.inf if up else -np.inf))
    return float(f)


def sat_counts(x, bounds: tuple[float, float], lib=np):
    """Non-NaN values within `(1 - t) · max(|lo|, |hi|)` of each bound, for t in SAT_LEVELS:
    [lo at 0.999, 0.99, 0.9, hi at 0.9, 0.99, 0.999] (spec §Columns), thresholds in float64 and
    compared exactly whatever the dtype. `x` is a numpy array or (`lib=torch`) a tensor."""
    lo, hi = bounds
    m = max(abs(lo), abs(hi))
    narrow = str(x.dtype).endswith("float32")
    lows = [lo + (1 - t) * m for t in reversed(SAT_LEVELS)]
    highs = [hi - (1 - t) * m for t in SAT_LEVELS]
    if narrow:
        lows, highs = [_f32_inward(v, False) for v in lows], [_f32_inward(v, True) for v in highs]
    if lib is np:  # the few values near a bound first, then each level on those (on a device: no sync)
        x = x[(x <= lows[-1]) | (x >= highs[0])]
    return lib.stack([(x <= v).sum() for v in lows] + [(x >= v).sum() for v in highs])


_OUTWARD = {"unit_min": -np.inf, "unit_max": np.inf, "unit_min_dev": -np.inf}  # float32 columns: round this way
_UNIT_DTYPES = {name: SCHEMA.field(name).type.value_type.to_pandas_dtype() for name in UNIT_COLUMNS}


def centre(bounds: tuple[float, float] | None) -> float:
    """The point `unit_min_dev` is measured from: the middle of the bounds, else 0."""
    return 0.0 if bounds is None else (bounds[0] + bounds[1]) / 2.0


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


def reduce_array(x, unit_axis: int | None, kind: str, *, layer: str = "?", stream: str = "activation",
                 bounds: tuple[float, float] | None = None, param: str | None = None,
                 per_unit: bool = True, histogram: bool = True) -> Reading:
    """Reduce `x` over every axis but `unit_axis` (None: the whole tensor is one unit)."""
    return reduce_arrays([(x, unit_axis, kind, dict(layer=layer, stream=stream, bounds=bounds, param=param,
                                                    per_unit=per_unit, histogram=histogram))])[0]


def relu_stats(stats: dict, sums: dict) -> dict:
    """relu(x)'s statistics from x's fused kernel pass (x without NaN or Inf): its sums and zeros
    come from the kernel (`sums`, the pass's "relu"); min, max and min |h| follow from x's;
    values <= 0 land in zero's bin."""
    lo = np.maximum(stats["unit_min"], 0)
    relu = {**{k: v for k, v in stats.items() if k != "sat_counts"}, **sums, "unit_min": lo,
            "unit_max": np.maximum(stats["unit_max"], 0), "unit_min_dev": lo}
    if stats.get("hist") is not None:
        hist = relu["hist"] = stats["hist"].copy()
        hist[bins.ZERO_BIN] = hist[: bins.ZERO_BIN + 1].sum()
        hist[: bins.ZERO_BIN] = 0
    return relu


def reduce_arrays(tensors: list[tuple]) -> list[Reading]:
    """`reduce_array(x, unit_axis, kind, **options)` of each (x, unit_axis, kind, options), the
    float32 ones in one kernel batch shared among all threads. An option `relu="NAME"` also
    gives the reading of relu(x) as layer NAME, right after x's: from x's own pass where it can
    (float32 without NaN or Inf), else from a pass over relu(x)."""
    jobs, out = [], []
    for x, unit_axis, kind, opt in tensors:
        layer, stream = opt.get("layer", "?"), opt.get("stream", "activation")
        if stream not in STREAMS:
            raise ReductionError(f"layer {layer!r}: unknown stream {stream!r}; expected one of {STREAMS}")
        bounds = bounds_for(kind, opt.get("bounds"))
        x3 = view3(x, unit_axis, layer)
        meta = dict(shape=np.shape(x), unit_axis=unit_axis, per_unit=opt.get("per_unit", True), layer=layer,
                    kind=kind, stream=stream, dtype=str(np.asarray(x).dtype), bounds=bounds, param=opt.get("param"))
        jobs.append((x3, bounds, opt.get("histogram", True), meta, opt.get("relu")))
    fused = [i for i, job in enumerate(jobs) if kernel.available and job[0].dtype == np.float32]
    stats = dict(zip(fused, kernel.reduce_many([(np.ascontiguousarray(jobs[i][0]), centre(jobs[i][1]), jobs[i][2],
                                                 jobs[i][4] is not None) for i in fused])))
    for i, (x3, bounds, histogram, meta, relu) in enumerate(jobs):
        if i in stats:
            st = stats[i]
            sums = st.pop("relu")
            if bounds is not None:
                st["sat_counts"] = sat_counts(x3, bounds)
        else:
            st, sums = reference(x3, 1, bounds=bounds, histogram=histogram), None
        out.append(Reading.from_stats(st, **meta))
        if relu is not None:
            relu_meta = dict(meta, layer=relu, kind="relu", bounds=None)
            if sums is not None and not (st["nan_count"].any() or st["inf_count"].any()):
                out.append(Reading.from_stats(relu_stats(st, sums), **relu_meta))
            else:  # NaN stays NaN through a ReLU, as in the frameworks
                out.append(Reading.from_stats(reference(np.maximum(x3, 0), 1, histogram=histogram), **relu_meta))
    return out


def param_grad_job(g, layer: str, param: str, kind: str) -> tuple:
    """The `reduce_arrays` task of one parameter's gradient, read layer-level (norm, extremes, zeros,
    NaN/Inf; units on axis 0) as every adapter reads gradients at each step."""
    g = np.asarray(g)
    return g, 0 if g.ndim else None, kind, dict(layer=layer, stream="param_grad", param=param, per_unit=False,
                                                histogram=False)


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
    """The statistics of a (before, units, after) float array over axes 0 and 2: sums in float64
    over finite values, extremes and min |h - c| of finite values (NaN for a unit with none),
    zero and finite counts per unit, the histogram, NaN and Inf totals."""
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
    return {"unit_sum": unit_sum, "unit_sumsq": unit_sumsq, "unit_min": unit_min, "unit_max": unit_max,
            "unit_min_dev": unit_min_dev, "unit_zero": unit_zero, "unit_count": unit_count,
            "hist": bins.histogram(x3, zeros) if histogram else None,
            "nan_count": nan_count, "inf_count": x3.size - int(unit_count.sum()) - nan_count}


def combine(rule: str, a, b, lib=np):
    """Two chunks' values of one column by its spec merge rule (`schema.MERGE`): `sum` adds, `min`
    and `max` skip NaN, `concat` adds batch extents. `lib` is numpy or torch."""
    if rule in ("sum", "concat"):
        return a + b
    if rule == "min":
        return lib.fmin(a, b)
    if rule == "max":
        return lib.fmax(a, b)
    raise ValueError(f"no values to combine under merge rule {rule!r}")


def merge(a: Reading, b: Reading, *, batch_axis: int = 0) -> Reading:
    """Combine the readings of two chunks of one tensor split along `batch_axis`, column by column
    by the schema's merge rules (`bounds` stands for `bound_lo`/`bound_hi`)."""
    out = {}
    for f in fields(Reading):
        name, va, vb = f.name, getattr(a, f.name), getattr(b, f.name)
        rule = MERGE.get(name, "same")
        if rule == "same":
            if va != vb:
                raise ReductionError(f"layer {a.layer!r}: cannot merge readings whose {name} differ "
                                     f"({va!r} vs {vb!r})")
            out[name] = va
        elif rule == "concat":
            out[name] = tuple(n + m if i == batch_axis else n for i, (n, m) in enumerate(zip(va, vb)))
        elif rule == "none" or va is None or vb is None:
            out[name] = None
        else:
            out[name] = combine(rule, va, vb)
    return Reading(**out)
