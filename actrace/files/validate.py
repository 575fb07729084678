"""Spec conformance (spec/trace-v1.md §Validity): every problem named by file, row and column.

`validate` checks every MUST of the spec over each source, across its part files. `row_problems`
is the part a reader runs on the columns it read, before it computes from them: each check runs
where the columns it needs were read.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from actrace.format import metadata
from actrace.format.bins import N_BINS
from actrace.files.reader import TraceError, _read, part_files, settled, trace_sources
from actrace.format.schema import (KIND_BOUNDS, KINDS, MAX_NAME, READING_KEY, SAT_COUNTS, SCALAR_INDEX, SCHEMA, SPEC_VERSION,
                     STREAMS, UNIT_COLUMNS, FORBIDDEN_IN_NAMES, minor_version, schema_problems)

MAX_ROWS_PER_CHECK = 5
MAX_CONFIG_DEPTH = 64  # nesting of the `config` JSON: deeper is no configuration, and costs a parser its stack
_LACK = r"(no \w+ reading|\d+ readings lost)"
STATUS = re.compile(rf"running|complete|closed at exit|interrupted|terminated|failed: \w+"
                    rf"|incomplete: {_LACK}(, {_LACK})*")


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


def _np(table: pa.Table, name: str, fill=0) -> np.ndarray:
    return table[name].fill_null(fill).to_numpy(zero_copy_only=False)


def _in(table: pa.Table, name: str, values) -> np.ndarray:
    return pc.is_in(table[name], pa.array(list(values))).fill_null(False).to_numpy(zero_copy_only=False)


def _starts(col) -> np.ndarray:
    lengths = pc.list_value_length(col).fill_null(0).to_numpy(zero_copy_only=False)
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)


def _sum_lists(col) -> np.ndarray:
    flat = pc.list_flatten(col).to_numpy(zero_copy_only=False)
    return np.add.reduceat(flat, _starts(col)) if len(flat) else np.zeros(len(col), dtype=np.int64)


def _scatter(mask: np.ndarray, values: np.ndarray) -> np.ndarray:
    out = np.zeros(len(mask), dtype=bool)
    out[mask] = values
    return out


def bad_names(column) -> np.ndarray:
    """Rows whose name breaks spec §Validity's rule for names: longer than MAX_NAME characters, or
    holding a control, a line or paragraph separator, or a bidirectional control."""
    too_long = pc.greater(pc.utf8_length(column), MAX_NAME)
    hostile = pc.match_substring_regex(column, f"[{FORBIDDEN_IN_NAMES}]")
    return pc.or_(too_long, hostile).fill_null(False).to_numpy(zero_copy_only=False)


def row_problems(t: pa.Table, path, *, read=None, newer_minor: bool = False) -> list[Problem]:
    """The row checks of spec §Validity over a table of spec columns; `read`: the columns actually
    read (the others null), each check running where all its columns were read."""
    read = set(t.column_names if read is None else read)
    problems: list[Problem] = []

    def need(*names) -> bool:
        return set(names) <= read

    def rows(mask, column, message) -> None:
        bad = np.nonzero(np.asarray(mask, dtype=bool))[0]
        problems.extend(Problem(str(path), message, int(r), column) for r in bad[:MAX_ROWS_PER_CHECK])
        if len(bad) > MAX_ROWS_PER_CHECK:
            problems.append(Problem(str(path), f"{message} (and {len(bad) - MAX_ROWS_PER_CHECK} more rows)", None,
                                    column))

    for field in SCHEMA:
        if not field.nullable and need(field.name):
            rows(t[field.name].is_null().to_numpy(zero_copy_only=False), field.name, "must not be null")
    if problems:
        return problems  # the checks below read these columns as numbers

    if not newer_minor:  # a newer minor version may add kinds (read as 'other') and streams (ignored)
        if need("kind"):
            rows(~_in(t, "kind", KINDS), "kind", f"unknown layer kind; expected one of {', '.join(KINDS)}")
        if need("stream"):
            rows(~_in(t, "stream", STREAMS), "stream", f"unknown stream; expected one of {', '.join(STREAMS)}")
    for name in ("run", "layer", "param"):
        if need(name):
            rows(bad_names(t[name]), name, f"a name longer than {MAX_NAME} characters, or holding a control, "
                 "line-separator or bidirectional character")
    if need("layer"):
        rows(pc.equal(t["layer"], "").fill_null(False).to_numpy(zero_copy_only=False), "layer", "layer name is empty")
    scalar = _in(t, "stream", ["scalar"]) if need("stream") else None
    if scalar is not None and need("layer_index"):
        index = _np(t, "layer_index")
        rows(scalar & (index != SCALAR_INDEX), "layer_index", f"a scalar row's must be {SCALAR_INDEX}")
        rows(~scalar & (index < 0), "layer_index", "must be at least 0")
    if scalar is not None and need("value"):
        rows(scalar != t["value"].is_valid().to_numpy(zero_copy_only=False), "value",
             "must be set in scalar rows and only there")
    if scalar is not None and need("count", "units"):
        rows(scalar & ((_np(t, "count") != 1) | (_np(t, "units") != 1)), "count",
             "a scalar row holds one value: count and units must be 1")
    units = _np(t, "units") if need("units") else None
    if units is not None:
        rows(units < 1, "units", "must be at least 1")
    if need("kind", "bound_lo", "bound_hi"):
        lo, hi = _np(t, "bound_lo", np.nan), _np(t, "bound_hi", np.nan)
        bounded = _in(t, "kind", [k for k, b in KIND_BOUNDS.items() if b is not None or k == "clip"])
        rows(bounded & np.isnan(lo + hi), "bound_lo", "a bounded kind must record its bounds")
        rows(lo >= hi, "bound_hi", "bound_hi must exceed bound_lo")
    if need("count", "nan_count", "inf_count", "zero_count"):
        count, nan, inf, zero = (_np(t, c) for c in ("count", "nan_count", "inf_count", "zero_count"))
        finite = count - nan - inf
        rows((nan < 0) | (inf < 0) | (finite < 0), "count", "count must be at least nan_count + inf_count")
        rows((zero < 0) | (zero > finite), "zero_count", "zero_count must lie between 0 and the finite count")
    else:
        count = nan = finite = zero = None
    if need("min", "max"):
        rows(_np(t, "min", np.nan) > _np(t, "max", np.nan), "min", "min exceeds max")
    if need("sumsq"):
        rows(_np(t, "sumsq", 0.0) < 0, "sumsq", "sum of squares is negative")
    for name in ("sum", "sumsq", "sum3", "sum4"):
        if need(name):
            rows(np.isnan(_np(t, name, 0.0)), name, "a sum of finite values cannot be NaN")
    if need("sum3", "sum4"):
        rows(_np(t, "sum4", 0.0) < 0, "sum4", "sum of fourth powers is negative")
        rows(t["sum3"].is_null().to_numpy(zero_copy_only=False) != t["sum4"].is_null().to_numpy(zero_copy_only=False),
             "sum4", "sum3 and sum4 are null together or set together")
    lists = [c for c in UNIT_COLUMNS if need(c)]
    if lists:
        nulls = np.stack([t[c].is_null().to_numpy(zero_copy_only=False) for c in lists])
        all_null = nulls.all(0)
        rows(nulls.any(0) & ~all_null, lists[0], "per-unit columns must be all present or all null")
        if units is not None:
            for c in lists:
                lengths = pc.list_value_length(t[c]).fill_null(-1).to_numpy(zero_copy_only=False)
                rows((lengths >= 0) & (lengths != units), c, "list length differs from the 'units' column")
        if problems:
            return problems
        full = ~all_null
        sub = t.filter(pa.array(full)) if full.any() and finite is not None else None
        if sub is not None and need("unit_count"):
            rows(_scatter(full, _sum_lists(sub["unit_count"]) != finite[full]), "unit_count",
                 "per-unit finite counts do not add up to count - nan_count - inf_count")
        if sub is not None and need("unit_count", "unit_zero"):
            rows(_scatter(full, _sum_lists(sub["unit_zero"]) != zero[full]), "unit_zero",
                 "per-unit zero counts do not add up to zero_count")
            flat_zero = pc.list_flatten(sub["unit_zero"]).to_numpy(zero_copy_only=False)
            flat_count = pc.list_flatten(sub["unit_count"]).to_numpy(zero_copy_only=False)
            bad = np.add.reduceat((flat_zero > flat_count) | (flat_zero < 0), _starts(sub["unit_zero"])) \
                if len(flat_zero) else np.zeros(len(sub), dtype=bool)
            rows(_scatter(full, bad > 0), "unit_zero", "a unit's zero count exceeds its finite count")
    if need("hist"):
        lengths = pc.list_value_length(t["hist"]).fill_null(-1).to_numpy(zero_copy_only=False)
        rows((lengths >= 0) & (lengths != N_BINS), "hist", f"histogram must have exactly {N_BINS} bins")
        has = lengths == N_BINS
        if has.any() and count is not None and not problems:
            sub = t.filter(pa.array(has))
            rows(_scatter(has, _sum_lists(sub["hist"]) != (count - nan)[has]), "hist",
                 "histogram counts do not add up to count - nan_count")
    if need("sat_counts"):
        _sat_counts(rows, t, None if count is None else count - nan)
    return problems


def _sat_counts(rows, t: pa.Table, non_nan: np.ndarray | None) -> None:
    n = len(SAT_COUNTS)
    lengths = pc.list_value_length(t["sat_counts"]).fill_null(-1).to_numpy(zero_copy_only=False)
    rows((lengths >= 0) & (lengths != n), "sat_counts", f"must have exactly {n} counts")
    has = lengths == n
    if has.any():
        c = np.asarray(pc.list_flatten(t.filter(pa.array(has))["sat_counts"]).to_numpy(zero_copy_only=False)
                       ).reshape(-1, n)
        outermost_first = [i for i, (side, _) in enumerate(SAT_COUNTS) if side == "lo"] + \
            [i for i, (side, _) in enumerate(SAT_COUNTS) if side == "hi"][::-1]
        inward = c[:, outermost_first]
        bad = (np.diff(inward[:, : n // 2]) < 0).any(1) | (np.diff(inward[:, n // 2:]) < 0).any(1) | (c < 0).any(1)
        if non_nan is not None:
            bad |= (c > non_nan[has, None]).any(1)
        rows(_scatter(has, bad), "sat_counts",
             "counts must grow from the outermost threshold inwards and stay within count - nan_count")


def _depth(text: str) -> int:
    """How deeply a JSON text nests arrays and objects, read without recursing."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            escaped, in_string = (not escaped and ch == "\\"), in_string and (escaped or ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def metadata_problems(meta: dict[str, str], path) -> list[Problem]:
    """spec §File metadata: the REQUIRED keys, a known status, a config that is a JSON object, aliases
    that are one of names, no_gradient a list of them, names within the rule for names."""
    out = [Problem(str(path), f"REQUIRED metadata key 'actrace:{key}' is missing or empty")
           for key in ("run_name", "run_id") if not meta.get(key)]
    for key in ("run_name", "run_id"):
        if meta.get(key) and bad_names(pa.array([meta[key]]))[0]:
            out.append(Problem(str(path), f"metadata 'actrace:{key}' is longer than {MAX_NAME} characters or holds "
                               "a control, line-separator or bidirectional character"))
    if meta.get("status") and not STATUS.fullmatch(meta["status"]):
        out.append(Problem(str(path), f"metadata 'actrace:status' {meta['status'][:80]!r} is not a status of "
                           "spec §File metadata"))
    config = meta.get("config") or "{}"
    if _depth(config) > MAX_CONFIG_DEPTH:
        out.append(Problem(str(path), f"metadata 'actrace:config' nests deeper than {MAX_CONFIG_DEPTH} levels"))
    else:
        try:
            if not isinstance(json.loads(config), dict):
                out.append(Problem(str(path), "metadata 'actrace:config' is JSON but not an object"))
        except ValueError as exc:
            out.append(Problem(str(path), f"metadata 'actrace:config' is not JSON ({exc})"))
    if meta.get("aliases"):
        try:
            aliases = json.loads(meta["aliases"]) if _depth(meta["aliases"]) <= 1 else None
        except ValueError:
            aliases = None
        if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
            out.append(Problem(str(path), "metadata 'actrace:aliases' is not a JSON object of names"))
    if meta.get("no_gradient"):
        try:
            cut = json.loads(meta["no_gradient"]) if _depth(meta["no_gradient"]) <= 1 else None
        except ValueError:
            cut = None
        if not isinstance(cut, list) or not all(isinstance(v, str) and v for v in cut):
            out.append(Problem(str(path), "metadata 'actrace:no_gradient' is not a JSON list of names"))
    return out


