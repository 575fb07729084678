"""The probe fingerprint of spec §Probe: a hash of the probe's arrays, names, shapes and dtypes."""
from __future__ import annotations

import hashlib

import numpy as np


def fingerprint(probe, dtypes: dict[str, str] | None = None) -> str:
    """16 hex digits of SHA-256 over a probe given as an array or a mapping name → array; a probe
    of one input is unnamed, whatever the framework calls it, so adapters agree. `dtypes` names
    the dtype of an input that numpy has no type for (bfloat16), given as raw bytes."""
    arrays = probe if isinstance(probe, dict) else {"": probe}
    dtypes = dtypes or {}
    if len(arrays) == 1:
        (name, array), = arrays.items()
        arrays, dtypes = {"": array}, ({"": dtypes[name]} if name in dtypes else {})
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{dtypes.get(name, a.dtype.str)}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]
