"""The metric table computed by an engine other than Polars, from the SQL of `analyzer.sql`: DuckDB
in this process, or Spark (local mode, or a cluster by its master URL). The engine reads the
traces' files itself; this process reads only each file's footer (its schema and metadata are
checked, as every reader does) and the few rows findings need beside the metrics (the loss, the
derived readings), so findings over a sweep read the engine's table.
"""
from __future__ import annotations

import warnings

import polars as pl

from actrace.files.location import location, remote
from actrace.files.reader import TraceError, checked, part_files, trace_sources
from actrace.files.validate import metadata_problems
from actrace.format import metadata
from actrace.format.schema import SCHEMA

from .metrics import EXTRA_COLUMNS, METRIC_COLUMNS, Thresholds
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
    for source in trace_sources(paths):
        try:
            meta, mine = {}, []
            for f in part_files(source):
                pf = metadata.open_file(f)
                meta = checked(pf, f)
                mine.append((str(f), pf.schema_arrow.names))
            problems = metadata_problems(meta, source)
            if problems:
                raise TraceError(str(problems[0]))
        except TraceError as exc:
            if not skip_invalid:
                raise
            warnings.warn(f"skipped {source}: {exc}", stacklevel=2)
            continue
        files += [f for f, _ in mine]
        present.update(name for _, names in mine for name in names)
        runs.append(dict(meta, file=str(source)))
    if not files:
        raise TraceError(f"no traces found in {paths}")
    return files, runs, [f.name for f in SCHEMA if f.name not in present]


def _missing(absent: list[str], dialect: str) -> str:
    """The absent spec columns as nulls of their type, for the `readings` view."""
    types = {"float32": "FLOAT", "double": "DOUBLE", "int64": "BIGINT", "int32": "INTEGER", "string": "VARCHAR"}
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
    """(metric table, side rows, runs) of the traces, computed by DuckDB."""
    duckdb = _engine("duckdb", "duckdb")

    files, runs, absent = traces(paths, skip_invalid)
    con = duckdb.connect()
    stores = {type(where.fs): where.fs for where in map(location, files) if remote(where)}
    for fs in stores.values():  # object storage through its fsspec filesystem; DuckDB asks for the
        con.register_filesystem(type(fs)(**fs.storage_options, default_cache_type="none"))  # ranges it reads
    con.sql(f"CREATE VIEW raw AS SELECT *{_missing(absent, 'duckdb')} FROM read_parquet({files!r}, "
            f"union_by_name = true, filename = true, file_row_number = true)")
    con.sql(f"CREATE VIEW readings AS SELECT * EXCLUDE (filename, file_row_number) FROM raw QUALIFY {LAST} "
            f"filename DESC, file_row_number DESC) = 1")
    return _typed(con.sql(metrics_sql("duckdb", th)).pl()), con.sql(side_sql()).pl(), runs


def on_spark(paths, th: Thresholds, master: str = "local[2]",
             skip_invalid: bool = False) -> tuple[pl.DataFrame, pl.DataFrame, list[dict]]:
    """(metric table, side rows, runs) of the traces, computed by Spark at `master`."""
    SparkSession = _engine("pyspark.sql", "spark").SparkSession

    files, runs, absent = traces(paths, skip_invalid)
    try:
        spark = (SparkSession.builder.master(master).appName("actrace").config("spark.ui.enabled", "false")
                 .config("spark.sql.session.timeZone", "UTC")
                 # a reading's row holds per-unit lists (thousands of values): Spark's 4,096 rows a batch
                 # overran local mode's 1 GiB heap at 100 runs of 512 units
                 .config("spark.sql.parquet.columnarReaderBatchSize", "256").getOrCreate())
    except Exception as exc:  # no Java, or no cluster at `master`: Spark's own words, first line
        raise ValueError(f"--engine spark at {master}: Spark did not start ({str(exc).strip().splitlines()[0]}); it "
                         "needs a Java runtime (Debian: default-jre-headless)") from None
    try:
        frame = spark.read.option("mergeSchema", "true").parquet(*[f.replace("s3://", "s3a://", 1) for f in files])
    except Exception as exc:  # an object store without its Hadoop connector on the cluster
        if not any("://" in f for f in files):
            raise
        raise ValueError(f"--engine spark: Spark cannot read {files[0]} ({str(exc).strip().splitlines()[0][:200]}); "
                         "object storage needs its Hadoop connector on the cluster (s3a: hadoop-aws)") from None
    frame.createOrReplaceTempView("raw")
    spark.sql(f"SELECT *{_missing(absent, 'spark')}, input_file_name() AS _file, monotonically_increasing_id() AS _row "
              f"FROM raw").createOrReplaceTempView("numbered")
    spark.sql(f"SELECT * EXCEPT (_file, _row, _last) FROM (SELECT *, {LAST} _file DESC, _row DESC) AS _last "
              f"FROM numbered) WHERE _last = 1").createOrReplaceTempView("readings")
    to_polars = lambda df: pl.from_arrow(df.toArrow())  # noqa: E731
    return _typed(to_polars(spark.sql(metrics_sql("spark", th)))), to_polars(spark.sql(side_sql())), runs


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
