"""ONNX Runtime adapter: models built with onnx.helper, checkpoint series, and clear errors for
bad models and probes (agreement with the PyTorch adapter: tests/test_onnx_agreement.py)."""
from __future__ import annotations

import numpy as np
import onnx
import polars as pl
import pytest
from onnx import TensorProto, helper, numpy_helper

import actrace
from actrace.adapters.onnx import record_onnx
from actrace.analyzer.metrics import metrics
from actrace.files.validate import validate


def helper_model(path, bias: float = 0.0, batch="N", external: bool = False):
    """x[N,8] → Gemm(16) → Relu → Gemm(4) → Clip(0,6) → Tanh, built by hand."""
    rng = np.random.default_rng(0)
    w1, b1 = rng.normal(size=(8, 16)).astype(np.float32), np.full(16, bias, np.float32)
    w2 = rng.normal(size=(16, 4)).astype(np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"),
                                                       (np.array(0, np.float32), "lo"), (np.array(6, np.float32), "hi"))]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h1"], name="fc1"),
             helper.make_node("Relu", ["h1"], ["a1"], name="fc1.relu"),
             helper.make_node("MatMul", ["a1", "w2"], ["h2"], name="fc2"),
             helper.make_node("Clip", ["h2", "lo", "hi"], ["c2"], name="relu6"),
             helper.make_node("Tanh", ["c2"], ["y"], name="out.tanh")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    if external:
        onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location=path.name + ".data",
                  size_threshold=0)
    else:
        onnx.save(model, path)
    return path


def test_records_every_activation_and_affine_output_with_kinds_and_bounds(tmp_path):
    model = helper_model(tmp_path / "m.onnx", bias=-100.0)
    np.save(tmp_path / "probe.npy", np.random.default_rng(1).normal(size=(40, 8)).astype(np.float32))
    record_onnx([model], tmp_path / "probe.npy", tmp_path / "t.parquet", chunk=16, progress=False)
    assert validate(tmp_path / "t.parquet") == []
    rows = actrace.read_table(tmp_path / "t.parquet").to_pylist()
    assert [(r["layer"], r["kind"], r["units"]) for r in rows] == [
        ("fc1", "linear", 16), ("fc1.relu", "relu", 16), ("fc2", "linear", 4), ("relu6", "relu6", 4),
        ("out.tanh", "tanh", 4)]
    assert rows[0]["shape"] == [40, 16] and rows[1]["zero_count"] == 40 * 16  # bias -100: all dead
    m = metrics(tmp_path / "t.parquet")
    assert m.filter(pl.col("layer") == "fc1.relu")["dead_fraction"][0] == 1.0


def test_layer_and_op_type_selection(tmp_path):
    model = helper_model(tmp_path / "m.onnx")
    np.save(tmp_path / "p.npy", np.ones((4, 8), np.float32))
    record_onnx([model], tmp_path / "p.npy", tmp_path / "a.parquet", op_types="Relu,Tanh", progress=False)
    assert actrace.read_table(tmp_path / "a.parquet")["layer"].to_pylist() == ["fc1.relu", "out.tanh"]
    record_onnx([model], tmp_path / "p.npy", tmp_path / "b.parquet", layers=["fc*"], progress=False)
    assert actrace.read_table(tmp_path / "b.parquet")["layer"].to_pylist() == ["fc1", "fc1.relu", "fc2"]


def test_the_model_file_is_never_changed_and_external_data_works(tmp_path):
    model = helper_model(tmp_path / "ext.onnx", external=True)
    before = model.read_bytes()
    np.save(tmp_path / "p.npy", np.ones((4, 8), np.float32))
    record_onnx([model], tmp_path / "p.npy", tmp_path / "t.parquet", progress=False)
    assert model.read_bytes() == before and len(actrace.read_table(tmp_path / "t.parquet")) == 5


