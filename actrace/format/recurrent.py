"""Recurrent layers read per layer and direction (spec §Recurrent layers): the names and kinds of
their readings, which row's hidden state feeds each step, and every gate of every step
recomputed from the layer's weights with two matmuls, never by unrolling the recurrence.

Rows are the valid (step, sequence) pairs in time-major order, as a packed sequence holds them;
padding is never a row. The arithmetic is the array library's own (`@`, slicing, indexing): numpy
for the ONNX adapter, torch for the PyTorch one, with its `sigmoid` and `tanh` passed in.
"""
from __future__ import annotations

import re

import numpy as np

# gates in the order PyTorch stacks their weights (LSTM: i, f, g, o; GRU: r, z, n), with their kinds
GATES: dict[str, tuple[tuple[str, str], ...]] = {
    "lstm": (("input_gate", "sigmoid"), ("forget_gate", "sigmoid"), ("cell_gate", "tanh"), ("output_gate", "sigmoid")),
    "gru": (("reset_gate", "sigmoid"), ("update_gate", "sigmoid"), ("new_gate", "tanh")),
    "rnn_tanh": (), "rnn_relu": (),
}
STATE_KIND = {"lstm": "tanh", "gru": "tanh", "rnn_tanh": "tanh", "rnn_relu": "relu"}
_NAME = re.compile(r"^(?:(?P<module>.*)\.)?(?P<layer>l\d+(?:_reverse)?)(?:\.(?P<part>[a-z]+_gate|h_n|c_n))?$")


def layer_name(layer: int, reverse: bool) -> str:
    return f"l{layer}" + ("_reverse" if reverse else "")


def parts(cell: str, layers: int, directions: int, projected: bool = False) -> list[tuple[str, str]]:
    """(name suffix, kind) of every reading of a recurrent module, in forward order: per layer and
    direction its gates, its hidden-state sequence (`l0`, `l0_reverse`; `linear` when an LSTM
    projects it), its final hidden state (`l0.h_n`) and an LSTM's final cell state (`l0.c_n`,
    unbounded: `other`)."""
    state = "linear" if projected else STATE_KIND[cell]
    out = []
    for layer in range(layers):
        for d in range(directions):
            base = layer_name(layer, d == 1)
            out += [(f"{base}.{gate}", kind) for gate, kind in GATES[cell]]
            out += [(base, state), (f"{base}.h_n", state)] + ([(f"{base}.c_n", "other")] if cell == "lstm" else [])
    return out


def layer_of(suffix: str) -> int:
    """The layer K of a reading's name suffix (`l1_reverse.forget_gate` → 1)."""
    return _index(_NAME.match(suffix)["layer"])


def _index(layer: str) -> int:
    return int(layer.removesuffix("_reverse")[1:])


def describe(name: str, names) -> tuple[str, str] | None:
    """(module, what) of a recurrent reading among a run's reading `names`: ("lstm", "forget gate
    of layer 0"), ("gru", "hidden state of layer 1 (reverse)"); None for any other reading. A
    recurrent layer is known by its final hidden state (`MODULE.lK.h_n`) among the names, not by
    its name alone: a plain layer may be called `l0`."""
    core, _, call = name.partition("#")
    m = _NAME.match(core)
    if m is None:
        return None
    base = f"{m['module']}.{m['layer']}" if m["module"] else m["layer"]
    if f"{base}.h_n" + (f"#{call}" if call else "") not in names:
        return None
    where = f"layer {_index(m['layer'])}" + (" (reverse)" if m["layer"].endswith("_reverse") else "") + \
        (f", call {call}" if call else "")
    part = m["part"]
    what = {None: "hidden state", "h_n": "final hidden state", "c_n": "final cell state"}.get(
        part, (part or "").replace("_", " "))
    return m["module"] or "", f"{what} of {where}"


def previous(valid: np.ndarray, reverse: bool) -> np.ndarray:
    """For each row (valid[t, b], time-major), the row holding the hidden state it reads: step
    t − 1 of the same sequence (t + 1 in reverse), or `rows + b` where that is the initial state
    (the caller appends the initial states after the rows)."""
    steps, batch = valid.shape
    row = np.full((steps, batch), -1, np.int64)
    row[valid] = np.arange(int(valid.sum()))
    t, b = np.nonzero(valid)
    src = t + 1 if reverse else t - 1
    inside = (src >= 0) & (src < steps)
    feed = np.where(inside, row[np.clip(src, 0, steps - 1), b], -1)
    return np.where(feed >= 0, feed, len(t) + b)


def gates(cell: str, x, h_prev, w_ih, w_hh, b_ih, b_hh, sigmoid, tanh, reset_after: bool = True) -> list:
    """Every gate of every row: `x` the layer's input rows, `h_prev` the hidden state each row
    reads, weights stacked as PyTorch stacks them (biases may be None). A GRU's new gate applies
    the reset after its recurrent matmul (PyTorch; ONNX's linear_before_reset=1), or before."""
    n = len(GATES[cell])
    if not n:
        return []
    size = w_hh.shape[0] // n

    def block(a, k):
        return a[:, k * size:(k + 1) * size]
    if cell == "lstm":  # one pre-activation, summed in place
        pre = x @ w_ih.T
        pre += h_prev @ w_hh.T
        if b_ih is not None:
            pre += b_ih + b_hh
        return [sigmoid(block(pre, 0)), sigmoid(block(pre, 1)), tanh(block(pre, 2)), sigmoid(block(pre, 3))]
    gi = x @ w_ih.T if b_ih is None else x @ w_ih.T + b_ih
    gh = h_prev @ w_hh.T if b_hh is None else h_prev @ w_hh.T + b_hh
    r = sigmoid(block(gi, 0) + block(gh, 0))
    z = sigmoid(block(gi, 1) + block(gh, 1))
    if reset_after:  # n = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn))
        new = r * block(gh, 2)
    else:             # n = tanh(W_in x + b_in + W_hn (r ⊙ h) + b_hn)
        new = (r * h_prev) @ w_hh[2 * size:].T
        new = new if b_hh is None else new + b_hh[2 * size:]
    return [r, z, tanh(block(gi, 2) + new)]
