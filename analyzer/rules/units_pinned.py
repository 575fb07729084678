"""Units pinned at a bound for every probe input."""
from __future__ import annotations

import numpy as np

from ._base import Family, Rule, Threshold, make
from ._gates import advice, pinned

UNITS_PINNED = Rule(
    "units_pinned", "warning", "per-unit saturation (units pinned for every input) at the last reading is above "
    "`max_saturation_units`",
    "units stuck at a bound for every input carry no information: lower the LR, re-initialize this layer, or "
    "normalize its input", uses=("max_saturation_units",), reads=("saturation_unit",))


def check(view, layer, r):
    g = layer.g
    steps, share = g["step"], g["saturation_unit"]
    if not len(share) or not share[-1] > r.max_saturation_units:
        return None
    start = steps[np.argmax(share > r.max_saturation_units)]
    return make(UNITS_PINNED, view.run, layer.name, start,
                f"{pinned(layer.what, layer.kind, g['mean'][-1], share[-1], view.th.sat_threshold)} for every probe "
                f"input at step {steps[-1]}, above {r.max_saturation_units:.0%} since step {start}", score=share[-1],
                advice=advice(layer.what), value=share[-1], threshold=r.max_saturation_units, first=start,
                last=steps[-1], index=layer.index)


FAMILY = Family((UNITS_PINNED,), check, "layer", (
    Threshold("max_saturation_units", 0.1, "share of units pinned at a bound for every probe input above which a "
              "layer is said", high=1.0),))
