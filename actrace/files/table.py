"""Readings ↔ Arrow: turn buffered readings into a table of the spec's schema (spec §Columns)."""
from __future__ import annotations

import operator

import numpy as np
import pyarrow as pa

from actrace.reduce import Reading
from actrace.reduce.reading import LAYER_VALUES, LayerTotals, layer_values
from actrace.format.schema import SCHEMA, UNIT_COLUMNS, canonical_kind

_SCALARS = ("layer", "stream", "param", "dtype", "unit_axis", "units", "count", "nan_count",
            "inf_count", "zero_count", "sum", "sumsq", "min", "max", "update_norm", "value", "sum3", "sum4")
_scalars = operator.attrgetter(*_SCALARS)
_LISTS = UNIT_COLUMNS + ("hist", "sat_counts")
_lists = operator.attrgetter(*_LISTS)


def _list_array(arrays: list[np.ndarray | None], typ: pa.ListType) -> pa.Array:
    """A list column from per-row numpy arrays in one copy (None → null row)."""
    present = [a for a in arrays if a is not None]
    if not present:  # a gradient reading's rows: no per-unit list, no histogram
        return pa.nulls(len(arrays), typ)
    value_type = typ.value_type.to_pandas_dtype()
    lengths = np.array([0 if a is None else len(a) for a in arrays], dtype=np.int32)
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(present).astype(value_type, copy=False)
    mask = pa.array([a is None for a in arrays]) if len(present) < len(arrays) else None
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=typ.value_type), mask=mask)


_CONTEXT = ("run", "step", "layer_index", "mode", "probe_fingerprint", "wall_time")
_COLUMNS = _CONTEXT + ("kind", "shape", "bound_lo", "bound_hi") + _SCALARS + _LISTS  # a `row`'s, in order


def row(reading: Reading, run: str, step: int, layer_index: int, mode: str | None, probe_fingerprint: str | None,
        wall_time: float) -> tuple:
    """A reading and its context as a writer buffers it until a flush: one flat tuple of plain values
    and numpy arrays, taken at record time, which Python's cyclic collector stops tracking by its
    second look. Buffered `Reading`s would be scanned by every full collection of the process, and
    make those come sooner: 1.35 ms of a 290-parameter model's 6.2 ms per-step gradient reading
    (4.0 ms with rows: bench/bench_torch.py's `grad ms`)."""
    kind = canonical_kind(reading.kind, reading.bounds)[0]  # one kind per clamp, whoever wrote it
    lo, hi = (None, None) if reading.bounds is None else reading.bounds
    return (run, step, layer_index, mode, probe_fingerprint, wall_time, kind, tuple(reading.shape), lo, hi) + \
        _scalars(reading) + _lists(reading)


_VALUES = _COLUMNS.index(LAYER_VALUES[0])  # where a layer-level reading's values lie in a row
assert _COLUMNS[_VALUES: _VALUES + len(LAYER_VALUES)] == LAYER_VALUES and len(_CONTEXT) == 6


class LayerRows:
    """The rows of layer-level readings of fixed tensors (a per-step gradient reading's parameters)
    made from each step's `LayerTotals` of them: every column but the step, mode, wall time and
    values taken once from a `row` of each tensor's reading (`readings`, named as the writer records
    them; the probe fingerprint as given then), so a step makes a tuple per tensor and no Reading."""

    def __init__(self, batch: LayerTotals, readings: list[Reading], run: str, layer_indexes: list[int],
                 probe_fingerprints: list[str | None]):
        made = [row(r, run, 0, i, None, f, 0.0) for r, i, f in zip(readings, layer_indexes, probe_fingerprints)]
        self.tensors, self.layer_indexes = (batch.metas, batch.shapes, batch.dtypes), layer_indexes
        self.keys = [(r.layer, r.stream, r.param) for r in readings]
        self.streams = {r.stream for r in readings}
        self._fixed = [(m[0], m[2], m[4], m[len(_CONTEXT): _VALUES], m[_VALUES + len(LAYER_VALUES):]) for m in made]

    def fits(self, batch: LayerTotals, layer_indexes: list[int]) -> bool:
        """Whether `batch` is of the tensors these rows were made for."""
        metas, shapes, dtypes = self.tensors
        return (metas is batch.metas or metas == batch.metas) and shapes == batch.shapes and \
            dtypes == batch.dtypes and self.layer_indexes == layer_indexes

    def rows(self, batch: LayerTotals, step: int, mode: str | None, wall_time: float, kept: list[int]) -> list[tuple]:
        """The `row`s of the readings `kept` (their positions) of this step's `batch`."""
        out = []
        for i in kept:
            run, index, fingerprint, head, tail = self._fixed[i]
            out.append((run, step, index, mode, fingerprint, wall_time) + head +
                       layer_values(batch.totals[i], batch.scale) + tail)
        return out


ROW_BYTES = 1024  # what a row holds beside its arrays (a tuple of ~45 slots, its numbers and shape), about


def row_bytes(r: tuple, counted: set[int]) -> tuple[int, set[int]]:
    """The memory a buffered `row` adds to a buffer that holds the arrays `counted` (their ids), about,
    and the ids of the arrays it adds: ROW_BYTES and each array its lists and histogram are views of (a
    reduction's lists are slices of one buffer, which they keep), once however many rows share it."""
    owners = {}
    for a in r[-len(_LISTS):]:
        if a is not None:
            owner = a.base if isinstance(a.base, np.ndarray) else a
            if id(owner) not in counted:
                owners[id(owner)] = owner.nbytes
    return ROW_BYTES + sum(owners.values()), set(owners)


def rows_to_table(rows: list[tuple]) -> pa.Table:
    """A table of the spec's schema from buffered `row`s."""
    cols: dict[str, list | pa.Array] = dict(zip(_COLUMNS, map(list, zip(*rows)))) if rows else \
        {name: [] for name in _COLUMNS}
    for name in _LISTS:
        cols[name] = _list_array(cols[name], SCHEMA.field(name).type)
    return pa.table({f.name: (cols[f.name] if isinstance(cols[f.name], pa.Array)
                              else pa.array(cols[f.name], type=f.type)) for f in SCHEMA}, schema=SCHEMA)
