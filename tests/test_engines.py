"""The spec's metrics on three engines: the Polars analyzer, and the SQL of `actrace sql` on DuckDB
and on Spark (local mode, Debian's Java): every metric of every reading of the demo's traces, of
the golden ones (every minor version) and of edge cases (no finite value, sums that overflow, a
reading written twice) is the same number on each, NaN for NaN, null for null; `summary --engine`
says what the Polars analyzer says."""
from __future__ import annotations

import math
import warnings

import polars as pl
import pytest

from actrace.analyzer.engines import on_duckdb, on_spark
from actrace.analyzer.metrics import EXTRA_COLUMNS, METRIC_COLUMNS, Thresholds, metrics

from conftest import EXAMPLES

KEY = ["run", "stream", "layer", "step"]


@pytest.fixture(scope="module")
def spark():
    """One local Spark session for the module (the engine's `getOrCreate` finds it), stopped after."""
    from pyspark.sql import SparkSession

    session = SparkSession.builder.master("local[2]").appName("actrace-tests").config("spark.ui.enabled", "false") \
        .getOrCreate()
    yield session
    session.stop()


def disagreements(polars: pl.DataFrame, other: pl.DataFrame) -> list[tuple]:
    """Every (column, key, Polars's value, the other's) that differs: a number by more than 1e-12 of
    itself (the order in which an engine adds a layer's tensors moves the last bit), NaN against
    anything but NaN, null against anything but null, a row one has and the other lacks."""
    assert polars.columns == other.columns == METRIC_COLUMNS + EXTRA_COLUMNS
    joined = polars.join(other, on=KEY, how="full", suffix="_other", coalesce=True, nulls_equal=True)
    out = []
    for column in (c for c in polars.columns if c not in KEY):
        for row, a, b in zip(joined.select(KEY).rows(), joined[column].to_list(), joined[f"{column}_other"].to_list()):
            close = isinstance(a, float) and isinstance(b, float) and (
                math.isnan(a) and math.isnan(b) or math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0))
            if a != b and not close:
                out.append((column, row, a, b))
    return out


SETS = {"demo and golden": None, "1.0": "valid-v1_0.parquet", "1.1": "valid-v1_1.parquet", "1.2": "valid-v1_2.parquet",
        "written twice": "invalid-duplicate_reading.parquet", "edges": "edges"}


def edges(path):
    """A trace of what formulas trip on: a layer whose bias gradient holds no finite value beside a
    finite weight's, values whose squares overflow, a tanh with a NaN unit, an empty-unit softmax."""
    import numpy as np

    import actrace

    with actrace.Writer(path, run="edges") as w:
        w.record_param_grad(0, "fc", "weight", np.array([[1.0, -2.0], [3.0, 0.5]]), kind="linear")
        w.record_param_grad(0, "fc", "bias", np.array([np.nan, np.nan]), kind="linear")
        w.record_activation(0, "huge", np.array([[1e160, 2e160], [3e160, 4e160]]), kind="linear")
        w.record_activation(0, "tanh", np.array([[0.995, np.nan, -0.2] * 4, [0.999, np.nan, 0.1] * 4]), kind="tanh")
        w.record_activation(0, "attn", np.full((3, 4), 0.25), kind="softmax")
        w.record_activation(0, "relu", np.zeros((2, 9)), kind="relu")
    return path


@pytest.mark.parametrize("which", SETS)
@pytest.mark.parametrize("th", [Thresholds(), Thresholds(dead_eps=0.01, sat_threshold=0.9, dormant_tau=0.3),
                                Thresholds(sat_threshold=0.95)], ids=["default", "other-levels", "unlisted-level"])
