"""One analysis of a set of traces: each trace read once into metrics and run metadata, from which
findings, the runs' alignment and comparison follow when first asked; `summary`, `findings`,
`check` and `report` share it. Histograms are read on demand (only the report draws them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

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

    @property
    def baseline(self) -> str | None:
        """The default baseline: the run of the first trace given that holds a reading."""
        return next((m.get("run_name") for m in self.read), None)

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

    def parted(self, baseline: str | None = None) -> Diff:
        """Where every other run parts from `baseline` (default: the first trace's run), as `actrace
        diff` says: only differences outside the baseline's band."""
        baseline = baseline or self.baseline
        names = [meta.get("run_name") for meta in self.read]
        if baseline not in names:
            raise ValueError(f"--baseline {baseline!r} is not one of the runs: {', '.join(names)}")
        if baseline not in self._parted:
            self._parted[baseline] = self.compared([baseline], [n for n in names if n != baseline])
        return self._parted[baseline]


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
