"""A corpus of hostile traces, each a named mutation of one valid trace (GeoParquet's shape): missing
and retyped columns, nulls, impossible values, bad metadata, bit flips, truncations, names made to
fake terminal lines or break a page, and a footer that declares far more than the file holds.

Every reading command must answer each one without a traceback: valid, or refused with a clear
message naming the file. `python tests/hostile.py` reruns the whole corpus through the CLI's
commands in one process and prints, per class, how many were tried, refused clearly, accepted,
and how many raised.
"""
from __future__ import annotations

import contextlib
import io
import json
import random
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import actrace
from actrace.format.schema import SCHEMA

WRONG_TYPES = {"count": pa.string(), "hist": pa.list_(pa.string()), "unit_min": pa.list_(pa.float64()),
               "layer": pa.int64(), "mode": pa.int8(), "step": pa.float64(), "units": pa.string(),
               "kind": pa.int32(), "stream": pa.list_(pa.string()), "sum": pa.string(),
               "unit_zero": pa.list_(pa.float64()), "shape": pa.string(), "sat_counts": pa.list_(pa.float64()),
               "bound_lo": pa.string(), "value": pa.string()}
NAMES = {"newline": "fc\n  CRITICAL nan_inf   forged / fc since step 0: planted", "carriage": "fc\rCRITICAL forged",
         "ansi": "fc\x1b[2J\x1b[31mred", "bidi": "fc\u202eevil", "line-separator": "fc\u2028next",
         "paragraph-separator": "fc\u2029next", "script": "</script><script>alert(1)</script>",
         "quotes": "fc\"'`\\", "long": "x" * 1_000_000, "nul": "fc\x00hidden", "empty-looking": "\u200b"}


def template(path: Path) -> Path:
    """A small valid trace: a ReLU and a tanh layer's activations, gradients, parameters and the loss."""
    rng = np.random.default_rng(0)
    with actrace.Writer(path, run="t", overwrite=True, config={"lr": 0.1}) as w:
        for step in (0, 10, 20):
            w.record_activation(step, "fc", np.maximum(rng.normal(size=(16, 8)), 0).astype(np.float32), kind="relu")
            w.record_activation(step, "act", np.tanh(rng.normal(size=(16, 4))).astype(np.float32), kind="tanh")
            w.record_param_grad(step, "fc", "weight", rng.normal(size=(8, 4)).astype(np.float32))
            w.record_param(step, "fc", "weight", rng.normal(size=(8, 4)).astype(np.float32))
            w.log(step, loss=2.0 - step / 20)
    return path


def _write(table: pa.Table, path: Path, meta: dict | None = None, **options) -> Path:
    pq.write_table(table.replace_schema_metadata(meta if meta is not None else table.schema.metadata), path,
                   **options)
    return path


def _set(table: pa.Table, name: str, array) -> pa.Table:
    i = table.column_names.index(name)
    return table.set_column(i, pa.field(name, array.type if hasattr(array, "type") else pa.infer_type(array)),
                            array)


def _retype(column: pa.ChunkedArray, typ: pa.DataType) -> pa.Array:
    """A column's values in another type, as a careless producer would write them."""
    values = column.to_pylist()
    if pa.types.is_string(typ):
        return pa.array([None if v is None else json.dumps(v) for v in values], typ)
    if pa.types.is_list(typ) and pa.types.is_string(typ.value_type):
        return pa.array([None if v is None else [str(x) for x in v] for v in values], typ)
    if pa.types.is_list(typ):
        return pa.array([None if v is None else [float(x) for x in v] for v in values], typ)
    if pa.types.is_integer(typ):
        return pa.array([None if v is None else (len(v) if isinstance(v, str) else int(v) % 100) for v in values], typ)
    return pa.array([None if v is None else float(v) for v in values], typ)


