"""`actrace summary` and `actrace check` as a user runs them."""
from __future__ import annotations

import csv
import io
import json

import pytest

from actrace.analyzer.metrics import METRIC_COLUMNS
from traces import write_run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    write_run(d / "healthy.parquet", "healthy")
    write_run(d / "dying.parquet", "dying", dead=lambda s: s // 25)
    write_run(d / "nan.parquet", "nan", nan_at=300)
    return d


def test_summary_prints_findings_and_a_per_layer_table(cli, runs, tmp_path):
    res = cli("summary", runs / "healthy.parquet", runs / "dying.parquet")
    assert res.returncode == 0, res.stderr
    assert "CRITICAL dead_growing" in res.stdout and "dying / block2.relu" in res.stdout
    assert "run healthy" in res.stdout and "block5.relu" in res.stdout
    assert "no baseline chosen, so no run is compared with another" in res.stdout  # never the first file's run
    res = cli("summary", runs / "dying.parquet", runs / "healthy.parquet", "--baseline", "healthy")
    assert "against the baseline healthy (chosen by --baseline) (actrace diff: differences outside its band " \
           "only)" in res.stdout
    (tmp_path / "actrace.toml").write_text('baseline = "healthy"\n')  # a project's own choice
    res = cli("summary", runs / "dying.parquet", runs / "healthy.parquet", cwd=tmp_path)
    assert f"against the baseline healthy (chosen by {tmp_path / 'actrace.toml'})" in res.stdout, res.stdout


def test_the_summary_shows_dormancy_of_activation_functions_only(cli, tmp_path):
    """By construction, a linear layer and a ReLU each with 3 of 8 units at 1/100 of the others: the
    ReLU's 38 % are dormant units (ReDo's neurons), the linear layer's say nothing and show "-"."""
    import numpy as np

    import actrace

    h = np.abs(np.random.default_rng(0).normal(size=(64, 8))) * np.array([0.01] * 3 + [1.0] * 5)
    with actrace.Writer(tmp_path / "t.parquet", run="t") as w:
        w.record_activation(0, "fc", h.astype(np.float32), kind="linear")
        w.record_activation(0, "relu", h.astype(np.float32), kind="relu")
    rows = {line.split()[0]: line.split() for line in cli("summary", tmp_path / "t.parquet").stdout.splitlines()
            if line.strip().startswith(("fc ", "relu "))}
    assert (rows["fc"][5], rows["relu"][5]) == ("-", "38%"), rows


def test_summary_csv_and_json_have_the_documented_columns(cli, runs):
    res = cli("summary", runs, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(res.stdout)))
    assert list(rows[0]) == METRIC_COLUMNS and {r["run"] for r in rows} == {"healthy", "dying", "nan"}
    res = cli("summary", runs / "dying.parquet", "--format", "json", "--dead-eps", "0.5")
    records = json.loads(res.stdout)
    assert list(records[0]) == METRIC_COLUMNS
    last = [r for r in records if r["layer"] == "block2.relu" and r["stream"] == "activation"][-1]
    assert last["dead_fraction"] == 20 / 32


def test_check_exits_one_on_violations_and_zero_when_clean(cli, runs):
    bad = cli("check", runs / "dying.parquet", "--max-dead", "0.2")
    assert bad.returncode == 1 and "  dying: failed (dead_growing)" in bad.stdout
    assert "dying / block2.relu: critical finding dead_growing since step 0: dead fraction rose from 0% at step 0 to " \
           "62% at step 500" in bad.stdout
    ok = cli("check", runs / "healthy.parquet", "--max-dead", "0.2", "--no-nan")
    assert ok.returncode == 0 and "check: passed" in ok.stdout
    nan = cli("check", runs / "nan.parquet", "--no-nan")
    assert nan.returncode == 1 and "first NaN/Inf at step 300 in block3.relu" in nan.stdout


def test_check_without_rules_fails_on_critical_findings(cli, runs):
    assert cli("check", runs / "dying.parquet").returncode == 1
    assert cli("check", runs / "healthy.parquet").returncode == 0


@pytest.mark.parametrize("args,message", [
    (["summary", "nowhere/*.parquet"], "no trace matches"),
    (["summary", "--sat-threshold", "1.5", "X"], "--sat-threshold must lie in (0, 1)"),
    (["summary", "--baseline", "zzz", "R"], "baseline 'zzz' is neither a run (dying, healthy, nan) nor a config "
                                           "KEY=VALUE"),
    # NaN compares false with every limit: a NaN threshold would switch its gate off, a NaN ε every death
    (["check", "--max-dead", "nan", "X"], "argument --max-dead: 'nan': expected a finite number in [0, 1]"),
    (["check", "--max-grad-norm", "NaN", "X"], "argument --max-grad-norm: 'NaN': expected a finite number at least 0"),
    (["summary", "--dead-eps", "nan", "X"], "argument --dead-eps: 'nan': expected a finite number at least 0"),
    (["sql", "--dead-eps", "-1"], "argument --dead-eps: '-1': expected a finite number at least 0"),
    (["summary", "--sat-threshold", "nan", "X"], "argument --sat-threshold: 'nan': expected a finite number"),
    (["diff", "--persist", "0", "X"], "argument --persist: '0': expected a whole number of 1 or more"),
    (["diff", "--sigmas", "-1", "X"], "argument --sigmas: '-1': expected a finite number above 0"),
    (["diff", "R", "--"], "nothing after --: give the runs to compare there"),
    (["validate", "EMPTY"], "no trace in "),  # a folder that holds no trace names nothing, as a missing path
    (["inspect", "EMPTY"], "no trace in "),
])
def test_bad_arguments_get_a_clear_message(cli, runs, args, message, tmp_path):
    args = [str(runs) if a in ("X", "R") else str(tmp_path) if a == "EMPTY" else a for a in args]
    res = cli(*args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr


def test_a_mapping_file_aligns_layers_of_differently_named_runs(cli, tmp_path):
    write_run(tmp_path / "a.parquet", "a", depth=3)
    write_run(tmp_path / "b.parquet", "b", depth=3, dead=lambda s: 16, layer_names=["x0", "x1", "x2", "out"])
    (tmp_path / "map.csv").write_text("run,layer,aligned\nb,x0,block0.relu\nb,x1,block1.relu\n"
                                      "b,x2,block2.relu\nb,out,head.tanh\n")
    res = cli("summary", tmp_path / "a.parquet", tmp_path / "b.parquet", "--mapping", tmp_path / "map.csv",
              "--baseline", "a")
    assert res.returncode == 0, res.stderr
    # b's third layer, x2, is a's block2.relu: half its units dead from the start, the one difference
    assert "from the first readings apart" in res.stdout and ": dead fraction in x2" in res.stdout
    assert "not compared" not in res.stdout
    bad = cli("summary", tmp_path / "a.parquet", tmp_path / "b.parquet", "--mapping", tmp_path / "nope.csv")
    assert bad.returncode == 2 and "nope.csv" in bad.stderr and "not a layer mapping" in bad.stderr
