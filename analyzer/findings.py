"""Findings: rules that turn metrics into "what is wrong, where, since when" (spec §Findings).

Every threshold is a field of `Rules`, its default calibrated on the labelled corpus of
bench/bench_findings.py (healthy runs of eight families give no critical finding). Each rule
computes its numbers once and builds its evidence and its `Finding` fields from those same numbers.
Trend beats level: a dead fraction still growing ranks above a larger stable one. A NaN is reported
where it starts (the forward pass, in forward order), then where it spread. Gradient growth is an
explosion only when it is sustained and the loss stops falling: a net leaving its initial plateau
raises its gradient norm tenfold while it learns.
"""
from __future__ import annotations

import fnmatch
import json
import warnings
from dataclasses import asdict, dataclass

import numpy as np
import polars as pl

from actrace.format.recurrent import describe
from actrace.format.schema import ACTIVATION_KINDS, DERIVED_KINDS, KIND_BOUNDS, SCALAR_INDEX, STREAMS, sat_margin

from .metrics import Thresholds
from .trends import held_since, onset, recent, series_bounds, stable_since, theil_sen

SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}
# Within a step, the forward pass comes first: a NaN starts there and the backward spreads it.
STREAM_ORDER = {stream: i for i, stream in enumerate(STREAMS)}  # the spec lists them in that order
# attention's query and key projections: their gradients are tiny while attention is near uniform
# (at initialization above all), which is normal, not vanishing
# whose units dormancy is read in (ReDo's neurons: an activation function's outputs), not a linear or
# norm output (units at −100 before a ReLU, dead after it, would make the healthy rest read dormant
# there), nor a softmax (rarely chosen classes are no dormant neurons)
DORMANT_KINDS = ACTIVATION_KINDS - {"softmax"}
QUERY_KEY = ("*.query", "*.key", "*q_proj", "*k_proj", "*.q", "*.k", "*.wq", "*.wk", "*q_lin", "*k_lin")


@dataclass(frozen=True)
class Rules:
    """Thresholds of the findings rules (analysis options, never recorded in traces)."""

    max_dead: float = 0.2            # "tens of % means the layer is effectively much narrower"
    max_dormant: float = 0.3         # units alive but barely firing (RMS ≤ τ × the layer's mean unit RMS):
    #                                  healthy ReLU nets of the corpus reach 25 % (SGD with momentum)
    dead_growth: float = 0.2         # rise in dead fraction over the recent half of the readings: still dying
    #                                  (healthy ReLU nets lose up to 12 points early in training: attrition;
    #                                  the corpus's dying layers rise by 41 points or more)
    max_saturation: float = 0.3      # "over 30 % suggests init or learning-rate trouble"
    max_gate_saturation: float = 0.9  # a recurrent gate works as a switch: most values at a bound is normal
    max_saturation_units: float = 0.1  # share of units pinned for every input of the probe
    saturation_spike: float = 0.2    # jump between two consecutive readings, landing above max_saturation
    saturation_growth: float = 0.2   # rise of the saturated share over the recent readings, ending above the
    #                                  limit: a hidden layer still being driven into its bounds (trend beats level)
    mean_drift_sigmas: float = 2.0   # |mean| > k·std for unbounded, non-rectified layers
    collapse_ratio: float = 1e-2     # std fell below this share of its first reading
    vanishing: float = 1e-5          # gradient norm of the earliest layers (their median) ...
    decay_ratio: float = 1e3         # ... or gradient RMS this many times below the latest layers'
    vanishing_share: float = 0.8     # ... at this share of the gradient readings, to the end of the run,
    vanishing_readings: int = 10     # and at least this many of them (a net on its initial plateau is no trend)
    exploding: float = 1.0           # gradient norm above this ...
    exploding_growth: float = 10.0   # ... and this many times its median before the window, at each of
    exploding_window: int = 10       # the last 3 of a window of this many gradient readings, still rising,
    #                                  while the loss stops falling (without a logged loss: growth² and
    #                                  a warning, not a critical finding)
    update_growth: float = 10.0      # or the layers' median update ratio this many times its median over
    #                                  the earlier parameter readings (critical when the loss stopped falling)
    massive_ratio: float = 100.0     # a unit's max |h| this many times the median unit's (Sun et al. 2024
    #                                  find ~1000x in trained LLMs; a random init stays under 10x) ...
    massive_readings: int = 3        # ... the same unit at this many consecutive readings, the last included
    entropy_collapse: float = 0.1    # a layer's mean head entropy (over its maximum, ln keys) below this: its
    #                                  heads near one-hot on every query (random init reads ~1)
    logit_limit: float = 50.0        # the largest attention logit above this (softmax then one-hot to e^-50) ...
    logit_growth: float = 5.0        # ... and this many times its first reading, still rising
    log_z_rise: float = 5.0          # the LM head's mean log Z this many nats above its first reading, still
    #                                  rising (the corpus's healthy language models drift up to 1.7)
    expert_tokens: float = 5.0       # an expert with no token, where the router's experts average this many


@dataclass
class Finding:
    """One finding. `value` is the number the rule tested and `threshold` the limit it crossed;
    `first_step`/`last_step` the readings it read; `step` is where the pathology starts."""

    severity: str
    rule: str
    run: str
    layer: str
    step: int
    evidence: str
    advice: str
    score: float = 0.0
    stream: str = "activation"
    value: float | None = None
    threshold: float | None = None
    first_step: int | None = None
    last_step: int | None = None
    layer_index: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


