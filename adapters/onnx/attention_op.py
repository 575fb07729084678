"""An ONNX `Attention` op (opset 23) read for its derived readings (spec §Derived readings): its
raw scaled scores exposed as its fourth output (`qk_matmul_output_mode` 0, the one mode every
version means the same by), then its soft cap, mask and causal rule applied here as the operator
defines them, before the core's numpy `attention` reads them. An op with a key/value cache,
padding lengths or a window is not read (`unread` says why).
"""
from __future__ import annotations

import numpy as np


class AttentionOp:
    def __init__(self, node):
        import onnx

        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        inputs = list(node.input) + [""] * 7
        self.mask, self.causal, self.softcap = inputs[3], bool(attrs.get("is_causal", 0)), float(attrs.get("softcap", 0))
        self.unread = "a key/value cache" if inputs[4] else "padding lengths" if inputs[6] else \
            "a sliding window" if max(attrs.get("left_window_size", -1), attrs.get("right_window_size", -1)) >= 0 \
            else None
        self.node = node

    def expose(self, name: str) -> None:
        """Make the op give its raw scaled scores as `name` (its fourth output)."""
        import onnx

        while len(self.node.output) < 4:
            self.node.output.append("")
        self.node.output[3] = name
        kept = [a for a in self.node.attribute if a.name != "qk_matmul_output_mode"]
        del self.node.attribute[:]
        self.node.attribute.extend(kept + [onnx.helper.make_attribute("qk_matmul_output_mode", 0)])

    def scores(self, qk: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        """The scores the op softmaxes, `[B, H, Q, K]`, a masked key at −inf: soft cap first, then
        the mask (boolean: True attends; else added), then causal (key ≤ query: no cache here)."""
        x = qk.astype(np.float32)
        if self.softcap > 0:
            x = self.softcap * np.tanh(x / self.softcap)
        if mask is not None and mask.dtype == np.bool_:
            x = np.where(mask, x, -np.inf)
        elif mask is not None:  # an additive mask leaves a key out at half its own dtype's lowest or below
            x = np.where(mask <= np.finfo(mask.dtype).min / 2, -np.inf, x + mask.astype(np.float32))
        if self.causal:
            x = np.where(np.tri(*x.shape[-2:], dtype=bool), x, -np.inf)
        return x
