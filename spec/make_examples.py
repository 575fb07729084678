"""Regenerate the golden traces in spec/examples/ and their expected values in spec/expected/
(`python spec/make_examples.py [DIR]`: into DIR/examples and DIR/expected instead).

Valid traces are built from tensors whose truth is known by construction; the expected
per-layer values are computed here from the raw tensors with plain numpy, independently of
the analyzer. Invalid traces are named mutations of one valid template, one rule each.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import actrace
from actrace.format.schema import KIND_BOUNDS, SATURATING_SIDES, canonical_kind, columns_absent_in

SPEC = Path(__file__).parent
THRESHOLDS = {"dead_eps": [0.0, 0.1], "sat_threshold": [0.9, 0.99]}


def layers(step: int, rng: np.random.Generator) -> dict:
    """(tensor, unit_axis, kind, bounds) per layer: 4 of 16 ReLU units killed, 3 of 8 tanh units
    pinned by a +5 bias, a sigmoid conv in NCHW whose channel 0 is pushed to 0, a ReLU6 with 2 of
    6 units pinned at 6 (and many zeros, which are not saturation), a hard-tanh(-2, 2) with 3 of 8
    units pinned at -2 or 2, a near-uniform softmax over 200 classes (not saturated)."""
    relu_in = rng.normal(size=(32, 16))
    relu_in[:, :4] -= 100.0
    tanh_in = rng.normal(size=(32, 8)) * 0.5
    tanh_in[:, :3] += 5.0 + step
    sig_in = rng.normal(size=(32, 4, 3, 3))
    sig_in[:, 0] -= 10.0
    return {
        "fc1.relu": (np.maximum(relu_in, 0).astype(np.float32), 1, "relu", None),
        "fc2.tanh": (np.tanh(tanh_in).astype(np.float32), 1, "tanh", None),
        "conv.sigmoid": ((1 / (1 + np.exp(-sig_in))).astype(np.float32), 1, "sigmoid", None),
        "clip": (np.clip(rng.normal(size=(32, 6)) * 4, 0, 6).astype(np.float32), 1, "clip", (0.0, 6.0)),
        "relu6": (np.clip(rng.normal(size=(32, 6)) * 2 + np.array([14, 14, 0, 0, 0, 0]), 0, 6).astype(np.float32),
                  1, "relu6", None),
        "hardtanh": (np.clip(rng.normal(size=(32, 8)) + np.array([8, -8, 8, 0, 0, 0, 0, 1.5]), -2, 2
                             ).astype(np.float32), 1, "hard_tanh", (-2.0, 2.0)),
        "softmax": (_softmax(rng.normal(size=(32, 200)) * 0.1).astype(np.float32), 1, "softmax", None),
    }


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


EDGES = np.array([float(l) for l in (SPEC / "bins-v1.txt").read_text().splitlines()
                  if not l.startswith("#")])


def value_bins(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each value's histogram bin as (lower, upper) value bounds, per spec §Histogram."""
    mag = np.abs(x)
    j = np.searchsorted(EDGES, mag, side="right")  # magnitude in [E[j-1], E[j])
    m_lo = np.where(j == 0, 0.0, EDGES[np.maximum(j - 1, 0)])
    m_hi = np.where(j == len(EDGES), np.inf, EDGES[np.minimum(j, len(EDGES) - 1)])
    lo = np.where(x > 0, m_lo, np.where(x < 0, -m_hi, 0.0))
    hi = np.where(x > 0, m_hi, np.where(x < 0, -m_lo, 0.0))
    return lo, hi


