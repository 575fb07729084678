"""Conformance: the spec and the code agree, and the golden examples give the expected values."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

import actrace
from actrace import SPEC_VERSION
from actrace.files.validate import validate
from actrace.format import bins
from actrace.format.schema import KINDS, SCHEMA

from conftest import EXAMPLES, SPEC

SPEC_TEXT = (SPEC / "trace-v1.md").read_text()
TYPES = {"string": pa.string(), "int64": pa.int64(), "int32": pa.int32(), "float64": pa.float64(),
         "float32": pa.float32()}


def _arrow_type(text: str) -> pa.DataType:
    m = re.fullmatch(r"list<(\w+)>", text)
    return pa.list_(TYPES[m.group(1)]) if m else TYPES[text]


def spec_columns() -> list[tuple[str, pa.DataType, bool]]:
    section = SPEC_TEXT.split("## Columns")[1].split("\n### ")[0]
    rows = re.findall(r"^\| `(\w+)` \| ([\w<>]+) \| (yes|no) \|", section, re.M)
    return [(name, _arrow_type(typ), null == "yes") for name, typ, null in rows]


def test_the_spec_column_table_is_the_arrow_schema():
    assert spec_columns() == [(f.name, f.type, f.nullable) for f in SCHEMA]


def test_the_spec_heading_names_the_version_constant():
    assert re.search(r"^# .*version (\d+\.\d+)$", SPEC_TEXT, re.M).group(1) == SPEC_VERSION


def test_the_bin_edges_in_the_spec_are_the_codes_bin_edges():
    lines = [l for l in (SPEC / "bins-v1.txt").read_text().splitlines() if not l.startswith("#")]
    assert [float(l) for l in lines] == bins.MAGNITUDE_EDGES.tolist()
    assert f"`hist` has **{bins.N_BINS}** bins" in SPEC_TEXT
    assert f"the {len(lines)} *magnitude edges*" in SPEC_TEXT


def test_the_bin_edge_table_holds_the_definition_to_the_last_bits():
    """The table is written out, never recomputed (`10.0 ** x` differs by an ULP between numpy
    versions); each entry is its definition, 10^(k/4) or a saturation edge, within 2 ULP."""
    from decimal import Decimal, getcontext

    getcontext().prec = 40
    exact = sorted({Decimal(10) ** (Decimal(k) / 4) for k in range(-32, 33)} | {Decimal("0.9"), Decimal("0.99"),
                                                                               Decimal("0.999")})
    assert len(exact) == len(bins.MAGNITUDE_EDGES)
    for table, true in zip(bins.MAGNITUDE_EDGES.tolist(), exact):
        assert abs(Decimal(table) - true) <= 2 * Decimal(np.spacing(table)), (table, true)


def test_every_kind_is_listed_in_the_spec():
    kinds_section = SPEC_TEXT.split("## Layer kinds")[1].split("## Streams")[0]
    assert sorted(k for k in KINDS if f"`{k}`" not in kinds_section) == []


VALID = sorted(p.name for p in EXAMPLES.glob("valid-*") if not p.name.endswith(".lock"))
INVALID_FAULTS = {
    "missing_version": "spec_version",
    "future_major_version": "version 2.0 is not supported",
    "no_gradient_not_a_list": "'actrace:no_gradient' is not a JSON list of names",
    "missing_column_units": "column 'units': required column is missing",
    "wrong_list_length": "row 0 column 'unit_max'",
    "zero_count_exceeds_finite": "row 0 column 'zero_count'",
    "unknown_kind": "row 0 column 'kind'",
    "bounded_kind_without_bounds": "column 'bound_lo'",
    "hist_wrong_bin_count": "row 0 column 'hist'",
    "unit_counts_do_not_add_up": "row 0 column 'unit_count'",
    "count_below_nan_count": "row 0 column 'count'",
    "duplicate_reading": "column 'step': a second reading of one (run, layer, stream, param, step)",
    "sat_counts_not_monotone": "column 'sat_counts': counts must grow",
    "truncated": "not a readable Parquet file",
    "not_parquet": "not a readable Parquet file",
}


@pytest.mark.parametrize("name", VALID)
def test_valid_examples_validate(name):
    assert validate(EXAMPLES / name) == []


def test_every_invalid_example_has_a_named_fault():
    assert sorted(p.name for p in EXAMPLES.glob("invalid-*")) == sorted(
        f"invalid-{n}.parquet" for n in INVALID_FAULTS)


@pytest.mark.parametrize("name,fault", INVALID_FAULTS.items(), ids=INVALID_FAULTS.keys())
def test_invalid_examples_are_refused_naming_the_fault(name, fault):
    problems = [str(p) for p in validate(EXAMPLES / f"invalid-{name}.parquet")]
    assert any(fault in p and f"invalid-{name}.parquet" in p for p in problems), problems


@pytest.mark.parametrize("name", [p.stem for p in (SPEC / "expected").glob("*.json")])
def test_analyzer_computes_the_golden_values(name):
    from actrace.analyzer.metrics import Thresholds, metrics

    expected = json.loads((SPEC / "expected" / f"{name}.json").read_text())
    th = expected["thresholds"]
    frames = {(e, t): metrics(EXAMPLES / f"{name}.parquet", Thresholds(e, t))
              for e in th["dead_eps"] for t in th["sat_threshold"]}
    checked = 0
    for layer, by_step in expected["layers"].items():
        for step, values in by_step.items():
            for key, want in values.items():
                metric, _, at = key.partition("@")
                for (e, t), frame in frames.items():
                    if at and float(at) != (e if metric == "dead_fraction" else t):
                        continue
                    row = frame.filter((frame["layer"] == layer) & (frame["step"] == int(step))
                                       & (frame["stream"] == "activation"))
                    assert row.height == 1
                    if want is None:  # where the metric means nothing: null, not 0
                        assert row[metric][0] is None, f"{name} {layer} step {step} {key}"
                    else:
                        np.testing.assert_allclose(row[metric][0], want, rtol=1e-5, atol=1e-6,
                                                   err_msg=f"{name} {layer} step {step} {key}")
                    checked += 1
    assert checked > 0


VOLATILE_META = {"run_id", "created", "host", "framework_version"}  # who, where and when, not what


def _content(path):
    """What a golden file says: its rows (but their wall time) and metadata (but who, where and
    when), or, unreadable, the problems `validate` names."""
    problems = [str(p).replace(str(path), "FILE") for p in validate(path)]
    try:
        t = actrace.read_table(path)
    except actrace.TraceError:
        return problems, None, None
    meta = {k: v for k, v in (t.schema.metadata or {}).items() if k.decode().removeprefix("actrace:") not in VOLATILE_META}
    return problems, t.drop_columns(["wall_time"]).to_pylist(), meta


def _close(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-300)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return a == b


def test_regenerating_the_examples_changes_nothing(tmp_path):
    """spec/make_examples.py run again gives the golden files committed: the same files, the
    same expected values, the same rows and metadata (floats to 1e-9: another CPU may round the
    kernel's sums otherwise)."""
    subprocess.run([sys.executable, str(SPEC / "make_examples.py"), str(tmp_path)], check=True, timeout=600)
    for folder in ("examples", "expected"):
        names = sorted(p.relative_to(SPEC / folder).as_posix() for p in (SPEC / folder).rglob("*"))
        assert sorted(p.relative_to(tmp_path / folder).as_posix() for p in (tmp_path / folder).rglob("*")) == names
    for name in (p.name for p in (SPEC / "expected").glob("*.json")):
        assert _close(json.loads((tmp_path / "expected" / name).read_text()),
                      json.loads((SPEC / "expected" / name).read_text())), name
    for path in sorted(EXAMPLES.iterdir()):
        if not path.name.endswith(".lock"):
            assert _close(_content(tmp_path / "examples" / path.name), _content(path)), path.name
