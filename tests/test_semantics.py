"""Spec 1.1's analysis semantics on models whose truth is known by construction: saturation on a
kind's saturating side(s), exact for any bounds; units pinned; the NaN origin; trends over a
window; float64 extremes; findings as data; one reading per key. Both directions each."""
from __future__ import annotations

import json
import warnings

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

import actrace
from actrace.adapters.torch import Monitor
from actrace.analyzer.findings import FINDING_COLUMNS, Rules, findings
from actrace.analyzer.metrics import Thresholds, metrics
from actrace.files.validate import validate


def probe_reading(model, probe, path):
    with Monitor(model, probe, path, grad_every=None) as mon:
        mon.probe_reading(0)
    return path


def act(path, layer, th=Thresholds()) -> dict:
    m = metrics(path, th).filter((pl.col("stream") == "activation") & (pl.col("layer") == layer))
    return m.row(0, named=True)


def linear_relu6(bias: float) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU6())
    with torch.no_grad():
        model[0].bias.add_(bias)
    return model


@pytest.mark.parametrize("t", [0.99, 0.9])
def test_relu6_zeros_are_not_saturation_but_outputs_at_six_are(tmp_path, t, cli):
    probe = torch.randn(256, 16)
    fresh = probe_reading(linear_relu6(0.0), probe, tmp_path / "fresh.parquet")
    pinned = probe_reading(linear_relu6(100.0), probe, tmp_path / "pinned.parquet")
    out = linear_relu6(0.0)(probe).detach().numpy()
    r = act(fresh, "1", Thresholds(sat_threshold=t))
    assert r["sparsity"] > 0.3  # plenty of zeros ...
    assert r["saturation_value"] == pytest.approx((out >= 6 - (1 - t) * 6).mean())  # ... none of them saturation
    assert r["saturation_value"] < 0.05
    assert act(pinned, "1", Thresholds(sat_threshold=t))["saturation_value"] == 1.0
    assert act(pinned, "1", Thresholds(sat_threshold=t))["saturation_unit"] == 1.0
    args = ["--sat-threshold", str(t), "--max-saturation", "0.3"]
    assert cli("check", fresh, *args).returncode == 0
    res = cli("check", pinned, *args)
    assert res.returncode == 1 and "  pinned: failed (saturation_high)" in res.stdout and \
        "100% of values and 100% of units saturated" in res.stdout, res.stdout


@pytest.mark.filterwarnings("ignore:actrace. the unit axis")  # an activation of the probe itself: one unit
@pytest.mark.parametrize("t", [0.99, 0.9, 0.999])
def test_hardtanh_with_other_bounds_reads_its_exact_share_at_every_level(tmp_path, t):
    torch.manual_seed(1)
    probe = torch.randn(512, 24) * 2.2  # about 36 % of |x| beyond 2: pinned at ±2
    path = probe_reading(nn.Sequential(nn.Hardtanh(-2.0, 2.0)), probe, tmp_path / "h.parquet")
    h = probe.clamp(-2, 2).double().numpy()
    want = ((h >= 2 - (1 - t) * 2) | (h <= -2 + (1 - t) * 2)).mean()
    assert 0.3 < want < 0.45
    assert act(path, "0", Thresholds(sat_threshold=t))["saturation_value"] == pytest.approx(want, abs=1e-12)


def test_a_wide_near_uniform_softmax_is_not_saturated_and_a_peaked_one_is(tmp_path):
    torch.manual_seed(2)
    logits = torch.randn(64, 200) * 0.1
    uniform = probe_reading(nn.Sequential(nn.Softmax(-1)), logits, tmp_path / "u.parquet")
    peaked = probe_reading(nn.Sequential(nn.Softmax(-1)), logits * 1000, tmp_path / "p.parquet")
    assert torch.softmax(logits, -1).max() < 0.01
    assert act(uniform, "0")["saturation_value"] == 0.0 and act(uniform, "0")["saturation_unit"] == 0.0
    p = torch.softmax(logits * 1000, -1).double().numpy()
    # the share of distributions (rows over the 200 units) whose largest probability is ≥ 0.99
    assert act(peaked, "0")["saturation_value"] == pytest.approx((p.max(-1) >= 0.99).mean(), abs=1e-12)
    assert act(peaked, "0")["saturation_value"] > 0.5 > (p >= 0.99).mean()  # per value it would read < 1/200


