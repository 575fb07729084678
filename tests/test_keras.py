"""Keras 3 on the torch and JAX backends: a small CNN with 3 of 8 channels killed by construction,
fused activations read as their kind (a softmax head: its gradients' rows carry its bounds too),
NHWC units on the last axis, gradients where kept."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import polars as pl
import pytest

import actrace
from actrace.format import metadata
from actrace.analyzer.metrics import metrics
from actrace.files.validate import validate
from conftest import HUNG

SCRIPT = """
import numpy as np, keras, warnings
from actrace.adapters.keras import TraceCallback
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
                          keras.layers.BatchNormalization(), keras.layers.Flatten(),
                          keras.layers.Dense(4, activation="softmax")])
model.layers[0].bias.assign(np.array([-50.0] * 3 + [0.0] * 5))  # 3 channels below zero for every input
model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy())
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
                         env=dict(os.environ, KERAS_BACKEND=backend), timeout=HUNG)
    assert res.returncode == 0, res.stderr[-3000:]
    assert validate(out) == [] and metadata.read(out)["framework"] == "keras"
    acts = {r["layer"]: r for r in actrace.read_table(out).to_pylist() if r["stream"] == "activation"}
    assert {name: (r["kind"], r["unit_axis"], r["units"]) for name, r in acts.items()} == {
        "conv2d": ("relu", 3, 8), "batch_normalization": ("norm", 3, 8), "dense": ("softmax", 1, 4)}
    m = metrics(out)
    conv = m.filter((pl.col("layer") == "conv2d") & (pl.col("stream") == "activation"))
    assert conv["step"].to_list() == [0, 2, 3] and set(conv["dead_fraction"]) == {3 / 8}
    scalars = [r for r in actrace.read_table(out).to_pylist() if r["stream"] == "scalar"]
    assert [r["step"] for r in scalars if r["layer"] == "loss"] == [0, 1, 2, 3]  # what fit logs, each batch
    assert all(r["value"] > 0 for r in scalars if r["layer"] == "loss")
    assert {round(r["value"], 6) for r in scalars if r["layer"] == "lr"} == {0.01}  # SGD's default rate
    grads = m.filter(pl.col("stream") == "param_grad")
    if backend == "torch":
        assert sorted(set(grads["step"])) == [0, 1, 2, 3] and {"conv2d", "dense"} <= set(grads["layer"])
        assert "WARNED:\n" in res.stdout + "\n"
    else:
        assert grads.height == 0 and "keeps no gradients" in res.stdout



LOSS_SCRIPT = """
import json, numpy as np, keras
from actrace.adapters.keras import TraceCallback
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
model.compile(optimizer=keras.optimizers.SGD(0.0), loss=loss, steps_per_execution=SPE)  # the weights never move:
# each batch's loss is known
rng = np.random.default_rng(0)
x, y = (rng.normal(size=(56, 6)) * np.arange(1, 57)[:, None] / 10).astype("float32"), rng.integers(0, 3, 56)
model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
          callbacks=[TraceCallback(probe=x[:8], out=OUT, probe_every=100, run="keras")])
each = [(float(keras.ops.convert_to_numpy(loss(y[i:i + 16], model(x[i:i + 16])))), len(y[i:i + 16]))
        for i in range(0, 56, 16)]
calls = [each[i:i + SPE] for i in range(0, 4, SPE)]  # a call after SPE batches: their loss, by sample
print("TRUTH:" + json.dumps([sum(l * n for l, n in c) / sum(n for _, n in c) for c in calls]))
"""


@pytest.mark.parametrize("backend, spe", [("torch", 1), ("jax", 1), ("jax", 2)])
def test_the_loss_recorded_is_each_batch_s_own_not_keras_s_running_mean(tmp_path, backend, spe):
    """With a learning rate of 0 each batch's loss is known by construction (16, 16, 16 then 8
    samples of growing scale, two epochs): the trace's `loss` at each step is that batch's, the last,
    partial one included, where Keras logs the epoch's running mean; with steps_per_execution=2
    (JAX), each call's two batches', by sample."""
    out = tmp_path / f"{backend}.parquet"
    res = subprocess.run([sys.executable, "-c", f"OUT, SPE = {str(out)!r}, {spe}\n" + LOSS_SCRIPT], capture_output=True,
                         text=True, env=dict(os.environ, KERAS_BACKEND=backend), timeout=HUNG)
    assert res.returncode == 0, res.stderr[-3000:]
    truth = json.loads(res.stdout.split("TRUTH:")[1])
    loss = {r["step"]: r["value"] for r in actrace.read_table(out).to_pylist() if r["layer"] == "loss"}
    assert sorted(loss) == list(range(2 * len(truth)))
    assert [loss[step] for step in sorted(loss)] == pytest.approx(truth * 2, rel=1e-5)
    assert abs(loss[len(truth) - 1] - truth[-1]) < 0.01 * abs(np.mean(truth) - truth[-1])  # not the running mean


CUSTOM_SCRIPT = """
import json, numpy as np, keras, torch, warnings
from actrace.adapters.keras import TraceCallback

class Custom(keras.Model):  # Keras's documented custom train_step: a loss tracker of its own
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.tracker = keras.metrics.Mean(name="loss")

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        loss = keras.ops.mean((self(x) - y) ** 2)
        loss.backward()
        with torch.no_grad():
            self.optimizer.apply([v.value.grad for v in self.trainable_weights], self.trainable_weights)
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}

    @property
    def metrics(self):
        return [self.tracker]

keras.utils.set_random_seed(0)
inp = keras.Input((6,))
model = Custom(inp, keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(inp)))
model.compile(optimizer=keras.optimizers.SGD(0.01))
x = np.random.default_rng(0).normal(size=(64, 6)).astype("float32")
logged = []
class Logs(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        logged.append(float(logs["loss"]))
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    model.fit(x, x[:, :1], batch_size=16, epochs=1, verbose=0, callbacks=[Logs(), TraceCallback(probe=x[:8], out=OUT)])
print("LOGGED:" + json.dumps(logged))
print("SAID:" + "|".join(str(w.message) for w in said if "actrace" in str(w.message)))
"""


def test_a_custom_train_step_s_loss_is_recorded_as_keras_logs_it_and_said_to_be_a_running_mean(tmp_path):
    out = tmp_path / "custom.parquet"
    res = subprocess.run([sys.executable, "-c", f"OUT = {str(out)!r}\n" + CUSTOM_SCRIPT], capture_output=True,
                         text=True, env=dict(os.environ, KERAS_BACKEND="torch"), timeout=HUNG)
    assert res.returncode == 0, res.stderr[-3000:]
    logged = json.loads(res.stdout.split("LOGGED:")[1].splitlines()[0])
    loss = [r["value"] for r in actrace.read_table(out).to_pylist() if r["layer"] == "loss"]
    assert loss == pytest.approx(logged) and len(loss) == 4
    assert "the running mean over the epoch" in res.stdout.split("SAID:")[1]
