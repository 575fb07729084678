"""Findings: the registry's rules (analyzer/rules) run over each run, causes before consequences.

Every rule reads one run's view (`RunView`): its metrics, as `analyzer.meaning` leaves them (null
where a number means nothing), its logged loss, its derived readings and its trace's metadata.
One fault shows in many numbers: a finding another explains (`Rule.explains`: a dead layer the zero
gradients below it, a NaN everything after it, a collapse the drifting means above it) is nested
under its cause (`Finding.cause`), said once as a consequence with the cause's remedy, and never
gates on its own. Findings come most urgent first: a NaN first, the runs by their worst finding,
each run's in the order they started, each consequence right after its cause.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np
import polars as pl

from actrace.format.recurrent import describe

from .metrics import Thresholds
from .rules import FAMILIES, REGISTRY, RULES_VERSION, SEVERITY_RANK, Finding, Rules, RunView
from .rules._base import Layer
from .trends import series_bounds

__all__ = ["FINDING_COLUMNS", "RULES_VERSION", "Finding", "FindingGroup", "Rules", "SEVERITY_RANK", "findings",
           "findings_frame", "group"]


_READINGS = ("step", "layer_index", "kind", "dead_fraction", "dormant_fraction", "saturation_value", "saturation_unit",
             "mean", "std", "nan_count", "inf_count", "top_unit", "top_ratio", "unit_std")
METADATA = {"status", "no_gradient"}  # what a family reads of a trace's metadata alone


def _per_layer(m: pl.DataFrame):
    """(run, layer, its activation readings in step order): each a dict of numpy arrays (nulls NaN),
    sliced from arrays made once for every layer, so thousands of layers cost one conversion."""
    mask = m["stream"] == "activation"
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


def _layers(m: pl.DataFrame) -> dict[str, list[Layer]]:
    """Each run's activation layers (a recurrent layer's final state left out: it is the last step of
    its sequence, judged there)."""
    names: dict[str, set] = {}
    for run, layer in m.select("run", "layer").unique().iter_rows():
        names.setdefault(run, set()).add(layer)
    out: dict[str, list[Layer]] = {}
    for run, layer, g in _per_layer(m):
        what = describe(layer, names[run])
        if not (what and what[1].startswith("final")):
            out.setdefault(run, []).append(Layer(layer, g, what))
    return out


def _view(run: str, rows: pl.DataFrame, layers: list[Layer], meta: dict | None, th: Thresholds,
          scalars: pl.DataFrame | None, signals) -> RunView:
    """One run's view: its metric rows (a scaler's skipped steps apart), layers, loss, derived readings."""
    skipped = pl.col("mode").fill_null("") == "skipped"
    series, units = signals if signals is not None else (None, None)
    loss = None if scalars is None else scalars.filter((pl.col("run") == run) & (pl.col("name") == "loss"))
    lost = None if loss is None else loss.filter(~pl.col("value").is_finite())
    return RunView(run, rows.filter(~skipped), rows.filter(skipped), layers, loss, lost,
                   None if series is None else series.filter(pl.col("run") == run),
                   None if units is None else units.filter(pl.col("run") == run), meta, th)


def _views(m: pl.DataFrame, metas: dict, th: Thresholds, scalars: pl.DataFrame | None, signals) -> Iterable[RunView]:
    """One view per run of the frame `m`, its trace metadata taken from `metas`."""
    if not m.height:
        return
    layers = _layers(m)
    for (run,), rows in m.partition_by("run", as_dict=True, maintain_order=True).items():
        yield _view(run, rows, layers.get(run, []), metas.pop(run, None), th, scalars, signals)


def _runs_in(*frames) -> list[str]:
    return [run for frame in frames if frame is not None and frame.height for run in frame["run"].unique(
        maintain_order=True).to_list()]


def _said(result) -> list[Finding]:
    if result is None:
        return []
    return [result] if isinstance(result, Finding) else [f for f in result if f is not None]


def _judged(view: RunView, rules: Rules, metadata_only: bool = False) -> list[Finding]:
    out = []
    for family in FAMILIES:
        if metadata_only and not all(set(rule.reads) <= METADATA for rule in family.rules):
            continue
        if family.scope == "layer":
            for layer in view.layers:
                out += _said(family.check(view, layer, rules))
        else:
            out += _said(family.check(view, rules))
    return out


def _explains(cause: Finding, f: Finding) -> bool:
    """Whether `cause` explains `f` (`Rule.explains`): same run, `f` starting no earlier than the
    reading before `cause` started, at the place the relation says."""
    if f is cause or f.run != cause.run or f.step < 0 or f.step < (cause.first_step if cause.first_step is not None
                                                                   else cause.step) or f.cause is not None:
        return False
    for rule, where in REGISTRY[cause.rule].explains:
        if rule not in ("*", f.rule):
            continue
        if where == "anywhere" or cause.layer_index is None or f.layer_index is None:
            return True
        if (where == "below" and f.layer_index <= cause.layer_index) or \
                (where == "above" and f.layer_index >= cause.layer_index):
            return True
    return False


def _nest(found: list[Finding]) -> list[Finding]:
    """Mark every finding another explains with its cause, the earliest-starting cause first (a NaN
    before the dead layer it follows); its advice becomes the cause's."""
    causes = sorted((f for f in found if REGISTRY[f.rule].explains and f.step >= 0),
                    key=lambda f: (f.step, SEVERITY_RANK[f.severity], f.layer_index or 0, f.rule))
    for cause in causes:
        if cause.cause is not None:
            continue  # itself a consequence: what it would explain, its cause explains
        for f in found:
            if _explains(cause, f):
                f.cause, f.advice = cause.key, f"a consequence of {cause.key}: {cause.advice}"
    return found


