"""PyTorch adapter: `Monitor` records probe readings and gradient readings of a model.

Probe readings run the fixed probe batch in eval mode under `no_grad` (the model's modes are
restored afterwards) and read every selected module's output through forward hooks; gradient
readings read `.grad` of every parameter after `backward()`. CPU float32 outputs are reduced by
the core's fused kernel at the next hook, while still in cache (so a probe reading holds two
activations at most); other tensors by torch kernels on their device,
with results moved to the host once per reading. A `nn.ReLU` whose input is a recorded tensor gets
its reading from that tensor's pass. A tensor about to be overwritten by an in-place module
(`ReLU(inplace=True)`) is read first; one changed in place by other code (`out += identity`) is
detected by its version counter, and the chunk is run again with that layer read at once.
Functional activations (`F.relu` inside `nn.TransformerEncoderLayer`) are read as the input of
the module that consumes them (`linear2`), which in eval mode is exactly the activation's output.
"""
from __future__ import annotations

import fnmatch
import json
import os
import warnings
from dataclasses import fields, is_dataclass

import numpy as np
import torch
from torch import nn

import actrace
from actrace.fingerprint import fingerprint

from ._torch_reduce import Pending, all_reduce, derive_relu, reduce_tensor, settle, to_readings

ACTIVATION_KINDS: list[tuple[type, str]] = [
    (nn.ReLU6, "relu6"), (nn.ReLU, "relu"), (nn.LeakyReLU, "leaky_relu"), (nn.PReLU, "prelu"),
    (nn.ELU, "elu"), (nn.CELU, "elu"), (nn.SELU, "selu"), (nn.GELU, "gelu"), (nn.SiLU, "silu"),
    (nn.Mish, "mish"), (nn.Softplus, "softplus"), (nn.Hardswish, "hard_swish"), (nn.Hardtanh, "hard_tanh"),
    (nn.Tanh, "tanh"), (nn.Softsign, "softsign"), (nn.Sigmoid, "sigmoid"), (nn.Hardsigmoid, "hard_sigmoid"),
    (nn.Softmax, "softmax"),
]
PARAM_KINDS: list[tuple[tuple[type, ...], str]] = [
    ((nn.Linear, nn.Bilinear), "linear"),
    ((nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d), "conv"),
    ((nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm), "norm"),
    ((nn.Embedding, nn.EmbeddingBag), "embedding"),
    ((nn.MultiheadAttention,), "attention"),
]
CHANNELS_FIRST = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
                  nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.modules.pooling._MaxPoolNd,
                  nn.modules.pooling._AvgPoolNd)
FUNCTIONAL = {"relu": "relu", "gelu": "gelu"}


def layer_kind(module: nn.Module) -> str | None:
    """The spec's kind for a module, or None when it is neither an activation nor parameterized."""
    for cls, kind in ACTIVATION_KINDS:
        if isinstance(module, cls):
            return kind
    for classes, kind in PARAM_KINDS:
        if isinstance(module, classes):
            return kind
    return "other" if any(True for _ in module.parameters(recurse=False)) else None


def _bounds(module: nn.Module, kind: str):
    if kind == "hard_tanh":
        return float(module.min_val), float(module.max_val)
    return None


def _tensors(output, prefix: str = ""):
    """(suffix, tensor) for every tensor in an output: a tensor, tuple, list, dict or dataclass."""
    if isinstance(output, torch.Tensor):
        yield prefix, output
    elif isinstance(output, (tuple, list)):
        for i, o in enumerate(output):
            yield from _tensors(o, f"{prefix}.{i}")
    elif isinstance(output, dict):
        for k, o in output.items():
            yield from _tensors(o, f"{prefix}.{k}")
    elif is_dataclass(output):
        for f in fields(output):
            yield from _tensors(getattr(output, f.name), f"{prefix}.{f.name}")


def _dist():
    d = torch.distributed
    if d.is_available() and d.is_initialized() and d.get_world_size() > 1:
        return d.get_rank(), d.get_world_size()
    return 0, 1


