"""PyTorch adapter: `Monitor` records probe readings and gradient readings of a model.

Probe readings run the fixed probe batch in evaluation behaviour under `no_grad` (the model's
modes are restored afterwards) through a `ForwardTrace`, which reads every layer output and
every activation wherever it is computed (modules of any library, functional calls), with unit
axes followed from the ops that made each tensor. Gradient readings read `.grad` of every
parameter after `backward()`, unscaled under a loss scaler. Wrapped models (`torch.compile`,
DistributedDataParallel, FSDP) are read through their eager module, under its own names.
At construction the first probe chunk runs twice: it proves the model takes the probe, fixes
depth as forward order, and checks that evaluation behaviour is deterministic (else readings are
marked `train`, with a warning naming the first layer that differed).
"""
from __future__ import annotations

import fnmatch
import math
import warnings
from contextlib import contextmanager

import torch
from torch import nn

from actrace.record import Recorder, patterns
from actrace.reduce import fold
from actrace.reduce.torch import (Pending, all_reduce, layer_readings, local_copy, reduce_tensor, relu_of,
                                  to_readings, update_norms)

from .kinds import module_kind
from .probe import Probe
from .recurrent import param as recurrent_param
from .trace import ForwardTrace, Output, output_tensors, own_parameters, root_name, unwrap

__all__ = ["Monitor", "module_kind"]


def _dist():
    d = torch.distributed
    if d.is_available() and d.is_initialized() and d.get_world_size() > 1:
        return d.get_rank(), d.get_world_size()
    return 0, 1


