"""Dormant units (ReDo): alive, but barely firing."""
from __future__ import annotations

from ..trends import held_since
from ._base import Family, Rule, Threshold, make

DORMANT_UNITS = Rule(
    "dormant_units", "warning", "the dormant fraction of an activation function's output (not a softmax's) is above "
    "`max_dormant` at every reading of a streak to the last",
    "units that barely fire carry little and learn little (ReDo): re-initialize their incoming weights (recycling), "
    "lower the weight decay, or check the learning rate", uses=("max_dormant",), reads=("dormant_fraction",))


def check(view, layer, r):
    g = layer.g
    steps, dormant = g["step"], g["dormant_fraction"]
    since = held_since(dormant > r.max_dormant, 1.0)  # null (NaN) where dormancy means nothing: never above
    if since is None:
        return None
    return make(DORMANT_UNITS, view.run, layer.name, steps[since],
                f"{dormant[-1]:.0%} of units alive but dormant (RMS at most {view.th.dormant_tau:g}× the layer's mean "
                f"unit RMS) at step {steps[-1]}, above {r.max_dormant:.0%} since step {steps[since]}",
                score=dormant[-1], value=dormant[-1], threshold=r.max_dormant, first=steps[since], last=steps[-1],
                index=layer.index)


FAMILY = Family((DORMANT_UNITS,), check, "layer", (
    Threshold("max_dormant", 0.3, "dormant fraction above which a layer is said (healthy ReLU nets of the corpus "
              "reach 25 percent under SGD with momentum)", high=1.0),))
