"""`actrace diff`: where and when a run parts from a baseline, judged against the baseline's own noise.

For each aligned layer and metric the *gap* is the run's value minus the baseline's (the median of
its seeds, when several are given), on the metric's scale. The run *parts* at the first reading
where the gap moves away from what it was at every reading before by more than the *band*, wider
(a gap that narrows is two runs coming together) and outside the band, and stays so for `persist`
readings (or to the end, two at least; a stream read more often than the probe, at half its
readings over the span of `persist` probe readings too); the band is the largest of a floor that no metric
resolves below (10 points of a share, a factor of 2 for a norm or a spread), `sigmas` times the
step-to-step noise of the baseline and of the gap, and 1.5 times the spread of the seeds. Two
seeds of one config start apart (another initialization) and stay so; a run whose learning rate is
raised at step K was the baseline until K, and parts there. A gap already beyond the band at the
first readings is said apart, as a difference from the start. A run parts wherever it holds a NaN
or an Inf the baseline's reading does not, whatever the metrics asked for.
"""
from __future__ import annotations

import bisect
import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import numpy as np
import polars as pl

from actrace.format.schema import shown

from .metrics import non_finite
from .trends import series_bounds

# metric: (stream, scale, floor, what it is): a share compares as it is, a norm or spread by its log10,
# a mean in units of the baseline's standard deviation
METRICS = {
    "dead_fraction": ("activation", "share", 0.1, "dead fraction"),
    "saturation_value": ("activation", "share", 0.1, "saturation"),
    "mean": ("activation", "sigma", 0.5, "mean"),
    "std": ("activation", "log", math.log10(2), "std"),
    "grad_norm": ("param_grad", "log", math.log10(2), "gradient norm"),
    "update_ratio": ("param", "log", math.log10(2), "update ratio"),
}
# compared unless asked otherwise: a layer's mean depends on its initialization, so seeds differ in it
DEFAULT_METRICS = ("dead_fraction", "saturation_value", "std", "grad_norm", "update_ratio")
# a 0 on a log scale (a gradient that stopped, a layer frozen or collapsed): far below any norm a model
# makes, so a metric gone to 0 parts (and is said as 0), where log10 would leave it out
LOG_ZERO = -30.0
# a Parting's metric where a run holds NaN or Inf the baseline does not: compared always (no band: a NaN
# is no noise, and every metric of the reading is unknown from there)
NON_FINITE = "non_finite"


@dataclass
class Parting:
    """One run leaving the baseline's band in one aligned layer and metric."""

    run: str
    baseline: str
    aligned: str
    layer: str
    layer_index: int
    stream: str
    metric: str
    step: int
    baseline_value: float
    value: float
    band: float
    readings: int          # readings outside the band from `step` on (NON_FINITE: holding NaN/Inf)
    significance: float    # the median distance from the baseline over the band, from `step` on (NON_FINITE:
    #                        the median count of NaN/Inf values)

    def change(self) -> tuple[str, str]:
        """What moved: "dead fraction 2% → 31%"; and the band it left: "±10.0%", "×/÷2"."""
        if self.metric == NON_FINITE:
            return f"NaN/Inf values {self.baseline_value:.0f} → {self.value:.0f}", "0"
        what, scale = METRICS[self.metric][3], METRICS[self.metric][1]
        fmt = (lambda v: f"{v:.0%}") if scale == "share" else (lambda v: f"{v:.3g}")
        band = f"±{self.band:.1%}" if scale == "share" else (f"×/÷{10 ** self.band:.3g}" if scale == "log"
                                                             else f"±{self.band:.3g}")
        return f"{what} {fmt(self.baseline_value)} → {fmt(self.value)}", band

    def said(self) -> str:
        change, band = self.change()
        if self.metric == NON_FINITE:
            return (f"{shown(self.run)} parts from {shown(self.baseline)} at step {self.step} in {shown(self.layer)}: "
                    f"{change} ({self.stream}), in {self.readings} reading(s) from there where the baseline "
                    "holds none")
        return (f"{shown(self.run)} parts from {shown(self.baseline)} at step {self.step} in {shown(self.layer)}: "
                f"{change}, outside the baseline's band {band} for {self.readings} reading(s) from there")