def test_a_softmax_with_no_value_to_read_has_no_saturation_and_a_nan_gradient_no_norm(tmp_path):
    rng = np.random.default_rng(3)
    p = np.exp(rng.normal(size=(32, 5)))
    p /= p.sum(1, keepdims=True)
    with actrace.Writer(tmp_path / "s.parquet", run="s") as w:
        w.record_activation(0, "probs", p, kind="softmax")
        w.record_activation(1, "probs", np.full((32, 5), np.nan), kind="softmax")  # diverged
        w.record_activation(0, "quiet", p, kind="softmax", histogram=False)
        w.record_activation_grad(0, "probs", np.full((32, 5), np.nan), kind="softmax")
    m = metrics(tmp_path / "s.parquet").sort("layer", "stream", "step")
    probs = m.filter((pl.col("layer") == "probs") & (pl.col("stream") == "activation"))
    assert probs["saturation_value"][0] == 0.0 and np.isnan(probs["saturation_value"][1])  # not 100 %
    assert not [f for f in findings(m) if f.rule.startswith("saturation")]
    quiet = metrics(tmp_path / "s.parquet", Thresholds(sat_threshold=0.95)).filter(pl.col("layer") == "quiet")
    assert quiet["saturation_value"].to_list() == [None]  # no histogram, no count at 0.95: nothing to say
    grad = m.filter(pl.col("stream") == "activation_grad")
    assert np.isnan(grad["norm"][0]) and np.isnan(grad["grad_norm"][0])


def tanh_with_pinned_units(n_pinned: int) -> nn.Module:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 20), nn.Tanh())
    with torch.no_grad():
        model[0].weight.mul_(0.1)
        model[0].bias[:n_pinned] = 50.0  # these units sit at +1 for every input
    return model


def test_units_pinned_for_every_input_are_a_finding_and_a_check(tmp_path, cli):
    probe = torch.randn(128, 8)
    bad = probe_reading(tanh_with_pinned_units(6), probe, tmp_path / "bad.parquet")
    good = probe_reading(tanh_with_pinned_units(0), probe, tmp_path / "good.parquet")
    assert act(bad, "1")["saturation_unit"] == pytest.approx(6 / 20)
    assert act(bad, "1")["saturation_value"] == pytest.approx(6 / 20)  # below max_saturation 0.3: not that rule
    rules = {(f.rule, f.layer) for f in findings(metrics(bad))}
    assert ("units_pinned", "1") in rules and ("saturation_high", "1") not in rules
    assert not [f for f in findings(metrics(good)) if f.rule == "units_pinned"]
    assert not [f for f in findings(metrics(bad), Rules(max_saturation_units=0.4)) if f.rule == "units_pinned"]
    res = cli("check", bad, "--max-saturation-units", "0.2")
    assert res.returncode == 1 and "  bad: failed (units_pinned)" in res.stdout and \
        "30% of units pinned at a bound for every probe input" in res.stdout, res.stdout
    assert cli("check", good, "--max-saturation-units", "0.2").returncode == 0


