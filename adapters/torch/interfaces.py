"""Hugging Face's attention registry (`AttentionInterface`) seen by a trace: an implementation whose
scores no torch call shows (flash, flex, one a user registered) is called through a wrapper that
hands its queries, keys and mask to the trace first, for its derived readings (spec §Derived
readings). SDPA and eager attention show their scores to the trace already and stay as they are.
Transformers is never imported here: a registry is wrapped only where a model brought it in.
"""
from __future__ import annotations

import functools
import sys

SHOWN = ("sdpa", "eager", "paged|eager")  # their scores reach the trace through torch calls


def wrap_registry(seen) -> dict:
    """Wrap every registered implementation not in SHOWN so that a call runs `seen(fn, module,
    query, key, value, mask, args, kwargs)` instead; what was replaced, for `restore`."""
    utils = sys.modules.get("transformers.modeling_utils")
    registry = getattr(getattr(utils, "AttentionInterface", None), "_global_mapping", None)
    if not isinstance(registry, dict):
        return {}
    replaced = {name: fn for name, fn in registry.items() if name not in SHOWN and callable(fn)}
    for name, fn in replaced.items():
        registry[name] = functools.wraps(fn)(functools.partial(_call, seen, fn))
    return replaced


def restore(replaced: dict) -> None:
    """Put back what `wrap_registry` replaced."""
    if replaced:
        sys.modules["transformers.modeling_utils"].AttentionInterface._global_mapping.update(replaced)


def _call(seen, fn, module, query, key, value, attention_mask, *args, **kwargs):
    return seen(fn, module, query, key, value, attention_mask, args, kwargs)
