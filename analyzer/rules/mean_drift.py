"""A biased layer: the next layer gets inputs far from zero."""
from __future__ import annotations

import numpy as np

from ._base import Family, Rule, Threshold, make

MEAN_KINDS = ("linear", "conv", "norm", "identity")  # unbounded, not rectified: a mean away from 0 is a bias
MEAN_DRIFT = Rule(
    "mean_drift", "warning",
    "a `linear`, `conv`, `norm` or `identity` layer's |mean| is above `mean_drift_sigmas` std at its last finite "
    "reading, but for the run's last such layer (its output, or what its output activation reads: no next layer "
    "gets it)", "the next layer gets biased inputs: check normalization and biases",
    uses=("mean_drift_sigmas",), reads=("mean", "std"))


def check(view, layer, r):
    g = layer.g
    if layer.kind not in MEAN_KINDS or layer.index == max(x.index for x in view.layers if x.kind in MEAN_KINDS):
        return None  # the run's last such layer: its output, or what its output activation reads
    clean = g["nan_count"] + g["inf_count"] == 0  # NaN readings are nan_inf's business
    std, mean, steps = g["std"][clean], g["mean"][clean], g["step"][clean]
    if not len(mean) or not std[-1] > 0 or not abs(mean[-1]) > r.mean_drift_sigmas * std[-1]:
        return None
    start = steps[np.argmax(np.abs(mean) > r.mean_drift_sigmas * std)]
    return make(MEAN_DRIFT, view.run, layer.name, start,
                f"mean {mean[-1]:.3g} is {abs(mean[-1]) / std[-1]:.1f} std from zero at step {steps[-1]}, beyond "
                f"{r.mean_drift_sigmas:g} std since step {start}", score=abs(mean[-1]) / std[-1],
                value=abs(mean[-1]) / std[-1], threshold=r.mean_drift_sigmas, first=start, last=steps[-1],
                index=layer.index)


FAMILY = Family((MEAN_DRIFT,), check, "layer", (
    Threshold("mean_drift_sigmas", 2.0, "|mean| above this many std is a drift (unbounded, non-rectified layers)"),))