@dataclass
class Diff:
    """A diff's answer: every parting, the first first; the layers that could not be aligned; the
    gaps already beyond the band at the first readings (`Parting.step` is the first reading)."""

    partings: list[Parting]
    unaligned: dict[str, list[str]]   # run → its layers (aligned keys) the baseline has not, and the reverse
    from_start: list[Parting] = field(default_factory=list)
    widths: dict[str, list[str]] = field(default_factory=dict)  # run → "fc (3 vs 64 units)": aligned, yet unlike
    unread: list[str] = field(default_factory=list)  # runs given that hold no reading: nothing compared

    @classmethod
    def of(cls, partings, unaligned, from_start, widths) -> Diff:
        """A diff's parts in its order: by run, the most significant first."""
        return cls(sorted(partings, key=lambda p: (p.run, -p.significance, p.step)), unaligned,
                   sorted(from_start, key=lambda p: (p.run, -p.significance)), widths)

    @classmethod
    def joined(cls, diffs: list[Diff]) -> Diff:
        """The diffs of disjoint sets of runs against one baseline as one."""
        return cls.of([p for d in diffs for p in d.partings], {r: v for d in diffs for r, v in d.unaligned.items()},
                      [p for d in diffs for p in d.from_start],
                      dict(sorted((r, v) for d in diffs for r, v in d.widths.items())))

    @property
    def first(self) -> dict[str, Parting]:
        """Per run, where it parts first: the earliest step, then the first layer in forward order."""
        out: dict[str, Parting] = {}
        for p in sorted(self.partings, key=lambda p: (p.step, p.layer_index, -p.significance)):
            out.setdefault(p.run, p)
        return out


def _values(df: pl.DataFrame, metric: str) -> pl.DataFrame:
    """run, aligned, layer, layer_index, stream, x, step, v (the metric on its comparison scale), std."""
    stream, scale, _, _ = METRICS[metric]
    v = pl.col(metric)
    if scale == "log":
        v = pl.when(v.abs() > 0).then(v.abs().log10()).when(v == 0).then(LOG_ZERO)  # (NaN stays: left out)
    return df.lazy().filter((pl.col("stream") == stream) & pl.col(metric).is_not_null()).select(  # lazy: the
        "run", "aligned", "layer", "layer_index", "stream", "x", "step", v.alias("v"), "std"  # columns read alone
    ).filter(pl.col("v").is_finite()).collect()


def noise(series: str, *by: str) -> pl.Expr:
    """Per group of `by` (rows in x order), the step-to-step noise of a series: the robust spread of
    its first differences, per reading; 0 with fewer than 3."""
    d = pl.col(series).diff().over(*by)
    return pl.when(d.count().over(*by) >= 3).then(
        1.4826 * (d - d.median().over(*by)).abs().median().over(*by) / math.sqrt(2)).otherwise(0.0)


def _noises(base: pl.DataFrame) -> pl.DataFrame:
    """Per aligned layer, the baselines' step-to-step noise (averaged over the seeds)."""
    return base.sort("run", "aligned", "x").with_columns(noise("v", "run", "aligned").alias("noise")) \
        .group_by("run", "aligned").agg(pl.col("noise").first()).group_by("aligned").agg(pl.col("noise").mean())


def _lacking(pairs: list[tuple], other: list[tuple]) -> list[str]:
    """The layer names of `pairs` (aligned key, layer) whose key none of `other` has (a null key
    matches none, as in a join)."""
    have = {k for k, _ in other}
    return sorted({layer for k, layer in pairs if k is None or k not in have})


