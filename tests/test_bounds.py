"""Bounded work for every input (issue 60, item 8): every engine refuses what the Polars analyzer
refuses, in one line and with the same exit; a spec version is read one way by every reader and
`validate`; footers that declare too much, and probe zip bombs, are refused before they are read."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import zipfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actrace.files.reader import TraceError, read_source
from actrace.files.validate import validate
from conftest import EXAMPLES, HUNG
from hostile import mutations, run, template

INVALID = sorted(EXAMPLES.glob("invalid-*.parquet"))


def _said(err: str) -> list[str]:
    """stderr's error lines (a warning, say of a reading written twice, is Polars' own)."""
    return [line for line in err.splitlines() if ": error: " in line or "Traceback" in line]


@pytest.mark.parametrize("command", ["summary", "check"])
@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_duckdb_refuses_each_invalid_example_as_polars_does(cli, path, command):
    polars = cli(command, path)
    duckdb = cli(command, "--engine", "duckdb", path)
    assert "Traceback" not in duckdb.stderr
    assert (duckdb.returncode, _said(duckdb.stderr)) == (polars.returncode, _said(polars.stderr))
    if path.stem != "invalid-duplicate_reading":  # a reader keeps the last of two readings, and says so
        assert duckdb.returncode == 2 and len(_said(duckdb.stderr)) == 1 and str(path) in duckdb.stderr


def test_duckdb_answers_the_hostile_corpus_as_polars_does(tmp_path):
    """The same exit and error line; or, where DuckDB reads bytes that Polars' columns do not (a bit
    flipped in a column the metrics do not read, or in a footer field pyarrow skips), a one-line
    refusal (2) naming the file."""
    corpus = mutations(template(tmp_path / "valid.parquet"), tmp_path / "hostile")
    differ = []
    for cls, items in corpus.items():
        for name, path in items:
            for command in ("summary", "check"):
                polars = run([command, str(path)])
                duckdb = run([command, "--engine", "duckdb", str(path)])
                refused = duckdb[0] == 2 and len(_said(duckdb[2])) == 1 and str(path) in duckdb[2]
                if isinstance(duckdb[0], str) or (duckdb[0], _said(duckdb[2])) != (polars[0], _said(polars[2])) \
                        and not (polars[0] != 2 and refused):
                    differ.append(f"{cls}: {name}: {command}: polars {polars[0]} {polars[2][-150:]!r}, "
                                  f"duckdb {duckdb[0]} {duckdb[2][-150:]!r}")
    assert differ == []


MALFORMED_VERSIONS = {"major only": "1", "trailing dot": "1.", "leading zero": "01.4", "three numbers": "1.4.0",
                      "leading space": " 1.4", "trailing letter": "1.4x", "negative": "-1.4",
                      "20-digit minor": "1.99999999999999999999", "empty minor": ".4", "plus sign": "+1.4",
                      "unicode digit": "1.\u0664", "empty": ""}


@pytest.mark.parametrize("version", MALFORMED_VERSIONS.values(), ids=MALFORMED_VERSIONS.keys())
def test_validate_and_every_reader_refuse_a_malformed_spec_version_alike(tmp_path, version):
    t = pq.read_table(EXAMPLES / "valid-mlp.parquet")
    path = tmp_path / "t.parquet"
    pq.write_table(t.replace_schema_metadata({**t.schema.metadata, b"actrace:spec_version": version.encode()}), path)
    with pytest.raises(TraceError) as refused:
        read_source(path)
    problems = validate(path)
    assert [str(p) for p in problems] == [str(refused.value)]
    assert "is not MAJOR.MINOR" in str(refused.value) and str(path) in str(refused.value)


def test_a_well_formed_newer_minor_version_is_still_read(tmp_path):
    t = pq.read_table(EXAMPLES / "valid-mlp.parquet")
    path = tmp_path / "t.parquet"
    pq.write_table(t.replace_schema_metadata({**t.schema.metadata, b"actrace:spec_version": b"1.10"}), path)
    assert validate(path) == [] and read_source(path)[0].num_rows == t.num_rows


def measured(*args) -> tuple[subprocess.CompletedProcess, float, float]:
    """The `actrace` command with `args`, run in a process of its own: (its result, its seconds, its
    peak memory in MiB), measured by a parent that has no other child."""
    parent = ("import json, resource, subprocess, sys, time; t = time.monotonic(); "
              "r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
              "print(json.dumps([r.returncode, r.stdout, r.stderr, time.monotonic() - t, "
              "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024]))")
    out = subprocess.run([sys.executable, "-c", parent, sys.executable, "-m", "actrace.cli", *map(str, args)],
                         capture_output=True, text=True, timeout=HUNG, check=True)
    code, stdout, stderr, seconds, mib = json.loads(out.stdout)
    return subprocess.CompletedProcess(args, code, stdout, stderr), seconds, mib


def test_a_probe_zip_bomb_is_refused_before_it_is_loaded(tmp_path):
    from test_onnx_adapter import helper_model

    from actrace.adapters.onnx import MAX_PROBE_BYTES

    bomb = tmp_path / "bomb.npz"
    n = MAX_PROBE_BYTES // 4 + 1  # float32s: one more than a probe may hold
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z, \
            z.open("x.npy", "w", force_zip64=True) as member:
        np.lib.format.write_array_header_1_0(member, {"descr": "<f4", "fortran_order": False, "shape": (1, n)})
        zeros = bytes(2 ** 24)
        for _ in range(n * 4 // len(zeros)):
            member.write(zeros)
        member.write(bytes(n * 4 % len(zeros)))
    assert bomb.stat().st_size < 2 ** 23  # 8 MiB on disk, 1 GiB unzipped
    res, seconds, mib = measured("record", helper_model(tmp_path / "m.onnx"), "--probe", bomb,
                                 "-o", tmp_path / "t.parquet")
    said = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(said) == 1 and str(bomb) in said[0], res.stderr[-500:]
    assert f"over the {MAX_PROBE_BYTES >> 20} MiB a probe may hold" in said[0]
    assert mib < 512 and seconds < 60 and not (tmp_path / "t.parquet").exists()


def _units_bomb(template_path, path):
    """One ReLU reading of MAX_UNITS + 1 units, each list all zeros: a few KiB on disk."""
    from actrace.format.metadata import MAX_UNITS

    t = pq.read_table(template_path)
    row = t.filter(pa.compute.equal(t["kind"], "relu")).slice(0, 1).to_pylist()[0]
    n = MAX_UNITS + 1
    row.update(units=n, count=n, zero_count=n, nan_count=0, inf_count=0)
    for name in ("unit_sum", "unit_sumsq", "unit_min", "unit_max", "unit_min_dev", "unit_zero", "unit_count"):
        row[name] = np.zeros(n, np.float32 if name in ("unit_min", "unit_max", "unit_min_dev") else np.float64)
    pq.write_table(pa.Table.from_pylist([row], schema=t.schema), path, compression="zstd")
    return path


def _rows_bomb(template_path, path):
    """MAX_ROWS + 1 copies of one reading: a few MiB on disk."""
    from actrace.format.metadata import MAX_ROWS

    t = pq.read_table(template_path)
    pq.write_table(t.take(np.zeros(MAX_ROWS + 1, dtype=np.int64)), path, compression="zstd")
    return path


def _parts_bomb(template_path, path):
    """A .parts folder of MAX_PARTS + 1 part files (empty: they are counted before one is opened)."""
    from actrace.files.reader import MAX_PARTS

    path.mkdir()
    for i in range(MAX_PARTS + 1):
        (path / f"part-{i:06d}.parquet").touch()
    return path


@pytest.mark.parametrize("bomb,limit", [(_units_bomb, "over the 1,048,576 a reading may hold"),
                                        (_rows_bomb, "1,048,576 a trace file may hold"),
                                        (_parts_bomb, "10,000 a .parts folder may hold")],
                         ids=["10M units", "2M rows", "10,001 parts"])
@pytest.mark.parametrize("command", ["validate", "summary"])
def test_a_trace_declaring_too_much_is_refused_from_its_footer_in_one_line(tmp_path, bomb, limit, command):
    name = "t.parquet.parts" if bomb is _parts_bomb else "t.parquet"
    path = bomb(template(tmp_path / "valid.parquet"), tmp_path / name)
    res, seconds, mib = measured(command, path)
    said = (res.stdout if command == "validate" else res.stderr).strip().splitlines()
    said = [line for line in said if not line.startswith("actrace: reading traces")]
    assert res.returncode == (1 if command == "validate" else 2) and len(said) == 1, res.stdout + res.stderr
    assert str(path) in said[0] and limit in said[0] and "not read" in said[0]
    assert mib < 400 and seconds < 60, (mib, seconds)
