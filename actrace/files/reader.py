"""Find and read traces (spec §Files, §Versioning): files, `.parts` directories, globs, folders.

A reader accepts any 1.x file, ignores columns it does not know and refuses another major
version with a message naming the version it supports.
"""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from actrace.files.lake import path_run, traces_in
from actrace.files.location import glob, has_magic, location, remote
from actrace.format import metadata
from actrace.format.metadata import TraceError
from actrace.format.schema import SCHEMA, schema_problems


def expand(pattern) -> list:
    """A glob pattern's matches, sorted; any other path as it is (it may not exist); local paths
    or object-store URLs alike (`location`)."""
    return glob(pattern) if has_magic(pattern) else [location(pattern)]


def trace_sources(paths, unwritten: bool = False) -> list:
    """Expand files, globs, `NAME.parquet.parts` dirs and folders of traces, local or in object
    storage, into trace sources; with `unwritten`, a folder's `.parts` folders that hold no part
    file yet too (the analyzer says what they are; a reader has nothing to read there)."""
    if isinstance(paths, (str, Path)) or remote(paths):
        paths = [paths]
    sources: list = []
    for raw in paths:
        matches = expand(raw)
        if not matches:
            raise TraceError(f"{raw}: no trace matches this pattern")
        for m in matches:
            if m.name.endswith(".parquet.lock"):
                continue  # a writer's lock beside its trace (spec §Files), which `runs/*` matches too
            m = compacted(m) or m
            if not m.exists():
                raise TraceError(f"{m}: no such file or directory")
            found = traces_in(m, unwritten) if m.is_dir() and not m.name.endswith(".parts") else [m]
            for f in found:
                f = compacted(f) or f  # where a trace and its parts are both listed: once, the trace
                if f not in sources:
                    sources.append(f)
    return sources


def compacted(source):
    """The compacted trace of a `NAME.parquet.parts` folder, where its writer has written it: it wins
    over the parts, which the writer removes next (spec §Files); else None."""
    if not source.name.endswith(".parquet.parts"):
        return None
    trace = source.with_name(source.name.removesuffix(".parts"))
    return trace if trace.exists() else None


def settled(read, source):
    """`read(source)`; where `source` is a `.parts` folder that its writer compacted before or while it
    was read (its parts gone, some or all, under the read), `read` of the compacted trace instead: a
    reader meeting a compaction reads the parts or the finished trace, never a part of either."""
    if compacted(source) is None:
        try:
            answer = read(source)
        except (TraceError, OSError):  # a part removed under the read
            if compacted(source) is None:
                raise
        else:
            if compacted(source) is None:
                return answer
    return read(compacted(source))


def unreadable(source, problem: Exception) -> dict:
    """The run metadata of a trace an analysis left out because it breaks the spec (`--skip-invalid`):
    no reading, status `unreadable: PROBLEM`, so a gate gives it a verdict instead of losing it."""
    path = location(source)
    return {"run_name": path_run(path.with_name(path.name.removesuffix(".parts"))),
            "status": f"unreadable: {str(problem).splitlines()[0]}", "file": str(source), "readings": 0}


def unwritten(source) -> dict | None:
    """The run metadata of a `.parts` directory with no part file in it, as an analyzer lists its runs':
    no reading, status `running`, the run its path names (its writer's default: it names no other
    anywhere yet); None for any other source. Its writer has not flushed yet, or never will: it was
    killed before its first flush."""
    if not (source.name.endswith(".parquet.parts") and source.is_dir()) or any(source.glob("part-*.parquet")) \
            or compacted(source) is not None:
        return None
    return {"run_name": path_run(source.with_name(source.name.removesuffix(".parts"))), "status": "running",
            "file": str(source), "readings": 0}


MAX_PARTS = 10_000  # part files of a `.parts` folder: a killed run's flushes, 10 s apart at the most, for 27 h


def part_files(source: Path) -> list[Path]:
    """The Parquet files a source consists of: itself, or a `.parts` directory's part files (at most
    MAX_PARTS, counted before any is opened)."""
    if source.is_dir():
        parts = sorted(source.glob("part-*.parquet"))
        if not parts:
            raise TraceError(f"{source}: a .parts directory with no part files")
        if len(parts) > MAX_PARTS:
            raise TraceError(f"{source}: {len(parts):,} part files, over the {MAX_PARTS:,} a .parts folder may "
                             "hold: not read")
        return parts
    return [source]


def known_columns(path: Path) -> list[str]:
    """The spec columns present in a file, in spec order (unknown columns are ignored)."""
    names = set(metadata.open_file(path).schema_arrow.names)
    return [f.name for f in SCHEMA if f.name in names]