def mutations(valid: Path, out: Path) -> dict[str, list[tuple[str, Path]]]:
    """Mutated copies of `valid` under `out`, by class: {class: [(name, path)]}."""
    out.mkdir(parents=True, exist_ok=True)
    t = pq.read_table(valid)
    meta = dict(t.schema.metadata)
    cases: dict[str, list[tuple[str, Path]]] = {}

    def add(cls: str, name: str, path: Path) -> None:
        cases.setdefault(cls, []).append((name, path))

    for f in SCHEMA:
        add("missing column", f.name, _write(t.drop_columns([f.name]), out / f"missing-{f.name}.parquet"))
    for name, typ in WRONG_TYPES.items():
        add("wrong type", f"{name} as {typ}", _write(_set(t, name, _retype(t[name], typ)), out / f"type-{name}.parquet"))
    for f in SCHEMA:
        if not f.nullable:
            add("null in a required column", f.name,
                _write(_set(t, f.name, pa.nulls(len(t), f.type)), out / f"null-{f.name}.parquet"))
    values = {
        "units zero": ("units", pa.array([0] * len(t), pa.int32())),
        "units huge": ("units", pa.array([2 ** 31 - 1] * len(t), pa.int32())),
        "count negative": ("count", pa.array([-5] * len(t), pa.int64())),
        "nan in sum": ("sum", pa.array([float("nan")] * len(t))),
        "empty sat_counts": ("sat_counts", pa.array([[] for _ in range(len(t))], pa.list_(pa.int64()))),
        "short hist": ("hist", pa.array([[1, 2] for _ in range(len(t))], pa.list_(pa.int64()))),
        "unknown kind": ("kind", pa.array(["swiglu"] * len(t))),
        "unknown stream": ("stream", pa.array(["weights"] * len(t))),
        "empty layer": ("layer", pa.array([""] * len(t))),
        "layer index negative": ("layer_index", pa.array([-7] * len(t), pa.int32())),
        "value in every row": ("value", pa.array([1.0] * len(t))),
        "bounds reversed": ("bound_lo", pa.array([5.0] * len(t))),
        "unit lists too long": ("unit_max", pa.array([[1.0] * 99 for _ in range(len(t))], pa.list_(pa.float32()))),
    }
    for name, (column, array) in values.items():
        add("impossible values", name, _write(_set(t, column, array), out / f"value-{name.replace(' ', '_')}.parquet"))
    for name, text in NAMES.items():
        for column in ("layer", "run", "param"):
            add("hostile names", f"{name} in {column}",
                _write(_set(t, column, pa.array([text] * len(t))), out / f"name-{name}-{column}.parquet"))
        add("hostile names", f"{name} in status", _write(t, out / f"name-{name}-status.parquet",
                                                          {**meta, b"actrace:status": text.encode()}))
    metas = {
        "no spec_version": {k: v for k, v in meta.items() if k != b"actrace:spec_version"},
        "future major": {**meta, b"actrace:spec_version": b"2.0"},
        "spec_version not a number": {**meta, b"actrace:spec_version": b"one.two"},
        "no run_name": {k: v for k, v in meta.items() if k != b"actrace:run_name"},
        "no run_id": {k: v for k, v in meta.items() if k != b"actrace:run_id"},
        "non-UTF-8 value": {**meta, b"actrace:host": b"\xff\xfe\xfa"},
        "non-UTF-8 key": {**meta, b"actrace:\xff": b"x"},
        "config nested 100000 deep": {**meta, b"actrace:config": b"[" * 100_000 + b"]" * 100_000},
        "config not JSON": {**meta, b"actrace:config": b"{lr: 0.1"},
        "config a list": {**meta, b"actrace:config": b"[1, 2]"},
        "run name differs from rows": {**meta, b"actrace:run_name": b"other"},
    }
    for name, m in metas.items():
        add("metadata", name, _write(t, out / f"meta-{name.replace(' ', '_')}.parquet", m))
    bad_name = t.append_column(pa.field("ok", pa.int64()), pa.array([1] * len(t)))
    path = _write(bad_name, out / "column-name-invalid-utf8.parquet")
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b"ok", b"\xff\xfe"))  # the name, in the schema and in the footer
    add("invalid UTF-8 column name", "a column named b'\\xff\\xfe'", path)
    add("declared sizes", "20,000 row groups", _write(pa.concat_tables([t.slice(0, 1)] * 20_000),
                                                      out / "rowgroups.parquet", row_group_size=1))
    data = valid.read_bytes()
    rng = random.Random(0)
    footer = int.from_bytes(data[-8:-4], "little")
    for i in range(60):
        flipped = bytearray(data)
        where = len(data) - 8 - footer + rng.randrange(footer + 8) if i % 2 else rng.randrange(len(data))
        flipped[where] ^= 1 << rng.randrange(8)
        (out / f"flip-{i}.parquet").write_bytes(bytes(flipped))
        add("bit flips", f"{'footer' if i % 2 else 'anywhere'} byte {where}", out / f"flip-{i}.parquet")
    for n in (0, 3, 8, len(data) // 2, len(data) - 9, len(data) - 1):
        (out / f"truncated-{n}.parquet").write_bytes(data[:n])
        add("truncated", f"{n} bytes", out / f"truncated-{n}.parquet")
    parts = out / "twice.parquet.parts"
    parts.mkdir(exist_ok=True)
    for n in (1, 2):
        (parts / f"part-{n:06d}.parquet").write_bytes(data)
    add("parts", "the same part twice", parts)
    other = out / "mixed.parquet.parts"
    other.mkdir(exist_ok=True)
    (other / "part-000001.parquet").write_bytes(data)
    _write(t, other / "part-000002.parquet", {**meta, b"actrace:run_id": b"f" * 32})
    add("parts", "two runs' parts in one folder", other)
    (out / "empty.parquet.parts").mkdir(exist_ok=True)
    add("parts", "no part files", out / "empty.parquet.parts")
    return cases


COMMANDS = [["validate"], ["inspect"], ["inspect", "--json"], ["summary"], ["findings", "--format", "json"],
            ["check"]]


def run(argv: list[str]) -> tuple[int | str, str, str]:
    """One CLI command in this process: (exit code, or 'traceback: TYPE'; stdout; stderr)."""
    from actrace.cli import main

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except BaseException as exc:  # noqa: BLE001 - what this corpus exists to catch
        return f"traceback: {type(exc).__name__}: {str(exc)[:200]}", out.getvalue(), err.getvalue()
    return code, out.getvalue(), err.getvalue()


def main() -> None:
    import tempfile
    import warnings

    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as d:
        cases = mutations(template(Path(d) / "valid.parquet"), Path(d) / "hostile")
        print(f"{'class':<28} {'tried':>6} {'refused':>8} {'accepted':>9} {'traceback':>10}")
        total = [0, 0, 0, 0]
        for cls, items in cases.items():
            counts = [0, 0, 0, 0]
            for name, path in items:
                for command in COMMANDS:
                    code, _, _ = run([*command, str(path)])
                    counts[0] += 1
                    counts[3 if isinstance(code, str) else 1 if code in (1, 2) else 2] += 1
                    if isinstance(code, str):
                        print(f"  {cls}: {name}: {' '.join(command)}: {code}", file=sys.stderr)
            total = [a + b for a, b in zip(total, counts)]
            print(f"{cls:<28} {counts[0]:>6} {counts[1]:>8} {counts[2]:>9} {counts[3]:>10}")
        print(f"{'all':<28} {total[0]:>6} {total[1]:>8} {total[2]:>9} {total[3]:>10}")


if __name__ == "__main__":
    main()
