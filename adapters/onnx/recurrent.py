"""ONNX `LSTM`, `GRU` and `RNN` nodes read as the PyTorch adapter reads their modules
(actrace.format.recurrent; spec §Recurrent layers): per direction the hidden-state sequence `Y`, every
gate of every step recomputed from the node's `W`, `R`, `B`, and the final states `Y_h`, `Y_c`.

Gate weights are reordered from ONNX's stacking (LSTM i, o, f, c; GRU z, r, h) to PyTorch's.
`sequence_lens` marks padding, which is never read. A node with non-default activations, `clip`,
`input_forget` or peepholes computes gates these formulas do not: its gates are not read (the
node's `gates` says why) and its states are kind `other`.
"""
from __future__ import annotations

import numpy as np

from actrace.format import recurrent

_TO_TORCH = {"lstm": [0, 2, 3, 1], "gru": [1, 0, 2]}  # ONNX gate blocks in PyTorch's order
_DEFAULT = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}
OPS = frozenset(_DEFAULT)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # no overflow for large |x|


class Op:
    """One recurrent node: the tensors a reading needs, and its readings (`parts`) from them."""

    def __init__(self, graph, node):
        from onnx import helper

        self.node, self.op_type = node, node.op_type
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        direction = attrs.get("direction", b"forward").decode()
        self.directions = 2 if direction == "bidirectional" else 1
        self.reverse = direction == "reverse"
        self.layout = attrs.get("layout", 0)
        self.reset_after = bool(attrs.get("linear_before_reset", 0))
        acts = [a.decode() for a in attrs.get("activations", [])][: len(_DEFAULT[node.op_type])]
        self.cell = {"LSTM": "lstm", "GRU": "gru"}.get(node.op_type) or (
            "rnn_relu" if acts[:1] == ["Relu"] else "rnn_tanh")
        inputs = list(node.input) + [""] * (8 - len(node.input))
        self.x, self.w, self.r, self.b, self.lens, self.h0 = inputs[:6]
        self.c0, peephole = (inputs[6], inputs[7]) if node.op_type == "LSTM" else ("", "")
        standard = not acts or acts == _DEFAULT[node.op_type] or (node.op_type == "RNN" and acts == ["Relu"])
        unusual = [what for what, present in (("activations " + ",".join(acts), not standard), ("clip", "clip" in attrs),
                                              ("input_forget", attrs.get("input_forget", 0)), ("peepholes", peephole))
                   if present]
        self.unread = ", ".join(unusual)  # why gates are not read: these formulas do not compute them
        self.gates = not unusual
        self.const = {name: graph.init[name] for name in (self.w, self.r, self.b, self.lens, self.h0, self.c0)
                      if name and name in graph.init}
        self.outputs = list(node.output) + [""] * (3 - len(node.output))

    def parts(self) -> list[tuple[str, str]]:
        """(name suffix, kind) per reading, `l0` standing for this node's place in its module."""
        found = recurrent.parts(self.cell, 1, self.directions)
        if self.reverse:
            found = [(s.replace("l0", "l0_reverse", 1), k) for s, k in found]
        if not self.gates:
            gates = {g for g, _ in recurrent.GATES[self.cell]}
            found = [(s, "other") for s, k in found if s.rsplit(".", 1)[-1] not in gates]
        return found

    def expose(self) -> list[str]:
        """Name the node's unnamed outputs (`Y`, `Y_h`, `Y_c`: the model copy's, never the file's)
        and return every tensor a reading fetches (weights too, where a graph computes them)."""
        wanted = 3 if self.op_type == "LSTM" else 2
        for i in range(wanted):
            if not self.outputs[i]:
                self.outputs[i] = f"{self.node.name or self.x}/actrace_output_{i}"
        del self.node.output[:]
        self.node.output.extend(self.outputs[:wanted])
        return [n for n in (self.x, self.w, self.r, self.b, self.lens, self.h0, self.c0, *self.outputs[:wanted])
                if n and n not in self.const]

    def _value(self, name: str, values: dict):
        from onnx import numpy_helper

        if not name:
            return None
        return numpy_helper.to_array(self.const[name]) if name in self.const else values[name]

    def readings(self, values: dict[str, np.ndarray], wanted: set[str]) -> dict[str, np.ndarray]:
        """The arrays of the `wanted` name suffixes (`parts`), from the fetched `values`."""
        x, y = self._value(self.x, values), self._value(self.outputs[0], values)
        y_h, y_c = self._value(self.outputs[1], values), self._value(self.outputs[2], values)
        h0, lens = self._value(self.h0, values), self._value(self.lens, values)
        if self.layout:  # batch first: [batch, seq, ...] and [batch, directions, hidden]
            x, y = x.swapaxes(0, 1), y.transpose(1, 2, 0, 3)
            y_h, y_c, h0 = (None if a is None else a.swapaxes(0, 1) for a in (y_h, y_c, h0))
        steps, batch = x.shape[:2]
        valid = np.ones((steps, batch), bool) if lens is None else np.arange(steps)[:, None] < lens[None, :]
        grid = (steps, batch) if valid.all() else None
        rows = x[valid]
        found = {}
        names = dict(self.parts())
        for d in range(self.directions):
            reverse = d == 1 or self.reverse
            base = recurrent.layer_name(0, reverse)
            hidden = y[:, d][valid]
            gate_names = [f"{base}.{g}" for g, _ in recurrent.GATES[self.cell]]
            if self.gates and any(g in wanted for g in gate_names):
                size = hidden.shape[-1]
                start = np.zeros((batch, size), hidden.dtype) if h0 is None else h0[d]
                h_prev = np.concatenate([hidden, start])[recurrent.previous(valid, reverse)]
                w, r, b = (self._value(n, values) for n in (self.w, self.r, self.b))
                order = _TO_TORCH.get(self.cell, [0])
                w_ih, w_hh = _reorder(w[d], order, size), _reorder(r[d], order, size)
                b_ih = b_hh = None
                if b is not None:
                    half = b.shape[-1] // 2
                    b_ih, b_hh = _reorder(b[d, :half], order, size), _reorder(b[d, half:], order, size)
                found.update(zip(gate_names, recurrent.gates(self.cell, rows, h_prev, w_ih, w_hh, b_ih, b_hh,
                                                             _sigmoid, np.tanh, self.reset_after)))
            found[base] = hidden
            found[f"{base}.h_n"] = y_h[d] if y_h is not None else None
            found[f"{base}.c_n"] = y_c[d] if y_c is not None else None
        # padded: per-row readings as [batch, time, units], batch first as the probe's chunks are cut
        return {s: (a.reshape(*grid, -1).swapaxes(0, 1) if grid and not s.endswith(("h_n", "c_n")) else a)
                for s, a in found.items() if s in wanted and s in names and a is not None}


def _reorder(a: np.ndarray, order: list[int], size: int) -> np.ndarray:
    """Blocks of `size` rows (or values) of a stacked weight or bias, in PyTorch's gate order."""
    return np.concatenate([a[k * size:(k + 1) * size] for k in order])
