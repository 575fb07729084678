"""The metric table held run by run, each run's rows compressed (Arrow IPC, zstd: a fourth of their
size in memory), so that findings and comparisons over a sweep of thousands of runs read a run, or
a few, at a time in bounded memory; the whole table is made only where a consumer asks for it."""
from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import polars as pl

LAYER_KEYS = ["run", "layer", "layer_index", "kind"]  # what aligning layers across runs reads
AT_ONCE = 32  # runs read as one frame: few enough to hold, enough that Polars' cost per call stays small


@dataclass(frozen=True)
class RunRows:
    """One run's metric rows, compressed; its layers (LAYER_KEYS, once each) kept as they are."""

    run: str | None  # an engine may give rows of no run
    height: int
    layers: pl.DataFrame
    packed: bytes

    @classmethod
    def of(cls, run: str | None, frame: pl.DataFrame) -> RunRows:
        buffer = io.BytesIO()
        frame.write_ipc(buffer, compression="zstd")
        return cls(run, frame.height, frame.select(LAYER_KEYS).unique(maintain_order=True), buffer.getvalue())

    def frame(self) -> pl.DataFrame:
        return pl.read_ipc(io.BytesIO(self.packed))


class RunTables:
    """The metric table as its runs' rows, in the order of the runs' names (each run's rows in the
    table's order): their concatenation is the sorted table."""

    def __init__(self, rows: Iterable[RunRows]):
        self._rows = {r.run: r for r in sorted(rows, key=lambda r: (r.run is None, r.run or ""))}  # a null run last

    @classmethod
    def split(cls, table: pl.DataFrame, runs: list[str]) -> RunTables:
        """A whole sorted table (an engine's) as the rows of each of its runs and of `runs` (those of
        the traces' metadata: a run of no readings has no rows)."""
        parts = {run: part for (run,), part in table.partition_by("run", as_dict=True, maintain_order=True).items()}
        return cls(RunRows.of(run, parts.get(run, table.clear())) for run in dict.fromkeys([*runs, *parts]))

    @property
    def runs(self) -> list[str]:
        return list(self._rows)

    @property
    def height(self) -> int:
        return sum(r.height for r in self._rows.values())

    @property
    def layers(self) -> pl.DataFrame:
        """Every run's layers: run, layer, layer_index, kind."""
        return pl.concat([r.layers for r in self._rows.values()])

    def batches(self, runs: Iterable[str] | None = None) -> Iterator[list[str]]:
        """The runs (of `runs`, default all) AT_ONCE at a time."""
        runs = list(self._rows if runs is None else runs)
        for i in range(0, len(runs), AT_ONCE):
            yield runs[i: i + AT_ONCE]

    def frames(self) -> Iterator[pl.DataFrame]:
        """The rows of every run, AT_ONCE runs to a frame."""
        for runs in self.batches():
            yield self.whole(runs)

    def whole(self, runs: Iterable[str] | None = None) -> pl.DataFrame:
        """The rows of `runs` (default all) as one frame."""
        return pl.concat([self._rows[run].frame() for run in (self._rows if runs is None else runs)],
                         how="diagonal_relaxed")
