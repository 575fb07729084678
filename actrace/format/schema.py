"""The trace schema of spec/trace-v1.md: version, columns, layer kinds, streams.

This module owns every name the spec defines; spec/trace-v1.md is normative and a test
checks that its column table and `SCHEMA` agree.
"""
from __future__ import annotations

import hashlib
import re

import numpy as np
import pyarrow as pa

SPEC_VERSION = "1.5"
SPEC_MAJOR = int(SPEC_VERSION.split(".")[0])
# spec §Version and schema: `MAJOR.MINOR`, each a number of at most 4 digits without a leading zero
VERSION = re.compile(r"(0|[1-9][0-9]{0,3})\.(0|[1-9][0-9]{0,3})")

STREAMS = ("activation", "activation_grad", "param_grad", "param", "scalar")  # scalar: 1.2
# a scalar row is no layer of the model: its layer_index (spec §Streams)
SCALAR_INDEX = -1

# 1.3: kinds of *derived* readings, tensors a producer computes from what a layer computed (spec
# §Derived readings), by what gives them: per head of an attention, per position of an LM head, per
# expert of a router. Only their own rules judge them: a head of entropy 0 is collapse, not a dead unit.
ATTENTION_KINDS = ("attention_logit", "attention_entropy", "attention_sink")
LOGIT_KINDS = ("log_z", "max_logit")
ROUTER_KINDS = ("expert_load", "router_prob", "router_entropy")
DERIVED_KINDS = ATTENTION_KINDS + LOGIT_KINDS + ROUTER_KINDS
# the derived kinds whose units an analyzer reads one by one (heads, experts)
PER_UNIT_KINDS = ATTENTION_KINDS + ("expert_load", "router_prob")

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
    **dict.fromkeys(DERIVED_KINDS),  # 1.3
}
KINDS = tuple(KIND_BOUNDS)
# The bound(s) at which a bounded kind saturates (spec §Layer kinds): where its slope vanishes.
# ReLU6's zeros are sparsity or death; a softmax saturates only at a probability near 1.
SATURATING_SIDES = {kind: ("hi",) if kind in ("relu6", "softmax") else ("lo", "hi")
                    for kind, bounds in KIND_BOUNDS.items() if bounds is not None or kind == "clip"}
# The thresholds t at which `sat_counts` counts values near each bound (spec §Columns).
SAT_LEVELS = (0.9, 0.99, 0.999)
# what each of the `sat_counts` counts is: the bound's side and the level, outermost first on the
# low side, innermost first on the high one: [lo at 0.999, 0.99, 0.9, hi at 0.9, 0.99, 0.999]
SAT_COUNTS = tuple(("lo", t) for t in reversed(SAT_LEVELS)) + tuple(("hi", t) for t in SAT_LEVELS)


def sat_margin(lo, hi, t):
    """How near a bound a value of a kind bounded by [lo, hi] is saturated at level t: within
    (1 − t) · max(|lo|, |hi|) of it (spec §Metrics). Scalars or numpy arrays."""
    return (1.0 - t) * np.maximum(np.abs(lo), np.abs(hi))


def sat_thresholds(bounds: tuple[float, float]) -> list[float]:
    """The threshold of each `sat_counts` count, in its order: a value at or beyond it is counted."""
    lo, hi = bounds
    return [lo + sat_margin(lo, hi, t) if side == "lo" else hi - sat_margin(lo, hi, t) for side, t in SAT_COUNTS]


# activation names as frameworks spell them (functions, the core of class names), lower case with
# only letters and digits, and the kind each one is: every adapter's one table (`activation_kind`)
_ACTIVATION_NAMES = {
    "relu": "relu", "relu6": "relu6", "leakyrelu": "leaky_relu", "rrelu": "leaky_relu", "prelu": "prelu",
    "elu": "elu", "celu": "elu", "selu": "selu", "gelu": "gelu", "gelutanh": "gelu", "silu": "silu", "swish": "silu",
    "mish": "mish", "softplus": "softplus", "hardswish": "hard_swish", "hswish": "hard_swish",
    "hardsilu": "hard_swish", "hardtanh": "hard_tanh", "tanh": "tanh", "softsign": "softsign", "sigmoid": "sigmoid",
    "hardsigmoid": "hard_sigmoid", "hsigmoid": "hard_sigmoid", "softmax": "softmax", "specialexpit": "sigmoid",
}
ACTIVATION_KINDS = frozenset(_ACTIVATION_NAMES.values())
RECTIFIED_KINDS = frozenset({"relu", "relu6", "clip"})