def test_a_nan_is_reported_at_the_forward_layer_where_it_starts(tmp_path):
    torch.manual_seed(4)
    model = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(8, 8), nn.Tanh())])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with Monitor(model, torch.randn(16, 8), tmp_path / "n.parquet", probe_every=1, grad_every=1) as mon:
        for step in range(5):
            if step == 3:
                with torch.no_grad():
                    model[4].weight[0, 0] = float("inf")  # layer 4 overflows in the forward from here
            opt.zero_grad()
            model(torch.randn(32, 8)).square().mean().backward()
            mon.step(step)
            opt.step()
    (f,) = [f for f in findings(metrics(tmp_path / "n.parquet")) if f.rule == "nan_inf"]
    assert (f.layer, f.stream, f.step) == ("4", "activation", 3)
    assert "gradients non-finite from step 3" in f.evidence
    raw = actrace.read_table(tmp_path / "n.parquet").to_pylist()
    assert any(r["step"] == 3 and r["stream"] == "param_grad" and r["layer"] == "0" and r["nan_count"] for r in raw)


def write_dead_series(path, run, fractions, steps):
    """A 20-unit ReLU layer whose first round(f·20) units are zero for every input, per step."""
    rng = np.random.default_rng(0)
    with actrace.Writer(path, run=run) as w:
        for step, f in zip(steps, fractions):
            x = np.abs(rng.normal(size=(64, 20))) + 0.1
            x[:, : round(f * 20)] = 0
            w.record_activation(step, "relu", x.astype(np.float32), kind="relu", unit_axis=1)


@pytest.mark.parametrize("growth", [0.05, 0.1])
def test_an_early_rise_that_stopped_is_a_stable_tax_and_a_climbing_layer_is_growing(tmp_path, growth):
    steps = list(range(0, 1100, 100))
    write_dead_series(tmp_path / "early.parquet", "early", [0, .3, .45] + [.45] * 8, steps)
    write_dead_series(tmp_path / "climbing.parquet", "climbing", [0, 0, .05, .05, .1, .1, .15, .2, .25, .3, .35], steps)
    found = findings(metrics(tmp_path), Rules(dead_growth=growth))
    rules = [(f.rule, f.run) for f in found]
    assert ("dead_high", "early") in rules and ("dead_growing", "early") not in rules
    assert ("dead_growing", "climbing") in rules
    assert rules.index(("dead_growing", "climbing")) < rules.index(("dead_high", "early"))  # trend beats level
    early = next(f for f in found if f.run == "early")
    assert early.step == 200 and f"within {growth / 2:.0%} of that since step 200" in early.evidence


def test_a_layer_dying_slowly_while_many_of_its_units_are_dead_is_still_growing(tmp_path):
    """A unit killed every few steps (+16 points over the recent half) is not a stable tax: above
    `max_dead`, half the rise `dead_growth` asks of a layer with few dead units is dying; the same
    slow rise below it is attrition."""
    steps = list(range(0, 1100, 100))
    write_dead_series(tmp_path / "slow.parquet", "slow", [0, .05, .05, .1, .1, .15, .15, .2, .25, .25, .3], steps)
    write_dead_series(tmp_path / "few.parquet", "few", [0, 0, 0, 0, .05, .05, .05, .1, .1, .15, .15], steps)
    found = {f.run: f for f in findings(metrics(tmp_path))}
    assert found["slow"].rule == "dead_growing" and "to 30% at step 1000" in found["slow"].evidence
    assert "few" not in found


def test_float64_extremes_below_float32_are_rounded_outward_not_to_zero(tmp_path):
    with actrace.Writer(tmp_path / "t.parquet", run="t") as w:
        w.record_activation(0, "tiny", np.full((8, 4), 1e-50), kind="linear", unit_axis=1)
        w.record_activation(0, "-tiny", np.full((8, 4), -1e-50), kind="linear", unit_axis=1)
        w.record_activation(0, "zero", np.zeros((8, 4)), kind="linear", unit_axis=1)
    row = {r["layer"]: r for r in actrace.read_table(tmp_path / "t.parquet").to_pylist()}
    assert all(0 <= v <= 1e-50 for v in row["tiny"]["unit_min"])  # never above the true minimum (0 here)
    assert all(v >= 1e-50 for v in row["tiny"]["unit_max"])        # never below the true maximum (nonzero)
    m = metrics(tmp_path / "t.parquet").filter(pl.col("stream") == "activation")
    dead = dict(zip(m["layer"], m["dead_fraction"]))
    assert dead == {"tiny": 0.0, "-tiny": 0.0, "zero": 1.0}
    assert metrics(tmp_path / "t.parquet", Thresholds(dead_eps=1e-40))["dead_fraction"].to_list() == [1.0] * 3


