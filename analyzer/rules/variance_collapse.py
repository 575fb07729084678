"""Representation collapse: every probe input gives each unit the same output."""
from __future__ import annotations

import numpy as np

from ._base import Family, Rule, Threshold, make

VARIANCE_COLLAPSE = Rule(
    "variance_collapse", "warning",
    "the unit std (each unit's std across the probe, their RMS over units; the layer's std where a trace holds no "
    "per-unit sums) at the last finite reading is below `collapse_ratio` of the first: every input gives each unit "
    "the same output, even where units sit at different constants and the layer-wide std looks fine",
    "all outputs alike (representation collapse): check the loss design (a contrastive loss without negatives, a "
    "collapsing target), the learning rate, overfitting",
    reads=("unit_std", "std"), explains=(("mean_drift", "above"), ("vanishing_gradients", "below"),
                                         ("variance_collapse", "above")))


def check(view, layer, r):
    g = layer.g
    clean = g["nan_count"] + g["inf_count"] == 0  # NaN readings are nan_inf's business
    per_unit = g["unit_std"][clean]
    spread, what = (per_unit, "unit std (each unit's spread across the probe)") if len(per_unit) and \
        not np.isnan(per_unit).any() else (g["std"][clean], "std")
    steps = g["step"][clean]
    if len(spread) < 2 or not spread[0] > 0 or not spread[-1] < r.collapse_ratio * spread[0]:
        return None
    i = int(np.argmax(spread < r.collapse_ratio * spread[0]))
    start = steps[i]
    return make(VARIANCE_COLLAPSE, view.run, layer.name, start,
                f"{what} fell from {spread[0]:.3g} at step {steps[0]} to {spread[-1]:.3g} at step {steps[-1]}, below "
                f"{r.collapse_ratio:.0%} of its first reading since step {start}",
                score=spread[0] / max(spread[-1], 1e-30), value=spread[-1] / spread[0], threshold=r.collapse_ratio,
                first=steps[i - 1], last=steps[-1], index=layer.index)


FAMILY = Family((VARIANCE_COLLAPSE,), check, "layer", (
    Threshold("collapse_ratio", 0.05, "the unit std below this share of its first reading is a collapse", high=1.0),))
