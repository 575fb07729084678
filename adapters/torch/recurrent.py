"""`nn.RNN`, `nn.LSTM` and `nn.GRU` read as what they compute (actrace.format.recurrent; spec §Recurrent
layers): per layer and direction the hidden-state sequence, every gate of every step and the
final states, from one call's input, initial state and output.

The fused op returns only its top layer's sequence; a lower layer's comes from running that one
layer again (the same fused kernel, on its own weights). Inputs may be batched, unbatched,
batch-first or packed; rows are the packed sequence's, so padding is never read.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import _VF, nn
from torch.nn.utils.rnn import PackedSequence

from actrace.format import recurrent

RECURRENT = (nn.RNN, nn.LSTM, nn.GRU)
_CELL = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu"}
_RUN = {"lstm": _VF.lstm, "gru": _VF.gru, "rnn_tanh": _VF.rnn_tanh, "rnn_relu": _VF.rnn_relu}


def parts(module: nn.Module) -> list[tuple[str, str]]:
    """(name suffix, kind) of the module's readings, in forward order."""
    return recurrent.parts(_CELL[module.mode], module.num_layers, 1 + module.bidirectional,
                           getattr(module, "proj_size", 0) > 0)


def param(path: str, module: nn.Module, name: str) -> tuple[str, str]:
    """(reading name, parameter name) of a parameter, a recurrent module's by layer and direction
    (`weight_hh_l1_reverse` of `lstm`: `lstm.l1_reverse`, `weight_hh`), so its gradients sit beside
    that layer's readings; any other module's as they are."""
    if type(module) not in RECURRENT or "_l" not in name:
        return path, name
    pname, layer = name.rsplit("_l", 1)
    return (f"{path}.l{layer}" if path else f"l{layer}"), pname


def readings(module: nn.Module, args: tuple, kwargs: dict, output, wanted: set[str]) -> dict[str, torch.Tensor]:
    """The tensors of the `wanted` name suffixes (`parts`) of one call `module(*args, **kwargs)`."""
    cell, layers, dirs = _CELL[module.mode], module.num_layers, 1 + module.bidirectional
    x = args[0] if args else kwargs["input"]
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    out, final = output
    h_n, c_n = final if cell == "lstm" else (final, None)
    if isinstance(x, PackedSequence):
        rows, sizes, top, order, grid = x.data, x.batch_sizes, out.data, x.sorted_indices, None
        valid = torch.arange(int(sizes[0]))[None, :] < sizes[:, None]
    else:
        rows, top = _time_major(module, x), _time_major(module, out)
        grid, sizes, order = rows.shape[:2], None, None
        valid = torch.ones(grid, dtype=torch.bool)
        rows, top = rows.reshape(-1, rows.shape[-1]), top.reshape(-1, top.shape[-1])
    h0, c0 = _initial(module, hx, h_n, c_n, order)
    feeds = [_to(rows.device, recurrent.previous(valid.numpy(), d == 1)) for d in range(dirs)]
    weights = len(module._flat_weights) // (layers * dirs)
    deepest = max(recurrent.layer_of(n) for n in wanted)
    found: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        first = layer * dirs
        if layer == layers - 1:
            seq = top
        elif layer < deepest:
            state = (h0[first:first + dirs], c0[first:first + dirs]) if cell == "lstm" else h0[first:first + dirs]
            own = module._flat_weights[first * weights:(first + dirs) * weights]
            if grid is None:  # packed
                seq = _RUN[cell](rows, sizes, state, own, module.bias, 1, 0.0, False, module.bidirectional)[0]
            else:  # the padded kernel, faster: [time, batch, features]
                seq = _RUN[cell](rows.view(*grid, -1), state, own, module.bias, 1, 0.0, False, module.bidirectional,
                                 False)[0].view(len(rows), -1)
        else:
            seq = None  # nothing above this layer is wanted: its sequence is not needed
        for d in range(dirs):
            base = recurrent.layer_name(layer, d == 1)
            size = h_n.shape[-1]
            hidden = seq[:, d * size:(d + 1) * size] if seq is not None else None
            names = [f"{base}.{g}" for g, _ in recurrent.GATES[cell]]
            if hidden is not None and any(n in wanted for n in names):
                suffix = f"_l{layer}" + ("_reverse" if d else "")
                w = [getattr(module, f"{p}{suffix}", None) for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
                h_prev = torch.cat([hidden, h0[first + d]])[feeds[d]]
                found.update(zip(names, recurrent.gates(cell, rows, h_prev, *w, torch.sigmoid, torch.tanh)))
            found.update({base: hidden, f"{base}.h_n": h_n[first + d]})
            if c_n is not None:
                found[f"{base}.c_n"] = c_n[first + d]
        rows = seq
    return {n: found[n] if n.endswith(("h_n", "c_n")) else _shaped(found[n], grid)
            for n in wanted if found.get(n) is not None}


def _time_major(module: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """A padded input or output as [time, batch, features]."""
    if t.dim() == 2:
        return t.unsqueeze(1)
    return t.transpose(0, 1) if module.batch_first else t


def _initial(module: nn.Module, hx, h_n: torch.Tensor, c_n, order):
    """The initial hidden (and cell) state as [layers·directions, batch, size], in the rows' order
    (a packed batch is sorted by length)."""
    if hx is None:
        h0, c0 = torch.zeros_like(h_n), (torch.zeros_like(c_n) if c_n is not None else None)
    else:
        h0, c0 = hx if isinstance(hx, tuple) else (hx, None)
    if h0.dim() == 2:
        h0, c0 = h0.unsqueeze(1), (c0.unsqueeze(1) if c0 is not None else None)
    if order is not None:
        h0, c0 = h0.index_select(1, order), (c0.index_select(1, order) if c0 is not None else None)
    return h0, c0


def _shaped(t: torch.Tensor, grid) -> torch.Tensor:
    """A per-row reading as [batch, time, units] where the input was padded (all rows valid): batch
    first, as the probe's chunks are cut."""
    return t if grid is None else t.reshape(*grid, t.shape[-1]).transpose(0, 1)


def _to(device: torch.device, a: np.ndarray) -> torch.Tensor:
    """An index array on `device`: to a GPU from pinned memory, so that the host need not wait."""
    t = torch.from_numpy(a)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
