"""Faults around a running trace (issue 60): a killed writer, a fork, a folder that refuses writes, a
reader beside a compaction, special files where traces should be."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import actrace
from actrace.files.reader import read_source
from actrace.files.validate import validate
from conftest import HUNG

KILLED = textwrap.dedent("""
    import os, signal, sys, numpy as np, actrace
    rng = np.random.default_rng(int(sys.argv[2]))
    w = actrace.Writer(sys.argv[1], flush_every=1)
    for step in range(3):  # a ReLU reading and a tanh reading, each in a part file of its own
        w.record_activation(step, "fc", np.maximum(rng.normal(size=(32, 16)), 0).astype(np.float32), kind="relu")
        w.record_activation(step, "gate", np.tanh(rng.normal(size=(32, 8))).astype(np.float32), kind="tanh")
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_killed_run_with_readings_of_mixed_kinds_in_its_parts_is_read_by_every_command(tmp_path, cli):
    for seed, name in enumerate("ab"):
        res = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path / f"{name}.parquet"), str(seed)],
                             timeout=HUNG)
        assert res.returncode == -signal.SIGKILL
    parts = [tmp_path / f"{name}.parquet.parts" for name in "ab"]
    assert len(list(parts[0].glob("part-*.parquet"))) == 6 and not (tmp_path / "a.parquet").exists()
    assert validate(parts) == []
    for args in (["summary"], ["check"], ["report", "-o", tmp_path / "r.html"], ["diff"], ["inspect"]):
        res = cli(*args, *parts)
        assert res.returncode in (0, 1) and "Traceback" not in res.stderr, (args, res.stderr[-2000:])
        assert "per-unit columns" not in res.stdout + res.stderr, args
    res = cli("summary", parts[0])
    assert "gate" in res.stdout and "running" in res.stdout, res.stdout  # the tanh layer read, the run said unfinished
    from actrace.analyzer.analysis import analyze

    metrics = analyze(parts[0]).metrics
    gate = metrics.filter(metrics["layer"] == "gate")
    assert gate.height == 3 and gate["saturation_unit"].is_not_null().all()  # what only the tanh rows' columns give

