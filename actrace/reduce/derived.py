"""Derived readings (spec §Derived readings) with numpy alone: the tensors an attention's scores
give per head and query, read as any tensor is. The definition the PyTorch adapter's fast path is
tested against, and what adapters without torch (ONNX Runtime) compute.
"""
from __future__ import annotations

import numpy as np


def attention(logits: np.ndarray) -> dict[str, np.ndarray]:
    """From pre-softmax scores `[B, H, Q, K]`, a masked key at −inf or at most half the dtype's
    lowest value (an additive mask), a key any head masks left out: per query and head (last axis),
    its largest logit over the keys it may attend, its entropy over them divided by ln(keys)
    (queries of 2 keys or more), and its mass on the first key it may attend. NaN stays NaN."""
    lowest = np.finfo(logits.dtype).min / 2
    x = logits.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        masked = (x <= lowest).any(1)  # [B, Q, K]
        n = x.shape[-1] - masked.sum(-1)
        live = np.where(masked[:, None], -np.inf, x)
        peak = live.max(-1, keepdims=True)
        e = np.exp(live - peak)  # a query with no key: NaN, left out
        total = e.sum(-1)
        p = e / total[..., None]
        entropy = -np.where(p == 0, 0.0, p * np.log(p)).sum(-1) / np.log(np.maximum(n, 2))[:, None]
        first = (~masked).argmax(-1)  # [B, Q]
        sink = np.take_along_axis(p, np.broadcast_to(first[:, None, :, None], (*p.shape[:3], 1)), -1)[..., 0]
    rows, wide = n >= 1, n >= 2
    return {"attention_logit": peak[..., 0].transpose(0, 2, 1)[rows],
            "attention_entropy": entropy.transpose(0, 2, 1)[wide], "attention_sink": sink.transpose(0, 2, 1)[rows]}