def findings(m, rules: Rules = Rules(), runs: list[dict] = (), th: Thresholds = Thresholds(),
             scalars: pl.DataFrame | None = None, signals=None) -> list[Finding]:
    """All findings over a metrics frame (computed at thresholds `th`), or over the frames of its runs
    one at a time, with the runs' trace metadata (`runs`), logged scalars (the loss) and derived
    readings (`signals`: `analyzer.signals` series and units), most urgent first."""
    metas = {meta.get("run_name"): meta for meta in runs}
    found, seen, schema = [], set(), None
    for frame in [m] if isinstance(m, pl.DataFrame) else m:
        schema = schema or frame.schema
        for view in _views(frame, metas, th, scalars, signals):
            seen.add(view.run)
            found += _nest(_judged(view, rules))
    # runs without a metric row: their derived readings and loss alone (a trace of attention heads), else
    # their metadata alone (a trace closed empty, a .parts folder never flushed into)
    for run in dict.fromkeys([*metas, *_runs_in(*(signals or ()), scalars)]):
        if run in seen:
            continue
        meta = metas.get(run)
        if schema is None:
            found += _judged(RunView(run, pl.DataFrame(), pl.DataFrame(), [], None, None, None, None, meta, th),
                             rules, metadata_only=True)
        else:
            found += _nest(_judged(_view(run, pl.DataFrame(schema=schema), [], meta, th, scalars, signals), rules))
    return _ranked(found)


def _ranked(found: list[Finding]) -> list[Finding]:
    """A NaN first: nothing else in a NaN run can be trusted; then by severity the runs, the worst first
    (by their most significant finding), each run's findings in the order they started, every
    consequence right after its cause. Ties broken by name: the same input, the same order."""
    causes = [f for f in found if f.cause is None]
    ranked = sorted(causes, key=lambda f: (SEVERITY_RANK[f.severity], f.rule != "nan_inf", -f.score, f.run, f.layer,
                                           f.rule))
    place: dict = {}
    for f in ranked:
        place.setdefault((f.severity, f.run), len(place))
    ordered = sorted(ranked, key=lambda f: (SEVERITY_RANK[f.severity], f.rule != "nan_inf", place[f.severity, f.run],
                                            f.step, f.layer_index if f.layer_index is not None else -1, f.layer,
                                            f.rule))
    follows: dict[tuple, list[Finding]] = {}
    for f in sorted((f for f in found if f.cause is not None), key=lambda f: (f.step, f.layer, f.rule)):
        follows.setdefault((f.run, f.cause), []).append(f)
    return [g for f in ordered for g in [f, *follows.pop((f.run, f.key), [])]] + \
        [g for rest in follows.values() for g in rest]  # (a cause is always said: none is left here)


FINDING_COLUMNS = ["severity", "rule", "run", "layer", "layer_index", "stream", "step", "first_step", "last_step",
                   "value", "threshold", "evidence", "advice", "score", "cause", "rules_version"]
FINDING_SCHEMA = {"severity": pl.String, "rule": pl.String, "run": pl.String, "layer": pl.String,
                  "layer_index": pl.Int64, "stream": pl.String, "step": pl.Int64, "first_step": pl.Int64,
                  "last_step": pl.Int64, "value": pl.Float64, "threshold": pl.Float64, "evidence": pl.String,
                  "advice": pl.String, "score": pl.Float64, "cause": pl.String, "rules_version": pl.String}


def findings_frame(found: list[Finding]) -> pl.DataFrame:
    """The findings as a Polars frame (FINDING_COLUMNS), most urgent first: numbers as numbers, each
    row with the version of the rules that said it."""
    return pl.DataFrame([{**{k: v for k, v in f.as_dict().items() if k in FINDING_SCHEMA},
                          "rules_version": RULES_VERSION} for f in found], schema=FINDING_SCHEMA)


@dataclass
class FindingGroup:
    """The findings of one rule in one run (its causes, or one cause's consequences): the most urgent
    one first, the other layers named."""

    first: Finding
    others: list[Finding]

    @property
    def layers(self) -> list[str]:
        return [self.first.layer] + [f.layer for f in self.others]


def group(found: list[Finding]) -> list[FindingGroup]:
    """One group per (rule, run, cause), in the order of each group's first finding (as `findings`
    orders them), so a pathology that hits 30 layers reads as one line, not 30."""
    groups: dict[tuple, FindingGroup] = {}
    for f in found:
        key = (f.rule, f.run, f.cause)
        if key in groups:
            groups[key].others.append(f)
        else:
            groups[key] = FindingGroup(f, [])
    return list(groups.values())
