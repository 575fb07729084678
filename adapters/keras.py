"""Keras 3 adapter, any backend: a `keras.callbacks.Callback` that records probe readings of every
layer's output and, where the backend keeps them, gradient readings.

    model.fit(x, y, callbacks=[TraceCallback(probe=x[:256], out="runs/keras.parquet")])

A probe reading runs a functional view of the model (its inputs to every chosen layer's output)
on the probe with `training=False`. A layer is read at its output, so a `Dense` or `Conv2D`
with a fused activation is that activation's reading (kind `relu`, `gelu`, …), and without one it
is `linear` or `conv`. Units follow the layer's data format: channels last (NHWC) reads units on
the last axis, channels first on axis 1. Reductions are the core's. Gradients: on the torch
backend each trainable variable's `.grad` after the step (layer-level readings, as the PyTorch
adapter takes them); the JAX and TensorFlow backends do not keep gradients, which is said once.
What `fit` logs after each batch and the optimizer's learning rate are recorded as scalars: the
`loss` as that batch's own (Keras logs its running mean over the epoch; its loss tracker's total and
count give the batch's, or the batches' since the last call under `steps_per_execution`; a model
whose tracker does not count them, a custom `train_step`'s, has its running mean recorded, said
once), metrics as Keras logs them (running means). Steps count the callback's calls from 0.
"""
from __future__ import annotations

import warnings

import keras
import numpy as np

from actrace.format.fingerprint import fingerprint
from actrace.format.schema import activation_kind
from actrace.record import Recorder, patterns
from actrace.reduce import reduce_arrays

__all__ = ["TraceCallback", "layer_kind"]

_LAYERS = [("linear", ("Dense", "EinsumDense")),
           ("conv", ("Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose",
                     "DepthwiseConv1D", "DepthwiseConv2D", "SeparableConv1D", "SeparableConv2D")),
           ("norm", ("BatchNormalization", "LayerNormalization", "GroupNormalization", "RMSNormalization")),
           ("embedding", ("Embedding",)), ("attention", ("MultiHeadAttention", "GroupedQueryAttention"))]
_NAMED_LAYERS = {"ReLU": "relu", "LeakyReLU": "leaky_relu", "PReLU": "prelu", "ELU": "elu", "Softmax": "softmax"}


def layer_kind(layer) -> str | None:
    """The spec's kind of a Keras layer's output (its fused activation's, where it has one), or None
    for a layer that is not read (dropout, pooling, reshapes, inputs)."""
    name = type(layer).__name__
    fn = getattr(getattr(layer, "activation", None), "__name__", None)
    if name == "Activation" or (fn and activation_kind(fn)):
        return activation_kind(fn or "") or "other"
    if name in _NAMED_LAYERS:
        return "relu6" if name == "ReLU" and getattr(layer, "max_value", None) == 6 else _NAMED_LAYERS[name]
    return next((kind for kind, names in _LAYERS if name in names), None)


def unit_axis(layer, ndim: int) -> int:
    """The units of a layer's output: channels first (`data_format`, or a norm's `axis` 1) on axis 1,
    anything else on the last axis."""
    if getattr(layer, "data_format", None) == "channels_first":
        return 1
    axis = getattr(layer, "axis", -1)
    axis = axis[0] if isinstance(axis, (list, tuple)) and len(axis) == 1 else axis
    return axis % ndim if isinstance(axis, int) else ndim - 1


class TraceCallback(keras.callbacks.Callback):
    """Record a `fit` run to `out`: a probe reading every `probe_every` batches (and at the end),
    gradient readings every `grad_every` batches where the backend keeps gradients; `include`/
    `exclude` are glob patterns on layer names."""

    def __init__(self, probe, out=None, *, probe_every: int = 200, grad_every: int = 1, run: str | None = None,
                 config: dict | None = None, include=None, exclude=None, histogram: bool = True,
                 overwrite: bool | None = None, flush_every: int = 4096):
        super().__init__()
        self.probe = probe if isinstance(probe, (list, tuple, dict)) else np.asarray(probe)
        self.options = dict(out=out, probe_every=probe_every, grad_every=grad_every, run=run, config=config,
                            include=include, exclude=exclude, histogram=histogram, overwrite=overwrite,
                            flush_every=flush_every)
        self.recorder: Recorder | None = None

    def on_train_begin(self, logs=None):
        self.recorder = FitRecorder(self.model, self.probe, **self.options)

    def on_train_batch_end(self, batch, logs=None):
        self.recorder.batch_end(self.model, batch, logs)  # `self.model` syncs a JAX trainer's state into the variables

    def on_train_end(self, logs=None):
        if self.recorder is not None:
            self.recorder.model = self.model
            self.recorder.close()


