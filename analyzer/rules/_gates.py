"""Recurrent gates as the rules say them: which gate a reading is, what pinned means for it, its advice."""
from __future__ import annotations

from actrace.format.schema import KIND_BOUNDS, sat_margin

# a recurrent gate at its bounds: what its own knobs are
GATE_ADVICE = ("a gate pinned for every input does the same at every step: check this gate's bias "
               "initialization (LSTMs usually start the forget gate's at 1, the others at 0) and the scale of "
               "the layer's input")
# what a sigmoid gate pinned near 1, or near 0, does to its layer (PyTorch's and ONNX's formulas)
GATE_SIDES = {
    "forget gate": ("open (the cell never forgets)", "closed (the cell forgets every step)"),
    "input gate": ("open (every candidate is written)", "closed (nothing new is written to the cell)"),
    "output gate": ("open (the state shows the whole cell)", "closed (the hidden state stays near 0)"),
    "update gate": ("at 1 (the state is copied, never updated)", "at 0 (the state is overwritten every step)"),
    "reset gate": ("at 1 (the past state always counts)", "at 0 (the past state is ignored)"),
}


def gate(what: tuple[str, str] | None) -> str | None:
    """The gate a recurrent reading (`describe`) is ("forget gate"), or None."""
    name = what[1].split(" of ")[0] if what else ""
    return name if name.endswith("gate") else None


def advice(what) -> str | None:
    """A gate's own advice, or None (the rule's)."""
    return GATE_ADVICE if gate(what) else None


def pinned(what: tuple[str, str] | None, kind: str, mean: float, share: float, t: float) -> str:
    """The share of units pinned at a bound, said of a recurrent gate as what it does ("forget
    gate of layer 0 pinned open (the cell never forgets): 100% of units ≥ 0.99")."""
    name, bounds = gate(what), KIND_BOUNDS.get(kind)
    if name is None or bounds is None:
        return f"{share:.0%} of units pinned at a bound"
    lo, hi = bounds
    margin = float(sat_margin(lo, hi, t))
    if kind == "sigmoid":
        high = mean > (lo + hi) / 2
        side = GATE_SIDES.get(name, ("at 1", "at 0"))[0 if high else 1]
        return f"{what[1]} pinned {side}: {share:.0%} of units {'≥' if high else '≤'} " \
               f"{hi - margin if high else lo + margin:.4g}"
    return f"{what[1]} pinned: {share:.0%} of units within {margin:.4g} of ±{hi:g}"
