"""Exploding gradients: sustained growth far past the run's own history while the loss stops falling."""
from __future__ import annotations

import warnings

import numpy as np
import polars as pl

from ..trends import theil_sen
from ._base import SEVERITY_RANK, Family, Rule, Threshold, make
from ._shared import loss_rose

EXPLODING_GRADIENTS = Rule(
    "exploding_gradients", "critical",
    "(a) the total gradient norm at each of the last 3 of a window of `exploding_window` readings is ≥ "
    "`exploding_growth`× its median before the window, above `exploding`, rising over the window, while the loss "
    "rose (its median beyond the spread of its values before, or one step `loss_catastrophic`× its median, or no "
    "number), "
    "and it does not recover (back under that growth within a window, to the end, is a spike: no finding); where the "
    "loss held level or none was logged, the growth must be `exploding_growth`² (a warning) or "
    "reaches `exploding_unlogged` (critical, at once or later in the run); where the loss falls, none; or (b) the layers' median update ratio at a `param` "
    "reading is ≥ `update_growth`× its median over the earlier readings (3 at least)",
    "unstable updates, divergence ahead: clip gradients, lower the LR",
    uses=("exploding", "exploding_growth", "exploding_window", "exploding_unlogged", "loss_catastrophic", "update_growth"), reads=("grad_norm", "update_ratio", "loss"),
    also="warning")


def _recovered(total: np.ndarray, i: int, limit: float, w: int) -> bool:
    """The total norm after reading `i` falls back under `limit` within `w` readings and stays under it
    to the end, for 3 readings at least: a spike (one bad batch) the run recovered from."""
    after = total[i + 1:]
    under = np.flatnonzero(after < limit)  # NaN is no recovery
    return bool(len(under)) and under[0] < w and len(after) - under[0] >= 3 and bool((after[under[0]:] < limit).all())


def _exploding(view, r):
    steps, depth, norm, _ = view.norms
    loss = view.loss
    total = np.sqrt(np.sum(norm ** 2, 1))
    w = r.exploding_window
    if len(total) < w + 5:
        return None
    low = np.fmin.accumulate(np.where(np.isfinite(total), total, np.inf))  # the median is above the minimum
    for i in range(w + 4, len(total)):
        if not np.isfinite(total[i]):
            break  # non-finite gradients are nan_inf's business
        window, history = total[i - w + 1: i + 1], total[: i - w + 1]
        if window[-1] <= r.exploding or window[-3:].min() < r.exploding_growth * low[i - w]:
            continue  # cannot have grown enough: the median before is above the minimum before
        base = np.median(history[np.isfinite(history)])
        growth = window[-3:].min() / max(base, 1e-30)
        rose = loss_rose(loss, steps[max(0, i - 2 * w + 1)], steps[i - w + 1], steps[i], r.loss_catastrophic)
        risen = rose is not None and rose[0] is True
        need = r.exploding_growth if risen else r.exploding_growth ** 2
        if growth < need or theil_sen(steps[i - w + 1: i + 1], np.log10(np.maximum(window, 1e-30))) <= 0:
            continue
        if rose is not None and rose[0] is False:
            continue  # the loss keeps falling: a net learning faster, not diverging
        if _recovered(total, i, r.exploding_growth * base, w):
            continue  # a spike the run came back from: one bad batch, not an explosion
        said = rose[1] if rose is not None else "; no loss was logged to read it against"
        start = i - w + 1 + int(np.argmax(window > r.exploding_growth * base))
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            ratios = norm[i] / np.maximum(np.nanmedian(norm[: i - w + 1], 0), 1e-30)
        worst = int(np.nanargmax(ratios))
        others = [depth[j][1] for j in np.argsort(-ratios) if j != worst and ratios[j] >= r.exploding_growth][:5]
        later = total[i:][np.isfinite(total[i:])]  # how far it went on from there, to the end or a NaN
        peak = later.max() / max(base, 1e-30)
        critical = risen or peak >= r.exploding_unlogged
        went = f", and on to {peak:.3g}× by step {steps[i + int(np.argmax(total[i:] == later.max()))]}" \
            if peak > 2 * growth else ""
        return make(EXPLODING_GRADIENTS, view.run, depth[worst][1], steps[start],
                    f"total gradient norm {window[-1]:.3g} at step {steps[i]}, {growth:.3g}× its median of "
                    f"{base:.3g} before step {steps[i - w + 1]} and still rising{went}{said}; grew most in "
                    f"{depth[worst][1]} ({ratios[worst]:.3g}×)" + (f", also {', '.join(others)}" if others else ""),
                    severity="critical" if critical else "warning", score=np.log10(growth), stream="param_grad",
                    value=growth, threshold=need, first=steps[i - w + 1], last=steps[i], index=depth[worst][0])
    return None