def test_every_metric_is_the_same_on_polars_duckdb_and_spark(which, th, demo_run, spark, tmp_path):
    """Thresholds at the defaults, at other levels `sat_counts` counts, and at one it does not (the
    histogram's bins then): 0 disagreements, rows included, over tens of thousands of values."""
    paths = [demo_run[0] / "runs", *(EXAMPLES / f"valid-{n}" for n in ("mlp.parquet", "nonfinite.parquet",
                                                                          "crashed.parquet.parts"))] \
        if SETS[which] is None else [edges(tmp_path / "edges.parquet")] if which == "edges" \
        else [EXAMPLES / SETS[which]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the trace written twice is said to repeat readings
        expected = metrics(paths, th)
    assert expected.height > (1000 if SETS[which] is None else 3)
    if which == "edges":  # the cases are there: a NaN bias beside a finite weight, squares past the largest float
        rows = {(r["stream"], r["layer"]): r for r in expected.to_dicts()}
        assert rows[("param_grad", "fc")]["max"] == 3.0 and math.isnan(rows[("param_grad", "fc")]["norm"])
        assert math.isnan(rows[("activation", "huge")]["std"]) and rows[("activation", "relu")]["dead_fraction"] == 1.0
    for engine in (on_duckdb, on_spark):
        got = engine(paths, th)[0]
        assert disagreements(expected, got) == [], engine.__name__


def test_summary_on_each_engine_says_what_polars_says(demo_run, spark, cli):
    runs = demo_run[0] / "runs"
    said = {engine: cli("summary", runs, "--engine", engine) for engine in ("polars", "duckdb", "spark")}
    assert all(r.returncode == 0 for r in said.values()), {e: r.stderr[-2000:] for e, r in said.items()}
    assert said["duckdb"].stdout == said["polars"].stdout == said["spark"].stdout
    assert "dead_growing" in said["polars"].stdout
    csv = {engine: cli("summary", runs, "--engine", engine, "--format", "csv").stdout for engine in ("polars", "duckdb")}
    assert csv["duckdb"] == csv["polars"] and csv["polars"].count("\n") > 1000


def test_spark_settings_reach_spark_and_its_tables_come_back_through_a_scratch_folder(demo_run, cli, tmp_path):
    """`--spark-conf` reaches a fresh Spark (a driver too small to start is refused in Spark's words,
    no Java trace); the metric table is written by Spark's tasks to `--spark-scratch` and read here
    (the same CSV as Polars), the folder emptied after; settings that cannot work stop before Spark."""
    runs = demo_run[0] / "runs"
    small = cli("summary", runs, "--engine", "spark", "--spark-conf", "spark.driver.memory=200m")
    assert small.returncode == 2 and "Insufficient driver memory" in small.stderr \
        and "Traceback" not in small.stderr, small.stderr[-2000:]
    scratch = tmp_path / "scratch"
    csv = {engine: cli("summary", runs, "--engine", engine, "--format", "csv", "--spark-scratch", scratch)
           for engine in ("polars", "spark")}
    assert csv["spark"].returncode == 0, csv["spark"].stderr[-2000:]
    assert csv["spark"].stdout == csv["polars"].stdout and csv["spark"].stdout.count("\n") > 1000
    assert scratch.is_dir() and not any(scratch.iterdir())
    bad = cli("summary", runs, "--engine", "spark", "--spark-conf", "spark.driver.memory")
    assert bad.returncode == 2 and "--spark-conf 'spark.driver.memory': expected KEY=VALUE" in bad.stderr
    cluster = cli("summary", runs, "--engine", "spark", "--spark-master", "spark://nowhere:7077")
    assert cluster.returncode == 2 and "needs --spark-scratch URL" in cluster.stderr


def test_the_printed_query_runs_where_its_help_says(demo_run, cli):
    """`actrace sql` printed, and run by DuckDB over a view of the traces as the help says."""
    import duckdb

    runs = demo_run[0] / "runs"
    printed = cli("sql", "--dialect", "duckdb", "--dead-eps", "0.01")
    assert printed.returncode == 0 and printed.stdout.startswith("SELECT")
    con = duckdb.connect()
    con.sql(f"CREATE VIEW readings AS SELECT * FROM read_parquet('{runs}/*.parquet', union_by_name = true)")
    got = con.sql(printed.stdout).pl().cast({"layer_index": pl.Int32, "units": pl.Int32, "nan_count": pl.Int64,
                                             "inf_count": pl.Int64, "values": pl.Int64})
    assert disagreements(metrics(runs, Thresholds(dead_eps=0.01)), got) == []
    spark_sql = cli("sql", "--dialect", "spark")
    assert spark_sql.returncode == 0 and "zip_with(" in spark_sql.stdout and "lambda" not in spark_sql.stdout


def test_spark_reads_a_lake_as_one_table(tmp_path, spark):
    """A lake's Hive partitions, read by Spark's partition discovery: `project` and `run` from the
    path, the same as the traces' own runs."""
    import numpy as np

    import actrace

    for project, run in (("vision", "a"), ("vision", "b"), ("text", "c")):
        with actrace.Writer(actrace.lake_path(tmp_path / "lake", run, project), run=run) as w:
            w.record_activation(step=0, layer="fc", x=np.ones((2, 3)), kind="relu")
    frame = spark.read.parquet(str(tmp_path / "lake")).selectExpr("project", "run AS path_run").collect()
    assert sorted((r.project, r.path_run) for r in frame) == [("text", "c"), ("vision", "a"), ("vision", "b")]
