"""JAX / Flax adapter: `Monitor` records probe readings of a Flax model (linen or nnx) and gradient
readings of the grads pytree, in a training loop the user writes.

    monitor = Monitor(model, probe=x[:256], out="runs/flax.parquet")          # linen: params each step
    for step in range(steps):
        params, grads = train_step(params, batch)
        monitor.step(step, params=params, grads=grads)
    monitor.close()

A probe reading runs the probe through a `trace.ProbeTrace`, traced once: every module of a
known kind is read at its output (`Dense` → `linear`, `Conv` → `conv`, norms, `Embed`, attention)
and every activation at its output (`nn.relu`, `jax.nn.gelu`, `jnp.tanh`, ..., however it was
called), with units on the last axis. Evaluation behaviour: an nnx model is read through a copy
in `.eval()`; a linen model is applied with `apply_kwargs` (`{"train": False}`, as the model
takes it). Gradient readings are layer-level, one per leaf of `grads`, named by module path and
parameter (`fc1`, `kernel`). Steps are the user's. Reductions are the core's.
"""
from __future__ import annotations

import warnings

import flax
import jax
import numpy as np

from actrace.format.fingerprint import fingerprint
from actrace.record import Recorder
from actrace.reduce import reduce_arrays

from .trace import ProbeTrace, linen_calls, nnx_calls

__all__ = ["Monitor"]


def _is_nnx(model) -> bool:
    from flax import nnx
    return isinstance(model, nnx.Module)


