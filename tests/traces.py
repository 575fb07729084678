"""Traces with pathologies built in by construction, written with the numpy writer."""
from __future__ import annotations

import numpy as np

import actrace

RNG_SEED = 3


def relu_layer(rng, units: int, dead: int, batch: int = 128) -> np.ndarray:
    pre = rng.normal(size=(batch, units))
    pre[:, :dead] -= 100.0
    return np.maximum(pre, 0).astype(np.float32)


def write_run(path, run: str, *, steps=range(0, 600, 100), dead=lambda step: 0, tanh_bias=lambda step: 0.0,
              grad_scale=lambda step, depth: 0.1, nan_at=None, fingerprint=lambda step: "feedc0de",
              mode="eval", layer_names=None, depth: int = 6, loss=None) -> None:
    """A run of `depth` ReLU layers then one tanh layer, with parameter gradients per layer, and
    `loss(step)` logged when given."""
    rng = np.random.default_rng(RNG_SEED)
    names = layer_names or [f"block{i}.relu" for i in range(depth)] + ["head.tanh"]
    with actrace.Writer(path, run=run, overwrite=True, mode=mode) as w:
        for step in steps:
            for i, name in enumerate(names[:-1]):
                h = relu_layer(rng, 32, dead(step) if i == 2 else 0)
                if nan_at is not None and step >= nan_at and i >= 3:
                    h[0, 0] = np.nan
                w.record_activation(step, name, h, kind="relu", probe_fingerprint=fingerprint(step))
                w.record_param_grad(step, name, "weight",
                                    rng.normal(size=(32, 32)) * grad_scale(step, i) / 32, kind="relu")
            t = np.tanh(rng.normal(size=(128, 16)) * 0.5 + tanh_bias(step)).astype(np.float32)
            w.record_activation(step, names[-1], t, kind="tanh", probe_fingerprint=fingerprint(step))
            w.record_param_grad(step, names[-1], "weight", rng.normal(size=(16, 32)) * 0.1 / 16, kind="tanh")
            if loss is not None:
                w.log(step, loss=loss(step))
