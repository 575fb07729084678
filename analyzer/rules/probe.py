"""A reading that cannot be trusted: the probe changed, or activations were read in train mode."""
from __future__ import annotations

import polars as pl

from ._base import Family, Rule, make

PROBE_CHANGED = Rule(
    "probe_changed", "warning", "the probe fingerprint changed within a run",
    "use the same fixed probe batch at every reading, or the numbers compare different data",
    reads=("probe_fingerprint",))
TRAIN_MODE = Rule(
    "train_mode", "warning", "activation readings were taken in `train` mode",
    "read activations in eval mode: dropout and batch statistics distort dead fraction", reads=("mode",))


def check(view, r):
    g = view.m.select("layer", "layer_index", "stream", "step", "probe_fingerprint", "mode").filter(
        pl.col("stream") == "activation").sort("step", "layer_index", "layer")
    if not g.height:
        return
    fps = g.filter(pl.col("probe_fingerprint").is_not_null())
    changed = fps.filter(pl.col("probe_fingerprint") != fps["probe_fingerprint"][0]) if fps.height else fps
    if changed.height:
        yield make(PROBE_CHANGED, view.run, changed["layer"][0], changed["step"][0],
                   f"probe fingerprint changed from {fps['probe_fingerprint'][0]} to "
                   f"{changed['probe_fingerprint'][0]}", first=changed["step"][0], last=g["step"].max())
    train = g.filter(pl.col("mode") == "train")
    if train.height:
        yield make(TRAIN_MODE, view.run, train["layer"][0], train["step"][0],
                   f"{train.height} activation readings taken in train mode", value=train.height,
                   first=train["step"][0], last=train["step"].max())


FAMILY = Family((PROBE_CHANGED, TRAIN_MODE), check)