class FitRecorder(Recorder):
    """The readings of one `fit`: its model's layers read through a functional view of them."""

    def __init__(self, model, probe, out=None, *, include=None, exclude=None, histogram: bool = True, **options):
        self.model, self.probe, self.histogram, self._warned = model, probe, histogram, False
        self._tracked, self._warned_loss = None, False  # (batch, the loss tracker's total, count) after the last call
        self.include, self.exclude = patterns(include), patterns(exclude)
        self.layers = [layer for layer in model.layers if layer_kind(layer) and self.wanted(layer.name)]
        try:
            self.view = keras.Model(model.inputs, [layer.output for layer in self.layers])
        except (AttributeError, ValueError) as exc:
            raise ValueError(f"actrace: the model {model.name!r} has no symbolic inputs and outputs to read "
                             f"its layers through (a subclassed model): build it with keras.Input ({exc})") from None
        arrays = probe if isinstance(probe, dict) else {"probe": probe}
        super().__init__(
            out, framework="keras", framework_version=f"{keras.__version__} ({keras.backend.backend()})",
            adapter="actrace.adapters.keras", mode="eval", probe_size=len(next(iter(arrays.values()))),
            probe_fingerprint=fingerprint({k: np.asarray(v) for k, v in arrays.items()}), include=include,
            exclude=exclude, **options)
        for layer in self.layers:  # layer_index: forward order
            self.order(layer.name)

    def batch_end(self, model, batch: int, logs) -> None:
        """Readings when due after a training batch (the epoch's `batch`-th), and what `fit` logged after it."""
        self.model = model
        logs = dict(logs or {})
        if "loss" in logs:
            logs["loss"] = self._batch_loss(batch, logs["loss"])
        step = 0 if self.last_step is None else self.last_step + 1
        if self.grads_due(step):
            self.safely("gradient", self.gradient_reading, step)
        if self.probe_due(step):
            self.safely("probe", self.probe_reading, step)
        self.last_step = step
        lr = getattr(self.model.optimizer, "learning_rate", None)
        self.log(step, lr=None if lr is None else keras.ops.convert_to_numpy(lr),
                 **{k: v for k, v in logs.items() if np.ndim(v) == 0})

    def _batch_loss(self, batch: int, logged) -> float:
        """The loss of the epoch's `batch`-th batch alone (of the batches since the last call): the
        change of the loss tracker's total over the change of its count (samples) since then (the
        tracker restarts each epoch). Where the tracker does not count them (none, or a custom
        `train_step` keeping its own), Keras's `logged` running mean, said once."""
        tracker = getattr(self.model, "_loss_tracker", None)
        if tracker is not None:
            total, count = (float(keras.ops.convert_to_numpy(v)) for v in (tracker.total, tracker.count))
            last = self._tracked if self._tracked and batch > self._tracked[0] else (-1, 0.0, 0.0)
            self._tracked = (batch, total, count)
            if count > last[2]:
                return (total - last[1]) / (count - last[2])
        if not self._warned_loss:
            warnings.warn("actrace: this Keras model's loss tracker does not count its batches (a custom "
                          "train_step?): its loss is recorded as Keras logs it, the running mean over the epoch, "
                          "which lags the loss of each batch", stacklevel=3)
            self._warned_loss = True
        return logged

    def probe_reading(self, step: int) -> int:
        given = self.probe if isinstance(self.probe, (list, tuple, dict)) else [self.probe]  # as model.inputs
        outputs = self.view(given, training=False)
        outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        jobs = []
        for layer, out in zip(self.layers, outputs):
            x = keras.ops.convert_to_numpy(out)
            if x.dtype.kind == "f" and x.size:
                jobs.append((x, unit_axis(layer, x.ndim), layer_kind(layer), dict(layer=layer.name,
                                                                                   histogram=self.histogram)))
        self.last_probe = step
        return self.write(step, reduce_arrays(jobs))

    def gradient_reading(self, step: int) -> int:
        """Layer-level readings of each trainable variable's gradient (torch backend only)."""
        grads = [(layer, v, getattr(v.value, "grad", None)) for layer in self.model.layers
                 for v in layer.trainable_weights if self.wanted(layer.name)]
        found = [(layer, v, g) for layer, v, g in grads if g is not None]
        if not found:
            if not self._warned and grads:
                warnings.warn(f"actrace: the {keras.backend.backend()} backend keeps no gradients after a step, "
                              "so this run has probe readings only (the torch backend has both)", stacklevel=2)
                self._warned = True
            return 0
        return self.write_gradients(step, [(g.detach().cpu().numpy(), layer.name, v.name, layer_kind(layer) or "other")
                                           for layer, v, g in found])