ADVICE = {
    "nan_inf": "find the first op that overflows: lower the LR, clip gradients, check for log(0) or 0/0",
    "dead_growing": "something keeps killing units: lower the LR, use leaky ReLU, check init variance",
    "dead_high": "a fixed capacity tax: weigh it against the validation metric; leaky ReLU or better init",
    "dormant_units": "units that barely fire carry little and learn little (ReDo): re-initialize their incoming "
                     "weights (recycling), lower the weight decay, or check the learning rate",
    "saturation_high": "activations hit their bounds: lower the LR or re-initialize this layer",
    "units_pinned": "units stuck at a bound for every input carry no information: lower the LR, re-initialize "
                    "this layer, or normalize its input",
    "saturation_spike": "activations jumped to their bounds: lower the LR around this step",
    "saturation_growing": "something keeps driving this layer into its bounds, where its gradient vanishes: lower "
                          "the LR, normalize its input, or re-initialize it",
    "mean_drift": "the next layer gets biased inputs: check normalization and biases",
    "variance_collapse": "all outputs alike (representation collapse): check the loss design, overfitting",
    "vanishing_gradients": "gradients don't reach early layers: residual connections, shallower net, init",
    "exploding_gradients": "unstable updates, divergence ahead: clip gradients, lower the LR",
    "probe_changed": "use the same fixed probe batch at every reading, or the numbers compare different data",
    "train_mode": "read activations in eval mode: dropout and batch statistics distort dead fraction",
    "run_unfinished": "the trace was never closed: the run is still going, or was killed; its part files are "
                      "what was flushed",
    "run_failed": "the run ended with an exception; its readings up to then are kept",
    "run_stopped": "the run was stopped (Ctrl-C or a termination signal) before it finished; its readings up "
                   "to then are kept",
    "run_empty": "the trace was closed without a reading: the monitor read nothing (no probe reading due, no "
                 "layer selected?), so nothing about this run can pass a gate",
    "stream_missing": "the monitor never got what it was set to read: call monitor.step(step) after "
                      "loss.backward() and before optimizer.zero_grad()",
    "gradient_missing": "these layers never learn: find what cuts them off from the loss (a .detach(), a "
                        "torch.no_grad block, an output left unused), or freeze them on purpose (requires_grad=False)",
    "massive_activation": "a few fixed units carry values far above the rest (outlier features, attention sinks): "
                          "they dominate the layer's norm and break low-precision quantization; watch them against "
                          "the loss, consider QK-norm, weight decay, or an explicit attention sink",
    "attention_entropy_collapse": "attention heads put all their mass on one key (entropy collapse, often with "
                                  "growing logits): normalize queries and keys (QK-norm), lower the LR, or warm up longer",
    "attention_logit_growth": "attention logits keep growing, a precursor of loss divergence in large transformers: "
                              "QK-norm or QK-clip, a lower LR, weight decay on the query and key projections",
    "logit_divergence": "the output logits' log-partition (log Z) drifts up: add a z-loss (1e-4 · log²Z), lower the LR",
    "dead_expert": "an expert no probe token reaches stops learning: raise the router's load-balancing loss, add "
                   "router noise or a capacity limit, or re-initialize that expert's router weights",
    "scaler_skipped": "the loss scaler skipped these updates and lowered its scale: normal now and then under "
                      "mixed precision; often in a row, lower the LR or the initial scale",
}

# a recurrent gate at its bounds: what its own knobs are
GATE_ADVICE = ("a gate pinned for every input does the same at every step: check this gate's bias "
               "initialization (LSTMs usually start the forget gate's at 1, the others at 0) and the scale of "
               "the layer's input")
# what a sigmoid gate pinned near 1, or near 0, does to its layer (PyTorch's and ONNX's formulas)
GATE_SIDES = {
    "forget gate": ("open (the cell never forgets)", "closed (the cell forgets every step)"),
    "input gate": ("open (every candidate is written)", "closed (nothing new is written to the cell)"),
    "output gate": ("open (the state shows the whole cell)", "closed (the hidden state stays near 0)"),
    "update gate": ("at 1 (the state is copied, never updated)", "at 0 (the state is overwritten every step)"),
    "reset gate": ("at 1 (the past state always counts)", "at 0 (the past state is ignored)"),
}


def _gate(what: tuple[str, str] | None) -> str | None:
    """The gate a recurrent reading (`describe`) is ("forget gate"), or None."""
    name = what[1].split(" of ")[0] if what else ""
    return name if name.endswith("gate") else None


def _finding(severity, rule, run, layer, step, evidence, *, score=0.0, stream="activation", advice=None,
             value=None, threshold=None, first=None, last=None, index=None) -> Finding:
    def num(v):
        return None if v is None else float(v)

    def whole(v):
        return None if v is None else int(v)
    return Finding(severity, rule, run, layer, int(step), evidence, advice or ADVICE[rule], float(score), stream,
                   num(value), num(threshold), whole(first), whole(last), whole(index))


_READINGS = ("step", "layer_index", "kind", "dead_fraction", "dormant_fraction", "saturation_value", "saturation_unit",
             "mean", "std", "nan_count", "inf_count", "top_unit", "top_ratio")


def _per_layer(m: pl.DataFrame, stream: str):
    """(run, layer, its readings in step order): each a dict of numpy arrays (nulls NaN), sliced from
    arrays made once for every layer, so thousands of layers cost one conversion, not thousands."""
    mask = m["stream"] == stream
    keys = m.select("run", "layer", "layer_index", "step").filter(mask)
    if not keys.height:
        return
    order = keys.select(pl.arg_sort_by("run", "layer_index", "layer", "step")).to_series()
    ordered = bool((order.diff().drop_nulls() > 0).all())  # the metric table's own order: nothing to move
    keys = keys if ordered else keys[order]

    def column(c: str) -> np.ndarray:  # one column at a time: a copy of the readings' table never exists
        v = m[c].filter(mask) if ordered else m[c].filter(mask).gather(order)
        return v.to_numpy() if c == "kind" else v.cast(pl.Float64).fill_null(np.nan).to_numpy()
    cols = {c: column(c) for c in _READINGS}
    cols["step"] = keys["step"].to_numpy()
    starts, ends = series_bounds(keys, "run", "layer")
    names = keys[starts].select("run", "layer").rows()  # each layer's names once, not each reading's
    for (run, layer), lo, hi in zip(names, starts, ends):
        yield run, layer, {c: v[lo:hi] for c, v in cols.items()}


