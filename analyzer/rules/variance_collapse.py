"""Representation collapse: every probe input gives each unit the same output."""
from __future__ import annotations

import numpy as np

from ._base import Family, Rule, Threshold, make

VARIANCE_COLLAPSE = Rule(
    "variance_collapse", "warning",
    "the unit std (each unit's std across the probe, their RMS over units) over the layer's RMS (√(mean² + std²)) at "
    "the last finite reading is below `collapse_ratio` of that share at the first: every input gives each unit the "
    "same output, even where units sit at different constants and the layer-wide std looks fine; a layer merely "
    "scaled down keeps its share (a trace without per-unit sums: its std below `collapse_ratio` of the first)",
    "all outputs alike (representation collapse): check the loss design (a contrastive loss without negatives, a "
    "collapsing target), the learning rate, overfitting",
    uses=("collapse_ratio",), reads=("unit_std", "std"), explains=(("mean_drift", "above"), ("variance_collapse", "above")))


def check(view, layer, r):
    g = layer.g
    clean = g["nan_count"] + g["inf_count"] == 0  # NaN readings are nan_inf's business
    unit_std, std, mean, steps = g["unit_std"][clean], g["std"][clean], g["mean"][clean], g["step"][clean]
    with np.errstate(invalid="ignore", divide="ignore"):  # a layer gone to exactly 0 has no spread left: 0
        share = np.where(unit_std == 0, 0.0, unit_std / np.sqrt(mean ** 2 + std ** 2))
    per_unit = len(share) and not np.isnan(share).any()
    spread = share if per_unit else std
    if len(spread) < 2 or not spread[0] > 0 or not spread[-1] < r.collapse_ratio * spread[0]:
        return None
    i = int(np.argmax(spread < r.collapse_ratio * spread[0]))
    said = (f"unit std (each unit's spread across the probe) fell from {unit_std[0]:.3g} ({share[0]:.1%} of the "
            f"layer's RMS) at step {steps[0]} to {unit_std[-1]:.3g} ({share[-1]:.2%}) at step {steps[-1]}") if per_unit \
        else f"std fell from {std[0]:.3g} at step {steps[0]} to {std[-1]:.3g} at step {steps[-1]}"
    return make(VARIANCE_COLLAPSE, view.run, layer.name, steps[i],
                f"{said}, below {r.collapse_ratio:.0%} of its first reading since step {steps[i]}",
                score=spread[0] / max(spread[-1], 1e-30), value=spread[-1] / spread[0], threshold=r.collapse_ratio,
                first=steps[i - 1], last=steps[-1], index=layer.index)


FAMILY = Family((VARIANCE_COLLAPSE,), check, "layer", (
    Threshold("collapse_ratio", 0.05, "the unit std below this share of its first reading is a collapse", high=1.0),))
