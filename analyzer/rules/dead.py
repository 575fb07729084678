"""Dead units: a layer still dying, a layer gone (almost) entirely dead, many units dead and stable."""
from __future__ import annotations

import numpy as np

from ..trends import held_since, stable_since
from ._base import Family, Rule, Threshold, make
from ._shared import growing

BELOW_AND_AFTER = (("vanishing_gradients", "below"), ("grad_norm_low", "below"), ("dead_growing", "above"), ("dead_high", "above"),
                   ("layer_dead", "above"), ("variance_collapse", "above"), ("mean_drift", "above"),
                   ("dormant_units", "above"), ("units_pinned", "above"))
LAYER_DEAD = Rule(
    "layer_dead", "critical",
    "the dead fraction at the last reading is ≥ `all_dead`: the layer passes (almost) nothing forward and no gradient "
    "back, whatever else follows from it (zero gradients below it, constant inputs above it)",
    "the layer is gone: lower the LR (or warm it up), use leaky ReLU or a better init variance; if its weights were "
    "zeroed or overwritten (a bad checkpoint load, weight decay on a frozen layer), restore them",
    uses=("all_dead",), reads=("dead_fraction",), explains=BELOW_AND_AFTER)
DEAD_GROWING = Rule(
    "dead_growing", "critical",
    "the dead fraction's robust rise over the recent readings is ≥ `dead_growth` (≥ half that where its last value "
    "is above `max_dead`: many units dead and still dying), its last value ≥ half that rise above where they start",
    "something keeps killing units: lower the LR, use leaky ReLU, check init variance",
    uses=("dead_growth", "max_dead"), reads=("dead_fraction",))
DEAD_HIGH = Rule(
    "dead_high", "warning", "not growing, and the dead fraction at the last reading is above `max_dead`",
    "a fixed capacity tax: weigh it against the validation metric; leaky ReLU or better init",
    uses=("max_dead", "dead_growth"), reads=("dead_fraction",))


def check(view, layer, r):
    """dead fraction's rules over one layer (it is null where it means nothing: analyzer.meaning)."""
    g = layer.g
    steps, dead = g["step"], g["dead_fraction"]
    known = ~np.isnan(dead)  # a NaN reading's is null (analyzer.meaning): judged at the last reading that says
    if not known.any():
        return None
    s, d = steps[known], dead[known]
    if d[-1] >= r.all_dead:
        since = held_since(d >= r.all_dead, 1.0)
        before = f", from {d[since - 1]:.0%} at step {s[since - 1]}" if since else " since the first reading"
        return make(LAYER_DEAD, view.run, layer.name, s[since],
                    f"{d[-1]:.0%} of units dead at step {s[-1]}, ≥ {r.all_dead:.0%} since step {s[since]}{before}: "
                    "the layer passes nothing forward and no gradient back", score=2 + d[-1], value=d[-1],
                    threshold=r.all_dead, first=s[max(since - 1, 0)], last=s[-1], index=layer.index)
    found = growing(DEAD_GROWING, view.run, layer.name, s, d, r.dead_growth / 2 if d[-1] > r.max_dead else
                    r.dead_growth, "dead fraction", layer.index)
    if found:
        return found
    if d[-1] > r.max_dead:
        since = stable_since(s, d, r.dead_growth / 2)
        trend = f"within {r.dead_growth / 2:.0%} of that since step {since}" if since < s[-1] else \
            "not rising steadily of late"
        return make(DEAD_HIGH, view.run, layer.name, since, f"{d[-1]:.0%} of units dead at step {s[-1]}, {trend}",
                    score=d[-1], value=d[-1], threshold=r.max_dead, first=since, last=s[-1], index=layer.index)
    return None


FAMILY = Family((LAYER_DEAD, DEAD_GROWING, DEAD_HIGH), check, "layer", (
    Threshold("max_dead", 0.2, "dead fraction above which a layer is said (tens of percent: the layer is "
              "effectively much narrower)", high=1.0),
    Threshold("dead_growth", 0.2, "rise in dead fraction over the recent readings that says a layer is still dying "
              "(healthy ReLU nets lose up to 12 points early: attrition)", high=1.0),
    Threshold("all_dead", 0.95, "dead fraction from which a layer is gone (critical, whatever its trend)", high=1.0)))
