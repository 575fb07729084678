"""Metrics from traces (spec/trace-v1.md §Metrics): Polars expressions over the raw reductions.

Every threshold is an argument here, never a property of the trace. `reduced()` reads each trace
once, only the columns the metrics need (saturation's only where a trace has bounded layers):
per-unit lists are reduced to counts as each trace is read, so many runs fit in bounded memory.
"""
from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from actrace.format import bins
from actrace.files.reader import TraceError, read_source, trace_sources, unreadable, unwritten
from actrace.format.schema import (DERIVED_KINDS, KINDS, PER_UNIT_KINDS, READING_KEY, SAT_COUNTS, SAT_LEVELS,
                                   SATURATING_SIDES, SCHEMA, SPEC_VERSION, STREAMS, minor_version, sat_margin)
from actrace.files.validate import metadata_problems, row_problems, run_problems

from .meaning import masked
from .tables import RunRows, RunTables

METRIC_COLUMNS = ["run", "layer", "layer_index", "kind", "stream", "step", "dead_fraction", "dormant_fraction",
                  "sparsity", "saturation_value", "saturation_unit", "mean", "std", "min", "max", "grad_norm",
                  "nan_count", "inf_count"]
EXTRA_COLUMNS = ["norm", "max_abs", "update_ratio", "units", "values", "mode", "probe_fingerprint", "top_unit",
                 "top_ratio", "kurtosis", "unit_std"]
_READ = ["run", "step", "layer", "layer_index", "kind", "stream", "param", "units", "bound_lo", "bound_hi", "mode",
         "probe_fingerprint", "count", "nan_count", "inf_count", "zero_count", "sum", "sumsq", "min", "max",
         "update_norm", "unit_min", "unit_max", "unit_min_dev", "hist", "sat_counts", "value", "unit_sum", "unit_count",
         "unit_sumsq", "sum3", "sum4"]
_TOL = 1e-12


@dataclass(frozen=True)
class Thresholds:
    """Analysis thresholds: ε for death, t for saturation, τ for dormancy (spec §Metrics)."""

    dead_eps: float = 0.0
    sat_threshold: float = 0.99
    dormant_tau: float = 0.1

    def __post_init__(self):
        if not 0 <= self.dead_eps < np.inf:  # NaN too: no unit's max |h| is at most NaN
            raise ValueError(f"--dead-eps must be a finite number ≥ 0, got {self.dead_eps}")
        if not 0 < self.sat_threshold < 1:
            raise ValueError(f"--sat-threshold must lie in (0, 1), got {self.sat_threshold}")
        if not 0 < self.dormant_tau < 1:
            raise ValueError(f"--dormant-tau must lie in (0, 1), got {self.dormant_tau}")


UPPER_ONLY = [kind for kind, sides in SATURATING_SIDES.items() if sides == ("hi",)]  # ReLU6, softmax


def saturated_bins(lo: float, hi: float, t: float, upper: bool = False) -> np.ndarray:
    """0/1 per histogram bin: 1 where the whole bin lies in the saturated region of a saturating
    side (the upper one only when `upper`)."""
    b_lo, b_hi = bins.bin_bounds()
    m = sat_margin(lo, hi, t)
    tol = _TOL * max(abs(lo), abs(hi), 1.0)
    return ((b_lo >= hi - m - tol) | (~upper & (b_hi <= lo + m + tol))).astype(np.int64)


