"""The writer: round trip, part files at every flush, atomic compaction, SIGKILL safety."""
from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import actrace
from actrace.format import metadata
from actrace.files.reader import TraceError, read_source
from actrace.files.validate import validate


def _write(path, steps=3, **kw):
    rng = np.random.default_rng(1)
    with actrace.Writer(path, run="r", **kw) as w:
        for step in range(steps):
            w.record_activation(step, "fc", rng.normal(size=(8, 4)).astype(np.float32), kind="linear")
            w.record_param(step, "fc", "weight", rng.normal(size=(4, 3)))
    return w


def test_round_trip_keeps_every_reading_and_the_metadata(tmp_path):
    w = _write(tmp_path / "a.parquet", config={"lr": 0.1})
    table, meta = read_source(tmp_path / "a.parquet")
    assert len(table) == 6 and w.readings_written == 6
    assert meta["run_name"] == "r" and meta["spec_version"] == actrace.SPEC_VERSION
    assert meta["config"] == '{"lr": 0.1}'
    assert not (tmp_path / "a.parquet.parts").exists()
    assert validate(tmp_path / "a.parquet") == []


def test_update_norm_is_the_distance_to_the_previous_parameter_reading(tmp_path):
    with actrace.Writer(tmp_path / "p.parquet") as w:
        w.record_param(0, "fc", "weight", np.zeros((2, 2)))
        w.record_param(1, "fc", "weight", np.full((2, 2), 3.0))
    norms = actrace.read_table(tmp_path / "p.parquet")["update_norm"].to_pylist()
    assert norms == [None, 6.0]


def test_refuses_to_overwrite_an_existing_trace_unless_told(tmp_path):
    _write(tmp_path / "a.parquet")
    with pytest.raises(FileExistsError, match="a.parquet.*overwrite"):
        actrace.Writer(tmp_path / "a.parquet")
    _write(tmp_path / "a.parquet", steps=1, overwrite=True)
    assert len(actrace.read_table(tmp_path / "a.parquet")) == 2


def test_every_flush_leaves_a_complete_readable_part_file(tmp_path):
    w = actrace.Writer(tmp_path / "b.parquet", flush_every=2)
    for step in range(5):
        w.record_activation(step, "fc", np.ones((2, 3), np.float32), kind="relu")
    parts = tmp_path / "b.parquet.parts"
    assert len(list(parts.glob("part-*.parquet"))) == 2
    assert len(actrace.read_table(parts)) == 4 and validate(parts) == []
    w.close()
    assert len(actrace.read_table(tmp_path / "b.parquet")) == 5


def test_flushes_on_the_clock_too(tmp_path):
    w = actrace.Writer(tmp_path / "c.parquet", flush_every=10_000, flush_seconds=0.05)
    w.record_activation(0, "fc", np.ones((2, 3), np.float32), kind="relu")
    time.sleep(0.1)
    w.record_activation(1, "fc", np.ones((2, 3), np.float32), kind="relu")
    assert len(actrace.read_table(tmp_path / "c.parquet.parts")) == 2
    w.close()


CHILD = textwrap.dedent("""
    import sys, numpy as np, actrace
    w = actrace.Writer(sys.argv[1], flush_every=7)
    step = 0
    while True:
        w.record_activation(step, "fc", np.random.rand(64, 32).astype(np.float32), kind="relu")
        w.record_activation(step, "out", np.random.rand(64, 8).astype(np.float32), kind="sigmoid")
        if not w._rows:
            print(w.readings_written, flush=True)
        step += 1
""")


def test_sigkill_mid_run_loses_no_flushed_reading(tmp_path):
    path = tmp_path / "killed.parquet"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, text=True)
    flushed = 0
    while flushed < 300:
        flushed = int(child.stdout.readline())
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert not path.exists()
    table = actrace.read_table(path.with_name("killed.parquet.parts"))
    assert len(table) >= flushed
    assert validate(path.with_name("killed.parquet.parts")) == []
    steps = sorted(set(table["step"].to_pylist()))
    assert steps == list(range(len(steps)))  # nothing missing in the middle


