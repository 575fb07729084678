"""The metric table computed by an engine other than Polars, from the SQL of `analyzer.sql`: DuckDB
in this process, or Spark (local mode, or a cluster by its master URL). The engine reads the
traces' files itself; this process checks each trace first as the Polars analyzer does (its
footer, and the rows of the columns the metrics read: a trace Polars refuses, every engine refuses,
in the same line) and reads the few rows findings need beside the metrics (the loss, the
derived readings), so findings over a sweep read the engine's table.
"""
from __future__ import annotations

import tempfile
import uuid
import warnings
from collections import Counter
from contextlib import nullcontext

import polars as pl
import pyarrow.parquet as pq

from actrace.files.location import location, remote, remove
from actrace.files.reader import (TraceError, checked, compacted, part_files, settled, trace_sources, unreadable,
                                  unwritten)
from actrace.format import metadata
from actrace.format.schema import SCHEMA

from .metrics import EXTRA_COLUMNS, METRIC_COLUMNS, Thresholds, checked_source
from .sql import metrics_sql, side_sql

ENGINES = ("polars", "duckdb", "spark")
# one row per reading key (spec §Validity): where a trace repeats one, the last written stands, as in
# the Polars analyzer (parts in name order, rows in file order)
LAST = "row_number() OVER (PARTITION BY run, layer, stream, param, step ORDER BY"


def traces(paths, skip_invalid: bool = False) -> tuple[list[str], list[dict], list[str]]:
    """The Parquet files of every trace (local paths or URLs), each trace's metadata (with its
    `file`), and the spec columns no file holds (an older minor version's: read as null). A trace
    whose footer breaks the spec stops it, naming the file (`skip_invalid`: left out, and said)."""
    files, runs, present = [], [], set()
    for source in trace_sources(paths, unwritten=True):
        if (meta := unwritten(source)) is not None:  # no reading, the run not closed: said (status_findings)
            runs.append(meta)
            continue
        try:
            checked_source(source)  # its rows checked as the Polars analyzer checks them: refused alike
            source, meta, mine, readings = settled(_footers, source)
        except TraceError as exc:
            if not skip_invalid:
                raise
            warnings.warn(f"skipped {source}: {exc}", stacklevel=2)
            runs.append(unreadable(source, exc))  # listed without a reading: a gate still gives it a verdict
            continue
        files += [f for f, _ in mine]
        present.update(name for _, names in mine for name in names)
        runs.append(dict(meta, file=str(source), readings=readings))
    if not runs:
        raise TraceError(f"no traces found in {paths}")
    named = Counter(m["run_name"] for m in runs)
    if any(n > 1 for n in named.values()):  # as one run, each reading's last written: the Polars analyzer
        warnings.warn(f"traces name one run {', '.join(repr(r) for r, n in named.items() if n > 1)}: read as one run "
                      "(--engine polars tells runs that share a name apart)", stacklevel=2)
    return files, runs, [f.name for f in SCHEMA if f.name not in present]


def _footers(source) -> tuple:
    """(source, its metadata, (file, column names) of each of its Parquet files, its rows), from the
    files' footers, each checked (`checked`)."""
    meta, mine, readings = {}, [], 0
    for f in part_files(source):
        pf = metadata.open_file(f)
        meta = checked(pf, f)
        mine.append((str(f), pf.schema_arrow.names))
        readings += pf.metadata.num_rows
    return source, meta, mine, readings


def _missing(absent: list[str], dialect: str) -> str:
    """The absent spec columns as nulls of their type, for the `readings` view."""
    types = {"float": "FLOAT", "double": "DOUBLE", "int64": "BIGINT", "int32": "INTEGER", "string": "VARCHAR"}
    out = []
    for name in absent:
        t = SCHEMA.field(name).type
        if hasattr(t, "value_type"):
            inner = types[str(t.value_type)]
            spelled = f"{inner}[]" if dialect == "duckdb" else f"ARRAY<{inner}>"
        else:
            spelled = types[str(t)]
        out.append(f", CAST(NULL AS {spelled}) AS {name}")
    return "".join(out)