# names (run, layer, param, run_name): at most MAX_NAME characters, none of these (spec §Validity):
# controls, line and paragraph separators, bidirectional controls, which could fake or reorder what
# a terminal or a page shows
MAX_NAME = 256
FORBIDDEN_IN_NAMES = "\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u061c\u202a-\u202e\u2066-\u2069"

_f64_list = pa.list_(pa.float64())
_f32_list = pa.list_(pa.float32())
_i64_list = pa.list_(pa.int64())

# (name, type, nullable, merge) in file order. The merge rule says how the readings of two chunks of
# one tensor combine (spec §Columns): `same` must agree, `concat` joins along the batch axis, `sum`,
# `min` and `max` (NaN-ignoring) combine values, `none` is null after a merge.
COLUMNS: list[tuple[str, pa.DataType, bool, str]] = [
    ("run", pa.string(), False, "same"),
    ("step", pa.int64(), False, "same"),
    ("layer", pa.string(), False, "same"),
    ("layer_index", pa.int32(), False, "same"),
    ("kind", pa.string(), False, "same"),
    ("stream", pa.string(), False, "same"),
    ("param", pa.string(), True, "same"),
    ("dtype", pa.string(), False, "same"),
    ("shape", _i64_list, False, "concat"),
    ("unit_axis", pa.int32(), True, "same"),
    ("units", pa.int32(), False, "same"),
    ("bound_lo", pa.float64(), True, "same"),
    ("bound_hi", pa.float64(), True, "same"),
    ("mode", pa.string(), True, "same"),
    ("probe_fingerprint", pa.string(), True, "same"),
    ("wall_time", pa.float64(), False, "max"),
    ("count", pa.int64(), False, "sum"),
    ("nan_count", pa.int64(), False, "sum"),
    ("inf_count", pa.int64(), False, "sum"),
    ("zero_count", pa.int64(), False, "sum"),
    ("sum", pa.float64(), False, "sum"),
    ("sumsq", pa.float64(), False, "sum"),
    ("min", pa.float64(), False, "min"),
    ("max", pa.float64(), False, "max"),
    ("update_norm", pa.float64(), True, "none"),
    ("unit_count", _i64_list, True, "sum"),
    ("unit_zero", _i64_list, True, "sum"),
    ("unit_sum", _f64_list, True, "sum"),
    ("unit_sumsq", _f64_list, True, "sum"),
    ("unit_min", _f32_list, True, "min"),
    ("unit_max", _f32_list, True, "max"),
    ("unit_min_dev", _f32_list, True, "min"),
    ("hist", _i64_list, True, "sum"),
    ("sat_counts", _i64_list, True, "sum"),  # 1.1
    ("value", pa.float64(), True, "none"),  # 1.2
    ("sum3", pa.float64(), True, "sum"),  # 1.3
    ("sum4", pa.float64(), True, "sum"),  # 1.3
]
UNIT_COLUMNS = tuple(name for name, *_ in COLUMNS if name.startswith("unit_") and name != "unit_axis")
SCHEMA = pa.schema([pa.field(n, t, nullable=null) for n, t, null, _ in COLUMNS])
READING_KEY = ("run", "layer", "stream", "param", "step")  # at most one row each (spec §Validity)
# the columns each minor version added: absent from the files of older minor versions, read as null
ADDED_IN = {"sat_counts": 1, "value": 2, "sum3": 3, "sum4": 3}
MERGE = {name: rule for name, _, _, rule in COLUMNS}


def minor_version(version: str) -> int:
    """The minor number of a `MAJOR.MINOR` spec version (`VERSION`; a reader refuses any other)."""
    return int(VERSION.fullmatch(version).group(2))


def columns_absent_in(version: str) -> frozenset[str]:
    """The columns a file of spec `version` may lack: those a later minor version added."""
    return frozenset(name for name, minor in ADDED_IN.items() if minor_version(version) < minor)


def activation_kind(name: str) -> str | None:
    """The kind of an activation named `name` by any framework (`leaky_relu`, `LeakyReLU`'s core
    `leakyrelu`, Keras's `hard_silu`), or None."""
    return _ACTIVATION_NAMES.get("".join(c for c in name.lower() if c.isalnum()))


