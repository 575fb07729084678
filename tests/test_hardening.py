"""A tool you can hand hostile files and careless users: the hostile corpus (tests/hostile.py) raises
no traceback and is refused clearly; outputs never destroy inputs; one writer per trace; a refusing
disk takes no training down; names cannot fake terminal lines; the same input gives the same bytes."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import actrace
from actrace.format import metadata
from actrace.format.schema import MAX_NAME
from actrace.files.validate import validate
from conftest import EXAMPLES, HUNG
from hostile import COMMANDS, mutations, run, template

# what must never reach a terminal raw: the characters names may not hold, but our own line breaks and tabs
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u061c\u202a-\u202e\u2066-\u2069]")
ALWAYS_INVALID = ("missing column", "wrong type", "null in a required column", "impossible values", "metadata",
                  "invalid UTF-8 column name", "declared sizes", "truncated")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    return mutations(template(d / "valid.parquet"), d / "mutations")


def test_every_command_answers_every_hostile_trace_without_a_traceback(corpus):
    raised, raw = [], []
    for cls, items in corpus.items():
        for name, path in items:
            for command in COMMANDS:
                code, out, err = run([*command, str(path)])
                if isinstance(code, str):
                    raised.append(f"{cls}: {name}: {' '.join(command)}: {code}")
                if RAW.search(out + err):
                    raw.append(f"{cls}: {name}: {' '.join(command)}")
    assert raised == [] and raw == []


def test_validate_refuses_every_mutation_that_breaks_a_rule_and_the_analyzer_names_the_file(corpus):
    for cls in ALWAYS_INVALID:
        for name, path in corpus[cls]:
            code, out, _ = run(["validate", str(path)])
            assert code == 1 and str(path) in out, (cls, name, out[-300:])
            code, _, err = run(["summary", str(path)])
            if cls not in ("missing column", "null in a required column"):  # some columns are not the summary's
                assert code == 2 and str(path) in err, (cls, name, err[-300:])


def test_skip_invalid_goes_on_past_a_bad_trace_naming_it(corpus, cli):
    bad = dict(corpus["impossible values"])["unknown kind"]
    good = EXAMPLES / "valid-mlp.parquet"
    res = cli("summary", good, bad)
    assert res.returncode == 2 and "unknown layer kind" in res.stderr and str(bad) in res.stderr
    res = cli("summary", good, bad, "--skip-invalid")
    assert res.returncode == 0 and f"skipped {bad}" in res.stderr and "run " in res.stdout
    # a gate never loses a run it could not read: it fails it, named (DuckDB checks the footers: a missing version)
    for engine, refused in (("polars", bad), ("duckdb", EXAMPLES / "invalid-missing_version.parquet")):
        gate = cli("check", good, refused, "--skip-invalid", "--format", "json", "--engine", engine)
        verdicts = {r["run"]: (r["verdict"], r["failed_rules"]) for r in json.loads(gate.stdout)["runs"]}
        assert gate.returncode == 1 and verdicts == {"valid-mlp": ("passed", []), refused.stem: (
            "failed", ["trace_unreadable"])}, gate.stdout


def test_a_footer_that_declares_20000_row_groups_is_refused_before_it_is_parsed(corpus):
    (_, path), = corpus["declared sizes"]
    code, out, _ = run(["validate", str(path)])
    assert code == 1 and "footer declares" in out


def test_forged_lines_and_bidi_characters_never_reach_the_terminal_raw(tmp_path, cli):
    forged = "fc\n  CRITICAL nan_inf      forged / fc since step 0: planted\u202e"
    with pytest.warns(UserWarning, match="escaped"):
        with actrace.Writer(tmp_path / "f.parquet", run="r\u2028un") as w:
            w.record_activation(0, forged, np.zeros((4, 3), np.float32), kind="relu")
    assert validate(tmp_path / "f.parquet") == []
    for args in (["summary"], ["findings"], ["inspect"], ["check", "--max-dead", "0.5"]):
        res = cli(*args, tmp_path / "f.parquet")
        lines = (res.stdout + res.stderr).splitlines()
        assert not [l for l in lines if l.lstrip().startswith("CRITICAL nan_inf")], args
        assert "\u202e" not in res.stdout and "\u2028" not in res.stdout and "\\u202e" in res.stdout, args


def test_a_long_name_is_shortened_at_write_time_and_two_stay_apart(tmp_path):
    long = "block." * 100_000
    with pytest.warns(UserWarning, match="cut to 256 characters"):
        with actrace.Writer(tmp_path / "l.parquet") as w:
            for suffix in ("a", "b"):
                w.record_activation(0, long + suffix, np.ones((2, 2), np.float32), kind="relu")
    names = [r["layer"] for r in actrace.read_table(tmp_path / "l.parquet").to_pylist()]
    assert len(set(names)) == 2 and all(len(n) <= MAX_NAME and n.startswith("block.block.") for n in names)


def test_the_summary_shows_names_whole(tmp_path, cli):
    names = [f"bert.encoder.layer.{i}.attention.self.{p}" for i in range(2) for p in ("query", "key", "value")]
    with actrace.Writer(tmp_path / "n.parquet") as w:
        for name in names:
            w.record_activation(0, name, np.ones((2, 2), np.float32), kind="linear")
    out = cli("summary", tmp_path / "n.parquet").stdout
    assert all(f"  {name} " in out for name in names)


@pytest.mark.parametrize("command", [["report"], ["findings", "--format", "json"], ["summary", "--format", "csv"],
                                     ["check", "--format", "json"]])
def test_an_output_never_overwrites_an_input_nor_another_kind_of_file(tmp_path, cli, command):
    trace = tmp_path / "t.parquet"
    template(trace)
    before = trace.read_bytes()
    res = cli(*command, trace, "-o", trace)
    assert res.returncode == 2 and "is one of this command's inputs" in res.stderr and trace.read_bytes() == before
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    res = cli(*command, trace, "-o", notes)
    assert res.returncode == 2 and "is not an actrace" in res.stderr and notes.read_text() == "my notes\n"
    assert cli(*command, trace, "-o", notes, "--force").returncode in (0, 1) and notes.read_text() != "my notes\n"
    again = cli(*command, trace, "-o", notes)  # its own earlier output is replaced
    assert again.returncode in (0, 1), again.stderr
    target = tmp_path / "target.txt"
    target.write_text("kept\n")
    (tmp_path / "link.out").symlink_to(target)
    res = cli(*command, trace, "-o", tmp_path / "link.out", "--force")
    assert res.returncode == 2 and "symbolic link" in res.stderr and target.read_text() == "kept\n"
    res = cli(*command, trace, "-o", tmp_path)
    assert res.returncode == 2 and "is a folder" in res.stderr and "Traceback" not in res.stderr
    live = tmp_path / "live.parquet.parts"  # another run's writer's folder: its part files are its trace
    live.mkdir()
    res = cli(*command, trace, "-o", live / "part-999999.parquet")
    assert res.returncode == 2 and "inside a trace's part folder" in res.stderr and not any(live.iterdir())
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("command", [["report"], ["findings", "--format", "json"], ["check", "--format", "junit"]])
def test_an_output_to_a_pipe_or_device_is_written_into_it_not_over_it(tmp_path, command):
    """`-o /dev/null` or a named pipe: the answer goes into it, and it stays what it was (a file moved
    over `/dev/null` would take it from the whole machine). A pipe stands in for the device here."""
    import stat
    import threading

    trace, fifo, got = tmp_path / "t.parquet", tmp_path / "answer", []
    template(trace)
    os.mkfifo(fifo)
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)  # blocks till written
    reader.start()
    code, _, err = run([*command, str(trace), "-o", str(fifo)])
    reader.join(timeout=60)  # written: the reader has it; replaced: it waits on a pipe nobody opens
    assert code in (0, 1), err
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and got and got[0].strip(), (got, err)
    assert not list(tmp_path.glob(".*.tmp"))

def limited(code: str, cwd: Path, file_bytes: int) -> subprocess.CompletedProcess:
    """`python -c code` with files it writes limited to `file_bytes` (RLIMIT_FSIZE): the kernel refuses
    larger writes (EFBIG) as a full disk refuses them (ENOSPC)."""
    import resource

    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=HUNG,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes)))


def test_a_disk_that_refuses_a_write_is_one_line_and_leaves_no_temporary_file(tmp_path):
    template(tmp_path / "t.parquet")
    res = limited("import sys; from actrace.cli import main; sys.exit(main(['report', 't.parquet', '-o', 'r.html']))",
                  tmp_path, 200_000)
    assert res.returncode == 2 and "actrace report: error:" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "r.html").exists() and not list(tmp_path.glob(".*.tmp"))


def test_a_disk_that_fills_up_mid_run_takes_no_training_down(tmp_path):
    code = """
