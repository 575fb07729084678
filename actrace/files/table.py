"""Readings ↔ Arrow: turn buffered readings into a table of the spec's schema (spec §Columns)."""
from __future__ import annotations

import operator

import numpy as np
import pyarrow as pa

from actrace.reduce import Reading
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


def readings_to_table(rows: list[tuple[Reading, dict]]) -> pa.Table:
    """Rows are (reading, context) where context holds run, step, layer_index, mode,
    probe_fingerprint and wall_time."""
    cols: dict[str, list | pa.Array] = {}
    for name in ("run", "step", "layer_index", "mode", "probe_fingerprint", "wall_time"):
        cols[name] = [ctx[name] for _, ctx in rows]
    scalars = zip(*map(_scalars, (r for r, _ in rows))) if rows else [[] for _ in _SCALARS]
    cols.update(zip(_SCALARS, map(list, scalars)))  # one C call per reading gives all its scalars
    cols["kind"] = [canonical_kind(r.kind, r.bounds)[0] for r, _ in rows]  # one kind per clamp, whoever wrote it
    cols["shape"] = [list(r.shape) for r, _ in rows]
    cols["bound_lo"] = [None if r.bounds is None else r.bounds[0] for r, _ in rows]
    cols["bound_hi"] = [None if r.bounds is None else r.bounds[1] for r, _ in rows]
    lists = zip(*map(_lists, (r for r, _ in rows))) if rows else [[] for _ in _LISTS]
    for name, arrays in zip(_LISTS, lists):  # one C call per reading gives all its lists
        cols[name] = _list_array(list(arrays), SCHEMA.field(name).type)
    return pa.table({f.name: (cols[f.name] if isinstance(cols[f.name], pa.Array)
                              else pa.array(cols[f.name], type=f.type)) for f in SCHEMA}, schema=SCHEMA)
