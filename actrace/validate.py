"""Spec conformance (spec/trace-v1.md §Validity): every problem named by file, row and column."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .bins import N_BINS
from . import metadata
from .reader import TraceError, part_files, trace_sources
from .schema import READING_KEY, SCALAR_INDEX, KIND_BOUNDS, KINDS, SAT_LEVELS, SCHEMA, SPEC_VERSION, STREAMS, UNIT_COLUMNS, \
    columns_absent_in, minor_version

MAX_ROWS_PER_CHECK = 5


@dataclass
class Problem:
    file: str
    message: str
    row: int | None = None
    column: str | None = None

    def __str__(self) -> str:
        where = "".join([f" row {self.row}" if self.row is not None else "",
                         f" column {self.column!r}" if self.column else ""])
        return f"{self.file}:{where + ':' if where else ''} {self.message}"


def _rows(mask) -> np.ndarray:
    return np.nonzero(np.asarray(mask, dtype=bool))[0]


def _check_rows(problems, path, mask, column, message) -> None:
    bad = _rows(mask)
    for row in bad[:MAX_ROWS_PER_CHECK]:
        problems.append(Problem(str(path), message, int(row), column))
    if len(bad) > MAX_ROWS_PER_CHECK:
        problems.append(Problem(str(path), f"{message} (and {len(bad) - MAX_ROWS_PER_CHECK} more rows)",
                                None, column))


def _np(table: pa.Table, name: str, fill=0) -> np.ndarray:
    return table[name].fill_null(fill).to_numpy(zero_copy_only=False)


def validate_file(path: Path) -> list[Problem]:
    """Every spec violation in one Parquet file."""
    try:
        pf = metadata.open_file(path)
        version = metadata.parse(pf.schema_arrow, path)["spec_version"]
        table = pf.read()
    except TraceError as exc:
        return [Problem(str(path), str(exc).removeprefix(f"{path}: "))]
    except (pa.ArrowException, OSError) as exc:
        return [Problem(str(path), f"not a readable Parquet file (truncated or corrupt?): {exc}")]
    problems: list[Problem] = []
    for field in SCHEMA:
        if field.name not in table.column_names and field.name in columns_absent_in(version):
            table = table.append_column(field, pa.nulls(len(table), field.type))  # added by a later minor version: null
        elif field.name not in table.column_names:
            problems.append(Problem(str(path), "required column is missing", None, field.name))
        elif not table.schema.field(field.name).type.equals(field.type):
            got = table.schema.field(field.name).type
            try:
                table = table.set_column(table.column_names.index(field.name), field.name,
                                         table[field.name].cast(field.type))
            except (pa.ArrowException, ValueError):
                problems.append(Problem(str(path), f"has type {got}, expected {field.type}", None, field.name))
        elif not field.nullable and table[field.name].null_count:
            _check_rows(problems, path, table[field.name].is_null(), field.name, "must not be null")
    if problems:
        return problems
    _check_values(problems, path, table, newer_minor=minor_version(version) > minor_version(SPEC_VERSION))
    return problems


def _check_values(problems: list[Problem], path: Path, t: pa.Table, newer_minor: bool) -> None:
    kind, stream = t["kind"].to_pylist(), t["stream"].to_pylist()
    if not newer_minor:  # a newer minor version may add kinds (read as 'other') and streams (ignored)
        _check_rows(problems, path, [k not in KINDS for k in kind], "kind",
                    f"unknown layer kind; expected one of {', '.join(KINDS)}")
        _check_rows(problems, path, [s not in STREAMS for s in stream], "stream",
                    f"unknown stream; expected one of {', '.join(STREAMS)}")
    _check_rows(problems, path, pc.equal(t["layer"], ""), "layer", "layer name is empty")
    scalar = np.array([s == "scalar" for s in stream], dtype=bool)
    index, has_value = _np(t, "layer_index"), t["value"].is_valid().to_numpy(zero_copy_only=False)
    _check_rows(problems, path, scalar & (index != SCALAR_INDEX), "layer_index", f"a scalar row's must be {SCALAR_INDEX}")
    _check_rows(problems, path, ~scalar & (index < 0), "layer_index", "must be at least 0")
    _check_rows(problems, path, scalar != has_value, "value", "must be set in scalar rows and only there")
    _check_rows(problems, path, scalar & ((_np(t, "count") != 1) | (_np(t, "units") != 1)), "count",
                "a scalar row holds one value: count and units must be 1")
    units = _np(t, "units")
    _check_rows(problems, path, units < 1, "units", "must be at least 1")
    lo, hi = _np(t, "bound_lo", np.nan), _np(t, "bound_hi", np.nan)
    needs_bounds = np.array([k == "clip" or KIND_BOUNDS.get(k) is not None for k in kind], dtype=bool)
    _check_rows(problems, path, needs_bounds & np.isnan(lo + hi), "bound_lo",
                "a bounded kind must record its bounds")
    _check_rows(problems, path, lo >= hi, "bound_hi", "bound_hi must exceed bound_lo")
    count, nan, inf, zero = (_np(t, c) for c in ("count", "nan_count", "inf_count", "zero_count"))
    finite = count - nan - inf
    _check_rows(problems, path, (nan < 0) | (inf < 0) | (finite < 0), "count",
                "count must be at least nan_count + inf_count")
    _check_rows(problems, path, (zero < 0) | (zero > finite), "zero_count",
                "zero_count must lie between 0 and the finite count")
    _check_rows(problems, path, _np(t, "min", np.nan) > _np(t, "max", np.nan), "min", "min exceeds max")
    _check_rows(problems, path, _np(t, "sumsq", 0.0) < 0, "sumsq", "sum of squares is negative")
    _check_duplicates(problems, path, t)
    present = [c for c in UNIT_COLUMNS if t[c].null_count < len(t)]
    all_null = np.ones(len(t), dtype=bool)
    any_null = np.zeros(len(t), dtype=bool)
    for c in UNIT_COLUMNS:
        nulls = t[c].is_null().to_numpy(zero_copy_only=False)
        all_null &= nulls
        any_null |= nulls
    _check_rows(problems, path, any_null & ~all_null, "unit_count",
                "per-unit columns must be all present or all null")
    for c in present:
        lengths = pc.list_value_length(t[c]).fill_null(-1).to_numpy(zero_copy_only=False)
        _check_rows(problems, path, (lengths >= 0) & (lengths != units), c,
                    "list length differs from the 'units' column")
    if problems:
        return
    full = ~all_null
    if full.any():
        sub = t.filter(pa.array(full))
        ucount = _sum_lists(sub["unit_count"])
        uzero = _sum_lists(sub["unit_zero"])
        _check_rows(problems, path, _scatter(full, ucount != finite[full]), "unit_count",
                    "per-unit finite counts do not add up to count - nan_count - inf_count")
        _check_rows(problems, path, _scatter(full, uzero != zero[full]), "unit_zero",
                    "per-unit zero counts do not add up to zero_count")
        flat_zero = pc.list_flatten(sub["unit_zero"]).to_numpy(zero_copy_only=False)
        flat_count = pc.list_flatten(sub["unit_count"]).to_numpy(zero_copy_only=False)
        bad_unit = np.add.reduceat((flat_zero > flat_count) | (flat_zero < 0), _starts(sub["unit_zero"])) \
            if len(flat_zero) else np.zeros(len(sub), dtype=bool)
        _check_rows(problems, path, _scatter(full, bad_unit > 0), "unit_zero",
                    "a unit's zero count exceeds its finite count")
    lengths = pc.list_value_length(t["hist"]).fill_null(-1).to_numpy(zero_copy_only=False)
    _check_rows(problems, path, (lengths >= 0) & (lengths != N_BINS), "hist",
                f"histogram must have exactly {N_BINS} bins")
    has_hist = lengths == N_BINS
    if has_hist.any() and not problems:
        sub = t.filter(pa.array(has_hist))
        _check_rows(problems, path, _scatter(has_hist, _sum_lists(sub["hist"]) != (count - nan)[has_hist]),
                    "hist", "histogram counts do not add up to count - nan_count")


    _check_sat_counts(problems, path, t, count - nan)


def _check_duplicates(problems: list[Problem], path: Path, t: pa.Table) -> None:
    """At most one row per (run, layer, stream, param, step)."""
    seen: dict[tuple, int] = {}
    dup = np.zeros(len(t), dtype=bool)
    for row, key in enumerate(zip(*(t[k].to_pylist() for k in READING_KEY))):
        if key in seen:
            dup[row] = True
        seen.setdefault(key, row)
    _check_rows(problems, path, dup, "step", "a second reading of one (run, layer, stream, param, step)")


def _check_sat_counts(problems: list[Problem], path: Path, t: pa.Table, non_nan: np.ndarray) -> None:
    n = 2 * len(SAT_LEVELS)
    lengths = pc.list_value_length(t["sat_counts"]).fill_null(-1).to_numpy(zero_copy_only=False)
    _check_rows(problems, path, (lengths >= 0) & (lengths != n), "sat_counts", f"must have exactly {n} counts")
    has = lengths == n
    if has.any() and not problems:
        c = np.asarray(pc.list_flatten(t.filter(pa.array(has))["sat_counts"]).to_numpy(zero_copy_only=False)
                       ).reshape(-1, n)
        inward = np.concatenate([c[:, : n // 2], c[:, n // 2:][:, ::-1]], axis=1)  # outermost first, per side
        bad = (np.diff(inward[:, : n // 2]) < 0).any(1) | (np.diff(inward[:, n // 2:]) < 0).any(1) | \
              (c < 0).any(1) | (c > non_nan[has, None]).any(1)
        _check_rows(problems, path, _scatter(has, bad), "sat_counts",
                    "counts must grow from the outermost threshold inwards and stay within count - nan_count")


def _starts(col) -> np.ndarray:
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)


def _sum_lists(col) -> np.ndarray:
    flat = pc.list_flatten(col).to_numpy(zero_copy_only=False)
    return np.add.reduceat(flat, _starts(col)) if len(flat) else np.zeros(len(col), dtype=np.int64)


def _scatter(mask: np.ndarray, values: np.ndarray) -> np.ndarray:
    out = np.zeros(len(mask), dtype=bool)
    out[mask] = values
    return out


def validate(paths) -> list[Problem]:
    """Every problem in the given traces (files, `.parts` directories, globs)."""
    problems: list[Problem] = []
    try:
        sources = trace_sources(paths)
    except TraceError as exc:
        return [Problem(str(paths), str(exc))]
    for source in sources:
        try:
            files = part_files(source)
        except TraceError as exc:
            problems.append(Problem(str(source), str(exc).removeprefix(f"{source}: ")))
            continue
        for f in files:
            problems += validate_file(f)
    return problems
