"""Traces in object storage: every writer and reading command takes `s3://` locations and globs as
it takes local paths, with the same crash safety (parts are separate objects; compaction writes
the trace whole and removes the parts only after). Each test runs against a local S3 server (moto,
from the `s3_server` fixture) and against the local filesystem."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import polars as pl
import pytest

import actrace
from actrace.analyzer.metrics import metrics
from actrace.files.location import location
from actrace.files.validate import validate

from conftest import HUNG, start_s3


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    """A folder for traces: a local one, or a fresh prefix in a bucket of the local S3 server."""
    if request.param == "local":
        return str(tmp_path / "runs")
    request.getfixturevalue("s3_server")
    import s3fs

    fs = s3fs.S3FileSystem()
    if not fs.exists("lab"):
        fs.mkdir("lab")
    return f"s3://lab/{uuid.uuid4().hex[:8]}"


KILLED = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from actrace.files.writer import Writer

    w = Writer(sys.argv[1], run="k", flush_every=1)
    x = np.zeros((8, 4))
    x[:, 2:] = 1.0  # units 0 and 1 dead for every input
    for step in range(3):
        w.record_activation(step=step, layer="fc", x=x, kind="relu")  # flushed at once: one part each
    os.kill(os.getpid(), signal.SIGKILL)  # no close, no compaction
""")


def test_a_run_killed_mid_way_leaves_every_flushed_part_readable(root, tmp_path):
    (tmp_path / "killed.py").write_text(KILLED)
    done = subprocess.run([sys.executable, tmp_path / "killed.py", f"{root}/k.parquet"], timeout=HUNG)
    assert done.returncode == -9
    parts = location(f"{root}/k.parquet.parts")
    assert not location(f"{root}/k.parquet").exists() and len(list(parts.glob("part-*.parquet"))) == 3
    table = actrace.read_table(f"{root}/*")  # the parts found by a glob, as a trace
    assert sorted(table["step"].to_pylist()) == [0, 1, 2]
    dead = metrics(f"{root}/*")["dead_fraction"].to_list()
    assert dead == [0.5, 0.5, 0.5]


MONITORED = textwrap.dedent("""
    import sys
    import torch
    from torch import nn
    from actrace.adapters.torch import Monitor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with torch.no_grad():
        model[0].bias[:4] = -100.0  # 4 of 16 units dead for every input
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Monitor(model, torch.randn(32, 8), out=sys.argv[1] if len(sys.argv) > 1 else None, probe_every=2) as mon:
        for step in range(4):
            model(torch.randn(16, 8)).square().mean().backward()
            mon.step(step)
            opt.step(); opt.zero_grad()
""")


def test_a_monitor_writes_one_compacted_trace_that_every_command_reads(root, tmp_path, cli):
    """A PyTorch Monitor with `out=` in the store, and `actrace record -o` there: each leaves one
    compacted trace (its parts removed), valid, whose dead units read as built; `summary`,
    `validate`, `inspect` and `report` take the store's glob; no credential is printed."""
    (tmp_path / "train.py").write_text(MONITORED)
    subprocess.run([sys.executable, tmp_path / "train.py", f"{root}/a.parquet"], check=True, timeout=HUNG)
    recorded = cli("record", "-o", f"{root}/b.parquet", "--", "python", tmp_path / "train.py")
    assert recorded.returncode == 0, recorded.stderr
    assert f"actrace record: trace {root}/b.parquet:" in recorded.stderr
    for name in ("a", "b"):
        assert location(f"{root}/{name}.parquet").exists() and not location(f"{root}/{name}.parquet.parts").exists()
        assert validate(f"{root}/{name}.parquet") == []
    rows = metrics(f"{root}/*.parquet").filter((pl.col("layer") == "1") & (pl.col("stream") == "activation"))
    assert rows["dead_fraction"].to_list() == [4 / 16] * 6 and rows["run"].unique().sort().to_list() == ["a", "b"]
    outputs = [recorded]
    for command in (["summary"], ["validate"], ["inspect"], ["report", "-o", tmp_path / "r.html"]):
        outputs.append(cli(*command, f"{root}/*.parquet"))
        assert outputs[-1].returncode == 0, (command, outputs[-1].stderr)
    assert len(re.findall(r"\n +1 +relu +16 +3 +25%", outputs[1].stdout)) == 2  # runs a and b, 4 of 16 dead
    assert f"{root}/a.parquet: valid" in outputs[2].stdout
    assert (tmp_path / "r.html").stat().st_size > 10_000
    assert not any("actrace-test-secret" in o.stdout + o.stderr for o in outputs)