def expected_values(x: np.ndarray, axis: int, kind: str, bounds, exact: bool = True) -> dict:
    """The spec's metrics computed straight from the tensor (no trace involved); per-value
    saturation exact (from `sat_counts`, 1.1) or from the histogram's bins (a 1.0 trace)."""
    x64 = np.moveaxis(x.astype(np.float64), axis, -1).reshape(-1, x.shape[axis])
    absmax = np.abs(x64).max(axis=0)
    # a softmax's zeros are masked entries, no dead units: its dead fraction is null (spec §Metrics)
    out = {f"dead_fraction@{e}": None if kind == "softmax" else float((absmax <= e).mean())
           for e in THRESHOLDS["dead_eps"]}
    out["sparsity"] = float((x64 == 0).mean())
    out["mean"], out["std"] = float(x64.mean()), float(x64.std())
    bounds = bounds or KIND_BOUNDS[kind]
    if bounds:
        lo, hi = bounds
        both = SATURATING_SIDES[kind] == ("lo", "hi")
        for t in THRESHOLDS["sat_threshold"]:
            margin = (1 - t) * max(abs(lo), abs(hi))
            sat = (x64 >= hi - margin) | (both & (x64 <= lo + margin))
            b_lo, b_hi = value_bins(x64)
            sat_by_bin = (b_lo >= hi - margin - 1e-12) | (both & (b_hi <= lo + margin + 1e-12))
            out[f"saturation_value@{t}"] = float((sat if exact else sat_by_bin).mean())
            out[f"saturation_unit@{t}"] = float(sat.all(axis=0).mean())
    return out