def _tensor_parallel(model: nn.Module) -> bool:
    """Whether the model's layers are split across ranks that see the same batch (tensor parallel:
    DTensor parameters outside FSDP, or on a mesh of more than one dimension)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    fsdp = any(isinstance(m, FSDPModule) for m in model.modules())
    return bool(sharded) and (not fsdp or any(p.device_mesh.ndim > 1 for p in sharded))


def _device(model: nn.Module) -> torch.device | None:
    return next((t.device for t in (*model.parameters(), *model.buffers())), None)


class Monitor(Recorder):
    """Watch a model: probe readings every `probe_every` steps, gradient readings every `grad_every`,
    parameter readings (norm, update ratio) every `param_every` (default: with the probe).

    >>> monitor = Monitor(model, probe=x_probe, out="runs/a.parquet")   # doctest: +SKIP
    >>> ... loss.backward(); monitor.step(step); optimizer.step()

    `include`/`exclude` are glob patterns on reading names (`layers.*.mlp.act`); `types` keeps
    only modules of those classes; `unit_axes` maps name patterns to a unit axis, over what the
    trace finds (except a softmax's, which is the axis it normalizes); `scaler` is the
    `torch.amp.GradScaler` whose scale the gradients carry. `grad_every=None` reads no gradients
    (probe readings of checkpoints); otherwise a run that closes without any gradient reading says
    so, and its trace's status is `incomplete`.
    """

    no_gradient_hint = "step() found no gradient: call it after loss.backward() and before optimizer.zero_grad()"

    def __init__(self, model: nn.Module, probe, out=None, *, probe_every: int = 200, grad_every: int = 1,
                 param_every: int | None = None,
                 run: str | None = None, config: dict | None = None, include=None, exclude=None,
                 types: tuple[type, ...] | None = None, unit_axes: dict[str, int] | None = None,
                 probe_chunk: int | None = None, activation_grads: bool = False, histogram: bool = True,
                 overwrite: bool | None = None, flush_every: int = 4096, scaler=None):
        self.model, self.inner = model, unwrap(model)
        self.param_every = param_every or probe_every
        self.probe_chunk, self.histogram, self.scaler = probe_chunk, histogram, scaler
        self.include, self.exclude, self.types = patterns(include), patterns(exclude), types
        self.unit_axes = unit_axes or {}
        self.rank, self.world = _dist()
        self._probe = Probe(probe, _device(self.inner))
        self._trace = ForwardTrace(self.inner, self._read, self._wanted)
        self._outputs: list[tuple[Output, Pending]] = []
        self._warned: set[str] = set()
        self.layers = {name: (m, k) for m, path in self._trace.paths.items()  # parameterized modules
                       if (k := self._trace.kinds[m]) and (name := path or root_name(k))
                       and any(True for _ in own_parameters(m)) and self._wanted(name, m)}
        self.layer_index: dict[str, int] = {}
        self._params = None
        self.split = _tensor_parallel(self.inner)
        if self.split and self.rank == 0:
            warnings.warn("actrace: a tensor-parallel model: each rank holds a slice of its layers' units, which "
                          "this version does not read as one; probe readings are skipped, gradient and parameter "
                          "readings are read whole", stacklevel=2)
        mode = "eval" if self.split else self._trial()
        order = list(self.layer_index) + list(self.layers)
        trainable = grad_every and any(p.requires_grad for p in self.inner.parameters())
        self._parameters()
        super().__init__(out, framework="torch", framework_version=torch.__version__, adapter="actrace.adapters.torch",
                         probe_fingerprint=self._probe.fingerprint, probe_size=self._probe.size, mode=mode,
                         probe_every=probe_every, grad_every=grad_every, run=run, config=config, include=include,
                         exclude=exclude, overwrite=overwrite, flush_every=flush_every,
                         expect=("param_grad",) if trainable else (), aliases=self.aliases, writes=self.rank == 0)
        self.mode = mode
        for name in order:
            self.order(name)
        self._previous: dict[tuple[str, str], torch.Tensor] = {}
        self._grad_outputs: list[Pending] = []
        self._steps_seen = 0
        self._fresh_grads, self._warned_stale, self._alarmed = False, False, False
        self._handles, self._grad_tracing, self._no_grad_blocks = [], False, set()
        if activation_grads:
            self._grad_trace = ForwardTrace(self.inner, self._hook_grad, self._wanted)
            self._handles = [self.inner.register_forward_pre_hook(self._start_grad_trace),
                             self.inner.register_forward_hook(self._stop_grad_trace, always_call=True)]
        self._handles += [p.register_post_accumulate_grad_hook(self._grad_arrived)
                          for *_, p in self._parameters() if p.requires_grad]

    @property
    def probe(self):
        return self._probe.value

    @probe.setter
    def probe(self, value) -> None:
        self._probe.value = value  # fingerprinted again at the next reading

    # -- selection and the traced forward --------------------------------------------------
    def _wanted(self, name: str, module: nn.Module | None) -> bool:
        return not (self.types and not isinstance(module, self.types)) and self.wanted(name)

    def _axis(self, out: Output) -> int | None:
        if out.kind == "softmax" and out.axis is not None:
            return out.axis  # the axis it normalizes, which its saturation counts across (spec §Units)
        for pattern, axis in self.unit_axes.items():
            if fnmatch.fnmatch(out.name, pattern):
                return axis
        return out.axis

    def _floating(self, out: Output) -> bool:
        if type(out.tensor) not in (torch.Tensor, nn.Parameter) and not out.tensor.is_nested:
            if out.name not in self._warned:  # a tensor subclass (a DTensor): its values are not all here
                self._warned.add(out.name)
                warnings.warn(f"actrace: skipping {out.name}: a {type(out.tensor).__name__} is not read", stacklevel=4)
            return False
        if out.tensor.is_floating_point():
            return True
        if out.name not in self._warned:
            self._warned.add(out.name)
            warnings.warn(f"actrace: skipping non-float output {out.name} ({out.tensor.dtype})", stacklevel=4)
        return False

    def _read(self, out: Output) -> None:
        if self._floating(out):
            source = out.relu_of.reading if out.relu_of is not None else None
            if isinstance(source, Pending) and source.relu is not None and self._axis(out) == self._axis(out.relu_of):
                out.reading = relu_of(source, out.name)
            else:
                out.reading = reduce_tensor(out.tensor, self._axis(out), out.kind, layer=out.name, bounds=out.bounds,
                                            histogram=self.histogram, relu_too=out.feeds_relu)
            self._outputs.append((out, out.reading))
        out.tensor = None  # read: the activation is not held

    @contextmanager
    def _evaluation(self):
        """Eval mode and no_grad for a probe forward; the modules' own modes restored afterwards."""
        modes = [(m, m.training) for m in self.inner.modules()]
        self.inner.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            for m, training in modes:
                m.training = training

    def _trial(self) -> str:
        """Run the first probe chunk twice: depth is forward order; 'train' if the two differ."""
        passes, seen = [], []

        def note(o: Output) -> None:
            seen.append((o, _signature(o.tensor)))
            o.tensor = o.tensor.ndim  # the ndim is all the check below needs: activations are not held
        trace = ForwardTrace(self.inner, note, self._wanted)
        for _ in range(2):
            seen.clear()
            try:
                with self._evaluation(), trace:
                    result = Probe.call(self.inner, self._probe.first_chunk(self.probe_chunk))
            except Exception as e:  # the model's own error, whatever it is
                first = (str(e).strip().splitlines() or [""])[0]
                hint = "; a dict probe is passed as keyword arguments: give (probe,) to pass it as one argument" \
                    if isinstance(self._probe.value, dict) and "keyword argument" in first else ""
                raise ValueError(f"actrace: the model cannot take the probe ({self._probe.describe()}): "
                                 f"{type(e).__name__}: {first}{hint}") from e
            passes.append([(o.name, s) for o, s in seen if o.name] +
                          [(f"output{k}", _signature(t)) for k, t in output_tensors(result)])
            if not self.layer_index:
                for o, _ in seen:
                    if o.name:
                        self.layer_index.setdefault(o.name, len(self.layer_index))
                if not self.layer_index and len(passes) == 1 and (self.include or self.exclude or self.types):
                    everything = ForwardTrace(self.inner, lambda o: names.append(o.name), lambda *_: True)
                    names: list[str] = []
                    with self._evaluation(), everything:
                        Probe.call(self.inner, self._probe.first_chunk(self.probe_chunk))
                    warnings.warn(f"actrace: no reading matches include={self.include} exclude={self.exclude} "
                                  f"types={self.types}, so nothing will be recorded; the model's readings are: "
                                  f"{', '.join(n for n in names if n)[:300]}", stacklevel=3)
                lost = [o.name for o, _ in seen if o.name and o.axis is None and o.tensor > 1
                        and not any(fnmatch.fnmatch(o.name, p) for p in self.unit_axes)]
                if lost:
                    warnings.warn(f"actrace: the unit axis of {len(lost)} reading(s) cannot be followed from the "
                                  f"ops that made them, so each is read as one unit (give unit_axes= to say "
                                  f"which axis): {', '.join(lost[:8])}{' ...' if len(lost) > 8 else ''}", stacklevel=3)
        first, second = passes
        differ = next((a for a, b in zip(first, second) if not _same(a[1], b[1])), None)
        if differ is None and len(first) == len(second):
            return "eval"
        culprit = differ[0] if differ else "the set of layers"
        kinds = sorted({type(m).__name__ for m in self.inner.modules()
                        if "dropout" in type(m).__name__.lower() or "noise" in type(m).__name__.lower()})
        warnings.warn(f"actrace: two identical evaluation-mode passes over the probe differ, first at {culprit!r}: "
                      f"some module ignores eval() (a custom dropout or noise{': ' + ', '.join(kinds) if kinds else ''}),"
                      f" so readings measure its randomness; they are marked mode=train", stacklevel=3)
        return "train"

    def _start_grad_trace(self, module, inputs):
        if torch.is_grad_enabled() and self.grad_every and self._steps_seen % self.grad_every == 0:
            self._grad_tracing = True
            self._grad_trace.__enter__()

    def _stop_grad_trace(self, module, inputs, output):
        if self._grad_tracing:
            self._grad_tracing = False
            self._grad_trace.__exit__(None, None, None)
            if self._no_grad_blocks and "no_grad" not in self._warned:
                self._warned.add("no_grad")
                blocks = sorted({name.rsplit(".", 1)[0] for name in self._no_grad_blocks})
                warnings.warn(f"actrace: the activation gradients of {len(self._no_grad_blocks)} reading(s) in "
                              f"{', '.join(blocks[:6])}{' ...' if len(blocks) > 6 else ''} cannot be read: the forward "
                              "runs them without autograd (torch.utils.checkpoint with use_reentrant=True "
                              "recomputes them inside the backward); use_reentrant=False reads them", stacklevel=2)

    def _hook_grad(self, out: Output) -> None:
        if not torch.is_grad_enabled() and out.name:  # a block run under no_grad inside a training forward
            self._no_grad_blocks.add(out.name)
        elif out.tensor.requires_grad and self._floating(out):
            axis = self._axis(out)

            def hook(grad):  # read at once: the backward may reuse the gradient's memory
                if out.name:
                    self._grad_outputs.append(reduce_tensor(
                        self._unscaled(grad), axis, out.kind, layer=out.name, stream="activation_grad",
                        bounds=out.bounds, histogram=self.histogram))
            out.tensor.register_hook(hook)
        out.tensor = None

    # -- readings --------------------------------------------------------------------------
    def probe_reading(self, step: int) -> int:
        """Run the probe (eval mode, no_grad, chunked) and record every selected reading."""
        self.last_probe = step
        if self.split:
            return 0
        fingerprint = self._probe.check()
        merged: dict = {}
        with self._evaluation():
            for chunk in self._probe.chunks(self.rank, self.world, self.probe_chunk):
                self._outputs = []
                with self._trace:
                    Probe.call(self.inner, chunk)
                named = [p for out, p in self._outputs if out.name is not None]
                for out, p in self._outputs:
                    p.layer = out.name  # the name the trace settled on, once the chunk ran
                fold(merged, to_readings(named))  # one host transfer per chunk
                self._outputs = []
        readings = list(merged.values())
        if self.world > 1:
            all_reduce(readings, _device(self.inner))
        return self.write(step, readings, mode=self.mode, probe_fingerprint=fingerprint)

    def _parameters(self) -> list[tuple[str, str, str, nn.Parameter]]:
        """(layer, kind, parameter name, parameter) of every selected layer's own parameters, each
        once: a tied one under its first name, its other names in `aliases`."""
        if self._params is None:  # a recurrent module's by layer and direction: `lstm.l1` `weight_ih`
            self._params, self.aliases, first = [], {}, {}
            for name, (module, kind) in self.layers.items():
                for pname, p in own_parameters(module):
                    layer, own = recurrent_param(name, module, pname)
                    if p in first:
                        self.aliases[f"{layer}/{own}"] = first[p]
                    else:
                        first[p] = f"{layer}/{own}"
                        self._params.append((layer, kind, own, p))
        return self._params

    def _scale(self) -> float:
        """The factor gradients carry now: the scaler's scale, unless they were unscaled already."""
        if self.scaler is None or not self.scaler.is_enabled():
            return 1.0
        from torch.amp.grad_scaler import OptState

        states = getattr(self.scaler, "_per_optimizer_states", {}).values()
        return 1.0 if any(s.get("stage") is OptState.UNSCALED for s in states) else float(self.scaler.get_scale())

    def _unscaled(self, grad: torch.Tensor) -> torch.Tensor:
        scale = self._scale()
        return grad if scale == 1.0 else grad / scale

    def _grad_arrived(self, _param) -> None:
        self._fresh_grads = True

    def gradient_reading(self, step: int) -> int:
        """Record every parameter's gradient (layer-level: norm, extremes, zeros, NaN/Inf), and the
        activation gradients captured in the last backward when `activation_grads` is on. Under a
        loss scaler the gradients are read unscaled, and a step it will skip (a NaN or Inf) has
        mode `skipped`; without one, the first step with a NaN or Inf gradient also gets a probe reading."""
        if not self._fresh_grads and not self._warned_stale and any(True for _ in self._parameters()):
            warnings.warn(f"actrace: step {step}: no gradient arrived since the last gradient reading; call "
                          "mon.step(step) after loss.backward() and before optimizer.zero_grad()", stacklevel=3)
            self._warned_stale = True
        self._fresh_grads = False
        grads = [(p.grad, dict(layer=name, kind=kind, stream="param_grad", param=pname))
                 for name, kind, pname, p in self._parameters() if p.grad is not None]
        # activation gradients: one reading per layer however many backward passes (micro-batches) ran
        readings = layer_readings([g for g, _ in grads], [m for _, m in grads], self._scale()) \
            + list(fold({}, to_readings(self._grad_outputs)).values())
        self._grad_outputs = []
        scaled = self.scaler is not None and self.scaler.is_enabled()
        broken = any(r.nan_count or r.inf_count for r in readings)
        written = self.write(step, readings, mode="skipped" if scaled and broken else "train")
        if broken and not scaled and not self._alarmed and self.last_probe != step:
            # the first non-finite gradient: read the probe now, with the weights that made it, so the
            # forward layer where the NaN or Inf starts is seen, not only the backward's spread
            self._alarmed = True
            written += self.probe_reading(step)
        return written

    def parameter_reading(self, step: int) -> int:
        """Record every parameter tensor and its update norm ‖w − w_prev‖ since the last parameter reading."""
        params = self._parameters()
        readings = layer_readings([p.detach() for *_, p in params], [
            dict(layer=name, kind=kind, stream="param", param=pname) for name, kind, pname, _ in params])
        keys = [(name, pname) for name, _, pname, _ in params]
        for r, norm in zip(readings, update_norms([p for *_, p in params], [self._previous.get(k) for k in keys])):
            r.update_norm = norm
        self._previous = {k: local_copy(p) for k, (*_, p) in zip(keys, params)}
        return self.write(step, readings, mode="train")

    def step(self, step: int) -> None:
        """Call once per training step after `backward()` (before `optimizer.step()`, and before
        `scaler.update()` under a loss scaler): gradient, parameter and probe readings when due (a
        probe reading at the first step whatever `probe_every` says, and at the last on close)."""
        if self.probe_due(step):
            self.probe_reading(step)
        if self.grads_due(step):
            self.gradient_reading(step)
        if step % self.param_every == 0:
            self.parameter_reading(step)
        self._steps_seen += 1
        self.last_step = step

    def log(self, step: int, loss=None, lr=None, **scalars) -> None:
        """Record the training loop's values at `step` (`loss`, `lr`, any other name; tensors are
        read with `.item()`), so findings are read against the loss (spec §Streams, `scalar`)."""
        values = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in dict(scalars, loss=loss, lr=lr).items()}
        super().log(step, **values)

    def release(self) -> None:
        for h in self._handles:
            h.remove()


class TrainerCallbackBase:
    """What a trainer's callback holds until training starts (the probe, where to write, the
    Monitor's options), and the Monitor it then opens (`adapters/huggingface.py`, `lightning.py`)."""

    def __init__(self, probe, out=None, *, probe_every: int = 200, grad_every: int = 1, run: str | None = None,
                 **monitor_options):
        self.probe, self.out, self.run = probe, out, run
        self.options = dict(monitor_options, probe_every=probe_every, grad_every=grad_every)
        self.monitor: Monitor | None = None


def _signature(t: torch.Tensor) -> float:
    """A cheap summary of a tensor's values, to compare two passes."""
    if t.is_nested:
        t = torch.cat([c.reshape(-1) for c in t.unbind()])
    return float(t.detach().to(torch.float64).sum())


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)