def diff(aligned: pl.DataFrame, baselines: list[str], runs: list[str], *, persist: int = 3,
         sigmas: float = 4.0, metrics=DEFAULT_METRICS) -> Diff:
    """Where each of `runs` parts from the `baselines` (seeds of one config), from metrics aligned
    by `analyzer.compare.align` (shared `aligned` layer keys, `x` step or progress)."""
    partings, from_start, unaligned = [], [], {}
    keys: dict[str, list] = {}
    for run, key, layer in aligned.select("run", "aligned", "layer").unique().iter_rows():
        keys.setdefault(run, []).append((key, layer))
    base = [pair for b in baselines for pair in keys.get(b, [])]
    for run in runs:  # by their own names: the baseline's layers the run lacks, then the run's the baseline lacks
        own = keys.get(run, [])
        # a name on both sides whose kinds are unlike: named once
        unaligned[run] = list(dict.fromkeys(_lacking(base, own) + _lacking(own, base)))
    units = aligned.filter(pl.col("stream") == "activation").group_by("run", "aligned").agg(
        pl.col("layer").first(), pl.col("units").max())
    both = units.filter(pl.col("run").is_in(runs)).join(
        units.filter(pl.col("run").is_in(baselines)).group_by("aligned").agg(pl.col("units").max().alias("base")),
        on="aligned").filter(pl.col("units") != pl.col("base")).sort("run", "layer")
    widths = {run: [f"{layer} ({n} vs {b} units)" for _, layer, n, b in g.select("run", "layer", "units", "base").rows()]
              for (run,), g in both.group_by(["run"], maintain_order=True)}
    partings += _non_finite(aligned, baselines, runs)
    spans = dict(aligned.filter(pl.col("stream") == "activation").select("run", "step").unique().sort(
        "run", "step").group_by("run").agg(pl.col("step").diff().median()).iter_rows())  # between probe readings
    for metric in metrics:
        _, scale, floor, _ = METRICS[metric]
        vals = _values(aligned, metric)
        a = vals.filter(pl.col("run").is_in(baselines))
        if not a.height:
            continue
        some = pl.col("v").filter(pl.col("v") > LOG_ZERO)  # a seed gone to 0 makes no band of decades
        band = a.group_by("aligned", "x").agg(
            some.median().fill_null(LOG_ZERO).alias("c"), ((some.max() - some.min()) / 2).fill_null(0.0).alias("spread"),
            pl.col("std").median().alias("a_std")).join(_noises(a), on="aligned")
        joined = vals.filter(pl.col("run").is_in(runs)).join(band, on=["aligned", "x"]).sort("run", "aligned", "x") \
            .with_columns((pl.col("v") - pl.col("c")).alias("gap")).with_columns(
                pl.max_horizontal(pl.col("noise"), noise("gap", "run", "aligned")).alias("noise"))
        # numbers as arrays once, each (run, aligned layer) a slice of them: thousands of layers stay cheap
        gaps = (joined["v"] - joined["c"]).to_numpy()
        floors = floor * joined["a_std"].fill_null(0).to_numpy() if scale == "sigma" else np.full(len(gaps), floor)
        spread, noises = 1.5 * joined["spread"].to_numpy(), joined["noise"].to_numpy()
        steps = joined["step"].to_numpy()
        for lo, hi in zip(*series_bounds(joined, "run", "aligned")):
            if hi - lo < 2:
                continue
            gap = gaps[lo:hi]
            h = np.maximum.reduce([floors[lo:hi], np.full(hi - lo, sigmas * noises[lo]), spread[lo:hi]])
            apart = abs(np.sort(gap[:3])[min(hi - lo, 3) // 2]) > np.sort(h[:3])[min(hi - lo, 3) // 2]  # medians
            found = _parting(gap, h, persist, _window(persist, spans.get(joined["run"][int(lo)]), steps[lo:hi]))
            if found is not None:
                partings.append(_said(baselines, metric, joined.slice(lo, hi - lo), gap, h, *found))
            if apart:
                from_start.append(_said(baselines, metric, joined.slice(lo, hi - lo), gap, h, 0, 0.0))
    return Diff.of(partings, unaligned, from_start, widths)


def _non_finite(aligned: pl.DataFrame, baselines: list[str], runs: list[str]) -> list[Parting]:
    """Per run, aligned layer and stream, its first reading holding a NaN or Inf where the baselines'
    reading at the same x holds none: a run gone NaN parts there (its metrics are unknown from there
    on, which the bands cannot compare)."""
    rows = aligned.lazy().select("run", "aligned", "layer", "layer_index", "stream", "x", "step",
                                 non_finite().alias("bad"))
    base = rows.filter(pl.col("run").is_in(baselines)).group_by("aligned", "stream", "x").agg(
        pl.col("bad").max().alias("base"))
    hit = rows.filter(pl.col("run").is_in(runs) & (pl.col("bad") > 0)).join(base, on=["aligned", "stream", "x"]) \
        .filter(pl.col("base") == 0).sort("run", "aligned", "stream", "x").collect()
    out = []
    for (run, key, stream), g in hit.group_by(["run", "aligned", "stream"], maintain_order=True):
        r = g.row(0, named=True)
        out.append(Parting(run, ",".join(baselines), key, r["layer"], int(r["layer_index"]), stream, NON_FINITE,
                           int(r["step"]), 0.0, float(r["bad"]), 0.0, g.height, float(g["bad"].median())))
    return out


def _parting(gap: np.ndarray, h: np.ndarray, persist: int, window: int = 0) -> tuple[int, float] | None:
    """(index, the gap before) of the first reading from which the gap is more than `h` away from
    its median over every reading before, for `persist` readings in a row (to the end, two at
    least) and for half the readings of the `window` from there at least (a dense series: a blip
    is no parting), and is then outside the band and wider than that median (further apart, or
    across and further on the other side): a gap that narrows (two seeds alike after their first
    readings; the baseline drifting towards where a run apart from the start was all along) is no
    parting. None where it never moves so. Candidates are the readings at least half a band from
    the mean before (one pass over all), and the median decides (the prefixes' medians made once)."""
    n = len(gap)
    mean_before = np.cumsum(gap)[:-1] / np.arange(1, n)
    candidates = (np.flatnonzero(np.abs(gap[1:] - mean_before) > h[1:] / 2) + 1).tolist()
    if not candidates:
        return None
    gaps, bands, before = gap.tolist(), h.tolist(), _medians_before(gap[: candidates[-1]])

    def away(j: int, i: int) -> bool:
        return abs(gaps[j] - before[i]) > bands[j] and abs(gaps[j]) > max(bands[j], abs(before[i]))
    for i in candidates:
        ahead = range(i, min(i + persist, n))
        if len(ahead) >= min(persist, 2) and all(away(j, i) for j in ahead):
            span = range(i, min(i + window, n))
            if 2 * sum(away(j, i) for j in span) >= len(span):
                return i, before[i]
    return None


def _window(persist: int, span, steps: np.ndarray) -> int:
    """The readings of a series that `persist` probe readings `span` (steps between them) cover: a
    series read more often than the probe (a gradient every step) must part over that long."""
    gap = float(np.median(np.diff(steps)))
    return math.ceil(persist * span / gap) if span and gap > 0 else persist


def _medians_before(v: np.ndarray) -> list[float]:
    """[i]: the median of v[:i] (NaN at 0), each prefix's by one sorted insertion, not a sort."""
    ordered, out = [], [math.nan]
    for x in v.tolist():
        bisect.insort(ordered, x)
        k = len(ordered)
        out.append(ordered[k // 2] if k % 2 else (ordered[k // 2 - 1] + ordered[k // 2]) / 2)
    return out


def _said(baselines, metric, j: pl.DataFrame, gap, h, i: int, before: float) -> Parting:
    """The Parting at reading `i` of one run's and layer's joined frame `j`; `before`: the gap it
    moved away from."""
    run, key = j["run"][0], j["aligned"][0]
    scale = METRICS[metric][1]
    to_value = (lambda z: 10 ** z if z > LOG_ZERO else 0.0) if scale == "log" else (lambda z: z)
    away = np.abs(gap[i:] - before) > h[i:]
    moved = np.abs(gap[i:] - before)[away] / h[i:][away]
    return Parting(run, ",".join(baselines), key, j["layer"][i], int(j["layer_index"][i]), j["stream"][i], metric,
                   int(j["step"][i]), float(to_value(j["c"][i])), float(to_value(j["v"][i])), float(h[i]),
                   int(away.sum()), float(np.median(moved)) if len(moved) else float(abs(gap[i] - before) / h[i]))


def as_text(d: Diff, runs: list[str], top: int = 8) -> str:
    lines, firsts = [], d.first
    partings, starts = defaultdict(list), defaultdict(list)  # by run, once (was a scan of all per run)
    for p in d.partings:
        partings[p.run].append(p)
    for p in d.from_start:
        starts[p.run].append(p)
    for run in runs:
        first, mine = firsts.get(run), partings[run]
        if first is None:
            lines.append(f"{shown(run)}: no parting from the baseline: every aligned layer and metric stayed inside "
                         "its band")
        else:
            lines.append(first.said())
            for p in [p for p in mine if p is not first][:top]:
                change, band = p.change()
                lines.append(f"  also {shown(p.layer)} from step {p.step}: {change} (band {band}, {p.readings} "
                             "readings)")
            if len(mine) > top + 1:
                lines.append(f"  … {len(mine) - top - 1} more parting(s): --format json lists them all")
        start = starts[run]
        if start:
            lines.append("  from the first readings apart (as two seeds may be; seeds of the baseline tell: "
                         "diff A1 A2 -- B): " + "; ".join(f"{METRICS[p.metric][3]} in {shown(p.layer)}"
                                                           for p in start[:5]) + (" …" if len(start) > 5 else ""))
        if d.widths.get(run):
            lines.append("  aligned, yet of other widths (different layers?): "
                         + ", ".join(map(shown, d.widths[run][:8])) + (" …" if len(d.widths[run]) > 8 else ""))
        if d.unaligned.get(run):
            names = ", ".join(map(shown, d.unaligned[run][:10])) + (" …" if len(d.unaligned[run]) > 10 else "")
            lines.append(f"  not compared: {len(d.unaligned[run])} layer(s) only one side has: {names} "
                         "(a mapping file aligns them: --mapping)")
    return "\n".join(lines) + "\n"


def as_json(d: Diff) -> str:
    return json.dumps({"partings": [asdict(p) for p in d.partings], "first": {r: asdict(p) for r, p in d.first.items()},
                       "from_start": [asdict(p) for p in d.from_start], "unaligned": d.unaligned,
                       "widths": d.widths, "unread": d.unread}, indent=2) + "\n"


def as_csv(d: Diff) -> str:
    frame = pl.DataFrame([asdict(p) for p in d.partings], schema=list(Parting.__annotations__), orient="row") \
        if d.partings else pl.DataFrame(schema=list(Parting.__annotations__))
    return frame.write_csv()
