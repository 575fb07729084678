"""Metrics from traces (spec/trace-v1.md §Metrics): Polars expressions over the raw reductions.

Every threshold is an argument here, never a property of the trace. `metrics()` is lazy and
reads only the columns it needs, so many runs fit in bounded memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from actrace import bins
from actrace.reader import scan

METRIC_COLUMNS = ["run", "layer", "layer_index", "kind", "stream", "step", "dead_fraction", "sparsity",
                  "saturation_value", "saturation_unit", "mean", "std", "min", "max", "grad_norm",
                  "nan_count", "inf_count"]
EXTRA_COLUMNS = ["norm", "max_abs", "update_ratio", "units", "mode", "probe_fingerprint"]
_READ = ["run", "step", "layer", "layer_index", "kind", "stream", "units", "bound_lo", "bound_hi", "mode",
         "probe_fingerprint", "count", "nan_count", "inf_count", "zero_count", "sum", "sumsq", "min", "max",
         "update_norm", "unit_min", "unit_max", "unit_min_dev", "hist"]
_TOL = 1e-12


@dataclass(frozen=True)
class Thresholds:
    """Analysis thresholds: ε for death, t for saturation (spec §Metrics)."""

    dead_eps: float = 0.0
    sat_threshold: float = 0.99

    def __post_init__(self):
        if self.dead_eps < 0:
            raise ValueError(f"--dead-eps must be ≥ 0, got {self.dead_eps}")
        if not 0 < self.sat_threshold < 1:
            raise ValueError(f"--sat-threshold must lie in (0, 1), got {self.sat_threshold}")


def _margin(lo, hi, t):
    return (1.0 - t) * np.maximum(np.abs(lo), np.abs(hi))


def saturated_bins(lo: float, hi: float, t: float) -> np.ndarray:
    """0/1 per histogram bin: 1 where the whole bin lies in the saturated region."""
    b_lo, b_hi = bins.bin_bounds()
    m = _margin(lo, hi, t)
    tol = _TOL * max(abs(lo), abs(hi), 1.0)
    return ((b_lo >= hi - m - tol) | (b_hi <= lo + m + tol)).astype(np.int64)


def dead_fraction(eps: float) -> pl.Expr:
    """Share of units whose max |h| over the whole probe is ≤ ε."""
    alive_low = pl.col("unit_min").list.eval((pl.element() >= -eps).cast(pl.Int64))
    alive_high = pl.col("unit_max").list.eval((pl.element() <= eps).cast(pl.Int64))
    return ((alive_low * alive_high).list.sum() / pl.col("units")).alias("dead_fraction")


def sparsity() -> pl.Expr:
    """Share of individual finite values that are exactly zero (not death)."""
    finite = pl.col("count") - pl.col("nan_count") - pl.col("inf_count")
    return pl.when(finite > 0).then(pl.col("zero_count") / finite).alias("sparsity")


def saturation_unit(t: float) -> pl.Expr:
    """Share of units pinned against a bound for every input (bounded kinds only)."""
    half = (pl.col("bound_hi") - pl.col("bound_lo")) / 2
    margin = (1 - t) * pl.max_horizontal(pl.col("bound_lo").abs(), pl.col("bound_hi").abs())
    need = half - margin - _TOL
    pinned = (pl.col("unit_min_dev") - need).list.eval(
        ((pl.element() >= 0) & pl.element().is_not_nan()).cast(pl.Int64)).list.sum()
    return pl.when(pl.col("bound_lo").is_not_null()).then(pinned / pl.col("units")).alias("saturation_unit")


def saturation_value(t: float, bound_pairs: list[tuple[float, float]]) -> pl.Expr:
    """Share of values in the bins wholly within the saturated region (bounded kinds only)."""
    expr = pl.lit(None, dtype=pl.Float64)
    non_nan = pl.col("count") - pl.col("nan_count")
    for lo, hi in bound_pairs:
        mask = pl.lit(pl.Series([saturated_bins(lo, hi, t).tolist()]))
        share = (pl.col("hist") * mask).list.sum() / non_nan
        expr = pl.when((pl.col("bound_lo") == lo) & (pl.col("bound_hi") == hi)).then(share).otherwise(expr)
    return expr.alias("saturation_value")


def _finite_n() -> pl.Expr:
    return pl.col("count") - pl.col("nan_count") - pl.col("inf_count")


def moments() -> list[pl.Expr]:
    n = _finite_n()
    mean = pl.when(n > 0).then(pl.col("sum") / n)
    var = pl.when(n > 0).then(pl.col("sumsq") / n - (pl.col("sum") / n) ** 2)
    return [mean.alias("mean"), pl.max_horizontal(var, pl.lit(0.0)).sqrt().alias("std")]


def activation_metrics(lf: pl.LazyFrame, th: Thresholds, bound_pairs) -> pl.LazyFrame:
    """One row per activation-like reading (activation and activation_grad streams)."""
    return lf.filter(pl.col("stream").is_in(["activation", "activation_grad"])).select(
        "run", "layer", "layer_index", "kind", "stream", "step", "units", "mode", "probe_fingerprint",
        dead_fraction(th.dead_eps), sparsity(), saturation_value(th.sat_threshold, bound_pairs),
        saturation_unit(th.sat_threshold), *moments(), "min", "max",
        pl.col("sumsq").sqrt().alias("norm"),
        pl.max_horizontal(pl.col("min").abs(), pl.col("max").abs()).alias("max_abs"),
        "nan_count", "inf_count",
    )


def parameter_metrics(lf: pl.LazyFrame) -> pl.LazyFrame:
    """One row per (run, layer, step, stream) of parameter streams, over the layer's tensors."""
    p = lf.filter(pl.col("stream").is_in(["param_grad", "param"]))
    n = _finite_n()
    return p.group_by("run", "layer", "stream", "step").agg(
        pl.col("layer_index").first(), pl.col("kind").first(), pl.col("units").first(),
        pl.col("mode").first(), pl.col("probe_fingerprint").first(),
        (pl.col("sum").sum() / n.sum()).alias("mean"),
        pl.max_horizontal(pl.col("sumsq").sum() / n.sum() - (pl.col("sum").sum() / n.sum()) ** 2,
                          pl.lit(0.0)).sqrt().alias("std"),
        pl.col("min").min(), pl.col("max").max(),
        pl.col("sumsq").sum().sqrt().alias("norm"),
        pl.max_horizontal(pl.col("min").abs(), pl.col("max").abs()).max().alias("max_abs"),
        (pl.col("update_norm").pow(2).sum().sqrt() / pl.col("sumsq").sum().sqrt()).alias("update_ratio"),
        pl.col("update_norm").is_not_null().any().alias("_has_update"),
        pl.col("nan_count").sum(), pl.col("inf_count").sum(),
    ).with_columns(pl.when(pl.col("_has_update")).then(pl.col("update_ratio")).alias("update_ratio")
                   ).drop("_has_update")


def metrics(paths, th: Thresholds = Thresholds(), *, lazy: bool = False):
    """Per (run, layer, stream, step) metrics of the given traces, sorted for reading."""
    lf = scan(paths, _READ)
    bound_pairs = (lf.select("bound_lo", "bound_hi").drop_nulls().unique()
                   .collect(engine="streaming").rows())
    act = activation_metrics(lf, th, bound_pairs)
    par = parameter_metrics(lf)
    out = pl.concat([act, par], how="diagonal_relaxed").with_columns(
        pl.when(pl.col("stream").is_in(["param_grad", "activation_grad"])).then(pl.col("norm"))
        .alias("grad_norm"))
    out = out.select(METRIC_COLUMNS + EXTRA_COLUMNS).sort("run", "stream", "layer_index", "step")
    return out if lazy else out.collect(engine="streaming")
