"""The trace schema of spec/trace-v1.md: version, columns, layer kinds, streams.

This module owns every name the spec defines; spec/trace-v1.md is normative and a test
checks that its column table and `SCHEMA` agree.
"""
from __future__ import annotations

import pyarrow as pa

SPEC_VERSION = "1.0"
SPEC_MAJOR = int(SPEC_VERSION.split(".")[0])
META_PREFIX = "actrace:"

STREAMS = ("activation", "activation_grad", "param_grad", "param")

# Layer kinds and, for bounded kinds, the asymptotes that define saturation (spec §Kinds).
KIND_BOUNDS: dict[str, tuple[float, float] | None] = {
    "relu": None,
    "leaky_relu": None,
    "prelu": None,
    "elu": None,
    "selu": None,
    "gelu": None,
    "silu": None,
    "mish": None,
    "softplus": None,
    "hard_swish": None,
    "relu6": (0.0, 6.0),
    "tanh": (-1.0, 1.0),
    "hard_tanh": (-1.0, 1.0),
    "softsign": (-1.0, 1.0),
    "sigmoid": (0.0, 1.0),
    "hard_sigmoid": (0.0, 1.0),
    "softmax": (0.0, 1.0),
    "clip": None,  # bounds come from the layer's attributes, recorded per row
    "linear": None,
    "conv": None,
    "norm": None,
    "embedding": None,
    "attention": None,
    "identity": None,
    "other": None,
}
KINDS = tuple(KIND_BOUNDS)
RECTIFIED_KINDS = frozenset({"relu", "relu6", "clip"})

_f64_list = pa.list_(pa.float64())
_f32_list = pa.list_(pa.float32())
_i64_list = pa.list_(pa.int64())

# (name, type, nullable) in file order. Merge rules live in actrace.reduce.
COLUMNS: list[tuple[str, pa.DataType, bool]] = [
    ("run", pa.string(), False),
    ("step", pa.int64(), False),
    ("layer", pa.string(), False),
    ("layer_index", pa.int32(), False),
    ("kind", pa.string(), False),
    ("stream", pa.string(), False),
    ("param", pa.string(), True),
    ("dtype", pa.string(), False),
    ("shape", _i64_list, False),
    ("unit_axis", pa.int32(), True),
    ("units", pa.int32(), False),
    ("bound_lo", pa.float64(), True),
    ("bound_hi", pa.float64(), True),
    ("mode", pa.string(), True),
    ("probe_fingerprint", pa.string(), True),
    ("wall_time", pa.float64(), False),
    ("count", pa.int64(), False),
    ("nan_count", pa.int64(), False),
    ("inf_count", pa.int64(), False),
    ("zero_count", pa.int64(), False),
    ("sum", pa.float64(), False),
    ("sumsq", pa.float64(), False),
    ("min", pa.float64(), False),
    ("max", pa.float64(), False),
    ("update_norm", pa.float64(), True),
    ("unit_count", _i64_list, True),
    ("unit_zero", _i64_list, True),
    ("unit_sum", _f64_list, True),
    ("unit_sumsq", _f64_list, True),
    ("unit_min", _f32_list, True),
    ("unit_max", _f32_list, True),
    ("unit_min_dev", _f32_list, True),
    ("hist", _i64_list, True),
]
UNIT_COLUMNS = tuple(name for name, _, _ in COLUMNS if name.startswith("unit_") and name != "unit_axis")
SCHEMA = pa.schema([pa.field(n, t, nullable=null) for n, t, null in COLUMNS])
REQUIRED = frozenset(name for name, _, _ in COLUMNS)

# File-level key/value metadata keys (spec §File metadata); values are UTF-8 strings.
META_KEYS = (
    "spec_version", "run_name", "run_id", "framework", "framework_version", "adapter",
    "adapter_version", "host", "created", "config", "probe_fingerprint", "probe_size", "mode",
)


def bounds_for(kind: str, bounds: tuple[float, float] | None = None) -> tuple[float, float] | None:
    """The saturation bounds of a layer: explicit ones (Clip) win over the kind's own."""
    if kind not in KIND_BOUNDS:
        raise ValueError(f"unknown layer kind {kind!r}; expected one of {', '.join(KINDS)}")
    return tuple(bounds) if bounds is not None else KIND_BOUNDS[kind]