def test_findings_come_as_json_and_csv_records_with_the_texts_content(tmp_path, cli):
    probe = torch.randn(128, 8)
    probe_reading(tanh_with_pinned_units(6), probe, tmp_path / "bad.parquet")
    res = cli("findings", tmp_path / "bad.parquet", "--format", "json")
    assert res.returncode == 0, res.stderr
    records = json.loads(res.stdout)
    assert {"severity", "rule", "run", "layer", "stream", "step", "evidence", "advice", "score"} <= set(records[0])
    (pinned,) = [r for r in records if r["rule"] == "units_pinned"]
    assert (pinned["layer"], pinned["stream"], pinned["severity"]) == ("1", "activation", "warning")
    csv = cli("findings", tmp_path / "bad.parquet", "--format", "csv").stdout.splitlines()
    assert csv[0] == ",".join(FINDING_COLUMNS) and len(csv) == len(records) + 1
    text = cli("findings", tmp_path / "bad.parquet").stdout
    assert pinned["evidence"] in text


def test_a_step_that_restarts_is_dropped_by_the_writer_naming_layer_and_steps_without_raising(tmp_path):
    with actrace.Writer(tmp_path / "r.parquet", run="r") as w:
        w.record_activation(5, "fc", np.ones((2, 3), np.float32), kind="relu")
        w.record_param_grad(5, "fc", "weight", np.ones((3, 3), np.float32))  # another stream: fine
        with pytest.warns(UserWarning, match=r"step 0 for activation of layer 'fc' is not after step 5"):
            w.record_activation(0, "fc", np.ones((2, 3), np.float32), kind="relu")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once: the next restart is dropped in silence
            w.record_activation(1, "fc", np.ones((2, 3), np.float32), kind="relu")
        w.record_activation(6, "fc", np.zeros((2, 3), np.float32), kind="relu")
    assert [(r["step"], r["stream"]) for r in actrace.read_table(tmp_path / "r.parquet").to_pylist()] == [
        (5, "activation"), (5, "param_grad"), (6, "activation")]
    assert validate(tmp_path / "r.parquet") == []


def test_a_reading_twice_in_one_batch_is_kept_once_and_said(tmp_path):
    """Two readings of one (layer, stream, param) handed over together at one step: the first is the
    trace's, the second is dropped and said, as one handed over later would be."""
    from actrace.reduce import reduce_array

    first, second = (reduce_array(np.full((2, 3), v, np.float32), 1, "relu", layer="fc") for v in (1.0, 2.0))
    with actrace.Writer(tmp_path / "r.parquet", run="r") as w:
        with pytest.warns(UserWarning, match="step 4 for activation of layer 'fc' was recorded already") as said:
            w.record_many(4, [first, second])
    assert said[0].filename == __file__  # said where the readings were handed over
    rows = actrace.read_table(tmp_path / "r.parquet").to_pylist()
    assert [(r["step"], r["sum"]) for r in rows] == [(4, 6.0)]
    assert validate(tmp_path / "r.parquet") == []


def test_duplicate_readings_made_elsewhere_are_reported_and_shown_once(tmp_path, cli):
    with actrace.Writer(tmp_path / "a.parquet", run="a") as w:
        for step in (0, 1):
            w.record_activation(step, "fc", np.full((2, 3), step, np.float32), kind="relu")
    t = pq.read_table(tmp_path / "a.parquet")
    again = t.slice(0, 1)  # step 0 once more, as a hand-made merge of two traces might
    pq.write_table(pa.concat_tables([t, again]).replace_schema_metadata(t.schema.metadata), tmp_path / "d.parquet")
    res = cli("validate", tmp_path / "d.parquet")
    assert res.returncode == 1 and "a second reading of one (run, layer, stream, param, step)" in res.stdout
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = metrics(tmp_path / "d.parquet")
    assert m.height == 2 and "1 reading(s) repeat" in str(caught[0].message)
    summary = cli("summary", tmp_path / "d.parquet")
    assert "warning: " in summary.stderr and "repeat a (run, layer, stream, param, step)" in summary.stderr


