"""NaN and Inf: where the first one appeared (the forward, the loss, the backward), then its spread."""
from __future__ import annotations

import polars as pl

from actrace.format.schema import SCALAR_INDEX, STREAMS

from ._base import Family, Rule, make

# Within a step, the forward pass comes first: a NaN starts there and the backward spreads it.
STREAM_ORDER = {stream: i for i, stream in enumerate(STREAMS)}  # the spec lists them in that order
GRADIENTS = ("activation_grad", "param_grad")
NAN_INF = Rule(
    "nan_inf", "critical", "any reading holds a NaN or an Inf, or the logged loss is not finite; said at its origin "
    "(spec §Metrics, NaN/Inf origin)",
    "find the first op that overflows: lower the LR, clip gradients, check for log(0) or 0/0",
    reads=("nan_count", "inf_count", "loss"), explains=(("*", "anywhere"),))


def check(view, r):
    """nan_inf: where a run's first NaN or Inf appeared: in a step, the forward (activations in layer
    order), then the loss it logged, then the backward (gradients from the output back); a loss that
    is no number while no activation is (a log(0) in it) named as the loss ("loss"), even where a
    guard skipped the step and no reading holds one; then how far it spread."""
    g = view.m.filter((pl.col("nan_count") > 0) | (pl.col("inf_count") > 0)).with_columns(
        pl.col("stream").replace_strict(STREAM_ORDER, default=len(STREAM_ORDER)).alias("_order"),
        pl.when(pl.col("stream").is_in(GRADIENTS)).then(-pl.col("layer_index")).otherwise("layer_index").alias("_at"))
    g = g.sort("step", "_order", "_at", "layer")  # within a step: the forward in layer order, the backward from the output
    loss = view.non_finite_loss
    lost = loss["step"].min() if loss is not None and loss.height else None
    if not g.height and lost is None:
        return None
    grads = g.filter(pl.col("stream").is_in(GRADIENTS))
    first = g.row(0, named=True) if g.height else None
    spread = (f"; gradients non-finite from step {grads['step'][0]} ({grads['stream'][0]} of {grads['layer'][0]} "
              "first)") if grads.height else ""
    if lost is not None and (first is None or lost < first["step"] or (lost == first["step"] and
                                                                        first["stream"] != "activation")):
        value = loss.filter(pl.col("step") == lost)["value"][0]
        return make(NAN_INF, view.run, "loss", lost,
                    f"first NaN/Inf at step {lost} in the logged loss ({value}), no activation read holding one"
                    f"{spread}; the loss not finite at {loss.height} logged step(s), "
                    f"{g.height} readings affected", score=g.height + loss.height, stream="scalar",
                    value=loss.height, threshold=0, first=lost, last=max(loss["step"].max(), g["step"].max() or 0),
                    index=SCALAR_INDEX)
    said = f"; the logged loss not finite from step {lost}" if lost is not None else ""
    return make(NAN_INF, view.run, first["layer"], first["step"],
                f"first NaN/Inf at step {first['step']} in {first['layer']} ({first['stream']}: "
                f"{first['nan_count']} NaN, {first['inf_count']} Inf)"
                f"{spread if first['stream'] == 'activation' else ''}{said}; "
                f"{g.height} readings affected", score=g.height, stream=first["stream"],
                value=first["nan_count"] + first["inf_count"], threshold=0, first=first["step"],
                last=g["step"].max(), index=first["layer_index"])


FAMILY = Family((NAN_INF,), check)