def _pinned(what: tuple[str, str] | None, kind: str, mean: float, share: float, t: float) -> str:
    """The share of units pinned at a bound, said of a recurrent gate as what it does ("forget
    gate of layer 0 pinned open (the cell never forgets): 100% of units ≥ 0.99")."""
    gate, bounds = _gate(what), KIND_BOUNDS.get(kind)
    if gate is None or bounds is None:
        return f"{share:.0%} of units pinned at a bound"
    lo, hi = bounds
    margin = float(sat_margin(lo, hi, t))
    if kind == "sigmoid":
        high = mean > (lo + hi) / 2
        side = GATE_SIDES.get(gate, ("at 1", "at 0"))[0 if high else 1]
        return f"{what[1]} pinned {side}: {share:.0%} of units {'≥' if high else '≤'} " \
               f"{hi - margin if high else lo + margin:.4g}"
    return f"{what[1]} pinned: {share:.0%} of units within {margin:.4g} of ±{hi:g}"


def _growing(rule, run, layer, s, v, need: float, what: str, index: int, advice=None) -> Finding | None:
    """`rule` (critical) where `v`'s robust rise over the recent readings is `need` or more and its
    last value at least half that above the value where they start: a layer still getting worse;
    the finding starts where the rise starts (`onset`)."""
    i = recent(s)
    rise = theil_sen(s[i:], v[i:]) * (s[-1] - s[i])
    if rise < need or v[-1] - v[i] < need / 2:
        return None
    start = onset(s, v)
    return _finding("critical", rule, run, layer, s[start],
                    f"{what} rose from {v[start]:.0%} at step {s[start]} to {v[-1]:.0%} at step {s[-1]}, {rise:+.0%} "
                    f"over the last {len(s) - i} readings (since step {s[i]})", score=1 + rise, value=rise,
                    threshold=need, first=s[i], last=s[-1], index=index, advice=advice)


def _dead(run, layer, g, r: Rules) -> Finding | None:
    """dead_growing: the dead fraction rose over the recent readings (a net rise, robust slope), by
    `dead_growth`, or by half that where it ends above `max_dead` (many units dead and still dying,
    however slowly); else dead_high: many units dead, near that level since the step it reached it.
    A reading holding a NaN or an Inf says nothing of death (its units may hold nothing else: nan_inf's
    business), nor does a softmax's 0 (a masked or unchosen entry: dead_expert's)."""
    steps, dead = g["step"], g["dead_fraction"]
    if g["kind"][0] == "softmax":
        return None
    known = ~np.isnan(dead) & (g["nan_count"] + g["inf_count"] == 0)
    if not known.any() or not known[-1]:
        return None
    s, d = steps[known], dead[known]
    index = int(g["layer_index"][0])
    growing = _growing("dead_growing", run, layer, s, d, r.dead_growth / 2 if d[-1] > r.max_dead else r.dead_growth,
                       "dead fraction", index)
    if growing:
        return growing
    if d[-1] > r.max_dead:
        since = stable_since(s, d, r.dead_growth / 2)
        trend = f"within {r.dead_growth / 2:.0%} of that since step {since}" if since < s[-1] else \
            "not rising steadily of late"
        return _finding("warning", "dead_high", run, layer, since,
                        f"{d[-1]:.0%} of units dead at step {s[-1]}, {trend}", score=d[-1], value=d[-1],
                        threshold=r.max_dead, first=since, last=s[-1], index=index)
    return None


def _saturation(run, layer, g, r: Rules, what, advice, output: bool) -> Finding | None:
    """saturation_growing: the saturated share rose by `saturation_growth` over the recent readings
    (a robust rise) to above max_saturation (max_gate_saturation for a recurrent gate), in a hidden
    layer (a softmax growing confident, the model's output layer, are learning); else
    saturation_spike: it jumped between two readings to above that limit; else saturation_high:
    above it at the last reading."""
    steps, sat = g["step"], g["saturation_value"]
    if not len(sat) or np.isnan(sat).all():
        return None
    index, limit = int(g["layer_index"][0]), r.max_gate_saturation if _gate(what) else r.max_saturation
    known = ~np.isnan(sat)
    s, v = steps[known], sat[known]
    growing = not output and g["kind"][0] != "softmax" and len(s) >= 3 and known[-1] and v[-1] > limit and _growing(
        "saturation_growing", run, layer, s, v, r.saturation_growth, f"{what[1]}: saturated share" if what else
        "saturated share", index, advice)
    if growing:
        return growing
    jumps = np.diff(sat)
    landed = (jumps >= r.saturation_spike) & (sat[1:] > limit)
    if landed.any():
        i = int(np.argmax(np.where(landed, jumps, -np.inf))) + 1
        return _finding("warning", "saturation_spike", run, layer, steps[i],
                        f"saturation jumped from {sat[i - 1]:.0%} at step {steps[i - 1]} to {sat[i]:.0%} at step "
                        f"{steps[i]}", score=jumps[i - 1], value=jumps[i - 1], threshold=r.saturation_spike,
                        first=steps[i - 1], last=steps[i], index=index, advice=advice)
    if sat[-1] > limit:
        start = steps[np.argmax(sat > limit)]
        unit = g["saturation_unit"][-1]
        share = "of its distributions peaked near 1" if g["kind"][-1] == "softmax" else "of values"
        return _finding("warning", "saturation_high", run, layer, start,
                        (f"{what[1]} at its bounds: " if what else "") +
                        f"{sat[-1]:.0%} {share} and {unit:.0%} of units saturated at step {steps[-1]}, above "
                        f"{limit:.0%} since step {start}", score=sat[-1], value=sat[-1],
                        threshold=limit, first=start, last=steps[-1], index=index, advice=advice)
    return None


