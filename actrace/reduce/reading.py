"""A `Reading`: one layer's reductions for one stream, as every backend gives them (spec §Columns),
and how two readings of chunks of one tensor merge by the schema's merge rules (spec §Columns).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

import numpy as np

from actrace.format.schema import MERGE, SCHEMA, UNIT_COLUMNS

_OUTWARD = {"unit_min": -np.inf, "unit_max": np.inf, "unit_min_dev": -np.inf}  # float32 columns: round this way
_add = functools.partial(np.add.reduce, axis=None)  # a whole array's sum by the ufunc: `.sum()` wraps it in Python
_UNIT_DTYPES = {name: SCHEMA.field(name).type.value_type.to_pandas_dtype() for name in UNIT_COLUMNS}


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
    sum3: float | None = None
    sum4: float | None = None

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
        `hist`, `sat_counts`, `nan_count`, `inf_count`), as torch kernels and the reference give them;
        the layer totals follow from them (spec §Columns); the C kernel's and the fused GPU kernels'
        results take `from_kernel`. Without `per_unit` only the totals are kept. Float64 extremes are
        rounded outward to float32, so a nonzero value never becomes 0."""
        v = {k: x if type(x) is np.ndarray else np.asarray(x) for k, x in stats.items() if x is not None}
        # units with no finite value hold NaN extremes, which fmin/fmax pass over
        total, squares, zeros = float(_add(v["unit_sum"])), float(_add(v["unit_sumsq"])), _add(v["unit_zero"])
        lo, hi = float(np.fmin.reduce(v["unit_min"], axis=None)), float(np.fmax.reduce(v["unit_max"], axis=None))
        sum3 = float(_add(v["unit_sum3"])) if "unit_sum3" in v else None
        sum4 = float(_add(v["unit_sum4"])) if "unit_sum4" in v else None
        unit_axis = None if unit_axis is None else unit_axis % len(shape)
        r = cls(shape=tuple(map(int, shape)), unit_axis=unit_axis,
                units=1 if unit_axis is None else int(shape[unit_axis]), count=math.prod(shape),
                nan_count=int(_add(v["nan_count"])), inf_count=int(_add(v["inf_count"])), zero_count=int(zeros),
                sum=total, sumsq=squares, min=lo, max=hi, sum3=sum3, sum4=sum4,
                hist=v["hist"].astype(np.int64, copy=False) if "hist" in v else None,
                sat_counts=v["sat_counts"].astype(np.int64, copy=False) if "sat_counts" in v else None, **meta)
        if per_unit:  # the backend's arrays kept where they have the column's type already (no copy)
            if c := centre(meta.get("bounds")):
                v["unit_min_dev"] = _one_sided(v, c)
            for name, dtype in _UNIT_DTYPES.items():
                value = v[name].reshape(-1)
                setattr(r, name, outward(value, _OUTWARD[name]) if name in _OUTWARD else value.astype(dtype, copy=False))
        return r

    @classmethod
    def from_kernel(cls, st: dict, *, shape: tuple, unit_axis: int | None, per_unit: bool = True,
                    **meta) -> "Reading":
        """`from_stats` of the C kernel's results (`kernel.reduce_many`, with `sat_counts` of a bounded
        kind; or the fused GPU kernels', `fused.unpack`): its TOTALS row and its per-unit views,
        one-dimensional and of the columns' types, taken as they are, but float64 extremes rounded
        outward. A probe reading makes one per tensor, where `from_stats`' checks and conversions of
        each column cost a deep model's reading more than a tenth of its time."""
        total, squares, sum3, sum4, lo, hi, zeros, nans, infs = st["totals"].tolist()
        unit_axis = None if unit_axis is None else unit_axis % len(shape)
        sat = st.get("sat_counts")
        r = cls(shape=tuple(shape), unit_axis=unit_axis, units=1 if unit_axis is None else int(shape[unit_axis]),
                count=math.prod(shape), nan_count=int(nans), inf_count=int(infs), zero_count=int(zeros), sum=total,
                sumsq=squares, min=lo, max=hi, sum3=sum3, sum4=sum4, hist=st["hist"],
                sat_counts=None if sat is None else np.asarray(sat, np.int64), **meta)
        if per_unit:
            c = centre(meta.get("bounds"))
            r.unit_count, r.unit_zero, r.unit_sum, r.unit_sumsq = (
                st[name] for name in ("unit_count", "unit_zero", "unit_sum", "unit_sumsq"))
            r.unit_min, r.unit_max = outward(st["unit_min"], -np.inf), outward(st["unit_max"], np.inf)
            r.unit_min_dev = outward(_one_sided(st, c) if c else st["unit_min_dev"], -np.inf)
        return r


# what each step gives a layer-level reading; the rest of it is fixed by its tensor (`table.LayerRows`)
LAYER_VALUES = ("nan_count", "inf_count", "zero_count", "sum", "sumsq", "min", "max")