import resource, torch, warnings
from torch import nn
from actrace.adapters.torch import Monitor
warnings.simplefilter("always")
model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with Monitor(model, torch.randn(64, 8), "t.parquet", probe_every=5, flush_every=1) as mon:
    for step in range(40):
        if step == 20:  # the disk fills up: the kernel refuses every larger write from now on (EFBIG)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
        loss = model(torch.randn(16, 8)).pow(2).mean()
        opt.zero_grad(); loss.backward(); mon.step(step); opt.step()
print("trained to the end")
"""
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=HUNG)
    assert res.returncode == 0 and "trained to the end" in res.stdout, res.stderr[-2000:]
    assert "cannot write a part file" in res.stderr and "stays as its part files" in res.stderr
    assert "readings could not be written at all" in res.stderr
    steps = {r["step"] for r in actrace.read_table(tmp_path / "t.parquet.parts").to_pylist()}
    assert steps == set(range(20))  # all that reached the disk is readable
    assert not list((tmp_path / "t.parquet.parts").glob(".*.tmp")) and not list(tmp_path.glob(".*.tmp"))


def test_a_second_writer_of_a_trace_fails_at_once_naming_the_first(tmp_path):
    with actrace.Writer(tmp_path / "t.parquet") as w:
        w.record_activation(0, "fc", np.ones((2, 2), np.float32), kind="relu")
        with pytest.raises(FileExistsError, match=rf"another writer holds this trace \(pid {os.getpid()} on "):
            actrace.Writer(tmp_path / "t.parquet", overwrite=True)
    assert actrace.read_table(tmp_path / "t.parquet").num_rows == 1  # the first trace is whole
    assert not (tmp_path / "t.parquet.lock").exists()
    code = ("import os, signal, numpy as np, actrace\n"
            "w = actrace.Writer('k.parquet', flush_every=1)\n"
            "w.record_activation(0, 'fc', np.ones((2, 2), np.float32), kind='relu')\n"
            "os.kill(os.getpid(), signal.SIGKILL)")
    assert subprocess.run([sys.executable, "-c", code], cwd=tmp_path).returncode == -9
    with actrace.Writer(tmp_path / "k.parquet", overwrite=True):  # a dead writer's lock is gone with it
        pass


def test_overwrite_replaces_a_trace_but_never_another_file(tmp_path, cli):
    (tmp_path / "data.parquet").write_bytes(b"PAR1 someone's dataset PAR1")
    with pytest.raises(FileExistsError, match="is not an actrace trace"):
        actrace.Writer(tmp_path / "data.parquet", overwrite=True)
    assert (tmp_path / "data.parquet").read_bytes().startswith(b"PAR1 someone")
    res = cli("record", "-o", tmp_path, "--overwrite", "--", "python", "-c", "print(1)")
    assert "Traceback" not in res.stderr
    with pytest.raises(ValueError, match="is a folder"):
        actrace.Writer(tmp_path, overwrite=True)


def test_a_parts_folder_compacted_while_it_is_read_is_read_from_its_trace(tmp_path):
    from actrace.files.reader import read_source

    w = actrace.Writer(tmp_path / "t.parquet", flush_every=1)
    w.record_activation(0, "fc", np.ones((2, 2), np.float32), kind="relu")
    parts = w.parts
    w.close()  # between a reader finding the folder and reading it
    table, meta = read_source(parts)
    assert table.num_rows == 1 and meta["status"] == "complete"


def test_the_same_input_gives_the_same_bytes(tmp_path, cli):
    from traces import write_run

    for name in ("a", "b", "c"):
        write_run(tmp_path / f"{name}.parquet", name, dead=lambda s: s // 50, tanh_bias=lambda s: s / 200)
    for args, out in ((["summary"], None), (["findings", "--format", "json"], None), (["report"], "r.html"),
                      (["check", "--format", "junit"], "j.xml")):
        answers = []
        for i in range(2):
            extra = ["-o", tmp_path / f"{i}{out}"] if out else []
            res = cli(*args, tmp_path, *extra)
            answers.append((tmp_path / f"{i}{out}").read_bytes() if out else res.stdout.encode())
        assert answers[0] == answers[1], args


def test_validate_exits_one_for_an_invalid_trace_and_two_only_for_a_usage_error(corpus, cli):
    bad = dict(corpus["metadata"])["non-UTF-8 value"]
    res = cli("validate", bad)
    assert res.returncode == 1 and "not UTF-8" in res.stdout
    assert cli("validate", EXAMPLES / "valid-mlp.parquet").returncode == 0
    assert cli("validate", "nowhere.parquet").returncode == 2
    twice = dict(corpus["parts"])["the same part twice"]
    res = cli("validate", twice)
    assert res.returncode == 1 and "a second reading" in res.stdout
    assert metadata.read(next(twice.glob("part-*.parquet")))["run_name"] == "t"