def _massive(run, layer, g, r: Rules, index: int) -> Finding | None:
    """One unit of an unbounded layer far above the others, the same unit reading after reading
    (a bounded layer's values cannot be massive: a peaked softmax is saturation)."""
    kind = g["kind"][0]
    ratio, top, steps = g["top_ratio"], g["top_unit"], g["step"]
    if kind == "clip" or KIND_BOUNDS.get(kind) is not None or not len(ratio) or not ratio[-1] >= r.massive_ratio:
        return None
    held = (ratio >= r.massive_ratio) & (top == top[-1])
    streak = len(held) - (np.flatnonzero(~held)[-1] + 1 if (~held).any() else 0)
    if streak < r.massive_readings:
        return None
    start = steps[-streak]
    return _finding("warning", "massive_activation", run, layer, start,
                    f"unit {int(top[-1])} reaches {ratio[-1]:.0f}× the max |h| of the layer's median unit at step "
                    f"{steps[-1]}, above {r.massive_ratio:g}× and the largest unit at every reading since step "
                    f"{start} ({streak} readings)", score=ratio[-1], value=ratio[-1], threshold=r.massive_ratio,
                    first=start, last=steps[-1], index=index)


MEAN_KINDS = ("linear", "conv", "norm", "identity")  # unbounded, not rectified: a mean away from 0 is a bias


def _activation_findings(m: pl.DataFrame, r: Rules, th: Thresholds) -> list[Finding]:
    out = []
    names = {}
    for run, layer in m.select("run", "layer").unique().iter_rows():
        names.setdefault(run, set()).add(layer)
    # each run's output layer: no next layer gets its biased values (a regression's target, a softmax's logits)
    acts = m.filter((pl.col("stream") == "activation") & ~pl.col("kind").is_in(DERIVED_KINDS))
    outputs = dict(acts.filter(pl.col("kind").is_in(MEAN_KINDS)).group_by("run").agg(
        pl.col("layer_index").max()).iter_rows())
    last = dict(acts.group_by("run").agg(pl.col("layer_index").max()).iter_rows())  # the model's output
    for run, layer, g in _per_layer(m, "activation"):
        what = describe(layer, names[run])
        if what and what[1].startswith("final"):
            continue  # a final state is the last step of its sequence, judged there
        advice = GATE_ADVICE if _gate(what) else None
        index = int(g["layer_index"][0])
        out += [f for f in (_dead(run, layer, g, r), _saturation(run, layer, g, r, what, advice,
                                                                 index == last.get(run))) if f]
        steps = g["step"]
        pinned = g["saturation_unit"]
        if len(pinned) and pinned[-1] > r.max_saturation_units:
            start = steps[np.argmax(pinned > r.max_saturation_units)]
            out.append(_finding("warning", "units_pinned", run, layer, start,
                                f"{_pinned(what, g['kind'][0], g['mean'][-1], pinned[-1], th.sat_threshold)} for "
                                f"every probe input at step {steps[-1]}, above {r.max_saturation_units:.0%} since "
                                f"step {start}", score=pinned[-1], advice=advice, value=pinned[-1],
                                threshold=r.max_saturation_units, first=start, last=steps[-1], index=index))
        dormant = g["dormant_fraction"]
        since = held_since(dormant > r.max_dormant, 1.0)
        if since is not None and g["kind"][0] in DORMANT_KINDS:
            out.append(_finding("warning", "dormant_units", run, layer, steps[since],
                                f"{dormant[-1]:.0%} of units alive but dormant (RMS at most {th.dormant_tau:g}× the "
                                f"layer's mean unit RMS) at step {steps[-1]}, above {r.max_dormant:.0%} since step "
                                f"{steps[since]}", score=dormant[-1], value=dormant[-1], threshold=r.max_dormant,
                                first=steps[since], last=steps[-1], index=index))
        massive = _massive(run, layer, g, r, index)
        if massive:
            out.append(massive)
        clean = g["nan_count"] + g["inf_count"] == 0  # NaN readings are nan_inf's business
        std, mean = g["std"][clean], g["mean"][clean]
        steps = steps[clean]
        if len(std) >= 2 and std[0] > 0 and std[-1] < r.collapse_ratio * std[0]:
            start = steps[np.argmax(std < r.collapse_ratio * std[0])]
            out.append(_finding("warning", "variance_collapse", run, layer, start,
                                f"std fell from {std[0]:.3g} at step {steps[0]} to {std[-1]:.3g} at step {steps[-1]}, "
                                f"below {r.collapse_ratio:.0%} of its first reading since step {start}",
                                score=std[0] / max(std[-1], 1e-30), value=std[-1] / std[0], threshold=r.collapse_ratio,
                                first=steps[0], last=steps[-1], index=index))
        if g["kind"][0] in MEAN_KINDS and index != outputs.get(run) and len(mean) and std[-1] > 0 \
                and abs(mean[-1]) > r.mean_drift_sigmas * std[-1]:
            start = steps[np.argmax(np.abs(mean) > r.mean_drift_sigmas * std)]
            out.append(_finding("warning", "mean_drift", run, layer, start,
                                f"mean {mean[-1]:.3g} is {abs(mean[-1]) / std[-1]:.1f} std from zero at step "
                                f"{steps[-1]}, beyond {r.mean_drift_sigmas:g} std since step {start}",
                                score=abs(mean[-1]) / std[-1], value=abs(mean[-1]) / std[-1],
                                threshold=r.mean_drift_sigmas, first=start, last=steps[-1], index=index))
    return out


def _streams(frame: pl.DataFrame, kind: str, *values: pl.Expr):
    """(run, layer, layer_index, steps, value arrays) of each derived reading of `kind`, per step
    the `values` aggregated over its units (heads, experts)."""
    g = frame.filter(pl.col("kind") == kind).group_by("run", "layer", "layer_index", "step").agg(*values)
    for (run, layer, index), rows in g.sort("run", "layer_index", "layer", "step").group_by(
            "run", "layer", "layer_index", maintain_order=True):
        yield run, layer, index, rows["step"].to_numpy(), rows


def _rising(steps: np.ndarray, v: np.ndarray) -> bool:
    start = recent(steps)
    return len(v) >= 3 and theil_sen(steps[start:], v[start:]) > 0


