"""Steps a loss scaler skipped: its overflowing gradients are the scaler's business, not the model's."""
from __future__ import annotations

from ._base import Family, Rule, make

SCALER_SKIPPED = Rule(
    "scaler_skipped", "info", "gradient readings of mode `skipped` (a loss scaler skipped the update)",
    "the loss scaler skipped these updates and lowered its scale: normal now and then under mixed precision; often "
    "in a row, lower the LR or the initial scale", reads=("mode",))


def check(view, r):
    g = view.skipped.sort("step")
    if not g.height:
        return None
    steps = g["step"].unique().sort()
    return make(SCALER_SKIPPED, view.run, g["layer"][0], steps[0],
                f"{steps.len()} step(s) skipped by the loss scaler for non-finite gradients, first at step {steps[0]}",
                stream="param_grad", value=steps.len(), first=steps[0], last=steps[-1])


FAMILY = Family((SCALER_SKIPPED,), check)
