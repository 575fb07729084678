"""Faults around a running trace (issue 60): a killed writer, a fork, a folder that refuses writes, a
reader beside a compaction, special files where traces should be."""
from __future__ import annotations

import os
import shutil
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


FORKS = textwrap.dedent("""
    import multiprocessing, os, sys, numpy as np, actrace
    trace, parts, lock = sys.argv[1], sys.argv[1] + ".parts", sys.argv[1] + ".lock"

    def fails():
        raise RuntimeError("the child fails")

    def writes_its_own():
        with actrace.Writer(sys.argv[2], run="child") as own:
            own.record_activation(0, "fc", np.ones((4, 2), np.float32), kind="relu")

    def forked(child):
        pid = os.fork()
        if pid == 0:
            child()
            sys.exit(0)  # the interpreter's own exit: atexit, the collector
        assert os.waitpid(pid, 0)[1] != 0 or child is not fails  # a child that raised exited 1
        assert os.path.isdir(parts) and os.path.exists(lock), child  # the parent's trace left to the parent

    def records():
        w.record_activation(10_000, "fc", np.ones((4, 2), np.float32), kind="relu")

    with actrace.Writer(trace, run="parent", flush_every=3) as w:
        for step in range(12):
            w.record_activation(step, "fc", np.full((4, 2), step, np.float32), kind="relu")
            if step == 2:
                forked(lambda: None)  # exits normally
            if step == 4:
                forked(records)  # records into the parent's writer, then exits
            if step == 6:
                forked(fails)  # raises through `with w`: its __exit__ closes the writer (the child's copy)
            if step == 8:
                context = multiprocessing.get_context("fork")
                for target in (fails, writes_its_own):
                    p = context.Process(target=target)
                    p.start()
                    p.join()
                    assert os.path.isdir(parts) and os.path.exists(lock), target
    print("parent closed", flush=True)
""")


def test_a_forked_child_never_writes_closes_or_unlocks_its_parents_trace(tmp_path):
    trace, own = tmp_path / "t.parquet", tmp_path / "own.parquet"
    res = subprocess.run([sys.executable, "-c", FORKS, str(trace), str(own)], capture_output=True, text=True,
                         timeout=HUNG)
    assert res.returncode == 0 and "parent closed" in res.stdout, res.stderr[-3000:]
    assert res.stderr.count("RuntimeError: the child fails") == 2  # both children did fail
    assert res.stderr.count("is a fork of process") == 1  # the child that recorded was told, once
    table, meta = read_source(trace)
    assert sorted(table["step"].to_pylist()) == list(range(12))  # every reading of the parent, none of a child
    assert meta["status"] == "complete" and meta["run_name"] == "parent"
    assert not (tmp_path / "t.parquet.parts").exists() and not (tmp_path / "t.parquet.lock").exists()
    assert validate(trace) == []
    table = actrace.read_table(own)  # the child's own writer is its own
    assert table["run"].to_pylist() == ["child"]


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs of this test's own, which `refuse(disk)` remounts read-only: a folder that refuses
    root's writes too (permission bits do not), unmounted after."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()}): a folder refusing root's "
                    "writes needs one")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def refuse(disk) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)


def test_a_folder_that_refuses_writes_mid_run_never_makes_close_raise(small_disk):
    import warnings

    import torch
    from torch import nn

    from actrace.adapters.torch import Monitor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    trace = small_disk / "t.parquet"
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        monitor = Monitor(model, torch.randn(32, 8), trace, probe_every=2, flush_every=1)
        for step in range(10):
            if step == 6:
                refuse(small_disk)
            model(torch.randn(4, 8)).pow(2).mean().backward()
            monitor.step(step)
        assert monitor.close() == small_disk / "t.parquet.parts"  # no exception: the trace stays as its parts
    lines = [str(w.message) for w in said if str(trace) in str(w.message)]
    assert len(lines) == 2 and all("\n" not in line for line in lines), lines
    assert "cannot write a part file" in lines[0] and "Read-only file system" in lines[0]  # said once, mid-run
    assert "stays as its part files" in lines[1] and "readings could not be written at all" in lines[1]
    lost = int(lines[1].split("; ")[-1].split()[0])
    table, meta = read_source(small_disk / "t.parquet.parts")
    assert set(table["step"].to_pylist()) == set(range(6)) and lost > 0  # what reached the disk, and what is said lost
    assert meta["status"] == "running"


