"""Limits a team sets on each layer's gradient norm at its last reading (off unless given)."""
from __future__ import annotations

import numpy as np

from ..trends import held_since
from ._base import Family, Rule, Threshold, make

GRAD_NORM_LOW = Rule("grad_norm_low", "warning", "a layer's gradient norm at its last reading is below "
                     "`min_grad_norm` (or NaN); off unless the limit is given",
                     "gradients below the team's limit: see vanishing_gradients' remedies",
    uses=("min_grad_norm",), reads=("grad_norm",))
GRAD_NORM_HIGH = Rule("grad_norm_high", "warning", "a layer's gradient norm at its last reading is above "
                      "`max_grad_norm` (or NaN); off unless the limit is given",
                      "gradients above the team's limit: clip gradients, lower the LR",
    uses=("max_grad_norm",), reads=("grad_norm",))


def check(view, r):
    """Each layer beyond a limit at its last reading, dated where it has been beyond it since."""
    for rule, limit, sign in ((GRAD_NORM_LOW, r.min_grad_norm, -1), (GRAD_NORM_HIGH, r.max_grad_norm, +1)):
        if limit is None:
            continue
        for (layer,), g in view.gradients.group_by(["layer"], maintain_order=True):
            steps, norm = g["step"].to_numpy(), g["grad_norm"].to_numpy()
            since = held_since(np.isnan(norm) | (norm < limit if sign < 0 else norm > limit), 1.0)
            if since is None:  # NaN is neither above nor below: it fails both
                continue
            said = f"gradient norm is NaN at step {steps[-1]}, not {'≥' if sign < 0 else '≤'} {limit:g}" if \
                np.isnan(norm[-1]) else f"gradient norm {norm[-1]:.3g} at step {steps[-1]} " \
                                       f"{'is below' if sign < 0 else 'exceeds'} {limit:g}"
            yield make(rule, view.run, layer, steps[since], said,
                       stream="param_grad", value=norm[-1], threshold=limit, first=steps[since], last=steps[-1],
                       index=g["layer_index"][0])


FAMILY = Family((GRAD_NORM_LOW, GRAD_NORM_HIGH), check, thresholds=(
    Threshold("min_grad_norm", None, "a layer's gradient norm below this at its last reading is said"),
    Threshold("max_grad_norm", None, "a layer's gradient norm above this at its last reading is said")))