def test_checkpoint_series_is_read_in_step_order(cli, tmp_path):
    for step, bias in ((300, -100.0), (100, 0.0), (1000, 5.0)):
        helper_model(tmp_path / f"step_{step}.onnx", bias=bias)
    np.savez(tmp_path / "probe.npz", x=np.random.default_rng(2).normal(size=(32, 8)).astype(np.float32))
    res = cli("record", tmp_path / "step_*.onnx", "--probe", tmp_path / "probe.npz", "-o", tmp_path / "b.parquet",
              "--run", "teamB")
    assert res.returncode == 0, res.stderr
    assert "b.parquet" in res.stderr and "\r" not in res.stderr and "\\x0d" not in res.stderr  # no bar into a pipe
    t = actrace.read_table(tmp_path / "b.parquet")
    assert sorted(set(t["step"].to_pylist())) == [100, 300, 1000]
    relu = [r for r in t.to_pylist() if r["layer"] == "fc1.relu"]
    assert [(r["step"], r["zero_count"] == r["count"]) for r in relu] == [(100, False), (300, True), (1000, False)]
    res = cli("record", tmp_path / "step_*.onnx", "--probe", tmp_path / "probe.npz", "-o", tmp_path / "c.parquet",
              "--steps", "1,2,3", "-q")
    assert sorted(set(actrace.read_table(tmp_path / "c.parquet")["step"].to_pylist())) == [1, 2, 3]


def test_fixed_batch_models_and_several_inputs(tmp_path):
    x = helper.make_tensor_value_info("a", TensorProto.FLOAT, [4, 3])
    y = helper.make_tensor_value_info("b", TensorProto.FLOAT, [4, 3])
    out = helper.make_tensor_value_info("s", TensorProto.FLOAT, [4, 3])
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["ab"], name="add"),
                               helper.make_node("Sigmoid", ["ab"], ["s"], name="sig")], "two", [x, y], [out])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "two.onnx")
    np.savez(tmp_path / "p.npz", a=np.zeros((12, 3), np.float32), b=np.full((12, 3), 10, np.float32))
    record_onnx([tmp_path / "two.onnx"], tmp_path / "p.npz", tmp_path / "t.parquet", progress=False)
    (row,) = actrace.read_table(tmp_path / "t.parquet").to_pylist()
    assert row["kind"] == "sigmoid" and row["shape"] == [12, 3] and row["bound_hi"] == 1.0


@pytest.mark.parametrize("make,probe,message", [
    (lambda d: d.joinpath("bad.onnx").write_text("not a model") and d / "bad.onnx", "ok", "not an ONNX model"),
    (lambda d: helper_model(d / "m.onnx"), "wrong_name", "no array for input 'x'"),
    (lambda d: helper_model(d / "m.onnx"), "wrong_shape", "expects shape ['N', 8]"),
    (lambda d: helper_model(d / "m.onnx"), "wrong_dtype", "expects tensor(float)"),
    (lambda d: helper_model(d / "m.onnx"), "missing", "no such file"),
    (lambda d: helper_model(d / "m.onnx", batch=16), "ok", "batch size is fixed at 16"),
])
def test_bad_models_and_probes_get_clear_errors(cli, tmp_path, make, probe, message):
    model = make(tmp_path)
    arrays = {"ok": {"x": np.ones((10, 8), np.float32)}, "wrong_name": {"inp": np.ones((10, 8), np.float32)},
              "wrong_shape": {"x": np.ones((10, 5), np.float32)}, "wrong_dtype": {"x": np.ones((10, 8), bool)}}
    if probe in arrays:
        np.savez(tmp_path / "p.npz", **arrays[probe])
    res = cli("record", model, "--probe", tmp_path / "p.npz", "-o", tmp_path / "t.parquet")
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_an_op_onnxruntime_cannot_run_is_named(cli, tmp_path):
    graph = helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["y"], name="weird", domain="nowhere.org"),
                               helper.make_node("Relu", ["y"], ["z"], name="r")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("nowhere.org", 1)])
    onnx.save(model, tmp_path / "w.onnx")
    np.save(tmp_path / "p.npy", np.ones((2, 2), np.float32))
    res = cli("record", tmp_path / "w.onnx", "--probe", tmp_path / "p.npy", "-o", tmp_path / "t.parquet")
    assert res.returncode == 2 and "ONNX Runtime cannot run this model" in res.stderr and "NoSuchOp" in res.stderr


def test_the_progress_bar_is_drawn_on_a_terminal(tmp_path):
    import os
    import pty
    import subprocess
    import sys

    for step in (100, 200):
        helper_model(tmp_path / f"step_{step}.onnx")
    np.save(tmp_path / "p.npy", np.ones((4, 8), np.float32))
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "actrace.cli", "record", str(tmp_path / "step_*.onnx"), "--probe",
                             str(tmp_path / "p.npy"), "-o", str(tmp_path / "t.parquet")], stderr=follower,
                            stdout=subprocess.DEVNULL)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        seen += chunk
    assert proc.wait() == 0
    assert b"2/2" in seen and b"\r" in seen and b"\\x0d" not in seen  # the bar's own carriage returns, raw
