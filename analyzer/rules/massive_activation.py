"""Massive activations: one fixed unit far above the rest (Sun et al. 2024)."""
from __future__ import annotations

import numpy as np

from actrace.format.schema import KIND_BOUNDS

from ._base import Family, Rule, Threshold, make

MASSIVE_ACTIVATION = Rule(
    "massive_activation", "warning", "an unbounded layer's `top_ratio` is ≥ `massive_ratio` at each of the last "
    "`massive_readings` readings or more, with the same `top_unit`",
    "a few fixed units carry values far above the rest (outlier features, attention sinks): they dominate the "
    "layer's norm and break low-precision quantization; watch them against the loss, consider QK-norm, weight "
    "decay, or an explicit attention sink", uses=("massive_ratio", "massive_readings"), reads=("top_ratio", "top_unit"))


def check(view, layer, r):
    """(a bounded layer's values cannot be massive: a peaked softmax is saturation)"""
    g = layer.g
    ratio, top, steps = g["top_ratio"], g["top_unit"], g["step"]
    if layer.kind == "clip" or KIND_BOUNDS.get(layer.kind) is not None or not len(ratio) or \
            not ratio[-1] >= r.massive_ratio:
        return None
    held = (ratio >= r.massive_ratio) & (top == top[-1])
    streak = len(held) - (np.flatnonzero(~held)[-1] + 1 if (~held).any() else 0)
    if streak < r.massive_readings:
        return None
    start = steps[-streak]
    return make(MASSIVE_ACTIVATION, view.run, layer.name, start,
                f"unit {int(top[-1])} reaches {ratio[-1]:.0f}× the max |h| of the layer's median unit at step "
                f"{steps[-1]}, above {r.massive_ratio:g}× and the largest unit at every reading since step "
                f"{start} ({streak} readings)", score=ratio[-1], value=ratio[-1], threshold=r.massive_ratio,
                first=start, last=steps[-1], index=layer.index)


FAMILY = Family((MASSIVE_ACTIVATION,), check, "layer", (
    Threshold("massive_ratio", 100.0, "a unit's max |h| this many times the median unit's (trained LLMs reach "
              "~1000×; a random init stays under 10×)", low=1.0),
    Threshold("massive_readings", 3, "... the same unit at this many consecutive readings, the last included",
              low=1, whole=True)))