def write_valid(out: Path, name: str, steps=(0, 100), nan: bool = False) -> Path:
    path = out / "examples" / f"{name}.parquet"
    rng = np.random.default_rng(7)
    expected: dict = {"thresholds": THRESHOLDS, "layers": {}}
    with actrace.Writer(path, run=name, framework="numpy", overwrite=True, mode="eval",
                        probe_fingerprint="0123456789abcdef", probe_size=32,
                        config={"example": True}) as w:
        for step in steps:
            for layer, (x, axis, kind, bounds) in layers(step, rng).items():
                if nan and layer == "fc1.relu":
                    x = x.copy()
                    x[0, 5], x[1, 6], x[2, 7] = np.nan, np.inf, -np.inf
                w.record_activation(step, layer, x, kind=kind, unit_axis=axis, bounds=bounds)
                if not nan:  # a clamp saturates as the kind it is written as (spec §Layer kinds)
                    expected["layers"].setdefault(layer, {})[str(step)] = expected_values(
                        x, axis, canonical_kind(kind, bounds)[0], bounds)
    if nan:
        expected["layers"] = {"fc1.relu": {str(s): {"nan_count": 1, "inf_count": 2} for s in steps}}
    (out / "expected" / f"{name}.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    return path


def write_older(out: Path, template: Path, version: str) -> None:
    """`valid-mlp` as an earlier writer made it: 1.2 without `sum3` and `sum4`; 1.1 without `value`
    too and with kinds as given (a `hard_tanh`, a `clip` to [0, 6], which 1.2 writes as `clip` and
    `relu6`); 1.0 without `sat_counts` too. A 1.3 reader reads them all; a 1.0 trace's saturation per
    value comes from the histogram."""
    t = pq.read_table(template)
    given = {layer: kind for layer, (_, _, kind, _) in layers(0, np.random.default_rng(0)).items()}
    if version < "1.2":
        t = t.set_column(t.column_names.index("kind"), "kind", pa.array(
            [given.get(layer, kind) for layer, kind in zip(t["layer"].to_pylist(), t["kind"].to_pylist())],
            t.schema.field("kind").type))
    t = t.drop_columns(sorted(columns_absent_in(version)))
    meta = {**t.schema.metadata, b"actrace:spec_version": version.encode()}
    name = f"valid-v{version.replace('.', '_')}"
    pq.write_table(t.replace_schema_metadata(meta), out / "examples" / f"{name}.parquet")
    rng = np.random.default_rng(7)
    expected: dict = {"thresholds": THRESHOLDS, "layers": {}}
    for step in (0, 100):
        for layer, (x, axis, kind, bounds) in layers(step, rng).items():
            kind = kind if version < "1.2" else canonical_kind(kind, bounds)[0]  # as the file holds it
            expected["layers"].setdefault(layer, {})[str(step)] = expected_values(x, axis, kind, bounds,
                                                                                  exact=version != "1.0")
    (out / "expected" / f"{name}.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


def mutate(out: Path, template: Path, name: str, change) -> None:
    table = pq.read_table(template)
    pq.write_table(change(table), out / "examples" / f"invalid-{name}.parquet")


def set_meta(key: str, value: str | None):
    def change(t: pa.Table) -> pa.Table:
        meta = dict(t.schema.metadata)
        meta.pop(f"actrace:{key}".encode(), None)
        if value is not None:
            meta[f"actrace:{key}".encode()] = value.encode()
        return t.replace_schema_metadata(meta)
    return change


def set_column(name: str, fn):
    def change(t: pa.Table) -> pa.Table:
        return t.set_column(t.column_names.index(name), name, fn(t[name]))
    return change


def first_row(fn):
    """Apply `fn` to the python value of row 0 only."""
    def apply(col):
        values = col.to_pylist()
        values[0] = fn(values[0])
        return pa.array(values, type=col.type)
    return apply


INVALID = {
    "missing_version": set_meta("spec_version", None),
    "future_major_version": set_meta("spec_version", "2.0"),
    "no_gradient_not_a_list": set_meta("no_gradient", '{"fc1": "weight"}'),
    "missing_column_units": lambda t: t.drop_columns(["units"]),
    "wrong_list_length": set_column("unit_max", first_row(lambda v: v[:-1])),
    "zero_count_exceeds_finite": set_column("zero_count", first_row(lambda v: 10_000)),
    "unknown_kind": set_column("kind", first_row(lambda v: "swishy")),
    "bounded_kind_without_bounds": set_column("bound_lo", lambda c: pa.nulls(len(c), pa.float64())),
    "hist_wrong_bin_count": set_column("hist", first_row(lambda v: v[:100])),
    "unit_counts_do_not_add_up": set_column("unit_count", first_row(lambda v: [n + 1 for n in v])),
    "count_below_nan_count": set_column("nan_count", first_row(lambda v: 1_000_000)),
    "duplicate_reading": lambda t: pa.concat_tables([t, t.slice(0, 1)]),
    "sat_counts_not_monotone": set_column("sat_counts", lambda c: pa.array(
        [None if v is None else [3, 2, 1, 0, 0, 0] for v in c.to_pylist()], type=c.type)),
}


def main(out: Path = SPEC) -> None:
    examples = out / "examples"
    (out / "expected").mkdir(parents=True, exist_ok=True)
    examples.mkdir(parents=True, exist_ok=True)
    for old in examples.glob("*.parquet*"):
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    template = write_valid(out, "valid-mlp")
    write_valid(out, "valid-nonfinite", steps=(0,), nan=True)
    for version in ("1.0", "1.1", "1.2"):
        write_older(out, template, version)
    for name, change in INVALID.items():
        mutate(out, template, name, change)
    (examples / "invalid-truncated.parquet").write_bytes(template.read_bytes()[: template.stat().st_size // 2])
    (examples / "invalid-not_parquet.parquet").write_text("step,layer\n0,fc1\n")
    # a crash leftover: the part files of a writer whose process died (no close, no exit handler)
    subprocess.run([sys.executable, "-c", CRASHED, str(examples / "valid-crashed.parquet")], check=True)


CRASHED = """
import os, sys
import numpy as np
import actrace

w = actrace.Writer(sys.argv[1], run="valid-crashed", flush_every=2, overwrite=True)
for step in range(3):
    w.record_activation(step, "fc", np.arange(-3, 5, dtype=np.float32).reshape(2, 4), kind="relu")
os._exit(0)
"""


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else SPEC)
