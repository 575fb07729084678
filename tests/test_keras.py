"""Keras 3 on the torch and JAX backends: a small CNN with 3 of 8 channels killed by construction,
fused activations read as their kind, NHWC units on the last axis, gradients where kept."""
from __future__ import annotations

import os
import subprocess
import sys

import polars as pl
import pytest

import actrace
from actrace import metadata
from actrace.analyzer.metrics import metrics
from actrace.validate import validate

SCRIPT = """
import numpy as np, keras, warnings
from actrace.adapters.keras import TraceCallback
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
                          keras.layers.BatchNormalization(), keras.layers.Flatten(), keras.layers.Dense(4)])
model.layers[0].bias.assign(np.array([-50.0] * 3 + [0.0] * 5))  # 3 channels below zero for every input
model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
rng = np.random.default_rng(0)
x, y = rng.normal(size=(64, 8, 8, 3)).astype("float32"), rng.integers(0, 4, 64)
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0,
              callbacks=[TraceCallback(probe=x[:32], out=OUT, probe_every=2, run="keras")])
print("WARNED:" + "|".join(str(w.message) for w in said if "actrace" in str(w.message)))
"""


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_a_keras_cnn_is_read_with_its_fused_activation_and_nhwc_units(tmp_path, backend):
    out = tmp_path / f"{backend}.parquet"
    res = subprocess.run([sys.executable, "-c", f"OUT = {str(out)!r}\n" + SCRIPT], capture_output=True, text=True,
                         env=dict(os.environ, KERAS_BACKEND=backend), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert validate(out) == [] and metadata.read(out)["framework"] == "keras"
    acts = {r["layer"]: r for r in actrace.read_table(out).to_pylist() if r["stream"] == "activation"}
    assert {name: (r["kind"], r["unit_axis"], r["units"]) for name, r in acts.items()} == {
        "conv2d": ("relu", 3, 8), "batch_normalization": ("norm", 3, 8), "dense": ("linear", 1, 4)}
    m = metrics(out)
    conv = m.filter((pl.col("layer") == "conv2d") & (pl.col("stream") == "activation"))
    assert conv["step"].to_list() == [0, 2, 3] and set(conv["dead_fraction"]) == {3 / 8}
    grads = m.filter(pl.col("stream") == "param_grad")
    if backend == "torch":
        assert sorted(set(grads["step"])) == [0, 1, 2, 3] and {"conv2d", "dense"} <= set(grads["layer"])
        assert "WARNED:\n" in res.stdout + "\n"
    else:
        assert grads.height == 0 and "keeps no gradients" in res.stdout


AGREE = """
import numpy as np, keras
from actrace.adapters.keras import TraceCallback
w = np.load(WEIGHTS)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Activation("relu"),
                          keras.layers.Dense(4)])
model.layers[0].set_weights([w["w0"].T, w["b0"]])
model.layers[2].set_weights([w["w2"].T, w["b2"]])
model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
cb = TraceCallback(probe=w["probe"], out=OUT, probe_every=1, run="keras")
model.fit(w["probe"][:8], np.zeros((8, 4), "float32"), batch_size=8, epochs=1, verbose=0, callbacks=[cb])
"""


def test_the_same_mlp_in_pytorch_and_keras_reads_the_same_and_aligns(tmp_path, cli):
    import numpy as np
    import torch
    from torch import nn

    from actrace.adapters.torch import Monitor
    from actrace.analyzer.compare import align
    from actrace.analyzer.findings import findings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        model[0].bias[:5] = -30.0  # 5 of 16 units dead in both frameworks
    probe = torch.randn(64, 8)
    np.savez(tmp_path / "w.npz", w0=model[0].weight.detach().numpy(), b0=model[0].bias.detach().numpy(),
             w2=model[2].weight.detach().numpy(), b2=model[2].bias.detach().numpy(), probe=probe.numpy())
    with Monitor(model, probe, tmp_path / "torch.parquet", run="torch") as mon:
        mon.probe_reading(0)
    res = subprocess.run([sys.executable, "-c", f"OUT = {str(tmp_path / 'keras.parquet')!r}\n"
                          f"WEIGHTS = {str(tmp_path / 'w.npz')!r}\n" + AGREE], capture_output=True, text=True,
                         env=dict(os.environ, KERAS_BACKEND="torch"), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    paths = [tmp_path / "torch.parquet", tmp_path / "keras.parquet"]
    m = align(metrics(paths)).filter(pl.col("stream") == "activation")
    pairs = m.group_by("aligned").agg(pl.col("run").sort()).filter(pl.col("run").list.len() == 2)
    assert pairs.height == 3  # linear[0], relu[0], linear[1]: each a pair of the two runs
    by_run = {run: dict(zip(g["aligned"], g["layer"])) for (run,), g in m.group_by(["run"])}
    first = [{r["layer"]: r for r in actrace.read_table(p).to_pylist() if r["stream"] == "activation"
              and r["step"] == 0} for p in paths]
    for aligned in pairs["aligned"]:
        t, k = first[0][by_run["torch"][aligned]], first[1][by_run["keras"][aligned]]
        assert (t["kind"], t["units"], t["count"], t["unit_zero"]) == (k["kind"], k["units"], k["count"], k["unit_zero"])
        for col in ("unit_sum", "unit_sumsq", "unit_min", "unit_max"):
            np.testing.assert_allclose(k[col], t[col], rtol=1e-5, atol=1e-5, err_msg=f"{aligned} {col}")
    said = {f.run: f.evidence for f in findings(metrics(paths)) if f.rule == "dead_high"}
    assert said.keys() == {"torch", "keras"} and said["torch"] == said["keras"]  # "31% of units dead at step 0…"
