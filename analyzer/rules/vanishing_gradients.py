"""Vanishing gradients: the depth profile decays towards the input."""
from __future__ import annotations

import fnmatch
import warnings

import numpy as np

from ..trends import held_since
from ._base import Family, Rule, Threshold, make
from ._shared import layers_named

# attention's query and key projections: their gradients are tiny while attention is near uniform
# (at initialization above all), which is normal, not vanishing
QUERY_KEY = ("*.query", "*.key", "*q_proj", "*k_proj", "*.q", "*.k", "*.wq", "*.wk", "*q_lin", "*k_lin")
VANISHING_GRADIENTS = Rule(
    "vanishing_gradients", "critical",
    "at each `param_grad` step, over the layers in depth order without attention's query and key projections: the "
    "earliest quarter's median L2 norm is below `vanishing`, or its median RMS (norm / √values) `decay_ratio`× below "
    "the latest quarter's; at `vanishing_share` or more of the gradient readings from the first that holds to the "
    "last, which holds, and at `vanishing_readings` of them or more",
    "gradients don't reach early layers: residual connections, shallower net, init",
    uses=("vanishing", "decay_ratio", "vanishing_share", "vanishing_readings"), reads=("grad_norm",))


def check(view, r):
    """The depth profile of each step decays towards the input (one step at initialization, or a net
    on its initial plateau, is no trend)."""
    steps, depth, norm, rms = view.norms
    keep = [i for i, (_, layer) in enumerate(depth) if not any(fnmatch.fnmatchcase(layer, p) for p in QUERY_KEY)]
    if len(keep) < 2:
        return None
    quarter = max(1, len(keep) // 4)
    early, late = keep[:quarter], keep[-quarter:]
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a step where every early layer is NaN: NaN
        early_norm, early_rms = np.nanmedian(norm[:, early], 1), np.nanmedian(rms[:, early], 1)
        late_norm, late_rms = np.nanmedian(norm[:, late], 1), np.nanmedian(rms[:, late], 1)
        decay = late_rms / early_rms
    usable = np.isfinite(norm).all(1) & (late_norm > 0)  # a broken or silent output says nothing of depth
    steps, decay = steps[usable], decay[usable]
    early_norm, late_norm = early_norm[usable], late_norm[usable]
    vanished = (early_norm < r.vanishing) | (decay > r.decay_ratio)
    since = held_since(vanished, r.vanishing_share)
    if since is None or len(vanished) - since < r.vanishing_readings:
        return None
    names = [depth[i][1] for i in early]
    lates = [depth[i][1] for i in late]
    share = vanished[since:].mean()
    how = "exactly 0: no learning signal reaches them" if early_norm[-1] == 0 else \
        f"RMS {decay[-1]:.2g}× smaller towards the input"
    return make(VANISHING_GRADIENTS, view.run, names[0], steps[since],
                f"gradient norm {early_norm[-1]:.2g} in {layers_named(names)} vs {late_norm[-1]:.2g} in "
                f"{layers_named(lates)} at step {steps[-1]} ({how}); so at {share:.0%} of the gradient readings since "
                f"step {steps[since]}",
                score=np.log10(np.clip(np.nan_to_num(decay[-1], nan=1.0), 1, 1e30)),  # (a 0: no infinite score)
                stream="param_grad", value=decay[-1], threshold=r.decay_ratio,
                first=steps[since], last=steps[-1], index=depth[early[0]][0])


FAMILY = Family((VANISHING_GRADIENTS,), check, thresholds=(
    Threshold("vanishing", 1e-5, "gradient norm of the earliest layers (their median) below which they vanish"),
    Threshold("decay_ratio", 1e3, "... or their gradient RMS this many times below the latest layers'", low=1.0),
    Threshold("vanishing_share", 0.8, "... at this share of the gradient readings, to the end of the run", high=1.0),
    Threshold("vanishing_readings", 10, "... and at least this many of them", low=1, whole=True)))
