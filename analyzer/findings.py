"""Findings: rules that turn metrics into "what is wrong, where, since when" (DOMAIN.md's table).

Every threshold is a field of `Rules`, defaulting to the reference points of DOMAIN.md. A dead
fraction still growing over the recent readings ranks above a larger stable one: trend beats
level. A NaN is reported where it starts: the forward pass, in forward order, then the spread.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import polars as pl

from actrace.recurrent import describe
from actrace.schema import KIND_BOUNDS, STREAMS

from .metrics import Thresholds

SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}
# Within a step, the forward pass comes first: a NaN starts there and the backward spreads it.
STREAM_ORDER = {stream: i for i, stream in enumerate(STREAMS)}  # the spec lists them in that order


@dataclass(frozen=True)
class Rules:
    """Thresholds of the findings rules (analysis options, never recorded in traces)."""

    max_dead: float = 0.2            # "tens of % means the layer is effectively much narrower"
    dead_growth: float = 0.05        # rise in dead fraction over the recent half of the readings: still growing
    max_saturation: float = 0.3      # "over 30 % suggests init or learning-rate trouble"
    max_saturation_units: float = 0.1  # share of units pinned for every input of the probe
    saturation_spike: float = 0.2    # jump between two consecutive readings
    mean_drift_sigmas: float = 2.0   # |mean| > k·std for unbounded, non-rectified layers
    collapse_ratio: float = 1e-2     # std fell below this share of its first reading
    vanishing: float = 1e-5          # gradient norm in the earliest quarter of the layers
    decay_ratio: float = 1e3         # last-layer / first-layer gradient norm
    exploding: float = 1.0           # gradient norm above this ...
    exploding_growth: float = 10.0   # ... and this many times the median of the layer's earlier readings


@dataclass
class Finding:
    severity: str
    rule: str
    run: str
    layer: str
    step: int
    evidence: str
    advice: str
    score: float = 0.0
    stream: str = "activation"

    def as_dict(self) -> dict:
        return asdict(self)


ADVICE = {
    "nan_inf": "find the first op that overflows: lower the LR, clip gradients, check for log(0) or 0/0",
    "dead_growing": "something keeps killing units: lower the LR, use leaky ReLU, check init variance",
    "dead_high": "a fixed capacity tax: weigh it against the validation metric; leaky ReLU or better init",
    "saturation_high": "activations hit their bounds: lower the LR or re-initialize this layer",
    "units_pinned": "units stuck at a bound for every input carry no information: lower the LR, re-initialize "
                    "this layer, or normalize its input",
    "saturation_spike": "activations jumped to their bounds: lower the LR around this step",
    "mean_drift": "the next layer gets biased inputs: check normalization and biases",
    "variance_collapse": "all outputs alike (representation collapse): check the loss design, overfitting",
    "vanishing_gradients": "gradients don't reach early layers: residual connections, shallower net, init",
    "exploding_gradients": "unstable updates, divergence ahead: clip gradients, lower the LR",
    "probe_changed": "use the same fixed probe batch at every reading, or the numbers compare different data",
    "train_mode": "read activations in eval mode: dropout and batch statistics distort dead fraction",
    "run_unfinished": "the trace was never closed: the run is still going, or was killed; its part files are "
                      "what was flushed",
    "run_failed": "the run ended with an exception; its readings up to then are kept",
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


def _finding(severity, rule, run, layer, step, evidence, score=0.0, stream="activation", advice=None) -> Finding:
    return Finding(severity, rule, run, layer, int(step), evidence, advice or ADVICE[rule], float(score), stream)


def recent_rise(steps: np.ndarray, values: np.ndarray) -> tuple[float, int]:
    """How much `values` rose over the recent half of the readings (the last three at least), and
    the step that half starts at: the median of the pairwise slopes there (Theil–Sen, robust to
    one odd reading) times its span of steps."""
    start = len(values) // 2 if len(values) >= 6 else max(len(values) - 3, 0)
    s, v = steps[start:].astype(np.float64), values[start:]
    i, j = np.triu_indices(len(v), 1)
    if len(v) < 3:
        return 0.0, int(steps[start])
    return float(np.median((v[j] - v[i]) / np.maximum(s[j] - s[i], 1e-12)) * (s[-1] - s[0])), int(steps[start])


def stable_since(steps: np.ndarray, values: np.ndarray, tolerance: float) -> int:
    """The first step from which `values` stays within `tolerance` of its last value."""
    off = np.nonzero(np.abs(values - values[-1]) > tolerance)[0]
    return int(steps[off[-1] + 1] if len(off) else steps[0])


def _per_layer(m: pl.DataFrame, stream: str):
    acts = m.filter(pl.col("stream") == stream).sort("run", "layer_index", "layer", "step")
    for (run, layer), g in acts.group_by(["run", "layer"], maintain_order=True):
        yield run, layer, g


def _pinned(what: tuple[str, str] | None, kind: str, mean: float, share: float, t: float) -> str:
    """The share of units pinned at a bound, said of a recurrent gate as what it does ("forget
    gate of layer 0 pinned open (the cell never forgets): 100% of units ≥ 0.99")."""
    gate, bounds = _gate(what), KIND_BOUNDS.get(kind)
    if gate is None or bounds is None:
        return f"{share:.0%} of units pinned at a bound"
    lo, hi = bounds
    margin = (1 - t) * max(abs(lo), abs(hi))
    if kind == "sigmoid":
        high = mean > (lo + hi) / 2
        side = GATE_SIDES.get(gate, ("at 1", "at 0"))[0 if high else 1]
        return f"{what[1]} pinned {side}: {share:.0%} of units {'≥' if high else '≤'} " \
               f"{hi - margin if high else lo + margin:.4g}"
    return f"{what[1]} pinned: {share:.0%} of units within {margin:.4g} of ±{hi:g}"


def _activation_findings(m: pl.DataFrame, r: Rules, th: Thresholds) -> list[Finding]:
    out = []
    names = {run: set(g["layer"]) for (run,), g in m.group_by(["run"])}
    for run, layer, g in _per_layer(m, "activation"):
        what = describe(layer, names[run])
        if what and what[1].startswith("final"):
            continue  # a final state is the last step of its sequence, judged there
        advice = GATE_ADVICE if _gate(what) else None
        steps = g["step"].to_numpy()
        dead = g["dead_fraction"].fill_null(np.nan).to_numpy()
        known = ~np.isnan(dead)
        if known.sum() and known[-1]:
            d, s = dead[known], steps[known]
            rise, start = recent_rise(s, d)
            if rise >= r.dead_growth:
                out.append(_finding("critical", "dead_growing", run, layer, start,
                                    f"dead fraction still rising: {d[0]:.0%} at step {s[0]}, {d[-1]:.0%} at step "
                                    f"{s[-1]}, +{rise:.0%} over the recent readings", 1 + rise))
            elif d[-1] > r.max_dead:
                since = stable_since(s, d, r.dead_growth / 2)
                trend = f"stable since step {since}" if since < s[-1] else "not rising steadily of late"
                out.append(_finding("warning", "dead_high", run, layer, since,
                                    f"{d[-1]:.0%} of units dead at step {s[-1]}, {trend}", d[-1]))
        sat = g["saturation_value"].fill_null(np.nan).to_numpy()
        if len(sat) and not np.isnan(sat).all():
            jumps = np.diff(sat)
            if len(jumps) and not np.isnan(jumps).all() and np.nanmax(jumps) >= r.saturation_spike:
                i = int(np.nanargmax(jumps)) + 1
                out.append(_finding("warning", "saturation_spike", run, layer, steps[i],
                                    f"saturation jumped from {sat[i - 1]:.0%} to {sat[i]:.0%}", jumps[i - 1]))
            elif sat[-1] > r.max_saturation:
                start = steps[np.argmax(sat > r.max_saturation)]
                unit = g["saturation_unit"][-1]
                share = "of its distributions peaked near 1" if g["kind"][-1] == "softmax" else "of values"
                out.append(_finding("warning", "saturation_high", run, layer, start,
                                    (f"{what[1]} at its bounds: " if what else "") +
                                    f"{sat[-1]:.0%} {share} and {unit:.0%} of units saturated at step "
                                    f"{steps[-1]}", sat[-1], advice=advice))
        pinned = g["saturation_unit"].fill_null(np.nan).to_numpy()
        if len(pinned) and pinned[-1] > r.max_saturation_units:
            start = steps[np.argmax(pinned > r.max_saturation_units)]
            out.append(_finding("warning", "units_pinned", run, layer, start,
                                f"{_pinned(what, g['kind'][0], g['mean'][-1], pinned[-1], th.sat_threshold)} for "
                                f"every probe input at step {steps[-1]}, above {r.max_saturation_units:.0%} since "
                                f"step {start}", pinned[-1], advice=advice))
        clean = (g["nan_count"] + g["inf_count"] == 0).to_numpy()  # NaN readings are nan_inf's business
        std = g["std"].fill_null(np.nan).to_numpy()[clean]
        mean = g["mean"].fill_null(np.nan).to_numpy()[clean]
        steps = steps[clean]
        kind = g["kind"][0]
        if len(std) >= 2 and std[0] > 0 and std[-1] < r.collapse_ratio * std[0]:
            start = steps[np.argmax(std < r.collapse_ratio * std[0])]
            out.append(_finding("warning", "variance_collapse", run, layer, start,
                                f"std fell from {std[0]:.3g} to {std[-1]:.3g}", std[0] / max(std[-1], 1e-30)))
        if kind in ("linear", "conv", "norm", "identity") and len(mean) and std[-1] > 0 \
                and abs(mean[-1]) > r.mean_drift_sigmas * std[-1]:
            drift = np.abs(mean) > r.mean_drift_sigmas * std
            out.append(_finding("warning", "mean_drift", run, layer, steps[np.argmax(drift)],
                                f"mean {mean[-1]:.3g} is {abs(mean[-1]) / std[-1]:.1f} std from zero",
                                abs(mean[-1]) / std[-1]))
    return out


def _gradient_findings(m: pl.DataFrame, r: Rules) -> list[Finding]:
    out = []
    grads = m.filter((pl.col("stream") == "param_grad") & pl.col("grad_norm").is_not_null())
    for (run,), g in grads.sort("run", "step", "layer_index").group_by(["run"], maintain_order=True):
        depth = sorted(set(zip(g["layer_index"].to_list(), g["layer"].to_list())))
        if len(depth) >= 2:
            early = {layer for _, layer in depth[: max(1, len(depth) // 4)]}
            first_layer, last_layer = depth[0][1], depth[-1][1]
            for (step,), s in g.group_by(["step"], maintain_order=True):
                norms = dict(zip(s["layer"].to_list(), s["grad_norm"].to_list()))
                top = norms.get(last_layer) or 0.0
                if not (np.isfinite(list(norms.values())).all() and top > 0):
                    continue  # a broken or zero signal at the output says nothing about depth
                low = {l: n for l, n in norms.items() if l in early and n < r.vanishing}
                ratio = top / norms[first_layer] if norms.get(first_layer) else np.inf
                if low or ratio > r.decay_ratio:
                    layer = min(low, key=low.get) if low else first_layer
                    out.append(_finding("critical", "vanishing_gradients", run, layer, step,
                                        f"gradient norm {norms.get(layer, 0):.2g} at {layer} vs "
                                        f"{norms.get(last_layer, 0):.2g} at {last_layer} "
                                        f"({ratio:.0e}× decay towards the input)", np.log10(max(ratio, 1)), "param_grad"))
                    break
        exploded = []  # (step, layer, norm, median): one finding per run, naming every layer
        for (layer,), s in g.group_by(["layer"], maintain_order=True):
            norm = s["grad_norm"].to_numpy()
            steps = s["step"].to_numpy()
            for i in range(5, len(norm)):  # against the median of the history, not the tiny first step
                history = norm[:i][np.isfinite(norm[:i])]
                if len(history) >= 5 and np.isfinite(norm[i]) and norm[i] > r.exploding \
                        and norm[i] > r.exploding_growth * np.median(history):
                    exploded.append((steps[i], layer, norm[i], np.median(history)))
                    break
        if exploded:
            step, layer, norm, median = min(exploded, key=lambda e: e[0])  # earliest, then nearest the input
            others = [e[1] for e in exploded if e[1] != layer]
            out.append(_finding("critical", "exploding_gradients", run, layer, step,
                                f"gradient norm rose to {norm:.3g} from a median of {median:.3g} before step "
                                f"{step}" + (f"; also in {', '.join(others)}" if others else ""),
                                np.log10(norm / max(median, 1e-30)), "param_grad"))
    return out


def _integrity_findings(m: pl.DataFrame) -> list[Finding]:
    out = []
    bad = m.filter((pl.col("nan_count") > 0) | (pl.col("inf_count") > 0)).with_columns(
        pl.col("stream").replace_strict(STREAM_ORDER, default=len(STREAM_ORDER)).alias("_order"))
    for (run,), g in bad.sort("step", "_order", "layer_index").group_by(["run"], maintain_order=True):
        first = g.row(0, named=True)
        grads = g.filter(pl.col("stream").is_in(["activation_grad", "param_grad"]))
        spread = (f"; gradients non-finite from step {grads['step'][0]} ({grads['stream'][0]} of "
                  f"{grads['layer'][0]} first)" if grads.height and first["stream"] == "activation" else "")
        out.append(_finding("critical", "nan_inf", run, first["layer"], first["step"],
                            f"first NaN/Inf at step {first['step']} in {first['layer']} ({first['stream']}: "
                            f"{first['nan_count']} NaN, {first['inf_count']} Inf){spread}; "
                            f"{g.height} readings affected", g.height, first["stream"]))
    acts = m.filter(pl.col("stream") == "activation").sort("run", "step")
    for (run,), g in acts.group_by(["run"], maintain_order=True):
        fps = g.filter(pl.col("probe_fingerprint").is_not_null())
        changed = fps.filter(pl.col("probe_fingerprint") != fps["probe_fingerprint"][0]) if fps.height else fps
        if changed.height:
            out.append(_finding("warning", "probe_changed", run, changed["layer"][0], changed["step"][0],
                                f"probe fingerprint changed from {fps['probe_fingerprint'][0]} to "
                                f"{changed['probe_fingerprint'][0]}"))
        train = g.filter(pl.col("mode") == "train")
        if train.height:
            out.append(_finding("warning", "train_mode", run, train["layer"][0], train["step"][0],
                                f"{train.height} activation readings taken in train mode"))
    return out


def _skipped_findings(skipped: pl.DataFrame) -> list[Finding]:
    """Steps a loss scaler skipped (mode `skipped`): their overflowing gradients are the scaler's
    business, not a pathology of the model."""
    out = []
    for (run,), g in skipped.sort("step").group_by(["run"], maintain_order=True):
        steps = g["step"].unique().sort()
        out.append(_finding("info", "scaler_skipped", run, g["layer"][0], steps[0],
                            f"{steps.len()} step(s) skipped by the loss scaler for non-finite gradients, "
                            f"first at step {steps[0]}", 0.0, "param_grad"))
    return out


def status_findings(runs: list[dict]) -> list[Finding]:
    """A run whose trace says it did not finish (metadata `status`: `running` left by a writer
    that never closed, or `failed: TYPE`)."""
    out = []
    for meta in runs:
        status = meta.get("status", "")
        if status == "running":
            out.append(_finding("warning", "run_unfinished", meta.get("run_name"), "-", -1,
                                f"{meta['file']} was not closed (status running)"))
        elif status.startswith("failed"):
            out.append(_finding("warning", "run_failed", meta.get("run_name"), "-", -1,
                                f"the run ended with an exception ({status})"))
    return out


def findings(m: pl.DataFrame, rules: Rules = Rules(), runs: list[dict] = (),
             th: Thresholds = Thresholds()) -> list[Finding]:
    """All findings over a metrics frame (computed at thresholds `th`), most urgent first."""
    skipped = pl.col("mode").fill_null("") == "skipped"
    found = _skipped_findings(m.filter(skipped))
    m = m.filter(~skipped)
    found += _integrity_findings(m) + _activation_findings(m, rules, th) + _gradient_findings(m, rules)
    found += status_findings(list(runs))
    # a NaN first: nothing else in a NaN run can be trusted
    return sorted(found, key=lambda f: (SEVERITY_RANK[f.severity], f.rule != "nan_inf", -f.score, f.run, f.layer))


@dataclass
class FindingGroup:
    """The findings of one rule in one run: the most urgent one first, the other layers named."""

    first: Finding
    others: list[Finding]

    @property
    def layers(self) -> list[str]:
        return [self.first.layer] + [f.layer for f in self.others]


def group(found: list[Finding]) -> list[FindingGroup]:
    """One group per (rule, run), in the order of each group's most urgent finding, so a pathology
    that hits 30 layers reads as one line, not 30."""
    groups: dict[tuple[str, str], FindingGroup] = {}
    for f in found:
        key = (f.rule, f.run)
        if key in groups:
            groups[key].others.append(f)
        else:
            groups[key] = FindingGroup(f, [])
    return list(groups.values())
