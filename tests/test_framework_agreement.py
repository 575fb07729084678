"""The same MLP with identical weights in PyTorch, Keras and Flax: identical per-unit reductions
(within 1e-5), the same findings, and the analyzer aligns the three runs layer for layer."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import polars as pl

import actrace
from actrace.analyzer.compare import align
from actrace.analyzer.findings import findings
from actrace.analyzer.metrics import metrics
from conftest import HUNG

KERAS = """
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


def test_the_same_mlp_in_pytorch_keras_and_flax_reads_the_same_and_aligns(tmp_path, cli):
    import flax.linen as fnn
    import torch
    from torch import nn

    from actrace.adapters.flax import Monitor as FlaxMonitor
    from actrace.adapters.torch import Monitor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with torch.no_grad():
        model[0].bias[:5] = -30.0  # 5 of 16 units dead in every framework
    probe = torch.randn(64, 8)
    w = dict(w0=model[0].weight.detach().numpy(), b0=model[0].bias.detach().numpy(),
             w2=model[2].weight.detach().numpy(), b2=model[2].bias.detach().numpy(), probe=probe.numpy())
    np.savez(tmp_path / "w.npz", **w)
    with Monitor(model, probe, tmp_path / "torch.parquet", run="torch") as mon:
        mon.probe_reading(0)
    res = subprocess.run([sys.executable, "-c", f"OUT = {str(tmp_path / 'keras.parquet')!r}\n"
                          f"WEIGHTS = {str(tmp_path / 'w.npz')!r}\n" + KERAS], capture_output=True, text=True,
                         env=dict(os.environ, KERAS_BACKEND="torch"), timeout=HUNG)
    assert res.returncode == 0, res.stderr[-3000:]

    class MLP(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            h = fnn.relu(fnn.Dense(16)(x))
            return fnn.Dense(4)(h)

    params = {"Dense_0": {"kernel": w["w0"].T, "bias": w["b0"]}, "Dense_1": {"kernel": w["w2"].T, "bias": w["b2"]}}
    with FlaxMonitor(MLP(), w["probe"], tmp_path / "flax.parquet", run="flax") as mon:
        mon.probe_reading(0, params)

    runs = ["torch", "keras", "flax"]
    paths = [tmp_path / f"{run}.parquet" for run in runs]
    m = align(metrics(paths)).filter(pl.col("stream") == "activation")
    aligned = m.group_by("aligned").agg(pl.col("run").sort()).filter(pl.col("run").list.len() == 3)
    assert aligned.height == 3  # linear[0], relu[0], linear[1]: each read by all three runs
    by_run = {run: dict(zip(g["aligned"], g["layer"])) for (run,), g in m.group_by(["run"])}
    first = {run: {r["layer"]: r for r in actrace.read_table(p).to_pylist() if r["stream"] == "activation"
                   and r["step"] == 0} for run, p in zip(runs, paths)}
    for name in aligned["aligned"]:
        t = first["torch"][by_run["torch"][name]]
        for run in ("keras", "flax"):
            o = first[run][by_run[run][name]]
            assert (t["kind"], t["units"], t["count"], t["unit_zero"]) == (o["kind"], o["units"], o["count"],
                                                                           o["unit_zero"]), (run, name)
            for col in ("unit_sum", "unit_sumsq", "unit_min", "unit_max"):
                np.testing.assert_allclose(o[col], t[col], rtol=1e-5, atol=1e-5, err_msg=f"{run} {name} {col}")
    said = {f.run: f.evidence for f in findings(metrics(paths)) if f.rule == "dead_high"}
    assert said.keys() == set(runs) and len(set(said.values())) == 1  # "31% of units dead at step 0…"
    res = cli("report", *paths, "-o", tmp_path / "r.html")
    assert res.returncode == 0, res.stderr
    html = (tmp_path / "r.html").read_text()
    assert all(f'"{run}"' in html for run in runs)  # the three runs side by side in one report