def validate_file(path: Path) -> tuple[list[Problem], pa.Table | None, dict]:
    """Every spec violation in one Parquet file, its table (None where it cannot be read) and metadata."""
    try:
        pf = metadata.open_file(path)
        meta = metadata.parse(pf.schema_arrow, path)
    except TraceError as exc:
        return [Problem(str(path), str(exc).removeprefix(f"{path}: "))], None, {}
    version = meta["spec_version"]
    problems = metadata_problems(meta, path)
    schema = schema_problems(pf.schema_arrow, version)
    problems += [Problem(str(path), problem, None, column) for column, problem in schema]
    if schema:
        return problems, None, meta
    present = [c for c in SCHEMA.names if c in pf.schema_arrow.names]
    try:
        table = _read(pf, path, present)
    except TraceError as exc:
        return problems + [Problem(str(path), str(exc).removeprefix(f"{path}: "))], None, meta
    for field in SCHEMA:
        if field.name not in table.column_names:  # added by a later minor version: null
            table = table.append_column(field, pa.nulls(len(table), field.type))
    problems += row_problems(table.select(SCHEMA.names), path,
                             newer_minor=minor_version(version) > minor_version(SPEC_VERSION))
    return problems + run_problems(table, meta, path), table, meta


def run_problems(t: pa.Table, meta: dict[str, str], path) -> list[Problem]:
    """Rows whose `run` is not the file's metadata `run_name` (spec §Columns: they are equal)."""
    if not meta.get("run_name") or not len(t):
        return []
    others = pc.not_equal(t["run"], meta["run_name"]).fill_null(True).to_numpy(zero_copy_only=False)
    return [Problem(str(path), f"{int(others.sum())} row(s) name a run other than the metadata's run_name "
                    f"{meta['run_name'][:80]!r}", int(np.argmax(others)), "run")] if others.any() else []


