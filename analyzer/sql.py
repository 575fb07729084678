"""The spec's normative metrics (spec §Metrics) as one SQL query over a table `readings` of trace
rows, in the dialect of DuckDB or of Spark, giving the metric table `analyzer.metrics` gives: the
same columns, the same values (NaN where the formula gives NaN, null where it gives none), so an
engine that scales past one machine computes what the Polars analyzer computes.

Both engines order NaN above every number, where the formulas' comparisons are false for NaN: every
comparison that may meet one is guarded (and `greatest(NaN, 0)` is NaN, as a variance of
overflowed sums is to the Polars analyzer). Spark raises on a division by zero (ANSI): every division
that may meet one is guarded, its IEEE result spelled out.
"""
from __future__ import annotations

import math

from actrace.format.bins import bin_bounds
from actrace.format.schema import DERIVED_KINDS, SAT_COUNTS, SAT_LEVELS

from .meaning import sql_masked
from .metrics import _TOL, EXTRA_COLUMNS, KURTOSIS_ERROR, METRIC_COLUMNS, SIDE_COLUMNS, UPPER_ONLY, Thresholds

DIALECTS = ("duckdb", "spark")


class Dialect:
    """The few spellings in which DuckDB and Spark SQL differ: lambdas, lists, special numbers."""

    def __init__(self, name: str):
        if name not in DIALECTS:
            raise ValueError(f"--dialect must be one of {', '.join(DIALECTS)}, got {name!r}")
        self.name, self.duck = name, name == "duckdb"

    def num(self, x: float) -> str:
        if math.isnan(x):
            return "CAST('NaN' AS DOUBLE)"
        if math.isinf(x):
            return f"CAST('{'-' if x < 0 else ''}{'inf' if self.duck else 'Infinity'}' AS DOUBLE)"
        return f"{x:.17e}"  # exponent notation: a DOUBLE in both (a plain decimal would be a DECIMAL)

    def nums(self, xs) -> str:
        return ("[" if self.duck else "array(") + ", ".join(self.num(float(x)) for x in xs) + ("]" if self.duck else ")")

    def strs(self, xs) -> str:
        return "(" + ", ".join(f"'{x}'" for x in xs) + ")"

    def q(self, name: str) -> str:
        """A column name that is a keyword (`values`)."""
        return f'"{name}"' if self.duck else f"`{name}`"

    def lam(self, args: str, body: str) -> str:
        return f"lambda {args}: {body}" if self.duck else f"({args}) -> {body}" if "," in args else f"{args} -> {body}"

    def count(self, lst: str, cond) -> str:
        """How many elements of `lst` meet `cond(element)` (null for a null list)."""
        if self.duck:
            return f"len(list_filter({lst}, {self.lam('_v', cond('_v'))}))"
        return f"(CASE WHEN ({lst}) IS NULL THEN NULL ELSE size(filter({lst}, {self.lam('_v', cond('_v'))})) END)"

    def zip(self, a: str, b: str, body) -> str:
        """`body(x, y)` of the elements x of `a` and y of `b` at each index."""
        if self.duck:
            return f"list_transform({a}, {self.lam('_x, _i', body('_x', f'({b})[_i]'))})"
        return f"zip_with({a}, {b}, {self.lam('_x, _y', body('_x', '_y'))})"

    def map(self, lst: str, body) -> str:
        return f"list_transform({lst}, {self.lam('_m', body('_m'))})" if self.duck else \
            f"transform({lst}, {self.lam('_m', body('_m'))})"

    def total(self, lst: str) -> str:
        return f"list_sum({lst})" if self.duck else f"aggregate({lst}, CAST(0 AS DOUBLE), (_a, _v) -> _a + _v)"

    def sort(self, lst: str) -> str:
        return f"list_sort({lst})" if self.duck else f"array_sort({lst})"

    def head(self, lst: str, n: str) -> str:
        return f"list_slice({lst}, 1, {n})" if self.duck else f"slice({lst}, 1, CAST({n} AS INT))"

    def at(self, lst: str, i: str) -> str:
        """Element `i` (from 0) of a list."""
        return f"({lst})[({i}) + 1]" if self.duck else f"element_at({lst}, CAST(({i}) + 1 AS INT))"

    def size(self, lst: str) -> str:
        return f"len({lst})" if self.duck else f"size({lst})"

    def argmax(self, lst: str) -> str:
        """The index (from 0) of a list's first largest element (no NaN in it)."""
        return f"(list_position({lst}, list_max({lst})) - 1)" if self.duck else \
            f"(array_position({lst}, array_max({lst})) - 1)"

    def idiv(self, a: str, b: str) -> str:
        return f"(({a}) // ({b}))" if self.duck else f"(({a}) div ({b}))"

    def div(self, a: str, b: str) -> str:
        """a / b in doubles as IEEE divides: ±inf for x / 0, NaN for 0 / 0 (where Spark would raise)."""
        if self.duck:
            return f"(CAST({a} AS DOUBLE) / ({b}))"
        nan, inf = self.num(math.nan), self.num(math.inf)
        return (f"(CASE WHEN ({b}) = 0 THEN (CASE WHEN isnan({a}) OR ({a}) = 0 THEN {nan} WHEN ({a}) > 0 THEN {inf} "
                f"ELSE -{inf} END) ELSE CAST({a} AS DOUBLE) / ({b}) END)")

    def fmax(self, a: str, b: str) -> str:
        """The larger of a and b, the other where one is NaN (numpy's fmax, Polars' max_horizontal)."""
        return f"(CASE WHEN isnan({a}) THEN {b} WHEN isnan({b}) THEN {a} ELSE greatest({a}, {b}) END)"

    def largest(self, x: str) -> str:
        """The largest of a column's values but NaN, NaN where all are (Polars' max)."""
        return f"coalesce(max(CASE WHEN isnan({x}) THEN NULL ELSE {x} END), max({x}))"


