"""One analysis of a set of traces: each trace read once into metrics and run metadata, from which
findings, the runs' alignment and comparison follow when first asked; `summary`, `findings`,
`check` and `report` share it. Histograms are read on demand (only the report draws them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import polars as pl

from actrace.files.location import location
from actrace.files.reader import read_source

from .compare import align
from .diff import Diff, diff
from .engines import ENGINES, on_duckdb, on_spark
from .findings import Finding, Rules, findings, findings_frame
from .metrics import Thresholds, reduced, scalars
from .signals import series, units


@dataclass
class Analysis:
    metrics: pl.DataFrame     # per (run, layer, stream, step): analyzer.metrics.METRIC_COLUMNS and more
    runs: list[dict]          # per trace, in the order given: its file metadata and `file`
    scalars: pl.DataFrame     # the training loop's logged values: run, step, name (loss, lr, …), value
    signals: tuple            # derived readings: analyzer.signals.series and .units (heads, experts)
    rules: Rules = Rules()
    mapping: dict | None = None
    x: str = "step"
    th: Thresholds = Thresholds()
    _parted: dict = field(default_factory=dict, repr=False)

    @cached_property
    def findings(self) -> list[Finding]:
        """The findings rules over the metrics, most urgent first."""
        return findings(self.metrics, self.rules, self.runs, self.th, self.scalars, self.signals)

    @property
    def findings_frame(self) -> pl.DataFrame:
        """The findings as a Polars frame, numbers as numbers (analyzer.findings.FINDING_COLUMNS)."""
        return findings_frame(self.findings)

    @property
    def baseline(self) -> str | None:
        """The default baseline: the run of the first trace given."""
        return self.runs[0].get("run_name") if self.runs else None

    @cached_property
    def aligned(self) -> pl.DataFrame:
        """The metrics with `aligned` (a layer key shared across runs) and `x` (analyzer.compare)."""
        return align(self.metrics, self.mapping, self.x)

    def histograms(self, pairs: list[tuple[str, str]]) -> pl.DataFrame:
        """run, layer, step, hist of the activation readings of the chosen (run, layer) pairs."""
        chosen = pl.DataFrame(pairs, schema=["run", "layer"], orient="row")
        frames, runs = [], set(chosen["run"])
        for meta in self.runs:
            if meta.get("run_name") in runs:
                table, _ = read_source(location(meta["file"]), ["run", "layer", "stream", "step", "hist"])
                frames.append(pl.from_arrow(table).filter((pl.col("stream") == "activation")
                                                          & pl.col("hist").is_not_null())
                              .join(chosen, on=["run", "layer"], how="semi", maintain_order="left").drop("stream"))
        return pl.concat(frames) if frames else pl.DataFrame()

    def parted(self, baseline: str | None = None) -> Diff:
        """Where every other run parts from `baseline` (default: the first trace's run), as `actrace
        diff` says: only differences outside the baseline's band."""
        baseline = baseline or self.baseline
        names = [meta.get("run_name") for meta in self.runs]
        if baseline not in names:
            raise ValueError(f"--baseline {baseline!r} is not one of the runs: {', '.join(names)}")
        if baseline not in self._parted:
            self._parted[baseline] = diff(self.aligned, [baseline], [n for n in names if n != baseline])
        return self._parted[baseline]


def analyze(paths, th: Thresholds = Thresholds(), rules: Rules = Rules(), *, mapping: dict | None = None,
            x: str = "step", skip_invalid: bool = False, engine: str = "polars", master: str = "local[2]") -> Analysis:
    """Read every trace once and derive what the analyzer commands show; a trace that breaks the spec
    stops it, naming the file (`skip_invalid`: leaves it out, saying so). `engine` computes the
    metric table: Polars here, or DuckDB or Spark (at `master`) from the spec's SQL (their files'
    footers checked, their rows trusted to the engine)."""
    if x not in ("step", "progress"):
        raise ValueError(f"--x must be 'step' or 'progress', got {x!r}")
    if engine not in ENGINES:
        raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    table, side, runs = reduced(paths, th, skip_invalid) if engine == "polars" else \
        on_duckdb(paths, th, skip_invalid) if engine == "duckdb" else on_spark(paths, th, master, skip_invalid)
    return Analysis(table, runs, scalars(side), (series(side), units(side)), rules, mapping, x, th)
