"""PyTorch adapter: `Monitor` records probe readings and gradient readings of a model.

Probe readings run the fixed probe batch in evaluation behaviour under `no_grad` (the model's
modes are restored afterwards) through a `ForwardTrace` (`forward.py`), which reads every layer
output and every activation wherever it is computed (modules of any library, functional calls),
with unit axes followed from the ops that made each tensor. Gradient readings (`gradients.py`)
read `.grad` of every parameter after `backward()`, unscaled under a loss scaler. Wrapped models
(`torch.compile`, DistributedDataParallel, FSDP) are read through their eager module, under its
own names; sharded parameters (DTensor) from their local shards. At construction the first probe
chunk runs twice: it proves the model takes the probe, fixes depth as forward order, and checks
that evaluation behaviour is deterministic (else readings are marked `train`, with a warning
naming the first layer that differed).
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from actrace.record import Recorder, collector_paused, patterns
from actrace.reduce.torch import keep, layer_readings, update_norms

from . import ranks
from .forward import ProbeForward
from .fsdp import FlatShards
from .gradients import Gradients
from .kinds import module_kind
from .pipeline import Pipeline, is_stage
from .probe import Probe
from .shards import split_of
from .trace import root_name, runner, unwrap

__all__ = ["Monitor", "module_kind"]


class Monitor(Recorder):
    """Watch a model: probe readings every `probe_every` steps, gradient readings every `grad_every`,
    parameter readings (norm, update ratio) every `param_every` (default: with the probe).

    >>> monitor = Monitor(model, probe=x_probe, out="runs/a.parquet")   # doctest: +SKIP
    >>> ... loss.backward(); monitor.step(step); optimizer.step()

    `include`/`exclude` are glob patterns on reading names (`layers.*.mlp.act`); `types` keeps
    only modules of those classes; `unit_axes` maps name patterns to a unit axis, over what the
    trace finds (except a softmax's, which is the axis it normalizes); `scaler` is the
    `torch.amp.GradScaler` whose scale the gradients carry; `logits` names (globs on module paths) the
    modules whose output is vocabulary logits, read per position (log Z, max logit) besides a Hugging
    Face model's own output embeddings. `grad_every=None` reads no gradients
    (probe readings of checkpoints); otherwise a run that closes without any gradient reading says
    so, and its trace's status is `incomplete`. Under pipeline parallel, `model` is this rank's
    `PipelineStage` (the same probe on every rank): the probe runs through the stages in turn.
    """

    no_gradient_hint = "step() found no gradient: call it after loss.backward() and before optimizer.zero_grad()"

    def __init__(self, model: nn.Module, probe, out=None, *, probe_every: int = 200, grad_every: int = 1,
                 param_every: int | None = None, run: str | None = None, config: dict | None = None, include=None,
                 exclude=None, types: tuple[type, ...] | None = None, unit_axes: dict[str, int] | None = None,
                 probe_chunk: int | None = None, activation_grads: bool = False, histogram: bool = True,
                 overwrite: bool | None = None, flush_every: int = 4096, scaler=None, logits=None):
        self.pipeline = Pipeline(model) if is_stage(model) else None
        self.model = model
        wrapped = model.submod if self.pipeline else model
        self.inner = unwrap(wrapped)
        self.include, self.exclude, self.types = patterns(include), patterns(exclude), types
        self.param_every, self.rank, self.world = param_every or probe_every, *_dist()
        split = split_of(self.inner)
        self.forward = ProbeForward(self.inner, Probe(probe, _device(self.inner)), self._wanted, unit_axes or {},
                                    histogram, probe_chunk, self.rank, self.world, patterns(logits), split,
                                    self.pipeline, runner(wrapped))
        selective = include or exclude or types
        mode, order = self.forward.trial(
            f"include={list(self.include)} exclude={list(self.exclude)} types={types}" if selective else None)
        trace = self.forward.trace  # layers with parameters of their own, for gradient and parameter readings
        flat = FlatShards(self.forward.runner)  # FSDP1's parameters, held in pieces of their units' shards
        self.layers = {name: (m, k) for m, path in trace.paths.items() if (k := trace.kinds[m])
                       and (name := path or root_name(k)) and any(True for _ in flat.parameters(m))
                       and self._wanted(name, m)}
        self.grads = Gradients(self.forward, self.layers, flat, scaler, activation_grads,
                               due=lambda: self.grads_due(self._steps_seen))
        trainable = grad_every and any(p.requires_grad for p in self.forward.runner.parameters())
        super().__init__(out, framework="torch", framework_version=torch.__version__, adapter="actrace.adapters.torch",
                         probe_fingerprint=self.forward.probe.fingerprint, probe_size=self.forward.probe.size, mode=mode,
                         probe_every=probe_every, grad_every=grad_every, run=run, config=config, include=include,
                         exclude=exclude, overwrite=overwrite, flush_every=flush_every,
                         expect=("param_grad",) if trainable else (), aliases=self.grads.aliases, writes=self.rank == 0)
        self.mode, self._steps_seen, self._previous, self._warned_stale, self._alarmed = mode, 0, {}, False, False
        self.alone = self.forward.alone
        layers, self.placed = list(self.layers), False  # placed: layers on some ranks only (expert parallel)
        if self.world > 1 and self.pipeline is None and split is None:
            layers, self.placed = ranks.names_everywhere(layers, self.forward.probe.device)
        for name in order + layers:
            self.order(name)

    @property
    def probe(self):
        return self.forward.probe.value

    @probe.setter
    def probe(self, value) -> None:
        self.forward.probe.value = value  # fingerprinted again at the next reading

    def _wanted(self, name: str, module: nn.Module | None) -> bool:
        return not (self.types and not isinstance(module, self.types)) and self.wanted(name)

    def probe_reading(self, step: int) -> int:
        """Run the probe (eval mode, no_grad, chunked) and record every selected reading."""
        self.last_probe = step
        changed = self.forward.probe.check()
        with collector_paused():
            readings, changed = self.forward.read(changed)
            return self.write(step, readings, mode=self.mode, probe_fingerprint=self.forward.probe.settle(changed))

    def gradient_reading(self, step: int) -> int:
        """Record every parameter's gradient (layer-level: norm, extremes, zeros, NaN/Inf), and the
        activation gradients captured since the last one when `activation_grads` is on. Under a
        loss scaler the gradients are read unscaled, and a step it will skip (a NaN or Inf) has
        mode `skipped`; without one, the first step with a NaN or Inf gradient also gets a probe reading."""
        if not self.grads.fresh and not self._warned_stale and self.grads.params:
            warnings.warn(f"actrace: step {step}: no gradient arrived since the last gradient reading; call "
                          "mon.step(step) after loss.backward() and before optimizer.zero_grad()", stacklevel=3)
            self._warned_stale = True
        self.grads.fresh = False
        batched = self.grads.batch() if self.pipeline is None and not self.placed else None  # else: gathered
        readings = self._whole(self.grads.read(with_params=batched is None))
        scaled = self.grads.scaler is not None and self.grads.scaler.is_enabled()
        broken = (batched is not None and batched.non_finite) or any(r.nan_count or r.inf_count for r in readings)
        mode = "skipped" if scaled and broken else "train"
        written = (0 if batched is None else self.write_totals(step, batched, mode=mode)) + \
            (self.write(step, readings, mode=mode) if readings else 0)
        if broken and not scaled and not self._alarmed and self.last_probe != step:
            # the first non-finite gradient: read the probe now, with the weights that made it, so the
            # forward layer where the NaN or Inf starts is seen, not only the backward's spread
            self._alarmed = True
            written += self.probe_reading(step)
        return written

    def parameter_reading(self, step: int) -> int:
        """Record every parameter tensor and its update norm ‖w − w_prev‖ since the last parameter reading."""
        params = self.grads.params
        values = [self.grads.flat.value(p) for *_, p in params]
        readings = layer_readings(values, [
            dict(layer=name, kind=kind, stream="param", param=pname) for name, kind, pname, _ in params])
        keys = [(name, pname) for name, _, pname, _ in params]
        for r, norm in zip(readings, update_norms(values, [self._previous.get(k) for k in keys])):
            r.update_norm = norm
        for k, w in zip(keys, values):  # in place: no second copy of the model's weights at once
            self._previous[k] = keep(w, self._previous.get(k))
        return self.write(step, self._whole(readings), mode="train")

    def _whole(self, readings: list) -> list:
        """This rank's gradient or parameter readings, with every other stage's in a pipeline and
        every other rank's experts under expert parallel."""
        if self.pipeline is not None:
            return self.pipeline.gather(readings)
        return ranks.union(readings, add=False, device=self.forward.probe.device) if self.placed else readings

    def step(self, step: int) -> None:
        """Call once per training step after `backward()` (before `optimizer.step()`, and before
        `scaler.update()` under a loss scaler): gradient, parameter and probe readings when due (a
        probe reading at the first step whatever `probe_every` says, and at the last on close)."""
        if self.probe_due(step):
            self.safely("probe", self.probe_reading, step)
        if self.grads_due(step):
            self.safely("gradient", self.gradient_reading, step)
        if step % self.param_every == 0:
            self.safely("parameter", self.parameter_reading, step)
        self._steps_seen += 1
        self.last_step = step

    def log(self, step: int, loss=None, lr=None, **scalars) -> None:
        """Record the training loop's values at `step` (`loss`, `lr`, any other name; tensors are
        read with `.item()`), so findings are read against the loss (spec §Streams, `scalar`)."""
        values = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in dict(scalars, loss=loss, lr=lr).items()}
        super().log(step, **values)

    def release(self) -> None:
        self.grads.remove()

    def unreached(self) -> list[str]:
        return self.grads.unreached()


class TrainerCallbackBase:
    """What a trainer's callback holds until training starts (the probe, where to write, the
    Monitor's options), and the Monitor it then opens (`adapters/huggingface.py`, `lightning.py`)."""

    def __init__(self, probe, out=None, *, probe_every: int = 200, grad_every: int = 1, run: str | None = None,
                 **monitor_options):
        self.probe, self.out, self.run = probe, out, run
        self.options = dict(monitor_options, probe_every=probe_every, grad_every=grad_every)
        self.monitor: Monitor | None = None


def _dist() -> tuple[int, int]:
    d = torch.distributed
    if d.is_available() and d.is_initialized() and d.get_world_size() > 1:
        return d.get_rank(), d.get_world_size()
    return 0, 1


def _device(model: nn.Module) -> torch.device | None:
    return next((t.device for t in (*model.parameters(), *model.buffers())), None)