def on_duckdb(paths, th: Thresholds, skip_invalid: bool = False) -> tuple[pl.DataFrame, pl.DataFrame, list[dict]]:
    """(metric table, side rows, runs) of the traces, computed by DuckDB. A `.parts` folder its writer
    compacted between this process's look at its footers and DuckDB's read is read again, as its
    compacted trace (a retry follows a compaction)."""
    duckdb = _engine("duckdb", "duckdb")

    while True:
        files, runs, absent = traces(paths, skip_invalid)
        try:
            return _duckdb_tables(duckdb, files, runs, absent, th)
        except duckdb.IOException:
            if not any(compacted(location(meta["file"])) for meta in runs):
                raise
        except duckdb.Error as exc:  # pages Polars' columns do not touch (a flipped bit): DuckDB's own words
            raise TraceError(f"{', '.join(meta['file'] for meta in runs)}: --engine duckdb cannot read it: "
                             f"{str(exc).strip().splitlines()[0]}") from None


def _duckdb_tables(duckdb, files: list[str], runs: list[dict], absent: list[str],
                   th: Thresholds) -> tuple[pl.DataFrame, pl.DataFrame, list[dict]]:
    con = duckdb.connect()
    stores = {type(where.fs): where.fs for where in map(location, files) if remote(where)}
    for fs in stores.values():  # object storage through its fsspec filesystem; DuckDB asks for the
        con.register_filesystem(type(fs)(**fs.storage_options, default_cache_type="none"))  # ranges it reads
    if files:
        con.sql(f"CREATE VIEW raw AS SELECT *{_missing(absent, 'duckdb')} FROM read_parquet({files!r}, "
                f"union_by_name = true, filename = true, file_row_number = true)")
    else:  # only runs killed before their first flush: no reading to read, their status said
        con.sql(f"CREATE VIEW raw AS SELECT '' AS filename, 0 AS file_row_number{_missing(absent, 'duckdb')} "
                "WHERE false")
    con.sql(f"CREATE VIEW readings AS SELECT * EXCLUDE (filename, file_row_number) FROM raw QUALIFY {LAST} "
            f"filename DESC, file_row_number DESC) = 1")
    return _typed(con.sql(metrics_sql("duckdb", th)).pl()), con.sql(side_sql()).pl(), runs