def test_reader_names_the_file_of_another_major_version(tmp_path):
    import pyarrow.parquet as pq

    _write(tmp_path / "a.parquet")
    t = pq.read_table(tmp_path / "a.parquet")
    meta = dict(t.schema.metadata)
    meta[b"actrace:spec_version"] = b"3.1"
    pq.write_table(t.replace_schema_metadata(meta), tmp_path / "future.parquet")
    with pytest.raises(TraceError, match=r"future.parquet.*3\.1.*reads 1\.x"):
        actrace.read_table(tmp_path / "future.parquet")


def test_reader_accepts_newer_minor_versions_and_ignores_unknown_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    _write(tmp_path / "a.parquet")
    t = pq.read_table(tmp_path / "a.parquet")
    meta = dict(t.schema.metadata)
    meta[b"actrace:spec_version"] = b"1.7"
    t = t.append_column("unit_p99", pa.array([[1.0]] * len(t))).replace_schema_metadata(meta)
    pq.write_table(t, tmp_path / "newer.parquet")
    table = actrace.read_table(tmp_path / "newer.parquet")
    assert "unit_p99" not in table.column_names and len(table) == 6
    assert validate(tmp_path / "newer.parquet") == []


def test_a_run_that_fails_before_recording_leaves_no_trace_but_keeps_partial_ones(tmp_path):
    with pytest.raises(RuntimeError):
        with actrace.Writer(tmp_path / "empty.parquet"):
            raise RuntimeError("model failed to load")
    assert not (tmp_path / "empty.parquet").exists() and not (tmp_path / "empty.parquet.parts").exists()
    with pytest.raises(RuntimeError):
        with actrace.Writer(tmp_path / "partial.parquet") as w:
            w.record_activation(0, "fc", np.ones((2, 2), np.float32), kind="relu")
            raise RuntimeError("checkpoint 2 is corrupt")
    assert len(actrace.read_table(tmp_path / "partial.parquet")) == 1


def test_scan_gives_a_lazy_polars_frame_over_files_and_parts(tmp_path):
    import polars as pl

    _write(tmp_path / "a.parquet")
    w = actrace.Writer(tmp_path / "b.parquet", flush_every=1)
    w.record_activation(0, "fc", np.ones((2, 3), np.float32), kind="relu")
    lf = actrace.scan([tmp_path / "a.parquet", tmp_path / "b.parquet.parts"], columns=["run", "layer", "step"])
    assert isinstance(lf, pl.LazyFrame)
    assert lf.collect().shape == (7, 3)
    w.close()


