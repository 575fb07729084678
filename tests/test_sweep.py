"""`actrace sweep --by KEY` on sweeps whose answer is known by construction: a readout initialized
with unit-variance weights grows as √width while the hidden layers keep their scale; units die from
the learning rate on where they are made to."""
from __future__ import annotations

import json

import numpy as np
import pytest

import actrace


@pytest.fixture(scope="module")
def widths(tmp_path_factory):
    d = tmp_path_factory.mktemp("widths")
    for w in (16, 32, 64, 128, 256):
        rng = np.random.default_rng(w)
        with actrace.Writer(d / f"w{w}.parquet", run=f"width-{w}", config={"width": w, "seed": w}) as wr:
            for step in (0, 10):
                x = rng.normal(size=(256, 32))
                h = np.maximum(x @ rng.normal(size=(32, w)) * np.sqrt(2 / 32), 0)  # He init: keeps its scale
                wr.record_activation(step, "fc1.relu", h.astype(np.float32), kind="relu")
                wr.record_activation(step, "hidden", (h @ rng.normal(size=(w, 16)) / np.sqrt(w)).astype(np.float32),
                                     kind="linear")
                wr.record_activation(step, "readout", (h @ rng.normal(size=(w, 16))).astype(np.float32), kind="linear")
    return d


def test_a_layer_whose_scale_grows_with_width_is_named_with_its_slope(widths, cli):
    res = cli("sweep", widths, "--by", "width", "--format", "json")
    assert res.returncode == 0, res.stderr
    answer = json.loads(res.stdout)
    assert [s["aligned"] for s in answer["scaling"]] == ["readout"]
    assert answer["scaling"][0]["slope"] == pytest.approx(0.5, abs=0.06)  # √width by construction
    assert answer["also_differ"] == ["seed"]
    text = cli("sweep", widths, "--by", "width").stdout
    assert "readout: slope +0.4" in text or "readout: slope +0.5" in text
    assert "also differ in seed" in text


@pytest.fixture(scope="module")
def rates(tmp_path_factory):
    from traces import relu_layer

    d = tmp_path_factory.mktemp("rates")
    for lr in (0.001, 0.01, 0.1, 1.0):
        rng = np.random.default_rng(0)
        with actrace.Writer(d / f"lr{lr}.parquet", run=f"lr-{lr}", config={"lr": lr}) as wr:
            for step in range(0, 600, 100):
                dying = step // 25 if lr >= 0.1 else 0  # 0 → 20 of 32 units, only from lr 0.1
                wr.record_activation(step, "fc.relu", relu_layer(rng, 32, dying), kind="relu")
    return d


def test_the_learning_rate_from_which_units_die_is_said(rates, cli):
    answer = json.loads(cli("sweep", rates, "--by", "lr", "--format", "json").stdout)
    (onset,) = [o for o in answer["onsets"] if o["rule"] == "dead_growing"]
    assert onset["first"] == 0.1 and onset["runs"] == {"0.001": "0 of 1", "0.01": "0 of 1", "0.1": "1 of 1",
                                                        "1": "1 of 1"}


def test_a_key_the_runs_lack_is_named_with_the_keys_they_have(rates, cli):
    res = cli("sweep", rates, "--by", "width")
    assert res.returncode == 2 and "no numeric 'width' in their config" in res.stderr and "lr" in res.stderr
