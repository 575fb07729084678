"""The probe fingerprint of spec §Probe: a hash of the probe's arrays, names, shapes and dtypes."""
from __future__ import annotations

import hashlib

import numpy as np


def fingerprint(probe) -> str:
    """16 hex digits of SHA-256 over a probe given as an array or a mapping name → array."""
    arrays = probe if isinstance(probe, dict) else {"": probe}
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]