def test_the_core_imports_without_any_framework_or_the_analyzer():
    code = ("import sys, actrace; bad = [m for m in ('torch', 'onnxruntime', 'onnx', 'polars', 'altair') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_flipped_bit_in_a_data_page_is_corruption_not_a_number(tmp_path):
    """Pages carry CRC checksums that the reader and the validator verify."""
    import pyarrow.parquet as pq

    from actrace.files.validate import validate

    with actrace.Writer(tmp_path / "t.parquet", run="t") as w:
        for step in range(5):
            w.record_activation(step, "fc", np.random.default_rng(step).normal(size=(64, 256)).astype(np.float32),
                                kind="linear")
    data = bytearray((tmp_path / "t.parquet").read_bytes())
    rg = pq.ParquetFile(tmp_path / "t.parquet").metadata.row_group(0)
    col = next(rg.column(i) for i in range(rg.num_columns) if rg.column(i).path_in_schema.startswith("unit_sum"))
    data[col.data_page_offset + col.total_compressed_size // 2] ^= 0x01
    (tmp_path / "bad.parquet").write_bytes(data)
    assert any("CRC checksum" in str(p) for p in validate(tmp_path / "bad.parquet"))
    with pytest.raises(actrace.TraceError, match="bad.parquet.*CRC checksum"):
        actrace.read_table(tmp_path / "bad.parquet")


def test_the_numpy_writer_records_gradients_layer_level_by_default_as_the_monitor_does(tmp_path):
    with actrace.Writer(tmp_path / "g.parquet", run="g") as w:
        w.record_param_grad(0, "fc", "weight", np.ones((64, 32), np.float32))
        w.record_param_grad(1, "fc", "weight", np.ones((64, 32), np.float32), per_unit=True, histogram=True)
    default, full = actrace.read_table(tmp_path / "g.parquet").to_pylist()
    assert default["unit_sum"] is None and default["hist"] is None and default["sumsq"] == 64 * 32
    assert len(full["unit_sum"]) == 64 and sum(full["hist"]) == 64 * 32


@pytest.mark.parametrize("kind, bounds, written", [
    ("hard_tanh", None, ("clip", -1.0, 1.0)), ("hard_tanh", (-2.0, 2.0), ("clip", -2.0, 2.0)),
    ("clip", (0.0, 6.0), ("relu6", 0.0, 6.0)), ("relu6", None, ("relu6", 0.0, 6.0)), ("clip", (0.0, 1.0), ("clip", 0.0, 1.0))])
def test_a_clamp_is_written_with_one_kind_whatever_it_was_called(tmp_path, kind, bounds, written):
    """spec §Layer kinds: the kind of a clamp follows from its bounds, so every framework's agree."""
    x = np.clip(np.random.default_rng(0).normal(0, 4, (32, 3)), *(bounds or (-1, 6))).astype(np.float32)
    with actrace.Writer(tmp_path / "c.parquet", run="c") as w:
        w.record_activation(0, "act", x, kind=kind, bounds=bounds)
    row = actrace.read_table(tmp_path / "c.parquet").to_pylist()[0]
    assert (row["kind"], row["bound_lo"], row["bound_hi"]) == written
    assert validate(tmp_path / "c.parquet") == []


def test_buffered_readings_are_left_alone_by_the_cyclic_collector(tmp_path):
    """Until a flush the writer holds each reading as plain values and numpy arrays, which Python's
    collector stops tracking by its second look (the shape, a tuple inside, at the first), long
    before a full collection: buffered `Reading`s (each with its own dict) would
    be scanned by every full collection of the training process and bring those sooner
    (bench/bench_torch.py's `grad ms`). Per-unit arrays, a histogram and bounds included."""
    rng = np.random.default_rng(0)
    with actrace.Writer(tmp_path / "g.parquet", flush_every=10**6) as w:
        for step in range(3):
            w.record_activation(step, "act", np.tanh(rng.normal(size=(16, 4))).astype(np.float32), kind="tanh")
            w.record_param_grad(step, "fc", "weight", rng.normal(size=(4, 3)))
            w.log(step, loss=1.0 / (step + 1))
        gc.collect(), gc.collect()
        assert len(w._rows) == 9 and not any(gc.is_tracked(row) for row in w._rows)
    rows = actrace.read_table(tmp_path / "g.parquet").to_pylist()
    assert len(rows) == 9 and {r["stream"] for r in rows} == {"activation", "param_grad", "scalar"}
    assert all(r["bound_lo"] == -1.0 for r in rows if r["kind"] == "tanh") and validate(tmp_path / "g.parquet") == []


def test_layer_totals_are_written_as_their_readings_would_be(tmp_path):
    """`record_totals` makes a per-step gradient reading's rows straight from its totals, with rows
    kept from the step before: the same trace as `record_many` of the batch's readings, through a
    loss scale, a NaN and an inf, a 0-d tensor, a tensor missing at one step (rows made anew), a
    name the spec escapes, and a step that does not grow (dropped and said)."""
    from actrace.reduce.reading import LayerTotals

    rng = np.random.default_rng(0)
    names = ["conv.weight", "bn\u202e", "head"]
    every = [dict(layer=n, kind="linear", stream="param_grad", param="weight") for n in names]

    def totals(x):
        f = x[np.isfinite(x)].astype(np.float64)
        return [f.sum(), (f ** 2).sum(), (f ** 3).sum(), (f ** 4).sum(), f.min(), f.max(), float((f == 0).sum()),
                float(np.isnan(x).sum()), float(np.isinf(x).sum())]

    batches = []
    for step, kept, scale in [(0, [0, 1, 2], 1.0), (1, [0, 1, 2], 1024.0), (2, [0, 2], 1.0), (2, [0, 1, 2], 1.0),
                              (3, [0, 1, 2], 8.0)]:
        arrays = [rng.normal(size=(5, 3)).astype(np.float32), rng.normal(size=(7,)).astype(np.float32),
                  np.float32(rng.normal(size=()))]
        if step == 1:
            arrays[1][[2, 4]] = [np.nan, -np.inf]
        batches.append((step, LayerTotals([totals(arrays[i]) for i in kept], [arrays[i].shape for i in kept],
                                          ["float32"] * len(kept), every if len(kept) == 3 else [every[i] for i in kept],
                                          scale)))
    tables = []
    for way in ("totals", "readings"):
        with actrace.Writer(tmp_path / f"{way}.parquet", run="r", mode="train") as w, \
                pytest.warns(UserWarning, match="step 2 for param_grad of layer 'conv.weight'.* recorded already"), \
                pytest.warns(UserWarning, match="name 'bn.*escaped"):
            for step, batch in batches:
                indexes = [{"conv.weight": 3, "bn\u202e": 1, "head": 2}[m["layer"]] for m in batch.metas]
                if way == "totals":
                    w.record_totals(step, batch, layer_indexes=indexes, mode="skipped" if step == 1 else None)
                else:
                    w.record_many(step, batch.readings(), layer_indexes=indexes, mode="skipped" if step == 1 else None)
        tables.append(actrace.read_table(tmp_path / f"{way}.parquet").drop_columns("wall_time"))
        assert validate(tmp_path / f"{way}.parquet") == []
    by_totals, by_readings = tables
    assert by_totals.equals(by_readings)
    rows = by_totals.to_pylist()
    assert len(rows) == 3 + 3 + 2 + 1 + 3 and rows[7]["layer"] == "head"  # step 2 again: only the new one kept
    assert rows[8]["layer"] == rows[1]["layer"] and rows[8]["step"] == 2
    assert rows[3]["mode"] == "skipped" and rows[1]["layer"] != names[1]
    assert (rows[4]["nan_count"], rows[4]["inf_count"], rows[4]["count"]) == (1, 1, 7)
    assert rows[3]["sumsq"] == pytest.approx(batches[1][1].totals[0][1] / 1024 ** 2)
    assert (rows[2]["shape"], rows[2]["unit_axis"], rows[2]["units"]) == ([], None, 1)


def test_what_a_reader_would_refuse_is_refused_when_recorded_and_the_rest_kept(tmp_path):
    """Spec §Validity's rules a single reading can break, said at the call that breaks them, naming the
    layer or the step, never left for the reader to refuse the whole trace over (or, for a step past
    int64, for the close to lose it): an empty layer name, a clip without bounds or with lo ≥ hi, a
    step that is no whole number or does not fit int64, a config that is no JSON object. The
    readings before them are written, and the trace validates."""
    from actrace.files.validate import validate

    h = np.ones((4, 3), np.float32)
    with pytest.raises(TypeError, match="config must be a dict"):
        actrace.Writer(tmp_path / "c.parquet", config=[1, 2])
    assert not list(tmp_path.iterdir())  # refused before any lock or folder
    path = tmp_path / "t.parquet"
    with actrace.Writer(path) as w:
        w.record_activation(0, "fc", h, kind="relu")
        for call, said in [(lambda: w.record_activation(1, "", h, kind="relu"), "with an empty layer name"),
                           (lambda: w.record_activation(1, "c", h, kind="clip"), "layer 'c': a clip layer's bounds"),
                           (lambda: w.record_activation(1, "c", h, kind="clip", bounds=(1, 1)), "not (1, 1)"),
                           (lambda: w.record_activation(2 ** 63, "fc", h, kind="relu"), "step 9223372036854775808"),
                           (lambda: w.record_activation(1.5, "fc", h, kind="relu"), "step 1.5: a step is a whole")]:
            with pytest.raises(ValueError, match=re.escape(said)):
                call()
        w.record_activation(1, "fc", h, kind="relu")
        w.record_activation(2, "c", h, kind="clip", bounds=(0, 6))
    assert validate(path) == [] and actrace.read_table(path)["step"].to_pylist() == [0, 1, 2]


def test_a_config_holding_nan_or_inf_is_written_as_strict_json(tmp_path):
    """JSON has no number for NaN or ±Inf: a config holding them (a float, a numpy float, nested in
    a list) keeps each as its string, so a strict parser (jq, a browser, DuckDB) reads the trace's
    config, and the finite values stay numbers."""
    path = tmp_path / "t.parquet"
    config = {"lr": 1e-3, "clip": float("inf"), "decay": np.float64("nan"), "betas": [0.9, float("-inf")]}
    with actrace.Writer(path, config=config) as w:
        w.record_activation(0, "fc", np.ones((2, 3), np.float32), kind="relu")
    text = metadata.read(path)["config"]
    strict = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON: {text}"))
    assert strict == {"lr": 1e-3, "clip": "inf", "decay": "nan", "betas": [0.9, "-inf"]}