def _real(*xs: str) -> str:
    """None of the expressions is NaN (a comparison with one is then false, as numpy's are)."""
    return " AND ".join(f"NOT isnan({x})" for x in xs)


def metrics_sql(dialect: str = "duckdb", th: Thresholds = Thresholds(), table: str = "readings") -> str:
    """The query: per (run, layer, stream, step) of the activation streams, and per (run, layer,
    stream, step) over a layer's tensors of the parameter streams, the metric table's columns (the
    thresholds `th` in it as numbers)."""
    d = Dialect(dialect)
    nan, zero, one = d.num(math.nan), d.num(0.0), d.num(1.0)
    n = "(count - nan_count - inf_count)"
    eps, tau, tol = d.num(th.dead_eps), d.num(th.dormant_tau), d.num(_TOL)
    margin = f"({d.num(1.0 - th.sat_threshold)} * greatest(abs(bound_lo), abs(bound_hi)))"
    upper = f"kind IN {d.strs(UPPER_ONLY)}"
    need = f"((bound_hi - bound_lo) / 2 - {margin} - {tol})"
    near_hi = f"(bound_hi - {margin} - {tol})"
    pinned = (f"CASE WHEN bound_lo IS NULL OR isnan({need}) THEN NULL "
              f"WHEN {upper} THEN {d.count('unit_min', lambda v: f'{_real(v)} AND {v} >= {near_hi}')} "
              f"ELSE {d.count('unit_min_dev', lambda v: f'{_real(v)} AND {v} >= {need}')} END")
    dead_mask = d.zip("unit_min", "unit_max", lambda a, b: f"{_real(a, b)} AND {a} >= -{eps} AND {b} <= {eps}")
    bin_tol = f"({tol} * greatest(abs(bound_lo), abs(bound_hi), {one}))"

    def in_region(b_lo: str, b_hi: str) -> str:  # a bin wholly in the saturated region of a saturating side
        return f"({b_lo} >= bound_hi - {margin} - {bin_tol} OR (NOT ({upper}) AND {b_hi} <= bound_lo + {margin} + {bin_tol}))"
    lo_bins, hi_bins = bin_bounds()
    if d.duck:
        binned = (f"list_sum(list_transform(hist, lambda _c, _i: CASE WHEN "
                  f"{in_region(f'({d.nums(lo_bins)})[_i]', f'({d.nums(hi_bins)})[_i]')} THEN _c ELSE 0 END))")
    else:
        edges = "array(" + ", ".join(f"named_struct('l', {d.num(a)}, 'h', {d.num(b)})"
                                     for a, b in zip(lo_bins, hi_bins)) + ")"
        binned = (f"aggregate(zip_with(hist, {edges}, (_c, _e) -> CASE WHEN {in_region('_e.l', '_e.h')} THEN _c "
                  f"ELSE 0 END), CAST(0 AS BIGINT), (_a, _v) -> _a + _v)")
    non_nan = "(count - nan_count)"
    share = d.div(binned, non_nan)
    if th.sat_threshold in SAT_LEVELS:
        hi_at, lo_at = SAT_COUNTS.index(("hi", th.sat_threshold)), SAT_COUNTS.index(("lo", th.sat_threshold))
        near = f"({d.at('sat_counts', str(hi_at))} + CASE WHEN {upper} THEN 0 ELSE {d.at('sat_counts', str(lo_at))} END)"
        share = f"CASE WHEN sat_counts IS NOT NULL THEN {d.div(near, non_nan)} ELSE {share} END"
    saturation = (f"CASE WHEN bound_lo IS NULL OR kind IS NULL THEN NULL WHEN kind = 'softmax' AND NOT isnan(share) "
                  f"THEN least(share * units, {one}) ELSE share END")
    rms = d.zip("unit_sumsq", "unit_count", lambda s, c: f"CASE WHEN {c} > 0 THEN sqrt({s} / {c}) ELSE {nan} END")
    valid = d.count("rms", _real)
    kept = f"({valid} - {d.idiv(valid, '10')})"
    reference = f"CASE WHEN {kept} > 0 THEN {d.total(d.head(d.sort('rms'), kept))} / {kept} ELSE {nan} END"
    dormant = d.count(d.zip("dead_mask", "rms", lambda dd, r: f"NOT {dd} AND {_real(r, 'ref')} AND {r} <= {tau} * ref"),
                      lambda x: x)
    mag = d.map(d.zip("unit_min", "unit_max", lambda a, b: d.fmax(f"abs({a})", f"abs({b})")),
                lambda m: f"CASE WHEN isnan({m}) THEN CAST(0 AS FLOAT) ELSE {m} END")  # the lists' float32
    width = d.size("mag")
    middle = [f"CAST({d.at('smag', d.idiv(i, '2'))} AS DOUBLE)" for i in (f"{width} - 1", width)]
    median = f"(({middle[0]} + {middle[1]}) / 2)"
    ok = f"unit_min IS NOT NULL AND {width} >= 8"
    mu, s2, s3, s4 = (d.div(c, "nn") for c in ("sum", "sumsq", "sum3", "sum4"))
    def power(x: str, k: int) -> str:  # x ** k as Polars takes it, x * x * … (the same rounding)
        return "(" + " * ".join([x] * k) + ")"
    var = f"({s2} - {power(mu, 2)})"
    m4 = f"({s4} - 4 * {mu} * {s3} + 6 * {power(mu, 2)} * {s2} - 3 * {power(mu, 4)})"
    rounding = f"({d.num(2.0 ** -24)} * ({s4} + 4 * abs({mu} * {s3}) + 6 * {power(mu, 2)} * {s2} + 3 * {power(mu, 4)}))"
    kurtosis = (f"CASE WHEN nn > 0 AND {var} > 0 AND {rounding} < {d.num(KURTOSIS_ERROR)} * {power(var, 2)} "
                f"THEN {d.fmax(m4, zero)} / {power(var, 2)} END")
    def per_unit(column: str) -> str:  # column[u] / unit_count[u], 0 for a unit of no finite value
        return d.zip(column, "unit_count", lambda a, c: f"CASE WHEN {c} > 0 THEN {a} / {c} ELSE {zero} END")
    var_u = d.zip("mu_u", "ms_u", lambda mu_u, s_u: f"greatest({s_u} - {mu_u} * {mu_u}, {zero})")
    have = d.count("unit_count", lambda c: f"{c} > 0")
    unit_std = f"CASE WHEN {have} > 0 AND NOT isnan({d.total(var_u)}) THEN sqrt({d.total(var_u)} / {have}) END"
    rows = f"(SELECT * FROM {table} WHERE kind IS NULL OR kind NOT IN {d.strs(DERIVED_KINDS)})"
    units_of = (f"SELECT *, {rms} AS rms, {mag} AS mag, {pinned} AS pinned, {per_unit('unit_sum')} AS mu_u, "
                f"{per_unit('unit_sumsq')} AS ms_u, "
                f"{dead_mask} AS dead_mask, {share} AS share, {n} AS nn "
                f"FROM {rows} WHERE stream IN ('activation', 'activation_grad')")
    values = d.q("values")
    activation = (
        f"SELECT run, layer, layer_index, kind, stream, step, units, mode, probe_fingerprint, "
        f"{sql_masked('dead_fraction', d.div(d.count('dead_mask', lambda x: x), 'units'), d.strs)} AS dead_fraction, "
        f"{sql_masked('dormant_fraction', d.div(dormant, 'units'), d.strs)} AS dormant_fraction, "
        f"CASE WHEN nn > 0 THEN {d.div('zero_count', 'nn')} END AS sparsity, {saturation} AS saturation_value, "
        f"{d.div('pinned', 'units')} AS saturation_unit, CASE WHEN nn > 0 THEN {mu} END AS mean, "
        f"CASE WHEN nn > 0 THEN sqrt(greatest({var}, {zero})) END AS std, min, max, "
        f"CASE WHEN nan_count + inf_count = 0 THEN sqrt(sumsq) ELSE {nan} END AS norm, "
        f"{d.fmax('abs(min)', 'abs(max)')} AS max_abs, CAST(NULL AS DOUBLE) AS update_ratio, nan_count, inf_count, "
        f"nn AS {values}, CASE WHEN {ok} THEN CAST({d.argmax('mag')} AS BIGINT) END AS top_unit, "
        f"CASE WHEN {ok} AND {median} > 0 THEN CAST({d.at('mag', d.argmax('mag'))} AS DOUBLE) / {median} END AS top_ratio, "
        f"{kurtosis} AS kurtosis, {unit_std} AS unit_std FROM (SELECT *, {reference} AS ref, {d.sort('mag')} AS smag FROM ({units_of}) u) w")
    total = f"CASE WHEN sum(nan_count + inf_count) = 0 THEN sqrt(sum(sumsq)) ELSE {nan} END"
    n_all, mean_all = f"sum({n})", d.div("sum(sum)", f"sum({n})")
    var_all = f"({d.div('sum(sumsq)', n_all)} - {power(mean_all, 2)})"
    null = ", ".join(f"CAST(NULL AS {'BIGINT' if c == 'top_unit' else 'DOUBLE'}) AS {c}" for c in (
        "dead_fraction", "dormant_fraction", "sparsity", "saturation_value", "saturation_unit", "top_unit",
        "top_ratio", "kurtosis", "unit_std"))
    parameter = (
        f"SELECT run, layer, max(layer_index) AS layer_index, max(kind) AS kind, stream, step, max(units) AS units, "
        f"max(mode) AS mode, max(probe_fingerprint) AS probe_fingerprint, {null}, "
        f"{mean_all} AS mean, CASE WHEN {n_all} > 0 THEN sqrt(greatest({var_all}, {zero})) END AS std, min(min) AS min, "
        f"{d.largest('max')} AS max, {total} AS norm, "
        f"{d.largest(d.fmax('abs(min)', 'abs(max)'))} AS max_abs, CASE WHEN count(update_norm) > 0 THEN "
        f"{d.div('sqrt(sum(update_norm * update_norm))', total)} END AS update_ratio, "
        f"CAST(sum(nan_count) AS BIGINT) AS nan_count, CAST(sum(inf_count) AS BIGINT) AS inf_count, "
        f"CAST({n_all} AS BIGINT) AS {values} "
        f"FROM {rows} WHERE stream IN ('param_grad', 'param') GROUP BY run, layer, stream, step")
    columns = ", ".join(d.q(c) if c == "values" else c for c in METRIC_COLUMNS + EXTRA_COLUMNS if c != "grad_norm")
    grad = "CASE WHEN stream IN ('param_grad', 'activation_grad') THEN norm END AS grad_norm"
    ordered = ", ".join(grad if c == "grad_norm" else d.q(c) if c == "values" else c
                        for c in METRIC_COLUMNS + EXTRA_COLUMNS)
    return (f"SELECT {ordered} FROM (\n  SELECT {columns} FROM ({activation}) a\n  UNION ALL\n"
            f"  SELECT {columns} FROM ({parameter}) p\n) m ORDER BY run, stream, layer_index, layer, step")


def side_sql(table: str = "readings") -> str:
    """The rows the metric table leaves out that findings read: the loop's scalars (the loss) and
    the derived readings (attention heads, LM heads, routers: analyzer.signals)."""
    return (f"SELECT {', '.join(SIDE_COLUMNS)} FROM {table} WHERE stream = 'scalar' OR kind IN "
            f"{Dialect('duckdb').strs(DERIVED_KINDS)}")