def test_the_monitor_records_one_reading_per_step_and_names_a_restart(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    with Monitor(model, torch.randn(8, 4), tmp_path / "m.parquet") as mon:
        mon.probe_reading(10)
        with pytest.warns(UserWarning, match="step 10 for activation of layer '0' was recorded already"):
            mon.probe_reading(10)  # a final reading at the step the loop read: the first stands
        with pytest.warns(UserWarning, match="step 3 for activation of layer '0' is not after step 10"):
            mon.probe_reading(3)  # a restart is said, and dropped: training goes on
    steps = [r["step"] for r in actrace.read_table(tmp_path / "m.parquet").to_pylist()]
    assert steps == [10, 10]  # layers 0 and 1, once each


def test_an_unclosed_writer_keeps_its_readings_and_a_failed_run_says_so(tmp_path, cli):
    import subprocess
    import sys

    script = ("import numpy as np, actrace\n"
              f"w = actrace.Writer({str(tmp_path / 'open.parquet')!r}, run='open', flush_every=10**9)\n"
              "for s in range(30): w.record_activation(s, 'fc', np.ones((2, 2), np.float32), kind='relu')\n")
    assert subprocess.run([sys.executable, "-c", script]).returncode == 0  # no with, no close()
    assert actrace.read_table(tmp_path / "open.parquet").num_rows == 30
    with pytest.raises(RuntimeError):
        with actrace.Writer(tmp_path / "failed.parquet", run="failed") as w:
            w.record_activation(0, "fc", np.ones((2, 2), np.float32), kind="relu")
            raise RuntimeError("diverged")
    inspect = cli("inspect", tmp_path / "failed.parquet").stdout
    assert "status failed: RuntimeError" in inspect
    killed = ("import os, numpy as np, actrace\n"
              f"w = actrace.Writer({str(tmp_path / 'killed.parquet')!r}, run='killed', flush_every=5)\n"
              "for s in range(12): w.record_activation(s, 'fc', np.ones((2, 2), np.float32), kind='relu')\n"
              "os.kill(os.getpid(), 9)\n")
    assert subprocess.run([sys.executable, "-c", killed]).returncode == -9  # no exit handler runs
    found = cli("findings", tmp_path / "failed.parquet", tmp_path / "open.parquet", tmp_path / "killed.parquet.parts",
                "--format", "json").stdout
    assert [(f["rule"], f["run"]) for f in json.loads(found)] == [("run_failed", "failed"),
                                                                ("run_unfinished", "killed")]


def test_the_monitor_reads_the_end_of_a_short_run_and_says_when_no_gradient_came(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, torch.randn(8, 4), tmp_path / "m.parquet", probe_every=200) as mon:
        with pytest.warns(UserWarning, match="no gradient arrived"):
            mon.step(0)  # before backward(): nothing to read
        for step in range(1, 150):
            opt.zero_grad()
            model(torch.randn(16, 4)).sum().backward()
            mon.step(step)
            opt.step()
    probe_steps = sorted({r["step"] for r in actrace.read_table(tmp_path / "m.parquet").to_pylist()
                          if r["stream"] == "activation"})
    assert probe_steps == [0, 149]  # the first and, whatever probe_every says, the last


def test_a_reading_of_nan_and_zeros_or_a_softmax_s_zeros_are_not_dead_units(tmp_path):
    """A ReLU layer whose values are NaN but for exact zeros (padding) holds no number to call a unit
    dead by: nan_inf names it, dead_high does not; a router softmax whose first 2 of 8 experts get
    exactly 0 (masked) has no dead units either (an expert nobody picks is dead_expert's), while a
    ReLU layer with 2 of 8 units zero for every input is 25 % dead."""
    rng = np.random.default_rng(0)
    with actrace.Writer(tmp_path / "t.parquet", run="t") as w:
        for step in range(0, 60, 10):
            h = np.abs(rng.normal(size=(32, 8))).astype(np.float32)
            if step >= 30:
                h[:, :] = np.nan
                h[::2, :] = 0  # the padding positions' zeros
            w.record_activation(step, "emb", h, kind="relu")
            p = rng.random(size=(32, 8))
            p[:, :2] = 0
            w.record_activation(step, "router", (p / p.sum(1, keepdims=True)).astype(np.float32), kind="softmax")
            k = np.abs(rng.normal(size=(32, 8))).astype(np.float32)
            k[:, :2] = 0
            w.record_activation(step, "relu", k, kind="relu")
    found = [(f.rule, f.layer) for f in findings(metrics(tmp_path))]
    assert ("nan_inf", "emb") in found and ("dead_high", "relu") in found, found
    assert not [f for f in found if f[0].startswith("dead") and f[1] != "relu"], found


def test_mean_drift_is_said_of_a_layer_whose_biased_values_feed_another_not_of_the_output(tmp_path):
    """By construction, fc1 and the output layer both hold values at mean 5, std 1: fc1 feeds the next
    layer biased inputs (mean_drift); the output (a regression's target near 5, a softmax's logits)
    feeds none."""
    rng = np.random.default_rng(0)
    with actrace.Writer(tmp_path / "t.parquet", run="t") as w:
        for step in range(0, 40, 10):
            for layer, kind in (("fc1", "linear"), ("relu1", "relu"), ("out", "linear")):
                h = rng.normal(5.0, 1.0, size=(64, 8)) if kind == "linear" else np.abs(rng.normal(size=(64, 8)))
                w.record_activation(step, layer, h.astype(np.float32), kind=kind)
    assert [(f.rule, f.layer) for f in findings(metrics(tmp_path)) if f.rule == "mean_drift"] == [("mean_drift", "fc1")]


def test_a_hidden_layer_driven_into_its_bounds_is_growing_saturation_and_a_confident_output_is_not(tmp_path):
    """By construction, over 11 readings: a hidden tanh layer whose inputs grow ×1.5 per reading (its
    saturated share climbing past 30 % to ~all) is saturation_growing, critical; the same growth in
    the model's output sigmoid (a classifier growing confident) and in a softmax is learning: no
    critical finding; a tanh saturated as much from the first reading is saturation_high, a warning."""
    rng = np.random.default_rng(0)
    with actrace.Writer(tmp_path / "t.parquet", run="t") as w:
        for i, step in enumerate(range(0, 1100, 100)):
            x = rng.normal(size=(128, 16)) * 0.3 * 1.5 ** i
            w.record_activation(step, "tanh1", np.tanh(x).astype(np.float32), kind="tanh")
            w.record_activation(step, "tanh2", np.tanh(x * 0 + rng.normal(size=x.shape) * 30).astype(np.float32),
                                kind="tanh")
            e = np.exp(x - x.max(1, keepdims=True))
            w.record_activation(step, "attn", (e / e.sum(1, keepdims=True)).astype(np.float32), kind="softmax")
            w.record_activation(step, "out", (1 / (1 + np.exp(-x))).astype(np.float32), kind="sigmoid")
    found = {(f.rule, f.layer): f.severity for f in findings(metrics(tmp_path))}
    assert found[("saturation_growing", "tanh1")] == "critical"
    assert found[("saturation_high", "tanh2")] == "warning"
    assert [key for key, severity in found.items() if severity == "critical"] == [("saturation_growing", "tanh1")]