def checked(pf: pq.ParquetFile, path: Path) -> dict[str, str]:
    """A part file's metadata, once its schema is known to hold every spec column (or, for those a
    later minor version added, to lack them) in its type or one that casts losslessly: a missing or
    retyped column is refused here, naming the file and the column, before anything computes."""
    meta = metadata.parse(pf.schema_arrow, path)
    problems = schema_problems(pf.schema_arrow, meta["spec_version"])  # every column: the footer says, cheaply
    if problems:
        column, problem = problems[0]
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise TraceError(f"{path}: column {column!r} {problem}{more}")
    return meta


def _read(pf: pq.ParquetFile, path: Path, columns: list[str]) -> pa.Table:
    """The columns of one part file in the spec's types, strings checked to be UTF-8."""
    try:
        table = pf.read(columns=columns)
        for name in table.column_names:
            want = SCHEMA.field(name).type
            if not table.schema.field(name).type.equals(want):
                table = table.set_column(table.column_names.index(name), name, table[name].cast(want))
            if pa.types.is_string(want):
                table[name].validate(full=True)  # a flipped bit in a string page is not a name
    except (pa.ArrowException, OSError) as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from None
    # the spec's fields, without whatever field metadata the file carried (not ours to trust)
    return pa.Table.from_arrays(table.columns, schema=pa.schema([SCHEMA.field(n) for n in table.column_names]))


def read_source(source: Path, columns: list[str] | None = None, *, when=None) -> tuple[pa.Table, dict[str, str]]:
    """One trace source as an Arrow table of spec columns, plus its file metadata. `when` is a list
    of (names, needed): those columns are read only where `needed(table of the other columns)` is
    true of the whole trace, every part file's rows together, and are null otherwise, so a reader pays
    for them only where they matter and a trace has one schema however its rows fell into parts.
    Every part file's schema is checked first (`checked`); the parts of a `.parts` directory must be
    one run's; a directory compacted while it is read is read from its compacted trace (`settled`)."""
    return settled(lambda s: _read_source(s, columns, list(when or ())), source)


def _read_source(source: Path, columns: list[str] | None, when: list) -> tuple[pa.Table, dict[str, str]]:
    lazy = {name for names, _ in when for name in names}
    want = [c for c in SCHEMA.names if columns is None or c in columns]
    opened, meta, run_id = [], {}, None
    for f in part_files(source):
        pf = metadata.open_file(f)  # one footer read gives the metadata and the columns
        meta = checked(pf, f)
        if run_id is not None and meta.get("run_id") != run_id:
            raise TraceError(f"{f}: a part of another run (run_id {meta.get('run_id')!r}, not {run_id!r}) "
                             f"in {source}")
        run_id = meta.get("run_id")
        opened.append((f, pf, set(pf.schema_arrow.names)))
    eager = [c for c in want if c not in lazy]
    tables = [_read(pf, f, [c for c in eager if c in present]) for f, pf, present in opened]
    whole = pa.concat_tables(_spec_columns(t, eager) for t in tables)
    extra = {c for names, needed in when if needed(whole) for c in names}
    if extra:
        for i, (f, pf, present) in enumerate(opened):
            more = _read(pf, f, [c for c in want if c in present and c in extra])
            for name in more.column_names:
                tables[i] = tables[i].append_column(more.schema.field(name), more[name])
    return pa.concat_tables(_spec_columns(t, want) for t in tables), meta


def _spec_columns(table: pa.Table, want: list[str]) -> pa.Table:
    """`table` with the columns `want`, in that order; one it lacks (not asked for here, or a column an
    older minor version lacks) null."""
    for name in want:
        if name not in table.column_names:
            table = table.append_column(SCHEMA.field(name), pa.nulls(len(table), SCHEMA.field(name).type))
    return table.select(want)


def read_table(paths, columns: list[str] | None = None) -> pa.Table:
    """All readings of the given traces in one Arrow table."""
    tables = [read_source(s, columns)[0] for s in trace_sources(paths)]
    if not tables:
        raise TraceError(f"no traces found in {paths}")
    return pa.concat_tables(tables, promote_options="permissive")


def scan(paths, columns: list[str] | None = None):
    """All readings as a lazy Polars frame (only the requested columns are read)."""
    import polars as pl

    frames = []
    for source in trace_sources(paths):
        files = part_files(source)
        for f in files:
            checked(metadata.open_file(f), f)
        cols = [c for c in known_columns(files[0]) if columns is None or c in columns]
        frames.append(pl.scan_parquet([str(f) for f in files]).select(cols))
    if not frames:
        raise TraceError(f"no traces found in {paths}")
    return pl.concat(frames, how="diagonal_relaxed")