def duplicates(t: pa.Table) -> np.ndarray:
    """Rows that repeat an earlier row's (run, layer, stream, param, step): spec §Validity allows one."""
    key = t.select(list(READING_KEY)).append_column("_row", pa.array(np.arange(len(t))))
    first = key.group_by(list(READING_KEY), use_threads=False).aggregate([("_row", "min")])["_row_min"]
    dup = np.ones(len(t), dtype=bool)
    dup[first.to_numpy()] = False
    return dup


def validate_source(source: Path) -> list[Problem]:
    """Every problem of one trace source: each part file's, then those across them (one run, no
    reading twice, part files named as the spec names them); a `.parts` folder compacted while it is
    validated, its compacted trace's (`settled`)."""
    return settled(_validate_source, source)


def _validate_source(source: Path) -> list[Problem]:
    try:
        files = part_files(source)
    except TraceError as exc:
        return [Problem(str(source), str(exc).removeprefix(f"{source}: "))]
    problems, tables, ids = [], [], set()
    for f in files:
        found, table, meta = validate_file(f)
        problems += found
        ids.add(meta.get("run_id"))
        if table is not None and not found:
            tables.append(table)
    if source.is_dir():
        problems += [Problem(str(f), "a part file must be named part-NNNNNN.parquet (six digits)") for f in files
                     if not re.fullmatch(r"part-\d{6}\.parquet", f.name)]
        if len(ids - {None}) > 1:
            problems.append(Problem(str(source), f"part files of {len(ids - {None})} runs (run_id) in one trace"))
    if tables and len(tables) == len(files):
        dup = duplicates(pa.concat_tables(tables))
        bad = np.nonzero(dup)[0]
        problems += [Problem(str(source), "a second reading of one (run, layer, stream, param, step)", int(r), "step")
                     for r in bad[:MAX_ROWS_PER_CHECK]]
    return problems


def validate(paths) -> list[Problem]:
    """Every problem in the given traces (files, `.parts` directories, globs, folders)."""
    return [p for source in trace_sources(paths) for p in validate_source(source)]