def test_a_trace_in_the_store_is_not_replaced_unless_asked(root):
    from actrace.files.writer import Writer

    for overwrite in (False, True):
        with Writer(f"{root}/w.parquet", overwrite=overwrite) as w:
            w.record_activation(step=0, layer="fc", x=np.ones((2, 3)) * (1 + overwrite), kind="relu")
        with pytest.raises(FileExistsError, match="a trace is already there"):
            Writer(f"{root}/w.parquet")
    assert actrace.read_table(f"{root}/w.parquet")["max"].to_pylist() == [2.0]


def test_a_missing_bucket_or_an_unknown_protocol_is_said_at_the_start(s3_server):
    from actrace.files.writer import Writer

    with pytest.raises(FileNotFoundError, match="s3://no-such-bucket/a.parquet: no bucket 'no-such-bucket'"):
        Writer("s3://no-such-bucket/a.parquet")
    with pytest.raises(ValueError, match="nosuch://x/a.parquet"):
        Writer("nosuch://x/a.parquet")


RUN = textwrap.dedent("""
    import os
    import numpy as np
    from actrace.files.writer import Writer, script_options

    dead = int(os.environ["DEAD"])
    x = np.ones((8, 4))
    x[:, :dead] = 0.0  # the first DEAD of 4 units dead for every input
    with Writer(**script_options(None, None, None, None)) as w:  # where `actrace record` says
        for step in range(2):
            w.record_activation(step=step, layer="fc", x=x, kind="relu")
""")


def _duckdb(root):
    """DuckDB, reading object storage through the fsspec filesystem of the store (no extension to fetch)."""
    import duckdb

    con = duckdb.connect()
    if root.startswith("s3://"):
        import s3fs

        con.register_filesystem(s3fs.S3FileSystem())
    return con


def test_a_lake_of_runs_reads_as_one_table_in_every_engine_and_by_partition(root, tmp_path, cli):
    """`actrace record --lake` writes LAKE/project=P/run=R/trace.parquet (names percent-encoded):
    DuckDB and Polars read the lake as one table whose partition columns are the runs' own, and
    `actrace summary` reads the whole lake, or one project's partition alone."""
    (tmp_path / "run.py").write_text(RUN)
    runs = {("vision", "lr/1"): 1, ("vision", "lr 2"): 2, ("text", "lr1"): 3}  # (project, run): dead units
    for (project, run), dead in runs.items():
        done = subprocess.run([sys.executable, "-m", "actrace.cli", "record", "--lake", f"{root}/lake", "--project",
                               project, "--run", run, "--", "python", tmp_path / "run.py"], timeout=HUNG,
                              capture_output=True, text=True, env=dict(os.environ, DEAD=str(dead)))
        assert done.returncode == 0, done.stderr
    assert location(f"{root}/lake/project=vision/run=lr%2F1/trace.parquet").exists()
    table = f"read_parquet('{root}/lake/**/*.parquet', hive_partitioning = true)"
    got = _duckdb(root).sql(f"select project, run, any_value(run) as own, sum(zero_count) / 8 / 2 as dead "
                            f"from {table} group by project, run order by run").fetchall()
    assert got == sorted([(p, r, r, d) for (p, r), d in runs.items()], key=lambda row: row[1])
    frame = pl.scan_parquet(f"{root}/lake/**/*.parquet", hive_partitioning=True).select("project", "run").unique()
    assert sorted(frame.collect().rows()) == sorted(runs)
    whole, vision = (metrics(f"{root}/lake{where}").group_by("run").agg(pl.col("dead_fraction").max())
                     for where in ("", "/project=vision"))
    assert dict(whole.rows()) == {r: d / 4 for (_, r), d in runs.items()}
    assert dict(vision.rows()) == {r: d / 4 for (p, r), d in runs.items() if p == "vision"}
    shown = cli("summary", f"{root}/lake/project=vision")
    assert shown.returncode == 0 and "run lr/1" in shown.stdout and "run lr1" not in shown.stdout, shown.stderr