def test_a_folder_that_refuses_writes_at_the_start_is_one_line_naming_the_trace(small_disk, cli, tmp_path):
    from test_onnx_adapter import helper_model

    refuse(small_disk)
    with pytest.raises(OSError) as refused:
        actrace.Writer(small_disk / "t.parquet")
    assert str(refused.value).startswith(f"{small_disk / 't.parquet'}: cannot start the trace there")
    helper_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "probe.npz", x=np.ones((4, 8), np.float32))
    res = cli("record", tmp_path / "m.onnx", "--probe", tmp_path / "probe.npz", "-o", small_disk / "t.parquet")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == [f"actrace record: error: {small_disk / 't.parquet'}: cannot start the "
                                               f"trace there (Read-only file system: {small_disk / 't.parquet.lock'})"]


COMPACTIONS = textwrap.dedent("""
    import os, sys, time, numpy as np, actrace
    runs, until = sys.argv[1], time.monotonic() + float(sys.argv[2])
    rounds = 0
    while time.monotonic() < until:
        os.mkdir(f"{runs}/{rounds:04d}")
        with actrace.Writer(f"{runs}/{rounds:04d}/t.parquet", flush_every=1) as w:
            for step in range(30):  # thirty part files, compacted at the end of the block
                w.record_activation(step, "fc", np.full((4, 8), step, np.float32), kind="relu")
        rounds += 1
    print(rounds)
""")


