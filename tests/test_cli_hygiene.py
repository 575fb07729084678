"""The command line with a user's ordinary mistakes and an untrusted trace: no traceback, no raw
control characters on the terminal, folders made."""
from __future__ import annotations

import subprocess
import sys

import numpy as np

import actrace

from conftest import EXAMPLES


def test_names_from_a_trace_reach_the_terminal_escaped(tmp_path, cli):
    evil_run, evil_layer = "a\x1b[2Jb", "fc\x1b]0;owned\x07"
    with actrace.Writer(tmp_path / "e.parquet", run=evil_run) as w:
        w.record_activation(0, evil_layer, np.zeros((4, 3), np.float32), kind="relu")
    for args in (["summary", tmp_path / "e.parquet"], ["inspect", tmp_path / "e.parquet"],
                 ["check", tmp_path / "e.parquet", "--max-dead", "0.5"], ["findings", tmp_path / "e.parquet"]):
        res = cli(*args)
        assert "\x1b" not in res.stdout + res.stderr and "\x07" not in res.stdout, args
        assert "fc\\x1b]0;owned\\x07" in res.stdout, (args, res.stdout)


def test_a_closed_pipe_ends_quietly(tmp_path):
    with actrace.Writer(tmp_path / "big.parquet", run="big") as w:  # more output than a pipe holds
        for i in range(3000):
            w.record_activation(0, f"block.{i}.act", np.ones((2, 2), np.float32), kind="relu")
    res = subprocess.run(f"{sys.executable} -m actrace.cli inspect {tmp_path / 'big.parquet'} | head -1",
                         shell=True, capture_output=True, text=True)
    assert res.stdout.count("\n") == 1 and "Traceback" not in res.stderr and "Error" not in res.stderr, res.stderr


def test_machine_output_goes_into_a_new_folder(tmp_path, cli):
    res = cli("summary", EXAMPLES / "valid-mlp.parquet", "--format", "csv", "-o", tmp_path / "new" / "m.csv")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "new" / "m.csv").read_text().startswith("run,layer")


def test_record_without_the_double_dash_says_how(tmp_path, cli):
    res = cli("record", "-o", tmp_path / "x.parquet", "python", "train.py")
    assert res.returncode == 2 and "'python' is not an ONNX model" in res.stderr
    assert f"actrace record -o {tmp_path / 'x.parquet'} -- python train.py" in res.stderr
    assert "Traceback" not in res.stderr


def test_record_does_not_report_an_older_trace_as_this_runs(tmp_path, cli):
    with actrace.Writer(tmp_path / "old.parquet", run="old") as w:
        w.record_activation(0, "fc", np.ones((2, 2), np.float32), kind="relu")
    script = "import os, actrace; actrace.Writer(os.environ['ACTRACE_OUT'])"  # refuses: a trace is there
    res = cli("record", "-o", tmp_path / "old.parquet", "--", "python", "-c", script)
    assert res.returncode == 1 and "FileExistsError" in res.stderr
    assert "no trace was written" in res.stderr and "older one" in res.stderr and "1 readings" not in res.stderr


def test_a_missing_extra_is_named_with_the_pip_command(tmp_path):
    code = ("import sys; sys.modules['torch'] = None  # as where the torch extra is not installed\n"
            f"from actrace.cli import main; sys.exit(main(['demo', '-o', {str(tmp_path / 'd')!r}]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 2 and "pip install 'actrace[torch]'" in res.stderr and "Traceback" not in res.stderr


def test_the_summary_explains_its_columns_and_names_streams_and_unit_mismatches(tmp_path, cli):
    rng = np.random.default_rng(0)
    for run, units in (("a", 64), ("b", 3)):
        with actrace.Writer(tmp_path / f"{run}.parquet", run=run) as w:
            for step in range(3):
                w.record_activation(step, "fc", np.abs(rng.normal(size=(16, units))).astype(np.float32) * (
                    1 if run == "a" else 5), kind="relu")
    out = cli("summary", tmp_path / "a.parquet", tmp_path / "b.parquet", "--baseline", "a").stdout
    assert "sat.v / sat.u: saturated share of values / of units pinned for every input" in out
    assert "aligned, yet of other widths (different layers?): fc (3 vs 64 units)" in out


def test_a_monitor_that_selects_nothing_says_so_at_construction(tmp_path):
    import pytest
    import torch
    from torch import nn

    from actrace.adapters.torch import Monitor

    with pytest.warns(UserWarning, match=r"no reading matches include=\['attn\*'\].*readings are: 0, 1"):
        Monitor(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), torch.randn(3, 2), tmp_path / "m.parquet",
                include=["attn*"]).close()