def _signal_findings(series: pl.DataFrame, units: pl.DataFrame, r: Rules,
                     scalars: pl.DataFrame | None = None) -> list[Finding]:
    """The rules of derived readings (spec §Findings): attention entropy collapse and logit growth
    per layer, a drifting log Z of the LM head, an expert no token reaches. A collapse or a drift
    while the loss falls to under half is a model finding its solution (one-hot heads, confident
    logits), not one diverging: not said (`_solving`)."""
    out = []

    def solving(run, since, last) -> bool:
        return scalars is not None and _solving(
            scalars.filter((pl.col("run") == run) & (pl.col("name") == "loss")), since, last)
    for run, layer, index, steps, g in _streams(units, "attention_entropy", pl.col("mean").mean().alias("v"),
                                                pl.col("unit").filter(pl.col("mean") < r.entropy_collapse).alias("low"),
                                                pl.len().alias("heads")):
        v = g["v"].to_numpy()
        since = held_since(v < r.entropy_collapse, 1.0)
        if since is not None and not solving(run, steps[since], steps[-1]):
            low = g["low"][-1].sort().to_list()
            out.append(_finding("warning", "attention_entropy_collapse", run, layer, steps[since],
                                f"mean head entropy {v[-1]:.3f} of its maximum at step {steps[-1]} (from {v[0]:.2f} at "
                                f"step {steps[0]}), below {r.entropy_collapse:g} since step {steps[since]}; "
                                f"{len(low)} of {g['heads'][-1]} heads below it: {', '.join(map(str, low[:16]))}",
                                score=1 - v[-1], value=v[-1], threshold=r.entropy_collapse, first=steps[since],
                                last=steps[-1], index=index))
    for run, layer, index, steps, g in _streams(units, "attention_logit", pl.col("max").max().alias("v"),
                                                pl.col("unit").sort_by("max").last().alias("head")):
        v = g["v"].to_numpy()
        grown = (v >= r.logit_limit) & (v >= r.logit_growth * v[0]) if v[0] > 0 else np.zeros(len(v), bool)
        since = held_since(grown, 1.0)
        if since is not None and _rising(steps, v):
            out.append(_finding("warning", "attention_logit_growth", run, layer, steps[since],
                                f"max attention logit {v[-1]:.3g} (head {g['head'][-1]}) at step {steps[-1]}, "
                                f"{v[-1] / v[0]:.1f}× its {v[0]:.3g} at step {steps[0]} and still rising; above "
                                f"{r.logit_limit:g} and {r.logit_growth:g}× since step {steps[since]}",
                                score=v[-1] / v[0], value=v[-1], threshold=r.logit_limit, first=steps[since],
                                last=steps[-1], index=index))
    for run, layer, index, steps, g in _streams(series, "log_z", pl.col("mean").first().alias("v")):
        v = g["v"].to_numpy()
        since = held_since(v - v[0] >= r.log_z_rise, 1.0)
        if since is not None and _rising(steps, v) and not solving(run, steps[since], steps[-1]):
            out.append(_finding("warning", "logit_divergence", run, layer, steps[since],
                                f"mean log Z {v[-1]:.3g} at step {steps[-1]}, {v[-1] - v[0]:.3g} nats above its "
                                f"{v[0]:.3g} at step {steps[0]} and still rising; {r.log_z_rise:g} above since step "
                                f"{steps[since]}", score=v[-1] - v[0], value=v[-1] - v[0], threshold=r.log_z_rise,
                                first=steps[since], last=steps[-1], index=index))
    for run, layer, index, steps, g in _streams(units, "expert_load", (pl.col("mean") * pl.col("count")).alias("tokens"),
                                                pl.col("unit").alias("expert")):
        tokens = np.vstack(g["tokens"].to_numpy())  # [step, expert]
        enough = tokens.mean(1) >= r.expert_tokens  # else too few probe tokens per expert to tell
        for e in np.flatnonzero((tokens[-1] == 0) & enough[-1]):
            since = held_since((tokens[:, e] == 0) & enough, 1.0)
            out.append(_finding("warning", "dead_expert", run, layer, steps[since],
                                f"expert {g['expert'][-1][int(e)]} got no probe token at step {steps[-1]} (the others "
                                f"{int(np.delete(tokens[-1], e).min())} to {int(tokens[-1].max())}), none since step "
                                f"{steps[since]}", score=tokens.mean(1)[-1], value=0, threshold=r.expert_tokens,
                                first=steps[since], last=steps[-1], index=index))
    return out


def _layer_norms(g: pl.DataFrame) -> tuple[np.ndarray, list[tuple[int, str]], np.ndarray, np.ndarray]:
    """A run's gradient readings as arrays: steps, the layers in depth order, and per (step, layer)
    the L2 norm and the RMS (norm over √values, which compares layers of different sizes)."""
    depth = sorted(set(zip(g["layer_index"].to_list(), g["layer"].to_list())))
    column = {layer: i for i, (_, layer) in enumerate(depth)}
    steps, row = np.unique(g["step"].to_numpy(), return_inverse=True)
    col = np.array([column[layer] for layer in g["layer"].to_list()])
    norm, count = np.full((len(steps), len(depth)), np.nan), np.full((len(steps), len(depth)), np.nan)
    norm[row, col] = g["grad_norm"].fill_null(np.nan).to_numpy()
    count[row, col] = g["values"].fill_null(np.nan).to_numpy()
    return steps, depth, norm, norm / np.sqrt(np.maximum(count, 1))


def _vanishing(run, steps, depth, norm, rms, r: Rules) -> Finding | None:
    """The depth profile of each step decays towards the input: the earliest quarter of the layers
    (attention's query and key projections left out) has a median gradient norm below `vanishing`,
    or a median RMS `decay_ratio` times below the latest quarter's, at `vanishing_share` of the
    gradient readings to the end of the run, `vanishing_readings` of them at least (one step at
    initialization, or a net on its initial plateau, is no trend)."""
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
    return _finding("critical", "vanishing_gradients", run, names[0], steps[since],
                    f"gradient norm {early_norm[-1]:.2g} in {_layers(names)} vs {late_norm[-1]:.2g} in "
                    f"{_layers(lates)} at step {steps[-1]} ({how}); "
                    f"so at {share:.0%} of the gradient readings since step {steps[since]}",
                    score=np.log10(np.clip(np.nan_to_num(decay[-1], nan=1.0), 1, 1e30)),  # (a 0: no infinite score)
                    stream="param_grad", value=decay[-1], threshold=r.decay_ratio,
                    first=steps[since], last=steps[-1], index=depth[early[0]][0])


