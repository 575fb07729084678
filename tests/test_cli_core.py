"""`actrace validate` and `actrace inspect` as a user runs them."""
from __future__ import annotations

import json

from actrace import SPEC_VERSION

from conftest import EXAMPLES


def test_validate_passes_the_valid_examples_and_skips_a_crashed_writers_lock(cli):
    res = cli("validate", *sorted(EXAMPLES.glob("valid-*")))
    assert res.returncode == 0, res.stdout + res.stderr
    traces = [p for p in EXAMPLES.glob("valid-*") if not p.name.endswith(".lock")]
    assert (EXAMPLES / "valid-crashed.parquet.lock").exists() and res.stdout.count(": valid") == len(traces) == 6


def test_validate_fails_with_a_line_per_problem_and_no_traceback(cli):
    res = cli("validate", EXAMPLES / "valid-mlp.parquet", EXAMPLES / "invalid-truncated.parquet",
              EXAMPLES / "invalid-wrong_list_length.parquet")
    assert res.returncode == 1
    lines = res.stdout.splitlines()
    assert any("invalid-truncated.parquet" in l and "not a readable Parquet" in l for l in lines)
    assert any("row 0 column 'unit_max'" in l for l in lines)
    assert "Traceback" not in res.stdout + res.stderr


def test_validate_names_a_path_that_does_not_exist_as_a_usage_error(cli):
    res = cli("validate", "runs/nope.parquet")  # exit 1 means "invalid"; naming nothing is a usage error
    assert res.returncode == 2 and "runs/nope.parquet" in res.stderr and "no such file" in res.stderr


def test_inspect_shows_layers_steps_streams_and_size(cli):
    res = cli("inspect", EXAMPLES / "valid-mlp.parquet")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    for text in (f"spec {SPEC_VERSION}", "run        valid-mlp", "steps      2 (from 0 to 100)",
                 "fc2.tanh", "tanh", "8 units", "KiB", "activation 14", "0123456789abcdef"):
        assert text in out, text


def test_inspect_json_is_machine_readable(cli):
    res = cli("inspect", "--json", EXAMPLES / "valid-mlp.parquet")
    d = json.loads(res.stdout)
    assert [l["layer"] for l in d["layers"]] == ["fc1.relu", "fc2.tanh", "conv.sigmoid", "clip", "relu6", "hardtanh",
                                               "softmax"]
    assert d["layers"][2]["units"] == 4 and d["metadata"]["config"] == {"example": True}
    assert d["size_bytes"] == (EXAMPLES / "valid-mlp.parquet").stat().st_size


def test_inspect_of_a_future_version_says_which_version_it_reads(cli):
    res = cli("inspect", EXAMPLES / "invalid-future_major_version.parquet")
    assert res.returncode == 2 and "reads 1.x" in res.stderr and "Traceback" not in res.stderr