class Monitor:
    """Watch a model: probe readings every `probe_every` steps, gradient readings every `grad_every`,
    parameter readings (norm, update ratio) every `param_every` (default: with the probe).

    >>> monitor = Monitor(model, probe=x_probe, out="runs/a.parquet")   # doctest: +SKIP
    >>> ... loss.backward(); monitor.step(step); optimizer.step()
    """

    def __init__(self, model: nn.Module, probe, out=None, *, probe_every: int = 200, grad_every: int = 1,
                 param_every: int | None = None,
                 run: str | None = None, config: dict | None = None, include=None, exclude=None,
                 types: tuple[type, ...] | None = None, unit_axes: dict[str, int] | None = None,
                 probe_chunk: int | None = None, activation_grads: bool = False, histogram: bool = True,
                 overwrite: bool | None = None, flush_every: int = 512):
        out = out or os.environ.get("ACTRACE_OUT")
        if out is None:
            raise ValueError("Monitor needs out='runs/NAME.parquet' (or run the script under `actrace record -o ...`)")
        self.model = model
        self.inner = getattr(model, "module", model)  # DistributedDataParallel wraps the model
        self.probe = probe
        self.probe_every, self.grad_every = probe_every, grad_every
        self.param_every = param_every or probe_every
        self.probe_chunk, self.histogram = probe_chunk, histogram
        self.activation_grads = activation_grads
        self.unit_axes = unit_axes or {}
        self.rank, self.world = _dist()
        cfg = dict(config or {})
        cfg.update(json.loads(os.environ.get("ACTRACE_CONFIG", "{}")))
        probe_arrays = {k: v.detach().cpu().numpy() for k, v in self._probe_items()}
        n_probe = len(next(iter(probe_arrays.values())))
        self.fingerprint = fingerprint(probe_arrays if len(probe_arrays) > 1 else next(iter(probe_arrays.values())))
        self.writer = None
        if self.rank == 0:
            self.writer = actrace.Writer(
                out, run=run or os.environ.get("ACTRACE_RUN"), framework="torch", framework_version=torch.__version__,
                adapter="actrace.adapters.torch", config=cfg, probe_fingerprint=self.fingerprint,
                probe_size=n_probe, mode="eval", flush_every=flush_every,
                overwrite=overwrite if overwrite is not None else os.environ.get("ACTRACE_OVERWRITE") == "1")
        self.layers = self._select(include, exclude, types)
        self.layer_index: dict[str, int] = {}
        self._pending: list[Pending] = []  # this chunk's readings
        self._open: list[Pending] = []     # the newest, settled at the next hook (a ReLU may derive from it)
        self._stale: list[Pending] = []
        self._eager: set[str] = set()  # layers whose output is changed in place after their hook
        self._derive: dict[nn.Module, Pending] = {}
        self._relus = {m for m, kind in self.layers.values() if kind == "relu"}
        self._relu_of: dict[str, str] = {}  # functional ReLU layer -> the layer whose relu it is
        self._calls: dict[str, int] = {}
        self._reading = False
        self._channels_first = False
        self._grad_pending: list[Pending] = []
        self._previous: dict[str, torch.Tensor] = {}
        self._warned: set[str] = set()
        self._steps_seen = 0
        self._handles = [m.register_forward_hook(self._hook(name, kind)) for name, (m, kind) in self.layers.items()
                         if kind != "functional"]
        self._handles += [m.register_forward_pre_hook(self._functional_hook(name, kind))
                          for name, (m, kind) in self._functional_layers().items()]
        self._handles += [m.register_forward_pre_hook(self._before) for m in self.inner.modules()
                          if m in self._relus or getattr(m, "inplace", False) is True]
        self.closed = False

    # -- selection -------------------------------------------------------------------------
    def _select(self, include, exclude, types) -> dict[str, tuple[nn.Module, str]]:
        chosen = {}
        for name, module in self.inner.named_modules():
            if not name:
                continue
            kind = layer_kind(module)
            if kind is None or (types and not isinstance(module, types)):
                continue
            if include and not any(fnmatch.fnmatch(name, p) for p in _patterns(include)):
                continue
            if exclude and any(fnmatch.fnmatch(name, p) for p in _patterns(exclude)):
                continue
            chosen[name] = (module, kind)
        return chosen

    def _functional_layers(self) -> dict[str, tuple[nn.Module, str]]:
        """Activations applied as functions inside transformer layers, read at `linear2`'s input.
        Where the layer's feed-forward block is PyTorch's own and the activation is `F.relu`, that
        input is relu(linear1's output) by construction (dropout is off in eval mode): noted in
        `_relu_of`, so the reading can come from linear1's pass."""
        out = {}
        for name, module in self.inner.named_modules():
            act = getattr(module, "activation", None)
            for cls in (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer):
                if isinstance(module, cls) and not isinstance(act, nn.Module):
                    kind = FUNCTIONAL.get(getattr(act, "__name__", ""), "other")
                    out[f"{name}.activation"] = (module.linear2, kind)
                    if act is nn.functional.relu and type(module)._ff_block is cls._ff_block:
                        self._relu_of[f"{name}.activation"] = f"{name}.linear1"
        return out

    # -- hooks -----------------------------------------------------------------------------
    def _unit_axis(self, name: str, module: nn.Module, t: torch.Tensor) -> int | None:
        for pattern, axis in self.unit_axes.items():
            if fnmatch.fnmatch(name, pattern):
                return axis
        if t.ndim <= 1:
            return None if t.ndim == 0 else 0
        if t.ndim >= 4 or (t.ndim == 3 and (isinstance(module, CHANNELS_FIRST) or self._channels_first)):
            return 1
        return t.ndim - 1

    def _record_output(self, name: str, module: nn.Module, kind: str, output) -> None:
        for suffix, t in _tensors(output):
            if not t.is_floating_point():
                if name not in self._warned:
                    self._warned.add(name)
                    warnings.warn(f"actrace: skipping non-float output {name}{suffix} ({t.dtype})", stacklevel=3)
                continue
            calls = self._calls[name + suffix] = self._calls.get(name + suffix, 0) + 1
            layer = f"{name}{suffix}" + (f"#{calls}" if calls > 1 else "")
            self.layer_index.setdefault(layer, len(self.layer_index))
            axis = self._unit_axis(name, module, t)
            if self._reading:
                p = reduce_tensor(t, axis, kind, layer=layer, bounds=_bounds(module, kind), histogram=self.histogram)
                src = self._derive.pop(module, None)
                if src is not None and src.shape == p.shape and src.unit_axis == p.unit_axis:
                    p.derived_from = src
                self._pending.append(p)
                self._settle(self._open)  # the reading before, its tensor still in cache
                self._open = [p]
                if layer in self._eager or p.version is None:
                    self._settle(self._open)
            elif self.activation_grads and t.requires_grad and self._steps_seen % self.grad_every == 0:
                t.register_hook(self._grad_hook(layer, kind, axis, _bounds(module, kind)))

    def _hook(self, name: str, kind: str):
        def hook(module, inputs, output):
            if isinstance(module, CHANNELS_FIRST):
                self._channels_first = True
            elif isinstance(module, (nn.Linear, nn.MultiheadAttention, nn.Embedding)):
                self._channels_first = False
            if self._reading or self.activation_grads:
                self._record_output(name, module, kind, output)
        return hook

    def _before(self, module, inputs):
        """Before a recorded ReLU or an in-place module runs: let the pass over a recorded input give
        the ReLU's reading too, and read any recorded tensor the module is about to overwrite."""
        if not self._reading or not inputs or not isinstance(inputs[0], torch.Tensor):
            return
        x = inputs[0]
        if module in self._relus:
            self._derive[module] = next((p for p in self._open if derive_relu(p, x)), None)
        if getattr(module, "inplace", False) is True:
            self._settle([p for p in self._open if p.holds(x)])

    def _settle(self, pending: list[Pending]) -> None:
        self._stale += settle(pending)

    def _functional_hook(self, name: str, kind: str):
        def hook(module, inputs):
            source = self._relu_of.get(name)
            if self._reading and source:
                self._derive[module] = next((p for p in self._open if p.layer.split("#")[0] == source
                                             and derive_relu(p, inputs[0], exact=False)), None)
            if self._reading or self.activation_grads:
                self._record_output(name, module, kind, inputs[0])
        return hook

    def _grad_hook(self, layer, kind, axis, bounds):
        def hook(grad):  # read at once: the backward may reuse the gradient's memory
            p = reduce_tensor(grad, axis, kind, layer=layer, stream="activation_grad", bounds=bounds,
                              histogram=self.histogram)
            settle([p])
            self._grad_pending.append(p)
        return hook

    # -- readings --------------------------------------------------------------------------
    def _probe_items(self):
        if isinstance(self.probe, torch.Tensor):
            return [("", self.probe)]
        if isinstance(self.probe, dict):
            return list(self.probe.items())
        return [(str(i), p) for i, p in enumerate(self.probe)]

    def _chunks(self):
        items = self._probe_items()
        n = len(items[0][1])
        idx = np.array_split(np.arange(n), self.world)[self.rank]
        size = self.probe_chunk or max(len(idx), 1)
        for start in range(0, len(idx), size):
            sel = idx[start: start + size]
            lo, hi = int(sel[0]), int(sel[-1]) + 1
            yield {k: v[lo:hi] for k, v in items}

    def _call(self, chunk: dict):
        if isinstance(self.probe, torch.Tensor):
            return self.model(chunk[""])
        if isinstance(self.probe, dict):
            return self.model(**chunk)
        return self.model(*chunk.values())

    def probe_reading(self, step: int) -> int:
        """Run the probe (eval mode, no_grad, chunked) and record every selected layer's output."""
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        merged: dict[str, Pending] = {}
        try:
            with torch.no_grad():
                for chunk in self._chunks():
                    self._forward(chunk)
                    if self._stale:  # changed in place after their hook: read those layers at once
                        self._eager.update(p.layer for p in self._stale)
                        self._forward(chunk)
                    for p in self._pending:
                        if p.layer in merged:
                            merged[p.layer].merge(p)
                        else:
                            merged[p.layer] = p
        finally:
            self._reading = False
            for m, training in modes:
                m.training = training
        pending = list(merged.values())
        if self.world > 1:
            all_reduce(pending)
        return self._write(step, to_readings(pending))

    def _forward(self, chunk: dict) -> None:
        self._reading, self._calls, self._pending, self._open, self._stale, self._derive = True, {}, [], [], [], {}
        self._call(chunk)
        self._settle(self._open)
        if self._stale and self._eager.issuperset(p.layer for p in self._stale):
            raise RuntimeError(f"actrace: {self._stale[0].layer!r} was changed in place before it could be read")

    def _parameters(self):
        for name, (module, kind) in self.layers.items():
            for pname, p in module.named_parameters(recurse=False):
                yield name, kind, pname, p, (0 if p.ndim else None)

    def gradient_reading(self, step: int) -> int:
        """Record every parameter's gradient (layer-level: norm, extremes, zeros, NaN/Inf), and the
        activation gradients captured in the last backward when `activation_grads` is on."""
        pending = [reduce_tensor(p.grad, axis, kind, layer=name, stream="param_grad", param=pname,
                                 per_unit=False, histogram=False)
                   for name, kind, pname, p, axis in self._parameters() if p.grad is not None]
        pending, self._grad_pending = pending + self._grad_pending, []
        return self._write(step, to_readings(pending), mode="train")

    def parameter_reading(self, step: int) -> int:
        """Record every parameter tensor and its update norm ‖w − w_prev‖ since the last parameter reading."""
        pending = []
        for name, kind, pname, p, axis in self._parameters():
            value = reduce_tensor(p, axis, kind, layer=name, stream="param", param=pname, per_unit=False,
                                  histogram=False)
            prev = self._previous.get((name, pname))
            if prev is None:
                self._previous[(name, pname)] = p.detach().clone()
            else:
                value.stats["update_norm"] = torch.linalg.vector_norm(p.detach() - prev, dtype=torch.float64)
                prev.copy_(p.detach())
            pending.append(value)
        return self._write(step, to_readings(pending), mode="train")

    def _write(self, step: int, readings, mode: str | None = None) -> int:
        if self.writer is None:
            return 0
        for r in readings:
            base = r.layer.split("#")[0]
            index = self.layer_index.get(r.layer, self.layer_index.get(base))
            if index is None:
                index = self.layer_index.setdefault(r.layer, len(self.layer_index))
            self.writer.record(step, r, mode=mode, layer_index=index)
        return len(readings)

    def step(self, step: int) -> None:
        """Call once per training step after `backward()` (before `optimizer.step()`): gradient,
        parameter and probe readings when due."""
        if step % self.probe_every == 0:
            self.probe_reading(step)
        if step % self.grad_every == 0:
            self.gradient_reading(step)
        if step % self.param_every == 0:
            self.parameter_reading(step)
        self._steps_seen += 1

    def close(self):
        """Remove the hooks and write the trace (compacting its part files)."""
        if self.closed:
            return None
        self.closed = True
        for h in self._handles:
            h.remove()
        return self.writer.close() if self.writer is not None else None

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _patterns(p) -> list[str]:
    return [p] if isinstance(p, str) else list(p)