def _layers(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"the {len(names)} layers {names[0]} … {names[-1]} (median)"


def _solving(loss: pl.DataFrame, since: int, last: int) -> bool:
    """Whether the logged loss over steps [since, last] has a median under half its median over as
    long a span before `since` (all of it finite, and that one above 0): the loss still falling steeply."""
    steps, values = loss["step"].to_numpy(), loss["value"].to_numpy()
    span = max(last - since, 1)
    before, now = values[(steps >= since - span) & (steps < since)], values[(steps >= since) & (steps <= last)]
    if not len(before) or not len(now) or not np.isfinite(now).all() or np.median(before) <= 0:
        return False  # (a loss below 0, a log-likelihood's, falls by no ratio)
    return bool(np.median(now) < np.median(before) / 2)


def _loss_rose(loss: pl.DataFrame | None, lo: int, mid: int, hi: int) -> tuple[bool | None, str] | None:
    """Whether the logged loss's median over steps [mid, hi] is above its median over [lo, mid) by
    more than the values before spread about theirs (their median absolute deviation: a minibatch
    loss's noise is no rise; a NaN or Inf loss has risen): True; False where it fell by as much;
    None where it held level; with the evidence. None where no loss was logged in either span."""
    if loss is None:
        return None
    steps, values = loss["step"].to_numpy(), loss["value"].to_numpy()
    before, now = values[(steps >= lo) & (steps < mid)], values[(steps >= mid) & (steps <= hi)]
    if not len(before) or not len(now):
        return None
    if not np.isfinite(now).all():
        return True, "; the loss is no longer finite"
    b, n = np.median(before), np.median(now)
    spread = np.median(np.abs(before - b)) if np.isfinite(before).all() else 0.0
    shown = f"its median {b:.3g} before, {n:.3g} since"
    if n > b + spread:
        return True, f"; the loss rose: {shown}"
    if n < b - spread and f"{n:.3g}" != f"{b:.3g}":  # as the medians read
        return False, f"; the loss still falls: {shown}"
    return None, f"; the loss held level: {shown}" + (f", within the spread of its values before (±{spread:.2g})"
                                                      if spread else "")


def _exploding(run, steps, depth, norm, loss: pl.DataFrame | None, r: Rules) -> Finding | None:
    """The total gradient norm grew `exploding_growth`× above its median before a window of
    `exploding_window` readings at each of the window's last three, is above `exploding`, still
    rising, and the loss over the window rose above the loss over the window before (`_loss_rose`).
    Where the loss held level, or none was logged, the growth must be squared, and the finding is a
    warning; where the loss falls, none (a net learning faster)."""
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
        rose = _loss_rose(loss, steps[max(0, i - 2 * w + 1)], steps[i - w + 1], steps[i])
        risen = rose is not None and rose[0] is True
        need = r.exploding_growth if risen else r.exploding_growth ** 2
        if growth < need or theil_sen(steps[i - w + 1: i + 1], np.log10(np.maximum(window, 1e-30))) <= 0:
            continue
        if rose is not None and rose[0] is False:
            continue  # the loss keeps falling: a net learning faster, not diverging
        said = rose[1] if rose is not None else "; no loss was logged to read it against"
        start = i - w + 1 + int(np.argmax(window > r.exploding_growth * base))
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            ratios = norm[i] / np.maximum(np.nanmedian(norm[: i - w + 1], 0), 1e-30)
        worst = int(np.nanargmax(ratios))
        others = [depth[j][1] for j in np.argsort(-ratios) if j != worst and ratios[j] >= r.exploding_growth][:5]
        return _finding("critical" if risen else "warning", "exploding_gradients", run,
                        depth[worst][1], steps[start],
                        f"total gradient norm {window[-1]:.3g} at step {steps[i]}, {growth:.3g}× its median of "
                        f"{base:.3g} before step {steps[i - w + 1]} and still rising{said}; grew most in "
                        f"{depth[worst][1]} ({ratios[worst]:.3g}×)" + (f", also {', '.join(others)}" if others else ""),
                        score=np.log10(growth), stream="param_grad", value=growth, threshold=need,
                        first=steps[i - w + 1], last=steps[i], index=depth[worst][0])
    return None


def _runaway_updates(run, p: pl.DataFrame, loss: pl.DataFrame | None, r: Rules) -> Finding | None:
    """The layers' median update ratio (‖Δw‖ / ‖w‖ since the previous parameter reading) at a reading
    is `update_growth`× its median over the earlier readings (three at least): the updates run away
    from their own history, as under a learning rate that keeps rising. Critical when the loss over
    that span rose (`_loss_rose`), else a warning (a falling loss weighs against it). A frozen layer's
    0 says nothing of an update's size (unfrozen, it would run away from nothing): left out."""
    per = p.filter(pl.col("update_ratio").is_finite() & (pl.col("update_ratio") > 0)).sort("step")
    ratio = per.group_by("step", maintain_order=True).agg(pl.col("update_ratio").median())
    steps, u = ratio["step"].to_numpy(), ratio["update_ratio"].to_numpy()
    for i in range(3, len(u)):
        base = np.median(u[:i])
        if not u[i] >= r.update_growth * max(base, 1e-30):
            continue
        rose = _loss_rose(loss, steps[i - 2], steps[i - 1], steps[i])
        layers = per.filter(pl.col("step") == steps[i]).with_columns(
            (pl.col("update_ratio") / pl.col("update_ratio").median()).alias("_rel")).sort(
            ["update_ratio", "layer"], descending=[True, False])
        worst = layers.row(0, named=True)
        said = rose[1] if rose is not None else ""
        return _finding("critical" if rose is not None and rose[0] is True else "warning", "exploding_gradients", run,
                        worst["layer"], steps[i],
                        f"updates ran away from their history: median update ratio {u[i]:.3g} at step {steps[i]}, "
                        f"{u[i] / base:.3g}× its median of {base:.3g} over the {i} readings before (largest in "
                        f"{worst['layer']}, {worst['update_ratio']:.3g}){said}", score=np.log10(u[i] / base),
                        stream="param", value=u[i] / base, threshold=r.update_growth, first=steps[0], last=steps[i],
                        index=worst["layer_index"])
    return None


def _gradient_findings(m: pl.DataFrame, r: Rules, scalars: pl.DataFrame | None) -> list[Finding]:
    out = []
    grads = m.filter((pl.col("stream") == "param_grad") & pl.col("grad_norm").is_not_null())
    params = m.filter(pl.col("stream") == "param")
    for (run,), g in grads.sort("run", "step", "layer_index").group_by(["run"], maintain_order=True):
        steps, depth, norm, rms = _layer_norms(g)
        loss = None if scalars is None else scalars.filter((pl.col("run") == run) & (pl.col("name") == "loss"))
        explosions = [f for f in (_exploding(run, steps, depth, norm, loss, r),
                                  _runaway_updates(run, params.filter(pl.col("run") == run), loss, r)) if f]
        out += [f for f in [_vanishing(run, steps, depth, norm, rms, r)] if f]
        if explosions:  # the earliest sign of one explosion, the most severe first on a tie
            out.append(min(explosions, key=lambda f: (f.step, SEVERITY_RANK[f.severity])))
    return out


GRADIENTS = ("activation_grad", "param_grad")


def _integrity_findings(m: pl.DataFrame, scalars: pl.DataFrame | None) -> list[Finding]:
    out = []
    bad = m.filter((pl.col("nan_count") > 0) | (pl.col("inf_count") > 0)).with_columns(
        pl.col("stream").replace_strict(STREAM_ORDER, default=len(STREAM_ORDER)).alias("_order"),
        pl.when(pl.col("stream").is_in(GRADIENTS)).then(-pl.col("layer_index")).otherwise("layer_index").alias("_at"))
    bad = bad.sort("step", "_order", "_at")  # within a step: the forward in layer order, the backward from the output
    losses = scalars.filter((pl.col("name") == "loss") & ~pl.col("value").is_finite() & pl.col("run").is_in(
        m["run"].unique().implode())) if scalars is not None else None
    for run in sorted(set(bad["run"]) | set(() if losses is None else losses["run"])):
        loss = None if losses is None else losses.filter(pl.col("run") == run)
        out.append(_nan_inf(run, bad.filter(pl.col("run") == run), loss))
    acts = m.select("run", "layer", "layer_index", "stream", "step", "probe_fingerprint", "mode").filter(
        pl.col("stream") == "activation").sort("run", "step", "layer_index", "layer")
    for (run,), g in acts.group_by(["run"], maintain_order=True):
        fps = g.filter(pl.col("probe_fingerprint").is_not_null())
        changed = fps.filter(pl.col("probe_fingerprint") != fps["probe_fingerprint"][0]) if fps.height else fps
        if changed.height:
            out.append(_finding("warning", "probe_changed", run, changed["layer"][0], changed["step"][0],
                                f"probe fingerprint changed from {fps['probe_fingerprint'][0]} to "
                                f"{changed['probe_fingerprint'][0]}", first=changed["step"][0], last=g["step"].max()))
        train = g.filter(pl.col("mode") == "train")
        if train.height:
            out.append(_finding("warning", "train_mode", run, train["layer"][0], train["step"][0],
                                f"{train.height} activation readings taken in train mode", value=train.height,
                                first=train["step"][0], last=train["step"].max()))
    return out


def _nan_inf(run, g: pl.DataFrame, loss: pl.DataFrame | None) -> Finding:
    """nan_inf: where a run's first NaN or Inf appeared: in a step, the forward (activations in layer
    order), then the loss it logged, then the backward (gradients from the output back); a loss that
    is no number while no activation is (a log(0) in it) named as the loss ("loss"), even where a
    guard skipped the step and no reading holds one; then how far it spread."""
    grads = g.filter(pl.col("stream").is_in(GRADIENTS))
    first = g.row(0, named=True) if g.height else None
    lost = loss["step"].min() if loss is not None and loss.height else None
    spread = (f"; gradients non-finite from step {grads['step'][0]} ({grads['stream'][0]} of {grads['layer'][0]} "
              "first)") if grads.height else ""
    if lost is not None and (first is None or lost < first["step"] or (lost == first["step"] and
                                                                        first["stream"] != "activation")):
        value = loss.filter(pl.col("step") == lost)["value"][0]
        return _finding("critical", "nan_inf", run, "loss", lost,
                        f"first NaN/Inf at step {lost} in the logged loss ({value}), no activation read holding one"
                        f"{spread}; the loss not finite at {loss.height} logged step(s), "
                        f"{g.height} readings affected", score=g.height + loss.height, stream="scalar",
                        value=loss.height, threshold=0, first=lost, last=max(loss["step"].max(), g["step"].max() or 0),
                        index=SCALAR_INDEX)
    said = f"; the logged loss not finite from step {lost}" if lost is not None else ""
    return _finding("critical", "nan_inf", run, first["layer"], first["step"],
                    f"first NaN/Inf at step {first['step']} in {first['layer']} ({first['stream']}: "
                    f"{first['nan_count']} NaN, {first['inf_count']} Inf)"
                    f"{spread if first['stream'] == 'activation' else ''}{said}; "
                    f"{g.height} readings affected", score=g.height, stream=first["stream"],
                    value=first["nan_count"] + first["inf_count"], threshold=0, first=first["step"],
                    last=g["step"].max(), index=first["layer_index"])


def _skipped_findings(skipped: pl.DataFrame) -> list[Finding]:
    """Steps a loss scaler skipped (mode `skipped`): their overflowing gradients are the scaler's
    business, not a pathology of the model."""
    out = []
    for (run,), g in skipped.sort("step").group_by(["run"], maintain_order=True):
        steps = g["step"].unique().sort()
        out.append(_finding("info", "scaler_skipped", run, g["layer"][0], steps[0],
                            f"{steps.len()} step(s) skipped by the loss scaler for non-finite gradients, "
                            f"first at step {steps[0]}", stream="param_grad", value=steps.len(),
                            first=steps[0], last=steps[-1]))
    return out


def status_findings(runs: list[dict]) -> list[Finding]:
    """A run whose trace says it did not finish cleanly (metadata `status`, spec §File metadata): never
    closed (`running`; a `.parts` folder with no part file, too), ended by an exception, stopped by a
    signal, or closed without a stream its producer set out to record; or closed without a reading.
    Each is critical: a gate must not pass a crashed run, nor one it has nothing to judge by. And
    (a warning) parameters that required a gradient and never got one (metadata `no_gradient`)."""
    out = []
    for meta in runs:
        status, run, file = meta.get("status", ""), meta.get("run_name"), meta["file"]
        if status == "running" and meta.get("readings") == 0:
            out.append(_finding("critical", "run_unfinished", run, "-", -1, f"{file} holds no part file: its writer "
                                "was killed before its first flush, or has just begun"))
        elif status == "running":
            out.append(_finding("critical", "run_unfinished", run, "-", -1, f"{file} was not closed (status running)"))
        elif status.startswith("failed"):
            out.append(_finding("critical", "run_failed", run, "-", -1, f"the run ended with an exception ({status})"))
        elif status in ("interrupted", "terminated"):
            out.append(_finding("critical", "run_stopped", run, "-", -1, f"the run was {status} before it finished"))
        elif status.startswith("incomplete"):
            out.append(_finding("critical", "stream_missing", run, "-", -1, f"the run closed {status}"))
        elif meta.get("readings") == 0:  # closed cleanly, yet with nothing to judge it by
            out.append(_finding("critical", "run_empty", run, "-", -1, f"{file} holds no reading"))
        cut = json.loads(meta.get("no_gradient") or "[]")
        if cut:
            layers = list(dict.fromkeys(name.rsplit("/", 1)[0] for name in cut))
            out.append(_finding("warning", "gradient_missing", run, layers[0], -1,
                                f"{len(cut)} parameter(s) of {len(layers)} layer(s) required a gradient and never got "
                                f"one: {', '.join(cut[:6])}{' …' if len(cut) > 6 else ''}", score=len(cut),
                                stream="param_grad", value=len(cut), threshold=0))
    return out


def findings(m, rules: Rules = Rules(), runs: list[dict] = (), th: Thresholds = Thresholds(),
             scalars: pl.DataFrame | None = None, signals=None) -> list[Finding]:
    """All findings over a metrics frame (computed at thresholds `th`), or over the frames of its runs
    one at a time (every rule over metrics reads one run), the runs' logged scalars (the loss) and
    their derived readings (`signals`: `analyzer.signals` series and units), most urgent first: by
    severity, a NaN first, the runs by their most significant finding, a run's in the order they started."""
    found = [f for frame in ([m] if isinstance(m, pl.DataFrame) else m) for f in _metric_findings(frame, rules, th,
                                                                                                 scalars)]
    found += status_findings(list(runs)) + (_signal_findings(*signals, rules, scalars) if signals is not None else [])
    # a NaN first: nothing else in a NaN run can be trusted; then by severity the runs, the worst first (by
    # their most significant finding), each run's findings in the order they started: a cause before what follows
    ranked = sorted(found, key=lambda f: (SEVERITY_RANK[f.severity], f.rule != "nan_inf", -f.score, f.run, f.layer))
    place: dict = {}
    for f in ranked:
        place.setdefault((f.severity, f.run), len(place))
    return sorted(ranked, key=lambda f: (SEVERITY_RANK[f.severity], f.rule != "nan_inf", place[f.severity, f.run], f.step))


def _metric_findings(m: pl.DataFrame, rules: Rules, th: Thresholds, scalars: pl.DataFrame | None) -> list[Finding]:
    skipped = pl.col("mode").fill_null("") == "skipped"
    found = _skipped_findings(m.filter(skipped))
    if found:  # else the table as it is: a filter copies every column
        m = m.filter(~skipped)
    return found + _integrity_findings(m, scalars) + _activation_findings(m, rules, th) + \
        _gradient_findings(m, rules, scalars)


FINDING_COLUMNS = ["severity", "rule", "run", "layer", "layer_index", "stream", "step", "first_step", "last_step",
                   "value", "threshold", "evidence", "advice", "score"]
FINDING_SCHEMA = {"severity": pl.String, "rule": pl.String, "run": pl.String, "layer": pl.String,
                  "layer_index": pl.Int64, "stream": pl.String, "step": pl.Int64, "first_step": pl.Int64,
                  "last_step": pl.Int64, "value": pl.Float64, "threshold": pl.Float64, "evidence": pl.String,
                  "advice": pl.String, "score": pl.Float64}


def findings_frame(found: list[Finding]) -> pl.DataFrame:
    """The findings as a Polars frame (FINDING_COLUMNS), most urgent first: numbers as numbers."""
    return pl.DataFrame([{k: f.as_dict()[k] for k in FINDING_COLUMNS} for f in found], schema=FINDING_SCHEMA)


@dataclass
class FindingGroup:
    """The findings of one rule in one run: the most urgent one first, the other layers named."""

    first: Finding
    others: list[Finding]

    @property
    def layers(self) -> list[str]:
        return [self.first.layer] + [f.layer for f in self.others]


def group(found: list[Finding]) -> list[FindingGroup]:
    """One group per (rule, run), in the order of each group's first finding (as `findings` orders
    them), so a pathology that hits 30 layers reads as one line, not 30."""
    groups: dict[tuple[str, str], FindingGroup] = {}
    for f in found:
        key = (f.rule, f.run)
        if key in groups:
            groups[key].others.append(f)
        else:
            groups[key] = FindingGroup(f, [])
    return list(groups.values())