def _runaway_updates(view, r):
    """The layers' median update ratio (‖Δw‖ / ‖w‖ since the previous parameter reading) at a reading
    is `update_growth`× its median over the earlier readings (three at least): the updates run away
    from their own history, as under a learning rate that keeps rising. Critical when the loss over
    that span rose (`loss_rose`), else a warning (a falling loss weighs against it). A frozen layer's
    0 says nothing of an update's size (unfrozen, it would run away from nothing): left out."""
    per = view.m.filter((pl.col("stream") == "param") & pl.col("update_ratio").is_finite() &
                        (pl.col("update_ratio") > 0)).sort("step")
    ratio = per.group_by("step", maintain_order=True).agg(pl.col("update_ratio").median())
    steps, u = ratio["step"].to_numpy(), ratio["update_ratio"].to_numpy()
    for i in range(3, len(u)):
        base = np.median(u[:i])
        if not u[i] >= r.update_growth * max(base, 1e-30):
            continue
        rose = loss_rose(view.loss, steps[i - 2], steps[i - 1], steps[i], r.loss_catastrophic)
        layers = per.filter(pl.col("step") == steps[i]).sort(["update_ratio", "layer"], descending=[True, False])
        worst = layers.row(0, named=True)
        said = rose[1] if rose is not None else ""
        return make(EXPLODING_GRADIENTS, view.run, worst["layer"], steps[i],
                    f"updates ran away from their history: median update ratio {u[i]:.3g} at step {steps[i]}, "
                    f"{u[i] / base:.3g}× its median of {base:.3g} over the {i} readings before (largest in "
                    f"{worst['layer']}, {worst['update_ratio']:.3g}){said}",
                    severity="critical" if rose is not None and rose[0] is True else "warning",
                    score=np.log10(u[i] / base), stream="param", value=u[i] / base, threshold=r.update_growth,
                    first=steps[0], last=steps[i], index=worst["layer_index"])
    return None


def check(view, r):
    """The earliest sign of one explosion, the most severe first on a tie."""
    explosions = [f for f in (_exploding(view, r) if view.gradients.height else None, _runaway_updates(view, r)) if f]
    return min(explosions, key=lambda f: (f.step, SEVERITY_RANK[f.severity])) if explosions else None


FAMILY = Family((EXPLODING_GRADIENTS,), check, thresholds=(
    Threshold("exploding", 1.0, "the total gradient norm above this ..."),
    Threshold("exploding_growth", 10.0, "... and this many times its median before the window", low=1.0),
    Threshold("exploding_window", 10, "... at each of the last 3 of a window of this many gradient readings", low=4,
              whole=True),
    Threshold("exploding_unlogged", 1000.0, "growth that is critical where the loss held level or none was logged",
              low=1.0),
    Threshold("loss_catastrophic", 10.0, "one logged loss this many times its median before (beyond its spread) is a "
              "rise, which a median would ignore", low=1.0),
    Threshold("update_growth", 10.0, "the layers' median update ratio this many times its earlier median", low=1.0)))
