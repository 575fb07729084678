"""`actrace demo`: each pathology appears in its run and is found; the healthy run stays silent."""
from __future__ import annotations

import polars as pl
import pytest

from actrace.analyzer.compare import align
from actrace.analyzer import analyze
from actrace.analyzer.metrics import metrics
from actrace.files.validate import validate


@pytest.fixture(scope="module")
def demo(demo_run):
    out, res = demo_run
    m = metrics(out / "runs")
    return out, res, m, analyze(out / "runs").findings


def _found(found, run):
    return {(f.rule, f.layer) for f in found if f.run == run}


def test_demo_writes_valid_traces_and_a_report_and_says_where(demo):
    out, res, _, _ = demo
    assert sorted(p.stem for p in (out / "runs").glob("*.parquet")) == [
        "dying-relu", "dying-relu-onnx", "healthy-relu", "lstm-forget-open", "nan-loss", "saturated-tanh",
        "vanishing-sigmoid"]
    assert validate(out / "runs") == []
    assert (out / "report.html").stat().st_size > 100_000
    assert f"report:  {out / 'report.html'}" in res.stdout and "[1/8] PyTorch: training" in res.stderr


def test_healthy_run_has_no_finding(demo):
    assert _found(demo[3], "healthy-relu") == set()


def test_dying_relu_is_found_growing_from_the_lr_jump_in_pytorch_and_in_its_onnx_export(demo):
    """The learning rate is raised 30x at step 200: from there ReLU units die, more and more."""
    for run in ("dying-relu", "dying-relu-onnx"):  # the export's readings carry the module names
        growing = [f for f in demo[3] if f.run == run and f.rule == "dead_growing"]
        assert growing and all(f.layer.startswith("relu") and 160 <= f.step <= 200 for f in growing)


def test_saturated_tanh_is_found_in_its_tanh_layers(demo):
    assert {("saturation_high", f"tanh{i}") for i in (2, 3, 4)} <= _found(demo[3], "saturated-tanh")


def test_the_lstm_forget_gate_is_found_pinned_open_and_nothing_else_in_it(demo):
    found = [f for f in demo[3] if f.run == "lstm-forget-open"]
    assert {(f.rule, f.layer) for f in found} == {("saturation_high", "lstm.l0.forget_gate"),
                                                  ("units_pinned", "lstm.l0.forget_gate")}
    assert any("forget gate of layer 0 pinned open" in f.evidence for f in found)


def test_vanishing_gradients_are_found_at_the_first_layer(demo):
    assert ("vanishing_gradients", "fc1") in _found(demo[3], "vanishing-sigmoid")


def test_a_ramping_learning_rate_is_said_to_explode_before_the_nan_it_ends_in(demo):
    found = [f for f in demo[3] if f.run == "nan-loss"]
    (nan,) = [f for f in found if f.rule == "nan_inf"]
    (boom,) = [f for f in found if f.rule == "exploding_gradients"]
    assert 200 < boom.step < nan.step <= 300 and nan.stream == "activation"  # the forward layer it starts in
    assert not [f for f in found if f.rule.startswith("dead")]  # NaN is not death


def test_pytorch_and_onnx_readings_of_the_same_checkpoints_agree(demo):
    m = align(demo[2].filter(pl.col("run").is_in(["dying-relu", "dying-relu-onnx"])
                             & (pl.col("kind") == "relu") & (pl.col("stream") == "activation")))
    onnx = m.filter(pl.col("run") == "dying-relu-onnx").select("aligned", "step", "dead_fraction")
    torch = m.filter(pl.col("run") == "dying-relu").select("aligned", "step", "dead_fraction")
    joined = onnx.join(torch, on=["aligned", "step"], suffix="_torch")
    assert joined.height == 4 * 5  # four ReLU layers at five checkpoints
    assert (joined["dead_fraction"] == joined["dead_fraction_torch"]).all()
