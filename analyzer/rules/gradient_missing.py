"""Parameters cut off from the loss (metadata `no_gradient`, spec §File metadata)."""
from __future__ import annotations

import json

from ._base import Family, Rule, make

GRADIENT_MISSING = Rule(
    "gradient_missing", "warning", "the trace's `no_gradient` names parameters that required a gradient and never "
    "got one", "these layers never learn: find what cuts them off from the loss (a .detach(), a torch.no_grad block, "
    "an output left unused), or freeze them on purpose (requires_grad=False)", reads=("no_gradient",))


def check(view, r):
    cut = json.loads((view.meta or {}).get("no_gradient") or "[]")
    if not cut:
        return None
    layers = list(dict.fromkeys(name.rsplit("/", 1)[0] for name in cut))
    return make(GRADIENT_MISSING, view.run, layers[0], -1,
                f"{len(cut)} parameter(s) of {len(layers)} layer(s) required a gradient and never got one: "
                f"{', '.join(cut[:6])}{' …' if len(cut) > 6 else ''}", score=len(cut), stream="param_grad",
                value=len(cut), threshold=0)


FAMILY = Family((GRADIENT_MISSING,), check)