def on_spark(paths, th: Thresholds, spark: dict | None = None,
             skip_invalid: bool = False) -> tuple[pl.DataFrame, pl.DataFrame, list[dict]]:
    """(metric table, side rows, runs) of the traces, computed by Spark with the settings `spark`
    (`spark.master`: local[2] unless given; `actrace.scratch`: where the cluster writes its tables for
    this process to read, a temporary folder here in local mode)."""
    SparkSession = _engine("pyspark.sql", "spark").SparkSession

    conf = {"spark.master": "local[2]", **(spark or {})}
    master, scratch = conf["spark.master"], conf.pop("actrace.scratch", None)
    if scratch is None and not master.startswith("local"):
        raise ValueError(f"--spark-master {master} needs --spark-scratch URL: a folder the cluster writes the metric "
                         "table to and this machine reads (e.g. s3://bucket/tmp)")
    files, runs, absent = traces(paths, skip_invalid)
    if not files:
        raise TraceError(f"--engine spark: no part file to read in {paths} (runs killed before their first flush); "
                         "--engine polars or duckdb says their status")
    builder = (SparkSession.builder.appName("actrace").config("spark.ui.enabled", "false")
               .config("spark.sql.session.timeZone", "UTC")
               # a reading's row holds per-unit lists (thousands of values): Spark's 4,096 rows a batch
               # overran local mode's 1 GiB heap at 100 runs of 512 units
               .config("spark.sql.parquet.columnarReaderBatchSize", "256"))
    try:
        session = builder.config(map=conf).getOrCreate()
    except Exception as exc:  # no Java, too little memory, or no cluster at `master`: Spark's own words
        java = "" if getattr(exc, "java_exception", None) is not None else \
            "; it needs a Java runtime (Debian: default-jre-headless)"
        raise ValueError(f"--engine spark at {master}: Spark did not start ({_said(exc)}){java}") from None
    try:
        frame = session.read.option("mergeSchema", "true").parquet(*map(_hadoop, files))
    except Exception as exc:  # an object store without its Hadoop connector on the cluster
        if not any("://" in f for f in files):
            raise
        raise ValueError(f"--engine spark: Spark cannot read {files[0]} ({_said(exc)[:200]}); "
                         "object storage needs its Hadoop connector on the cluster (s3a: hadoop-aws)") from None
    frame.createOrReplaceTempView("raw")
    session.sql(f"SELECT *{_missing(absent, 'spark')}, input_file_name() AS _file, "
                f"monotonically_increasing_id() AS _row FROM raw").createOrReplaceTempView("numbered")
    session.sql(f"SELECT * EXCEPT (_file, _row, _last) FROM (SELECT *, {LAST} _file DESC, _row DESC) AS _last "
                f"FROM numbered) WHERE _last = 1").createOrReplaceTempView("readings")
    with nullcontext(scratch) if scratch else tempfile.TemporaryDirectory(prefix="actrace-spark-") as there:
        folder = f"{there}/actrace-{uuid.uuid4().hex}"
        try:
            return _typed(_written(session.sql(metrics_sql("spark", th)), f"{folder}/metrics")), \
                _written(session.sql(side_sql()), f"{folder}/side"), runs
        finally:
            remove(location(folder))


def _written(df, folder: str) -> pl.DataFrame:
    """`df` written by Spark's tasks as Parquet in `folder` and read here: no table passes through the
    driver (collecting 960,000 metric rows ran local mode's 1 GiB driver out of memory)."""
    try:
        df.write.parquet(_hadoop(folder))
    except Exception as exc:
        said = _said(exc)
        if "OutOfMemoryError" in str(exc):
            raise ValueError(f"--engine spark ran out of memory ({said}); give it more, e.g. --spark-conf "
                             "spark.driver.memory=6g (in local mode the driver runs every task; on a cluster "
                             "spark.executor.memory)") from None
        raise
    where = location(folder)
    return pl.from_arrow(pq.read_table(where.path if remote(where) else str(where),
                                       filesystem=where.fs if remote(where) else None))


def _hadoop(url: str) -> str:
    """A location as Spark's Hadoop file systems name it (S3 is `s3a://` there)."""
    return url.replace("s3://", "s3a://", 1)


def _said(exc: Exception) -> str:
    """Spark's own first line for an error: the Java exception's where there is one (Py4J's own line
    says only which call failed), else Python's."""
    java = getattr(exc, "java_exception", None)
    text = java.toString() if java is not None else str(exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


def _engine(module: str, extra: str):
    """The engine's module, or an error saying how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"--engine {extra} needs {module.split('.')[0]}: pip install 'actrace[{extra}]'"
                         + (" and a Java runtime (Debian: default-jre-headless)" if extra == "spark" else "")) from None


def _typed(df: pl.DataFrame) -> pl.DataFrame:
    """The engine's table in the Polars analyzer's column types."""
    ints = {"layer_index": pl.Int32, "units": pl.Int32, "step": pl.Int64, "nan_count": pl.Int64,
            "inf_count": pl.Int64, "values": pl.Int64, "top_unit": pl.Int64}
    return df.select(METRIC_COLUMNS + EXTRA_COLUMNS).cast(
        {c: ints.get(c, pl.Float64) for c in df.columns if c in ints or df.schema[c].is_numeric()})