def _flat(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A list column as (values, row start offsets, null mask), zero-copy where Arrow allows."""
    arr = col.combine_chunks()
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)[offsets[0]: offsets[-1]]
    return values, offsets[:-1] - offsets[0], arr.is_null().to_numpy(zero_copy_only=False)


def _count_per_row(mask: np.ndarray, starts: np.ndarray, nulls: np.ndarray) -> np.ndarray:
    """How many True per list row (NaN for null rows, whose start may sit at the end)."""
    counts = np.add.reduceat(np.append(mask, False), starts).astype(np.float64)
    counts[nulls] = np.nan
    return counts


SLICE = 1024  # rows of per-unit lists reduced at a time: numpy's temporaries stay a few MiB per column


def unit_counts(table: pa.Table, th: Thresholds) -> dict[str, np.ndarray]:
    """`_unit_counts` of every row, SLICE rows at a time, so that memory does not grow with the trace."""
    parts = [_unit_counts(table.slice(start, SLICE), th) for start in range(0, max(len(table), 1), SLICE)]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def _unit_counts(table: pa.Table, th: Thresholds) -> dict[str, np.ndarray]:
    """Per row: units dead at ε (max |h| <= ε), units pinned at threshold t on the kind's
    saturating side(s), the outlier unit and its ratio, and units dormant at τ (spec §Metrics).

    Computed on the flattened per-unit lists in one numpy pass each, which is what makes many
    traces fast to analyze; a NaN unit is neither dead nor pinned.
    """
    lo, starts, nulls = _flat(table["unit_min"])
    hi = _flat(table["unit_max"])[0]
    with np.errstate(invalid="ignore"):
        is_dead = (lo >= -th.dead_eps) & (hi <= th.dead_eps)
        dead = _count_per_row(is_dead, starts, nulls)
        dev, dev_starts, _ = _flat(table["unit_min_dev"])
        b_lo = table["bound_lo"].to_numpy(zero_copy_only=False)
        b_hi = table["bound_hi"].to_numpy(zero_copy_only=False)
        need = (b_hi - b_lo) / 2 - sat_margin(b_lo, b_hi, th.sat_threshold) - _TOL
        lengths = np.diff(np.append(dev_starts, len(dev)))
        both = _count_per_row(dev >= np.repeat(need, lengths), dev_starts, nulls | np.isnan(need))
        upper_rows = pc.is_in(table["kind"], pa.array(UPPER_ONLY)).to_numpy(zero_copy_only=False)
        pinned = both
        if upper_rows.any():  # ReLU6, softmax: pinned at the upper bound only, from unit_min
            near_hi = b_hi - sat_margin(b_lo, b_hi, th.sat_threshold) - _TOL
            upper = _count_per_row(lo >= np.repeat(near_hi, np.diff(np.append(starts, len(lo)))), starts,
                                   nulls | np.isnan(near_hi))
            pinned = np.where(upper_rows, upper, both)
    pinned[np.isnan(b_lo)] = np.nan
    top, ratio = _top_units(np.fmax(np.abs(lo), np.abs(hi)), starts, nulls)
    return {"dead_units": dead, "pinned_units": pinned, "top_unit": top, "top_ratio": ratio,
            "dormant_units": _dormant(table, th, is_dead, starts, nulls), "unit_std": _unit_std(table, starts, nulls)}


def _unit_std(table: pa.Table, starts: np.ndarray, nulls: np.ndarray) -> np.ndarray:
    """Per row: the RMS over units of each unit's std across the probe (spec §Metrics, unit std),
    sqrt(mean_u max(sumsq_u / n_u − (sum_u / n_u)², 0)) over the units with a finite value: near 0
    where every input gives each unit the same output (a representation collapse), even where the
    units sit at different constants and the layer's std looks healthy. NaN without lists."""
    sums = _flat(table["unit_sum"])[0]
    squares = _flat(table["unit_sumsq"])[0]
    counts = _flat(table["unit_count"])[0].astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        have = counts > 0
        mean = sums / counts
        var = np.where(have, np.maximum(squares / counts - mean * mean, 0.0), 0.0)
        units = _count_per_row(have, starts, nulls)
        return np.where(units > 0, np.sqrt(np.add.reduceat(np.append(var, 0.0), starts) / units), np.nan)


def _by_width(values: np.ndarray, starts: np.ndarray, rows: np.ndarray):
    """(row indices, width, their units as a [rows, width] array) for each width among the rows
    `rows` selects: a view of `values` where every row is that wide, else a gathered copy."""
    lengths = np.diff(np.append(starts, len(values)))
    for width in np.unique(lengths[rows]):
        which = np.flatnonzero(rows & (lengths == width))
        if len(which) == len(starts) and len(values) == len(starts) * width:
            yield which, width, values.reshape(len(starts), width)
        else:
            yield which, width, np.take(values, (starts[which, None] + np.arange(width)).ravel()).reshape(
                len(which), width)


def _dormant(table: pa.Table, th: Thresholds, dead: np.ndarray, starts: np.ndarray, nulls: np.ndarray) -> np.ndarray:
    """Per row: units alive but dormant (spec §Metrics): RMS sqrt(unit_sumsq / unit_count) at most τ
    times the mean RMS of the layer's units with a finite value but its largest tenth (an outlier
    feature would make every other unit read dormant); NaN where there are no lists. Rows of one
    width at a time, as a 2-D array partitioned along its units (sorted where a unit reads NaN)."""
    squares = _flat(table["unit_sumsq"])[0]
    counts = _flat(table["unit_count"])[0].astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        rms = np.sqrt(squares / counts)  # NaN for a unit of no finite value
    reference = np.full(len(starts), np.nan)
    for which, width, units in _by_width(rms, starts, ~nulls):
        valid = (~np.isnan(units)).sum(1)
        kept = valid - valid // 10
        total = np.zeros(len(which))
        full, k = valid == width, width - width // 10  # no NaN: the k smallest found by a partition
        if k and full.any():  # an infinite RMS counts as the largest float, as in the sort's sum
            total[full] = np.nan_to_num(np.partition(units[full], k - 1, axis=1)[:, :k]).sum(1)
        if not full.all():  # NaN sorts last
            block = np.sort(units[~full], axis=1)
            total[~full] = np.cumsum(np.nan_to_num(block), axis=1)[np.arange(len(block)),
                                                                    np.maximum(kept[~full] - 1, 0)]
        reference[which] = np.where(kept > 0, total / np.maximum(kept, 1), np.nan)
    with np.errstate(invalid="ignore"):
        dormant = ~np.isnan(rms) & ~dead & (rms <= th.dormant_tau * np.repeat(
            reference, np.diff(np.append(starts, len(rms)))))
    return _count_per_row(dormant, starts, nulls)


def _top_units(absmax: np.ndarray, starts: np.ndarray, nulls: np.ndarray, fewest: int = 8):
    """Per row: the unit of the largest |h| (the first on ties) and its |h| over the median unit's
    (spec §Metrics, outlier unit); NaN for rows of fewer than `fewest` units or a median of 0.
    Rows of one width at a time, as a 2-D array: an argmax and a partition, no sort."""
    rows = len(starts)
    lengths = np.diff(np.append(starts, len(absmax)))
    mag = np.where(np.isnan(absmax), 0.0, absmax)  # a unit with no finite value holds nothing large
    top, ratio = np.full(rows, np.nan), np.full(rows, np.nan)
    ok = (lengths >= fewest) & ~nulls
    for which, width, block in _by_width(mag, starts, ok):
        best = block.argmax(axis=1)
        peak = block[np.arange(len(which)), best]
        middle = [(width - 1) // 2, width // 2]
        block.partition(middle, axis=1)  # in place: the block is a copy, or a view of `mag`, ours
        median = block[:, middle].mean(axis=1, dtype=np.float64)  # two float32 near their largest: no overflow
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio[which] = np.where(median > 0, peak / median, np.nan)
        top[which] = best
    return top, ratio


def _finite_n() -> pl.Expr:
    return pl.col("count") - pl.col("nan_count") - pl.col("inf_count")


def non_finite() -> pl.Expr:
    """A metric row's NaN and Inf values (0 where it counts none: a row of no such count)."""
    return pl.col("nan_count").fill_null(0) + pl.col("inf_count").fill_null(0)


def sparsity() -> pl.Expr:
    """Share of individual finite values that are exactly zero (not death)."""
    finite = _finite_n()
    return pl.when(finite > 0).then(pl.col("zero_count") / finite).alias("sparsity")


def saturation_value(t: float, bounded: list[tuple[str, float, float]]) -> pl.Expr:
    """Share of non-NaN values near a saturating bound (bounded kinds only): exact from
    `sat_counts` at its levels, else the bins wholly within the saturated region; for a softmax,
    the share of its distributions (rows across its units) that are peaked (spec §Metrics)."""
    expr = pl.lit(None, dtype=pl.Float64)
    non_nan = pl.col("count") - pl.col("nan_count")
    for kind, lo, hi in bounded:
        upper = kind in UPPER_ONLY
        mask = pl.lit(pl.Series([saturated_bins(lo, hi, t, upper).tolist()]))
        share = (pl.col("hist") * mask).list.sum() / non_nan
        if t in SAT_LEVELS:
            count = pl.col("sat_counts").list.get
            near = count(SAT_COUNTS.index(("hi", t))) + (0 if upper else count(SAT_COUNTS.index(("lo", t))))
            share = pl.when(pl.col("sat_counts").is_not_null()).then(near / non_nan).otherwise(share)
        if kind == "softmax":  # per distribution, not per value: at most one value of each is near 1
            share = pl.when(share.is_not_nan()).then(pl.min_horizontal(share * pl.col("units"), pl.lit(1.0))
                                                     ).otherwise(share)  # no value to read stays NaN or null
        expr = pl.when((pl.col("kind") == kind) & (pl.col("bound_lo") == lo) & (pl.col("bound_hi") == hi)
                       ).then(share).otherwise(expr)
    return expr.alias("saturation_value")


def l2_norm(sumsq: pl.Expr, non_finite: pl.Expr) -> pl.Expr:
    """sqrt(sumsq), NaN where the tensor held a NaN or Inf: `sumsq` leaves them out, and the finite
    values' norm would read as healthy, or as vanishing (spec §Metrics)."""
    return pl.when(non_finite == 0).then(sumsq.sqrt()).otherwise(float("nan"))


def _std(var: pl.Expr) -> pl.Expr:
    """sqrt of a variance from raw sums, rounding's small negatives read as 0; NaN where the sums
    overflowed (inf − inf): unknown, not 0."""
    return pl.when(var.is_nan()).then(var).otherwise(pl.max_horizontal(var, pl.lit(0.0))).sqrt()


def moments() -> list[pl.Expr]:
    n = _finite_n()
    mean = pl.when(n > 0).then(pl.col("sum") / n)
    var = pl.when(n > 0).then(pl.col("sumsq") / n - (pl.col("sum") / n) ** 2)
    return [mean.alias("mean"), pl.when(n > 0).then(_std(var)).alias("std")]


KURTOSIS_ERROR = 0.05  # the most the float32 rounding of the power sums may move a kurtosis


def kurtosis() -> pl.Expr:
    """m4 / var² from the raw power sums (spec §Metrics): 3 for a normal distribution, far above for
    heavy tails; null where the fourth powers were not recorded, the variance is 0, or the mean
    stands so far from 0 that the sums' float32 rounding (2⁻²⁴ of each term) could move it by more
    than KURTOSIS_ERROR (|mean| beyond ~15 std): said as unknown, never as a wrong number."""
    n = _finite_n().cast(pl.Float64)
    mu, s2, s3, s4 = pl.col("sum") / n, pl.col("sumsq") / n, pl.col("sum3") / n, pl.col("sum4") / n
    var = s2 - mu ** 2
    m4 = s4 - 4 * mu * s3 + 6 * mu ** 2 * s2 - 3 * mu ** 4
    rounding = 2.0 ** -24 * (s4 + 4 * (mu * s3).abs() + 6 * mu ** 2 * s2 + 3 * mu ** 4)
    return pl.when((n > 0) & (var > 0) & (rounding < KURTOSIS_ERROR * var ** 2)).then(
        pl.max_horizontal(m4, pl.lit(0.0)) / var ** 2).alias("kurtosis")


def activation_metrics(lf: pl.LazyFrame, th: Thresholds, bound_pairs) -> pl.LazyFrame:
    """One row per activation-like reading (activation and activation_grad streams)."""
    return lf.filter(pl.col("stream").is_in(["activation", "activation_grad"])).select(
        "run", "layer", "layer_index", "kind", "stream", "step", "units", "mode", "probe_fingerprint",
        (pl.col("dead_units") / pl.col("units")).alias("dead_fraction"),
        (pl.col("dormant_units") / pl.col("units")).alias("dormant_fraction"), sparsity(),
        saturation_value(th.sat_threshold, bound_pairs),
        (pl.col("pinned_units") / pl.col("units")).alias("saturation_unit"), *moments(), "min", "max",
        l2_norm(pl.col("sumsq"), pl.col("nan_count") + pl.col("inf_count")).alias("norm"),
        pl.max_horizontal(pl.col("min").abs(), pl.col("max").abs()).alias("max_abs"),
        "nan_count", "inf_count", _finite_n().alias("values"), pl.col("top_unit").cast(pl.Int64), "top_ratio",
        kurtosis(), "unit_std",
    ).pipe(masked)


def parameter_metrics(lf: pl.LazyFrame) -> pl.LazyFrame:
    """One row per (run, layer, step, stream) of parameter streams, over the layer's tensors."""
    p = lf.filter(pl.col("stream").is_in(["param_grad", "param"]))
    n = _finite_n()
    return p.group_by("run", "layer", "stream", "step").agg(
        # the same for every tensor of a layer but `units`, the most of any: what does not hang on row order
        pl.col("layer_index").max(), pl.col("kind").max(), pl.col("units").max(),
        pl.col("mode").max(), pl.col("probe_fingerprint").max(),
        (pl.col("sum").sum() / n.sum()).alias("mean"),
        pl.when(n.sum() > 0).then(_std(pl.col("sumsq").sum() / n.sum() - (pl.col("sum").sum() / n.sum()) ** 2))
        .alias("std"),
        pl.col("min").min(), pl.col("max").max(),
        l2_norm(pl.col("sumsq").sum(), (pl.col("nan_count") + pl.col("inf_count")).sum()).alias("norm"),
        pl.max_horizontal(pl.col("min").abs(), pl.col("max").abs()).max().alias("max_abs"),
        (pl.col("update_norm").pow(2).sum().sqrt()
         / l2_norm(pl.col("sumsq").sum(), (pl.col("nan_count") + pl.col("inf_count")).sum())).alias("update_ratio"),
        pl.col("update_norm").is_not_null().any().alias("_has_update"),
        pl.col("nan_count").sum(), pl.col("inf_count").sum(), n.sum().alias("values"),
    ).with_columns(pl.when(pl.col("_has_update")).then(pl.col("update_ratio")).alias("update_ratio")
                   ).drop("_has_update")


_BOUNDED_ONLY = ("unit_min_dev", "hist", "sat_counts")  # read only from files with bounded layers
UNIT_LISTS = ("unit_sum", "unit_count", "unit_min", "unit_max")  # kept in the rows of those readings only


def _bounded(t: pa.Table) -> bool:
    return t["bound_lo"].null_count < len(t)


def _per_unit(t: pa.Table) -> pa.Array:
    return pc.is_in(t["kind"], pa.array(PER_UNIT_KINDS))


def _counted(table: pa.Table, th: Thresholds) -> pl.DataFrame:
    """Readings (`_READ` columns) as the metrics read them: with their dead, pinned and dormant unit
    counts, the per-unit lists kept only for heads and experts."""
    counts = unit_counts(table, th)
    keep = _per_unit(table)  # the per-unit lists of heads and experts stay: few rows, read one by one
    for name in UNIT_LISTS:
        table = table.set_column(table.column_names.index(name), name,
                                 pc.if_else(keep, table[name], pa.nulls(len(table), table[name].type)))
    table = table.drop_columns(["unit_min_dev", "unit_sumsq"])
    return pl.from_arrow(table).with_columns(pl.Series(name, v, nan_to_null=True) for name, v in counts.items())


def checked_source(source) -> tuple[pa.Table, dict, bool]:
    """One trace's columns that the metrics read (and, where it has bounded layers, what saturation
    needs), its metadata and whether it is of a newer minor version, checked first (spec §Validity):
    a trace that breaks a rule they fall under is refused, naming the file and the rule. Every engine
    checks a trace here before it computes from it."""
    lazy = [(_BOUNDED_ONLY, _bounded)]
    table, meta = read_source(source, _READ, when=lazy)
    read = set(_READ).difference(*(names for names, needed in lazy if not needed(table)))
    newer = minor_version(meta["spec_version"]) > minor_version(SPEC_VERSION)
    problems = metadata_problems(meta, source) + row_problems(table, source, read=read, newer_minor=newer)
    problems = problems or run_problems(table, meta, source)
    if problems:
        more = f" (and {len(problems) - 1} more; `actrace validate {source}` lists them)" if len(problems) > 1 else ""
        raise TraceError(f"{problems[0]}{more}")
    return table, meta, newer


def _reduce_source(source, th: Thresholds) -> tuple[pl.DataFrame, dict]:
    """One trace's scalar columns plus its dead and pinned unit counts (and, where it has bounded
    layers, what saturation needs); its metadata; the trace checked first (`checked_source`)."""
    table, meta, newer = checked_source(source)
    if newer:  # a newer minor version's streams are not ours to read, its kinds read as 'other'
        table = table.filter(pc.is_in(table["stream"], pa.array(list(STREAMS))))
        table = table.set_column(table.column_names.index("kind"), "kind", pc.if_else(
            pc.is_in(table["kind"], pa.array(list(KINDS))), table["kind"], "other"))
    df = _counted(table, th)
    unique = df.unique(subset=list(READING_KEY), keep="last", maintain_order=True)
    if unique.height < df.height:  # spec §Validity: one reading per key; the last written stands
        warnings.warn(f"{source}: {df.height - unique.height} reading(s) repeat a (run, layer, stream, param, "
                      f"step) already in the trace (steps restarting each epoch?); the last of each is kept",
                      stacklevel=2)
    return unique, dict(meta, file=str(source), readings=unique.height)


ORDER = ["run", "stream", "layer_index", "layer", "step"]  # the metric table's, for reading
SIDE_COLUMNS = ["run", "layer", "layer_index", "kind", "stream", "step", "count", "nan_count", "inf_count", "sum",
                "min", "max", "value", "unit_sum", "unit_count", "unit_min", "unit_max"]


def reduced(paths, th: Thresholds, skip_invalid: bool = False) -> tuple[RunTables, pl.DataFrame, list[dict]]:
    """(metric table, side rows, runs) of the traces: each trace read, checked and reduced to its
    metric rows (held compressed, analyzer.tables) and the few rows findings read beside them
    (SIDE_COLUMNS of the loop's scalars and the derived readings) as soon as it is read, two at a
    time (reading one while reducing the other), so memory holds two traces' per-unit lists and the
    compressed table. A trace that cannot be read or breaks the spec stops the analysis, naming it;
    with `skip_invalid` it is left out, and said."""
    sources = trace_sources(paths, unwritten=True)
    if not sources:
        raise TraceError(f"no traces found in {paths}")

    def reduce(source):
        try:
            meta = unwritten(source)  # no reading, and the run not closed: said (run_unfinished)
            if meta is None:
                rows, meta = _reduce_source(source, th)
        except TraceError as exc:
            if not skip_invalid:
                raise
            warnings.warn(f"skipped {source}: {exc}", stacklevel=2)
            meta = unreadable(source, exc)  # listed without a reading: a gate still gives it a verdict
        if not meta["readings"]:
            rows = _counted(SCHEMA.empty_table().select(_READ), th)
        side = rows.filter((pl.col("stream") == "scalar") | pl.col("kind").is_in(DERIVED_KINDS)).select(SIDE_COLUMNS)
        return source, RunRows.of(meta["run_name"], _metric_rows(rows, th).sort(ORDER)), side, meta

    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(reduce, sources))
    if all(meta.get("status", "").startswith("unreadable") for *_, meta in done):
        raise TraceError(f"no valid trace in {' '.join(map(str, paths)) if isinstance(paths, list) else paths}")
    # each trace holds one run (spec §Columns). A run in several traces (a resumed run, its parameters
    # in another file) has its traces reduced again together: its layers' tensors are one reading. Traces
    # of one name most of whose readings are the same ones are not that: runs that share a name (old/x,
    # new/x), read apart. A trace without a reading stands alone (it is said: `status_findings`)
    split: dict[str, list] = {}
    for source, _, _, meta in done:
        split.setdefault(meta["run_name"], []).append(source)
    metas, reduced_rows = {source: meta for source, *_, meta in done}, {source: r for source, r, _, _ in done}
    side, rows = {source: s for source, _, s, _ in done}, []
    for run, group in split.items():
        sources = [s for s in group if metas[s]["readings"]]
        if len(sources) < 2:  # one run's rows per name: its trace with readings, else the one it has
            rows.append(reduced_rows[(sources or group)[0]])
            continue
        with warnings.catch_warnings():  # what their first reading said stands
            warnings.simplefilter("ignore")
            frames = [_reduce_source(s, th)[0] for s in sources]
        joined = pl.concat(frames, how="diagonal_relaxed")
        if 2 * joined.select(READING_KEY).is_duplicated().sum() <= joined.height:
            rows.append(RunRows.of(run, _metric_rows(joined, th).sort(ORDER)))
            continue
        labels = _labels(sources)
        warnings.warn(f"{', '.join(map(str, sources))} each name their run {run!r}, most of their readings of the "
                      f"same layers and steps: read as {len(sources)} runs, {', '.join(map(repr, labels))} (a run's "
                      "name is the writer's run=, else its file's)", stacklevel=2)
        for source, frame, label in zip(sources, frames, labels):
            rows.append(RunRows.of(label, _metric_rows(frame.with_columns(run=pl.lit(label)), th).sort(ORDER)))
            side[source] = side[source].with_columns(run=pl.lit(label))
            metas[source]["run_name"] = label
    return RunTables(rows), pl.concat(list(side.values()), how="diagonal_relaxed"), list(metas.values())


def _labels(sources: list) -> list[str]:
    """Names that tell apart runs of one name by their traces' paths (local or URLs): each path below
    the folders they share, without its suffix (old/baseline, new/baseline)."""
    parts = [str(s).split("/") for s in sources]
    shared = 0
    while all(len(p) > shared + 1 and p[shared] == parts[0][shared] for p in parts):
        shared += 1
    return ["/".join(p[shared:]).removesuffix(".parts").removesuffix(".parquet") for p in parts]


def _metric_rows(rows: pl.DataFrame, th: Thresholds) -> pl.DataFrame:
    """Per (run, layer, stream, step) metrics of one trace's reduced readings."""
    lf = rows.lazy().filter(~pl.col("kind").is_in(DERIVED_KINDS))  # signals of their own (analyzer.signals)
    bound_pairs = lf.select("kind", "bound_lo", "bound_hi").drop_nulls().unique().collect().rows()
    act = activation_metrics(lf, th, bound_pairs)
    par = parameter_metrics(lf)
    out = pl.concat([act, par], how="diagonal_relaxed").with_columns(
        pl.when(pl.col("stream").is_in(["param_grad", "activation_grad"])).then(pl.col("norm"))
        .alias("grad_norm"))
    return out.select(METRIC_COLUMNS + EXTRA_COLUMNS).collect()


def scalars(rows: pl.DataFrame) -> pl.DataFrame:
    """The training loop's logged values (spec §Streams, `scalar`): run, step, name, value."""
    return (rows.filter(pl.col("stream") == "scalar").select("run", "step", pl.col("layer").alias("name"), "value")
            .sort("run", "name", "step"))


def last_reading(df: pl.DataFrame, *keys: str) -> pl.DataFrame:
    """The rows at the last step of each group of `keys` (each layer's latest state)."""
    return df.filter(pl.col("step") == pl.col("step").max().over(*keys))


def metrics(paths, th: Thresholds = Thresholds()) -> pl.DataFrame:
    """Per (run, layer, stream, step) metrics of the given traces, sorted for reading."""
    return reduced(paths, th)[0].whole()
