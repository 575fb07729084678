"""Saturation: a hidden layer still being driven into its bounds, a jump to them, a layer at them."""
from __future__ import annotations

import numpy as np

from ._base import Family, Rule, Threshold, make
from ._gates import advice, gate
from ._shared import growing

SATURATION_GROWING = Rule(
    "saturation_growing", "critical",
    "per-value saturation's robust rise over the recent readings is ≥ `saturation_growth`, its last value ≥ half that "
    "above where they start and above `max_saturation` (`max_gate_saturation` for a recurrent gate), in a hidden layer "
    "(not a softmax, nor the run's last activation reading: an output growing confident is learning)",
    "something keeps driving this layer into its bounds, where its gradient vanishes: lower the LR, normalize its "
    "input, or re-initialize it",
    uses=("saturation_growth", "max_saturation", "max_gate_saturation"), reads=("saturation_value",))
SATURATION_SPIKE = Rule(
    "saturation_spike", "warning",
    "not growing, and per-value saturation jumps by ≥ `saturation_spike` between two readings, to above that limit",
    "activations jumped to their bounds: lower the LR around this step",
    uses=("saturation_spike", "max_saturation", "max_gate_saturation"), reads=("saturation_value",))
SATURATION_HIGH = Rule(
    "saturation_high", "warning", "per-value saturation at the last reading is above that limit",
    "activations hit their bounds: lower the LR or re-initialize this layer",
    uses=("max_saturation", "max_gate_saturation"), reads=("saturation_value",))


def check(view, layer, r):
    g, what = layer.g, layer.what
    steps, sat = g["step"], g["saturation_value"]
    if not len(sat) or np.isnan(sat).all():
        return None
    index, limit, said = layer.index, r.max_gate_saturation if gate(what) else r.max_saturation, advice(what)
    known = ~np.isnan(sat)
    s, v = steps[known], sat[known]
    output = layer.index == max(x.index for x in view.layers)  # the model's output, growing confident
    found = not output and layer.kind != "softmax" and len(s) >= 3 and v[-1] > limit and growing(
        SATURATION_GROWING, view.run, layer.name, s, v, r.saturation_growth,
        f"{what[1]}: saturated share" if what else "saturated share", index, said)
    if found:
        return found
    jumps = np.diff(sat)
    landed = (jumps >= r.saturation_spike) & (sat[1:] > limit)
    if landed.any():
        i = int(np.argmax(np.where(landed, jumps, -np.inf))) + 1
        return make(SATURATION_SPIKE, view.run, layer.name, steps[i],
                    f"saturation jumped from {sat[i - 1]:.0%} at step {steps[i - 1]} to {sat[i]:.0%} at step "
                    f"{steps[i]}", score=jumps[i - 1], value=jumps[i - 1], threshold=r.saturation_spike,
                    first=steps[i - 1], last=steps[i], index=index, advice=said)
    if sat[-1] > limit:
        start = steps[np.argmax(sat > limit)]
        unit = g["saturation_unit"][-1]
        share = "of its distributions peaked near 1" if g["kind"][-1] == "softmax" else "of values"
        return make(SATURATION_HIGH, view.run, layer.name, start,
                    (f"{what[1]} at its bounds: " if what else "") +
                    f"{sat[-1]:.0%} {share} and {unit:.0%} of units saturated at step {steps[-1]}, above "
                    f"{limit:.0%} since step {start}", score=sat[-1], value=sat[-1],
                    threshold=limit, first=start, last=steps[-1], index=index, advice=said)
    return None


FAMILY = Family((SATURATION_GROWING, SATURATION_SPIKE, SATURATION_HIGH), check, "layer", (
    Threshold("max_saturation", 0.3, "saturated share of values above which a layer is said (over 30 percent suggests "
              "init or learning-rate trouble)", high=1.0),
    Threshold("max_gate_saturation", 0.9, "the same for a recurrent gate, which works as a switch", high=1.0),
    Threshold("saturation_spike", 0.2, "jump of the saturated share between two readings that is a spike", high=1.0),
    Threshold("saturation_growth", 0.2, "rise of the saturated share over the recent readings that says a layer is "
              "still being driven into its bounds", high=1.0)))