def layer_values(totals: list[float], scale: float = 1.0) -> tuple:
    """A tensor's TOTALS row (`kernel.TOTALS`) as a layer-level reading's `LAYER_VALUES`, those of
    values that carry a factor `scale` (a loss scaler's) with it divided out."""
    total, squares, _, _, lo, hi, zeros, nans, infs = totals
    return int(nans), int(infs), int(zeros), total / scale, squares / scale ** 2, lo / scale, hi / scale


@dataclass
class LayerTotals:
    """Layer-level readings (unit axis 0, None for a 0-d tensor; no per-unit columns) of many
    tensors, kept as their whole-tensor statistics (a `kernel.TOTALS` row each; sum3 and sum4 may
    be NaN: not read here) beside their shapes, dtypes, `metas` (layer, kind, bounds, stream, param)
    and `scale`: a per-step gradient reading's parameters, which a writer makes rows of straight
    from these (`table.LayerRows`): a `Reading` per tensor, made at every training step, costs more
    than reducing it."""

    totals: list[list[float]]
    shapes: list[tuple]
    dtypes: list[str]
    metas: list[dict]
    scale: float = 1.0

    @property
    def non_finite(self) -> bool:
        """Whether any of the tensors holds a NaN or an inf."""
        return any(nans or infs for *_, nans, infs in self.totals)

    def readings(self) -> list[Reading]:
        """The `Reading` of each tensor, as `record_many` takes them."""
        return [Reading(shape=tuple(shape), unit_axis=0 if shape else None, units=shape[0] if shape else 1,
                        count=math.prod(shape), dtype=dtype, **dict(zip(LAYER_VALUES, layer_values(t, self.scale))),
                        **meta)
                for t, shape, dtype, meta in zip(self.totals, self.shapes, self.dtypes, self.metas)]


def centre(bounds: tuple[float, float] | None) -> float:
    """The point `unit_min_dev` is measured from: the middle of the bounds, else 0."""
    return 0.0 if bounds is None else (bounds[0] + bounds[1]) / 2.0


def _one_sided(v: dict, c: float) -> np.ndarray:
    """`unit_min_dev` with each unit that lies on one side of the centre `c` at its exact distance,
    `unit_min - c` or `c - unit_max` in float64, as the reference gives it: a backend's |h - c| in
    float32 may round above the true least distance, which a stored minimum must never be (spec §Numerics)."""
    lo, hi = (v[k].reshape(-1).astype(np.float64) for k in ("unit_min", "unit_max"))
    with np.errstate(invalid="ignore"):
        return np.where(lo >= c, lo - c, np.where(hi <= c, c - hi, v["unit_min_dev"].reshape(-1)))


def outward(v: np.ndarray, toward: float) -> np.ndarray:
    """`v` as float32, each value rounded toward `toward` (-inf for a minimum, +inf for a maximum)
    where float32 cannot hold it: a stored minimum is never above the true one (spec §Numerics)."""
    f = v.astype(np.float32, copy=False)
    if v.dtype == np.float64:
        with np.errstate(invalid="ignore"):
            off = f > v if toward < 0 else f < v
        f[off] = np.nextafter(f[off], np.float32(toward))
    return f


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


def merge(a: Reading, b: Reading, *, batch_axis: int = 0, units: bool = False) -> Reading:
    """Combine the readings of two chunks of one tensor split along `batch_axis`, column by column
    by the schema's merge rules (`bounds` stands for `bound_lo`/`bound_hi`); `units`: the axis is
    the unit axis, so the unit counts add (the caller sets the per-unit columns, `join_units`)."""
    if len(a.shape) != len(b.shape) or any(n != m for i, (n, m) in enumerate(zip(a.shape, b.shape)) if i != batch_axis):
        raise ReductionError(f"layer {a.layer!r}: cannot merge chunks of shapes {a.shape} and {b.shape}: they differ "
                             f"on an axis other than the batch axis {batch_axis}")
    out = {}
    for f in fields(Reading):
        name, va, vb = f.name, getattr(a, f.name), getattr(b, f.name)
        rule = MERGE.get(name, "same")
        if units and name == "units":
            out[name] = va + vb
        elif units and name in UNIT_COLUMNS:
            out[name] = None
        elif rule == "same":
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


def join_units(parts: list[Reading]) -> Reading:
    """One reading of a tensor whose units are split, in order, across `parts` (the ranks of a
    tensor-parallel layer, each over the whole batch): per-unit columns concatenated, the unit
    axis's extent and the unit count added, every other column by the schema's merge rules."""
    first = parts[0]
    per_unit = {name: np.concatenate([getattr(p, name) for p in parts]) for name in UNIT_COLUMNS
                if all(getattr(p, name) is not None for p in parts)}
    whole = functools.reduce(lambda a, b: merge(a, b, batch_axis=first.unit_axis, units=True), parts)
    for name, value in per_unit.items():
        setattr(whole, name, value)
    return whole


def fold(merged: dict, readings) -> dict:
    """Fold readings into `merged` (keyed by layer, stream and param, in the order first met): a
    chunk of the probe, or a micro-batch's, of a tensor already there merges into it (`merge`)."""
    for r in readings:
        key = (r.layer, r.stream, r.param)
        merged[key] = merge(merged[key], r) if key in merged else r
    return merged
