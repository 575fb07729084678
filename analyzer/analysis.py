"""One analysis of a set of traces: each trace read once into metrics and run metadata, from which
findings, the runs' alignment and comparison follow when first asked; `summary`, `findings`,
`check` and `report` share it. Histograms are read on demand (only the report draws them)."""
from __future__ import annotations

import json
import tomllib
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import polars as pl

from actrace.files.location import location
from actrace.files.reader import read_source

from .compare import layer_keys, with_keys
from .diff import Diff, diff
from .engines import ENGINES, on_duckdb, on_spark
from .findings import Finding, Rules, findings, findings_frame
from .metrics import Thresholds, last_reading, reduced, scalars
from .signals import series, units
from .tables import RunTables


PROJECT_FILE = "actrace.toml"


@dataclass
class Baseline:
    """The runs others are compared with (several: a baseline's seeds), and why they were chosen."""

    runs: list[str]
    why: str

    @property
    def said(self) -> str:
        return f"{', '.join(self.runs)} (chosen by {self.why})"


def project_baseline(start: Path | None = None) -> tuple[str | None, str]:
    """The `baseline` key of the nearest `actrace.toml` (this folder or one above), and where it was."""
    folder = (start or Path.cwd()).resolve()
    for place in [folder, *folder.parents]:
        path = place / PROJECT_FILE
        if path.is_file():
            try:
                value = tomllib.loads(path.read_text()).get("baseline")
            except (OSError, tomllib.TOMLDecodeError) as exc:
                raise ValueError(f"{path}: not a readable TOML file: {exc}") from None
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{path}: baseline must be a string (a run's name or KEY=VALUE), got {value!r}")
            return value, str(path)
    return None, ""


@dataclass
class Analysis:
    tables: RunTables         # per (run, layer, stream, step): analyzer.metrics.METRIC_COLUMNS and more, run by run
    runs: list[dict]          # per trace, in the order given: its file metadata and `file`
    scalars: pl.DataFrame     # the training loop's logged values: run, step, name (loss, lr, …), value
    signals: tuple            # derived readings: analyzer.signals.series and .units (heads, experts)
    rules: Rules = Rules()
    mapping: dict | None = None
    x: str = "step"
    th: Thresholds = Thresholds()
    _parted: dict = field(default_factory=dict, repr=False)

    @cached_property
    def metrics(self) -> pl.DataFrame:
        """The metric table of every run, sorted for reading (made when first asked)."""
        return self.tables.whole()

    @cached_property
    def findings(self) -> list[Finding]:
        """The findings rules over the metrics, a batch of runs at a time, most urgent first."""
        return findings(self.tables.frames(), self.rules, self.runs, self.th, self.scalars, self.signals)

    @property
    def findings_frame(self) -> pl.DataFrame:
        """The findings as a Polars frame, numbers as numbers (analyzer.findings.FINDING_COLUMNS)."""
        return findings_frame(self.findings)

    @cached_property
    def latest(self) -> pl.DataFrame:
        """Each run's layers at their last reading of each stream (what the layer table shows)."""
        return pl.concat([last_reading(m, "run", "layer", "stream") for m in self.tables.frames()],
                         how="diagonal_relaxed")

    @property
    def read(self) -> list[dict]:
        """The runs' metadata of those with a reading: what charts and comparisons read (the others are
        findings only: `run_unfinished`, `run_empty`)."""
        return [m for m in self.runs if m.get("readings") != 0]

    def baseline(self, requested: str | None = None) -> Baseline | None:
        """The runs the others are compared with, and why: `requested` (--baseline), else the project
        file's `baseline` (`actrace.toml` here or in a folder above), each a run's name or KEY=VALUE
        (the runs whose config holds that value: a baseline's seeds); else none. Never the file that
        sorts first: a broken run would be every run's yardstick."""
        if requested is not None:
            return self._chosen(requested, "--baseline")
        requested, where = project_baseline()
        if requested is None:
            return None
        try:
            return self._chosen(requested, where)
        except ValueError as exc:  # the project's baseline is not among these traces: said, not fatal
            warnings.warn(f"{where}: {exc}; no baseline for these traces", stacklevel=2)
            return None

    def _chosen(self, requested: str, why: str) -> Baseline:
        """The runs `requested` names (a run, or KEY=VALUE of their configs), chosen by `why`."""
        names = [m.get("run_name") for m in self.read]
        if requested in names:
            return Baseline([requested], why)
        key, eq, value = requested.partition("=")
        if eq:
            try:
                wanted = json.loads(value)
            except json.JSONDecodeError:
                wanted = value
            chosen = [m.get("run_name") for m in self.read if json.loads(m.get("config") or "{}").get(key) == wanted]
            if chosen and len(chosen) < len(names):
                return Baseline(chosen, f"{why} {requested}: the runs whose config has {key} = {value}")
            if chosen:
                raise ValueError(f"baseline {requested!r}: every run has {key} = {value}: nothing left to compare")
        raise ValueError(f"baseline {requested!r} is neither a run ({', '.join(map(str, names))}) nor a config "
                         "KEY=VALUE that a run's config holds")

    @cached_property
    def keys(self) -> pl.DataFrame:
        """The layer key of each run's layer across runs (analyzer.compare.layer_keys)."""
        return layer_keys(self.tables.layers, self.mapping)

    @cached_property
    def aligned(self) -> pl.DataFrame:
        """The metrics with `aligned` (a layer key shared across runs) and `x` (analyzer.compare)."""
        return with_keys(self.metrics, self.keys, self.x)

    @cached_property
    def latest_aligned(self) -> pl.DataFrame:
        """`latest` with each layer's `aligned` key (what `analyzer.sweep` reads)."""
        return with_keys(self.latest, self.keys)

    def compared(self, baselines: list[str], runs: list[str], **options) -> Diff:
        """`analyzer.diff.diff` of `runs` against `baselines`, a batch of runs at a time (each run is
        compared with the baselines alone)."""
        baselines = list(dict.fromkeys(baselines))
        if not baselines:
            raise ValueError("no baseline left to compare with (its traces were skipped)")
        missing = sorted(set(baselines) - set(self.tables.runs))
        if missing:
            raise ValueError(f"no run {missing[0]!r} among the traces' runs to compare with: they are "
                             f"{', '.join(map(str, self.tables.runs))}")

        def frame(names):
            return with_keys(self.tables.whole(names), self.keys, self.x)
        base, parts = frame(baselines), []
        for batch in self.tables.batches(dict.fromkeys(runs)):
            own = [r for r in batch if r not in baselines]  # a run that is also a baseline: its rows are in `base`
            parts.append(diff(pl.concat([base, frame(own)]) if own else base, baselines, batch, **options))
        return Diff.joined(parts)

    def histograms(self, pairs: list[tuple[str, str]]) -> pl.DataFrame:
        """run, layer, step, hist of the activation readings of the chosen (run, layer) pairs."""
        chosen = pl.DataFrame(pairs, schema=["run", "layer"], orient="row")
        frames, runs = [], set(chosen["run"])
        for meta in self.read:
            if meta.get("run_name") in runs:
                table, _ = read_source(location(meta["file"]), ["run", "layer", "stream", "step", "hist"])
                rows = pl.from_arrow(table).with_columns(run=pl.lit(meta["run_name"]))  # runs of one name: apart
                frames.append(rows.filter((pl.col("stream") == "activation") & pl.col("hist").is_not_null())
                              .join(chosen, on=["run", "layer"], how="semi", maintain_order="left").drop("stream"))
        return pl.concat(frames) if frames else pl.DataFrame()

    def parted(self, baseline: Baseline) -> Diff:
        """Where every other run parts from the `baseline`'s runs, as `actrace diff` says: only
        differences outside the baseline's band."""
        key = tuple(baseline.runs)
        if key not in self._parted:
            names = [meta.get("run_name") for meta in self.read]
            self._parted[key] = self.compared(baseline.runs, [n for n in names if n not in key])
        return self._parted[key]


def analyze(paths, th: Thresholds = Thresholds(), rules: Rules = Rules(), *, mapping: dict | None = None,
            x: str = "step", skip_invalid: bool = False, engine: str = "polars", spark: dict | None = None) -> Analysis:
    """Read every trace once and derive what the analyzer commands show; a trace that breaks the spec
    stops it, naming the file (`skip_invalid`: leaves it out, saying so). `engine` computes the
    metric table: Polars here, or DuckDB or Spark (with the settings `spark`) from the spec's SQL (their files'
    footers checked, their rows trusted to the engine)."""
    if x not in ("step", "progress"):
        raise ValueError(f"--x must be 'step' or 'progress', got {x!r}")
    if engine not in ENGINES:
        raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "polars":
        tables, side, runs = reduced(paths, th, skip_invalid)
    else:
        table, side, runs = on_duckdb(paths, th, skip_invalid) if engine == "duckdb" else \
            on_spark(paths, th, spark, skip_invalid)
        tables = RunTables.split(table, [meta["run_name"] for meta in runs])
    return Analysis(tables, runs, scalars(side), (series(side), units(side)), rules, mapping, x, th)