def clamp_kind(lo, hi) -> tuple[str, tuple[float, float] | None] | None:
    """(kind, bounds) of a clamp to [lo, hi], `None` for an open side (torch's clamp, hardtanh and
    ReLU6, ONNX's Clip, Flax's and Keras's hard_tanh): every adapter's one rule (spec §Layer kinds).
    [0, 6] is a `relu6`, any other two bounds a `clip` with them, [0, ∞) a `relu`, and any other
    one-sided clamp a guard, not an activation (None)."""
    lo, hi = (None if v is None else float(v) for v in (lo, hi))
    if (lo, hi) == (0.0, 6.0):
        return "relu6", None
    if lo is not None and hi is not None:
        return "clip", (lo, hi)
    return ("relu", None) if lo == 0.0 and hi is None else None


def canonical_kind(kind: str, bounds: tuple[float, float] | None = None) -> tuple[str, tuple[float, float] | None]:
    """A reading's kind and bounds as the spec writes them: a clamp (`hard_tanh`, `relu6`, `clip`)
    by `clamp_kind` of its bounds, so the same function has one kind in every framework."""
    if kind in ("hard_tanh", "relu6", "clip") and (bounds is not None or KIND_BOUNDS[kind] is not None):
        return clamp_kind(*bounds_for(kind, bounds))
    return kind, bounds


def bounds_for(kind: str, bounds: tuple[float, float] | None = None) -> tuple[float, float] | None:
    """The saturation bounds of a layer: explicit ones (Clip) win over the kind's own."""
    if kind not in KIND_BOUNDS:
        raise ValueError(f"unknown layer kind {kind!r}; expected one of {', '.join(KINDS)}")
    return tuple(bounds) if bounds is not None else KIND_BOUNDS[kind]


def lossless(got: pa.DataType, want: pa.DataType) -> bool:
    """Whether values of type `got` cast to `want` with nothing lost (spec §Validity: a column has
    its type, or one that casts losslessly): a narrower integer or float, another string or list
    encoding, a dictionary of strings."""
    if got.equals(want):
        return True
    if pa.types.is_dictionary(got):
        return lossless(got.value_type, want)
    if pa.types.is_integer(want) and pa.types.is_integer(got):
        return pa.types.is_signed_integer(want) >= pa.types.is_signed_integer(got) and \
            got.bit_width + (pa.types.is_signed_integer(want) and not pa.types.is_signed_integer(got)) <= want.bit_width
    if pa.types.is_floating(want) and pa.types.is_floating(got):
        return got.bit_width <= want.bit_width
    if pa.types.is_string(want):
        return pa.types.is_large_string(got) or pa.types.is_string_view(got)
    if pa.types.is_list(want) and (pa.types.is_list(got) or pa.types.is_large_list(got)
                                   or pa.types.is_fixed_size_list(got) or pa.types.is_list_view(got)):
        return lossless(got.value_type, want.value_type)
    return False


def schema_problems(schema: pa.Schema, version: str, columns=None) -> list[tuple[str, str]]:
    """(column, problem) for each spec column a file of spec `version` lacks or holds in a type that
    does not cast losslessly to the spec's; `columns`: only those (default every column)."""
    absent = columns_absent_in(version)
    out = []
    for field in SCHEMA:
        if columns is not None and field.name not in columns:
            continue
        i = schema.get_field_index(field.name)
        if i < 0:
            if field.name not in absent:
                out.append((field.name, "required column is missing"))
        elif not lossless(schema.field(i).type, field.type):
            out.append((field.name, f"has type {schema.field(i).type}, expected {field.type}"))
    return out


_FORBIDDEN = re.compile(f"[{FORBIDDEN_IN_NAMES}]")


def shown(text: str) -> str:
    """`text` with each character forbidden in names written as its escape (`\\x1b`, `\\u202e`): what
    a terminal or a page may show of a string from a trace, which must not fake or reorder lines."""
    return _FORBIDDEN.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)


def safe_name(name: str) -> str:
    """`name` as spec §Validity allows a name: `shown`, and a name longer than MAX_NAME cut to its
    first 240 characters, `…` and 8 hex digits of the SHA-256 of the whole, so two long names stay
    apart."""
    safe = shown(name)
    if len(safe) > MAX_NAME:
        safe = safe[:240] + "…" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return safe