def _key(k) -> str:
    """One step of a pytree path as a name: a dict key, an attribute, an index."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def leaf_names(path) -> tuple[str, str]:
    """(layer, param) of a parameter's pytree path: `params/fc1/kernel` (linen) and
    `fc1/kernel/value` (an nnx state) are both layer `fc1`, param `kernel`."""
    parts = [_key(k) for k in path]
    parts = parts[1:] if parts[:1] == ["params"] else parts
    parts = parts[:-1] if len(parts) > 1 and parts[-1] in ("value", "raw_value") else parts
    return ".".join(parts[:-1]) or parts[-1], parts[-1]


class Monitor(Recorder):
    """Watch a Flax model: probe readings every `probe_every` steps, gradient readings every
    `grad_every` steps that pass `grads`. `include`/`exclude` are glob patterns on reading names;
    `apply_kwargs` go to a linen model's `apply` (what makes it deterministic: `train=False`)."""

    def __init__(self, model, probe, out=None, *, probe_every: int = 200, grad_every: int = 1,
                 run: str | None = None, config: dict | None = None, include=None, exclude=None,
                 apply_kwargs: dict | None = None, histogram: bool = True, overwrite: bool | None = None,
                 flush_every: int = 4096):
        self.model, self.nnx = model, _is_nnx(model)
        self.probe = tuple(probe) if isinstance(probe, (list, tuple)) else (probe,)
        self.histogram, self.apply_kwargs = histogram, dict(apply_kwargs or {})
        arrays = {f"probe{i}": np.asarray(x) for i, x in enumerate(self.probe)}
        super().__init__(
            out, framework="jax", framework_version=f"jax {jax.__version__}, flax {flax.__version__}",
            adapter="actrace.adapters.flax", mode="eval", probe_size=len(self.probe[0]),
            probe_fingerprint=fingerprint(arrays, {k: str(a.dtype) for k, a in arrays.items() if a.dtype.kind == "V"}),
            probe_every=probe_every, grad_every=grad_every, run=run, config=config, include=include, exclude=exclude,
            overwrite=overwrite, flush_every=flush_every)
        self.trace: ProbeTrace | None = None
        self.params = None
        self._plans: dict = {}  # a gradient tree's leaves to read (`_plan`), by structure, dtypes, trace, selection

    def _state(self, params):
        """The forward's first argument: a linen model's variables, an nnx model's state."""
        if self.nnx:
            from flax import nnx
            return nnx.state(self.model) if params is None else params
        if params is None:
            raise ValueError("actrace: a linen model's probe reading needs its parameters: "
                             "monitor.step(step, params=params)")
        return params if "params" in params else {"params": params}

    def _forward(self, calls, state, *probe):
        """The model's probe forward with `state`, its module calls made through `calls`."""
        if self.nnx:
            from flax import nnx
            model = nnx.merge(nnx.graphdef(self.model), state)
            model.eval()
            with nnx_calls(model, calls):
                return model(*probe)
        with linen_calls(calls):
            return self.model.apply(state, *probe, **self.apply_kwargs)

    def probe_reading(self, step: int, params=None) -> int:
        """Record every read tensor of the model on the probe, with `params` (linen) or its state (nnx)."""
        state = self._state(params if params is not None else self.params)
        if self.trace is None:
            self.trace = self._trace(state)
        values = self.trace(state, *self.probe)
        jobs = []
        for read, value in zip(self.trace.reads, values):
            x = np.asarray(value)  # bfloat16 stays so: the core widens it and keeps its dtype's name
            x = x.reshape(*x.shape[:-read.feature_axes], -1) if read.feature_axes > 1 else x
            axis = None if read.unit_axis is None or x.ndim < 2 else read.unit_axis % x.ndim
            jobs.append((x, axis, read.kind, dict(layer=read.name, histogram=self.histogram)))
        self.last_probe = step
        return self.write(step, reduce_arrays(jobs))

    def _trace(self, state) -> ProbeTrace:
        try:
            trace = ProbeTrace(self._forward, (state, *self.probe), self.wanted)
        except Exception as exc:
            hint = "" if self.nnx else (" (give params= every collection it reads, batch_stats too, as "
                                        "{'params': ..., 'batch_stats': ...}, and apply_kwargs= what puts it in "
                                        "evaluation behaviour, e.g. {'train': False})")
            raise RuntimeError(f"actrace: {type(self.model).__name__} does not run on the probe{hint}: {exc}") from exc
        if trace.unread or trace.dropped:
            warnings.warn(f"actrace: {type(self.model).__name__}: {trace.unread} activation(s) and the outputs of "
                          f"{len(trace.dropped)} module(s) {trace.dropped[:5]} sit inside a nested computation "
                          "(nn.scan, nn.remat, a jit inside the model) and are not read", stacklevel=4)
        for r in trace.reads:
            self.order(r.name)
        return trace

    def gradient_reading(self, step: int, grads) -> int:
        """Record each leaf of `grads` (layer-level: norm, extremes, zeros, NaN/Inf) as its module's
        `param_grad`, of that module's kind where the probe trace knows it."""
        if self.trace is None and (self.nnx or self.params is not None):
            self.trace = self._trace(self._state(self.params))  # the kinds of the layers, and their order
        leaves, tree = jax.tree_util.tree_flatten(grads)
        key = (tree, tuple(g.dtype for g in leaves), self.trace, self.include, self.exclude)
        if key not in self._plans:
            if len(self._plans) >= 64:  # a loop's trees are few; one whose tree changes each step keeps none long
                self._plans.clear()
            self._plans[key] = self._plan(grads)
        return self.write_gradients(step, [(leaves[i], *names) for i, *names in self._plans[key]])

    def _plan(self, grads) -> list[tuple]:
        """(leaf index, layer, param, kind) of each leaf of `grads` that is read (floating, selected):
        decided once per tree structure, dtypes, trace and selection, as each step's gradients repeat them."""
        kinds = self.trace.kinds if self.trace is not None else {}
        plan = []
        for i, (path, g) in enumerate(jax.tree_util.tree_flatten_with_path(grads)[0]):
            layer, param = leaf_names(path)
            if jax.numpy.issubdtype(g.dtype, jax.numpy.floating) and self.wanted(layer):
                plan.append((i, layer, param, kinds.get(layer, "other")))
        return plan

    def step(self, step: int, *, params=None, grads=None) -> None:
        """Call once per training step: a gradient reading of `grads` and a probe reading with
        `params` (a linen model's params or variables; an nnx model reads its own state) when due."""
        if params is not None:
            self.params = params
        if self.probe_due(step):
            self.safely("probe", self.probe_reading, step)
        if grads is not None and self.grads_due(step):
            self.safely("gradient", self.gradient_reading, step, grads)
        self.last_step = step