LOST = textwrap.dedent("""
    import os, signal, sys, warnings
    import numpy as np
    import s3fs
    from actrace.files.writer import Writer

    s3fs.S3FileSystem().mkdir("gone")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        w = Writer("s3://gone/a.parquet", flush_every=1)
        w.record_activation(step=0, layer="fc", x=np.ones((2, 3)), kind="relu")  # a part written
        os.kill(int(sys.argv[1]), signal.SIGKILL)  # the server goes
        for step in (1, 2):
            w.record_activation(step=step, layer="fc", x=np.ones((2, 3)), kind="relu")  # the store is gone
        w.close()
    print("TRAINING WENT ON", [str(m.message)[:60] for m in said if "actrace" in str(m.message)])
""")


def test_a_store_that_goes_away_mid_run_does_not_take_training_down(tmp_path):
    """The S3 server dies after the first part: the next flushes fail with the client's connection
    error (no OSError), said once and kept in memory; the close says it cannot compact; the
    training loop goes on and ends cleanly."""
    (tmp_path / "lost.py").write_text(LOST)
    server, env = start_s3()  # a server of its own, which the run kills
    try:
        done = subprocess.run([sys.executable, tmp_path / "lost.py", str(server.pid)], timeout=HUNG,
                              capture_output=True, text=True, env=dict(os.environ, **env))
    finally:
        server.kill()
        server.wait(timeout=HUNG)
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout.split("TRAINING WENT ON", 1)[1]
    assert said.count("cannot write a part file") == 1 and said.count("cannot compact the trace") == 1, said


def test_a_lake_trace_is_named_by_its_run_folder_and_outputs_stay_local(tmp_path, cli):
    """A script writing to `lake_path(lake, "lr/1")` without run= records run "lr/1" (not "trace");
    an analyzer's -o to a URL is refused before any work, naming it."""
    from actrace.files.writer import Writer

    with Writer(actrace.lake_path(tmp_path / "lake", "lr/1", "p")) as w:
        w.record_activation(step=0, layer="fc", x=np.ones((2, 3)), kind="relu")
    assert actrace.read_table(tmp_path / "lake")["run"].to_pylist() == ["lr/1"]
    refused = cli("summary", tmp_path / "lake", "--format", "json", "-o", "s3://lab/out.json")
    assert refused.returncode == 2 and "s3://lab/out.json: a command's json output is written to a local file" \
        in refused.stderr, refused.stderr


def test_spark_without_a_connector_for_the_store_says_so(s3_server, cli, tmp_path):
    """Spark reads object storage through a Hadoop connector (s3a: hadoop-aws) the cluster must
    have; without one, `--engine spark` says that, naming the file, instead of a Java trace."""
    from actrace.files.writer import Writer

    import s3fs

    if not s3fs.S3FileSystem().exists("lab"):
        s3fs.S3FileSystem().mkdir("lab")
    with Writer("s3://lab/spark/a.parquet", overwrite=True) as w:
        w.record_activation(step=0, layer="fc", x=np.ones((2, 3)), kind="relu")
    said = cli("summary", "s3://lab/spark/*.parquet", "--engine", "spark")
    assert said.returncode == 2 and "Spark cannot read s3://lab/spark/a.parquet" in said.stderr \
        and "hadoop-aws" in said.stderr, said.stderr[-2000:]