def test_a_reader_meeting_a_compaction_reads_the_parts_or_the_trace_never_calls_it_corrupt(tmp_path):
    from actrace.analyzer.analysis import analyze
    from actrace.files.describe import describe

    runs = tmp_path / "runs"
    runs.mkdir()
    writer = subprocess.Popen([sys.executable, "-c", COMPACTIONS, str(runs), "4"], stdout=subprocess.PIPE, text=True)
    reads = settled = 0
    try:
        while writer.poll() is None:
            folders = sorted(runs.iterdir())
            if not folders:
                continue
            assert validate(folders[-1]) == []  # `actrace validate DIR` of the trace being written
            trace = folders[-1] / "t.parquet"
            flushed = any(trace.with_name("t.parquet.parts").glob("part-*.parquet")) or trace.exists()
            if flushed and reads % 4 == 0:  # `actrace summary DIR`, on either engine (a fourth of the time: slower)
                analysis = analyze(folders[-1], engine=("polars", "duckdb")[reads % 8 // 4])
                assert len(analysis.runs) == 1 and analysis.findings is not None  # the trace read once
            parts = folders[-1] / "t.parquet.parts"
            if any(parts.glob("part-*.parquet")):  # flushed into (its writer removes none of them)
                d = describe(parts)  # `actrace inspect X.parts`
                complete = d["metadata"]["status"] == "complete"
                assert d["readings"] == 30 if complete else d["metadata"]["status"] == "running", d
                settled += d["path"] == str(parts).removesuffix(".parts")
            reads += 1
    finally:
        writer.kill()
        rounds = int(writer.communicate(timeout=HUNG)[0] or 0)
    assert writer.returncode == 0 and rounds >= 1 and reads >= 1, (rounds, reads)
    print(f"{rounds} compactions, {reads} reads, {settled} of the parts read from the finished trace")
    assert validate(runs) == [] and len(list(runs.glob("*/t.parquet"))) == rounds


READERS = textwrap.dedent("""
    import json, sys, warnings
    sys.path.insert(0, sys.argv[1])
    from hostile import run
    warnings.simplefilter("ignore")
    for command in json.loads(sys.argv[2]):
        print(json.dumps([command[0], *run(command)]), flush=True)
""")


def test_a_fifo_named_as_a_trace_or_a_part_is_refused_unopened_by_every_reader_command(tmp_path):
    import json

    from traces import write_run

    write_run(tmp_path / "ok.parquet", "ok")
    os.mkfifo(tmp_path / "pipe.parquet")
    parts = tmp_path / "killed.parquet.parts"
    w = actrace.Writer(tmp_path / "w.parquet", flush_every=1)
    w.record_activation(0, "fc", np.ones((4, 2), np.float32), kind="relu")
    shutil.copytree(w.parts, parts)  # a writer's parts, as a killed writer leaves them
    w.discard()
    os.mkfifo(parts / "part-000002.parquet")
    commands = [[*command, str(tmp_path / "ok.parquet"), str(fifo)] for fifo in (tmp_path / "pipe.parquet", parts)
                for command in (["validate"], ["inspect"], ["summary"], ["summary", "--engine", "duckdb"], ["findings"],
                                ["check"], ["diff"], ["sweep", "--by", "lr"], ["report", "-o", tmp_path / "r.html"])]
    res = subprocess.run([sys.executable, "-c", READERS, os.path.dirname(__file__), json.dumps(commands, default=str)],
                         capture_output=True, text=True, timeout=600)  # a hang: every command blocked on the pipe
    answers = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(answers) == len(commands), res.stderr[-2000:]
    for (command, code, out, err), args in zip(answers, commands):
        assert code in (1, 2), (args, code, out, err)
        assert "not a regular file (a pipe, a device or a socket): not read" in out + err, (args, out, err)


WRITERS = textwrap.dedent("""
    import os, sys, time, warnings, numpy as np, actrace
    warnings.filterwarnings("error", "actrace")  # a part unwritten or a compaction broken under it: the run fails
    path, until = sys.argv[1], time.monotonic() + float(sys.argv[2])
    held = overlaps = 0
    while time.monotonic() < until:
        try:
            w = actrace.Writer(path, overwrite=True, run=f"p{os.getpid()}", flush_every=1)
        except FileExistsError:  # another writer holds it: refused at once
            continue
        try:  # while this writer holds the trace, no other may: the holder's mark is made only once
            os.close(os.open(path + ".holder", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            mine = True
        except FileExistsError:
            overlaps, mine = overlaps + 1, False
        for step in range(2):
            w.record_activation(step, "fc", np.ones((4, 2), np.float32), kind="relu")
        if mine:
            os.unlink(path + ".holder")
        assert str(w.close()) == path  # compacted, its parts removed
        held += 1
    print(held, overlaps)
""")


def test_concurrent_writers_of_one_trace_with_overwrite_never_hold_it_together(tmp_path):
    path = tmp_path / "t.parquet"
    writers = [subprocess.Popen([sys.executable, "-c", WRITERS, str(path), "2"], stdout=subprocess.PIPE, text=True)
               for _ in range(3)]
    answers = [w.communicate(timeout=HUNG)[0].split() for w in writers]
    assert all(w.returncode == 0 for w in writers), answers
    held, overlaps = (sum(int(a[i]) for a in answers) for i in (0, 1))
    print(f"{held} holds, {overlaps} overlapping")
    assert held >= 1 and overlaps == 0
    assert validate(path) == [] and not list(tmp_path.glob("t.parquet.*"))  # one whole trace; no parts, no lock


def test_a_full_disk_keeps_readings_up_to_the_cap_writes_them_when_space_returns_and_counts_the_rest(small_disk):
    import warnings

    from actrace.files.table import ROW_BYTES

    def held(rows) -> int:  # the memory of the rows buffered: each array their lists are views of, once
        arrays = [a for r in rows for a in r if isinstance(a, np.ndarray)]
        owners = {id(o): o.nbytes for o in (a.base if isinstance(a.base, np.ndarray) else a for a in arrays)}
        return len(rows) * ROW_BYTES + sum(owners.values())

    rng = np.random.default_rng(0)
    x = lambda: rng.normal(size=(16, 64)).astype(np.float32)  # noqa: E731 - one reading's tensor
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        w = actrace.Writer(small_disk / "t.parquet", flush_every=1, flush_seconds=0.0, buffer_bytes=100_000)
        filler, most = small_disk / "filler", 0
        for step in range(120):
            if step == 20:  # the disk fills up
                with open(filler, "wb") as f, pytest.raises(OSError, match="No space left"):
                    f.write(b"x" * (8 << 20))
            if step == 90:  # and space comes back
                filler.unlink()
            w.record_activation(step, "gate", x(), kind="tanh")
            most = max(most, held(w._rows))
        w.close()
    table, meta = read_source(small_disk / "t.parquet")
    kept = set(table["step"].to_pylist())
    assert most <= 100_000 and 0 < w.lost < 70  # memory held to the cap: some readings kept, the rest dropped
    assert set(range(20)) | set(range(91, 120)) <= kept and len(kept) + w.lost == 120  # each kept one written
    assert meta["status"] == f"incomplete: {w.lost} readings lost" and validate(small_disk / "t.parquet") == []
    lines = [str(m.message) for m in said if str(small_disk / "t.parquet") in str(m.message)]
    assert sum("newer readings are dropped" in line for line in lines) == 1  # said once when it starts
    assert sum(f"{w.lost} readings were lost" in line for line in lines) == 1  # and at close
    from actrace.analyzer import analyze  # the analyzer says the loss, and no gate passes it silently

    (lost,) = [f for f in analyze(small_disk / "t.parquet").findings if f.rule == "readings_lost"]
    assert (lost.severity, lost.value) == ("critical", w.lost) and "stream_missing" not in {
        f.rule for f in analyze(small_disk / "t.parquet").findings}
