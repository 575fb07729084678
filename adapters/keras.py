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
What `fit` logs after each batch (`loss`, metrics: Keras's running means over the epoch) and the
optimizer's learning rate are recorded as scalars. Steps count training batches from 0.
"""
from __future__ import annotations

import warnings

import keras
import numpy as np

import actrace
from actrace.format.fingerprint import fingerprint
from actrace.reduce import param_grad_job, reduce_arrays
from actrace.format.schema import activation_kind
from actrace.files.writer import script_options

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
    gradient readings every `grad_every` batches where the backend keeps gradients."""

    def __init__(self, probe, out=None, *, probe_every: int = 200, grad_every: int = 1, run: str | None = None,
                 config: dict | None = None, histogram: bool = True, overwrite: bool | None = None):
        super().__init__()
        self.probe = probe if isinstance(probe, (list, tuple, dict)) else np.asarray(probe)
        self.options, self.histogram = script_options(out, run, config, overwrite), histogram
        self.probe_every, self.grad_every = probe_every, grad_every
        self.writer, self.step, self._warned = None, -1, False

    def on_train_begin(self, logs=None):
        self.layers = [layer for layer in self.model.layers if layer_kind(layer)]
        self.depth = {layer.name: i for i, layer in enumerate(self.model.layers)}  # layer_index: forward order
        try:
            self.view = keras.Model(self.model.inputs, [layer.output for layer in self.layers])
        except (AttributeError, ValueError) as exc:
            raise ValueError(f"actrace: the model {self.model.name!r} has no symbolic inputs and outputs to read "
                             f"its layers through (a subclassed model): build it with keras.Input ({exc})") from None
        arrays = self.probe if isinstance(self.probe, dict) else {"probe": self.probe}
        self.writer = actrace.Writer(
            **self.options, framework="keras", framework_version=f"{keras.__version__} ({keras.backend.backend()})",
            adapter="actrace.adapters.keras", mode="eval",
            probe_fingerprint=fingerprint({k: np.asarray(v) for k, v in arrays.items()}),
            probe_size=len(next(iter(arrays.values()))))

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if self.step % self.grad_every == 0:
            self.gradient_reading(self.step)
        if self.step % self.probe_every == 0:
            self.probe_reading(self.step)
        lr = getattr(self.model.optimizer, "learning_rate", None)
        self.writer.log(self.step, lr=None if lr is None else keras.ops.convert_to_numpy(lr),
                        **{k: v for k, v in (logs or {}).items() if np.ndim(v) == 0})

    def on_train_end(self, logs=None):
        if self.writer is None:
            return
        if self.step >= 0 and self.step % self.probe_every:
            self.probe_reading(self.step)  # trends need the end of the run
        self.writer.close()

    def probe_reading(self, step: int) -> None:
        given = self.probe if isinstance(self.probe, (list, tuple, dict)) else [self.probe]  # as model.inputs
        outputs = self.view(given, training=False)
        outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        jobs = []
        for layer, out in zip(self.layers, outputs):
            x = keras.ops.convert_to_numpy(out)
            if x.dtype.kind == "f" and x.size:
                jobs.append((x, unit_axis(layer, x.ndim), layer_kind(layer), dict(layer=layer.name,
                                                                                   histogram=self.histogram)))
        readings = reduce_arrays(jobs)
        self.writer.record_many(step, readings, layer_indexes=[self.depth[r.layer] for r in readings])

    def gradient_reading(self, step: int) -> None:
        """Layer-level readings of each trainable variable's gradient (torch backend only)."""
        grads = [(layer, v, getattr(v.value, "grad", None)) for layer in self.model.layers
                 for v in layer.trainable_weights]
        found = [(layer, v, g) for layer, v, g in grads if g is not None]
        if not found:
            if not self._warned and grads:
                warnings.warn(f"actrace: the {keras.backend.backend()} backend keeps no gradients after a step, "
                              "so this run has probe readings only (the torch backend has both)", stacklevel=2)
                self._warned = True
            return
        jobs = [param_grad_job(g.detach().cpu().numpy(), layer.name, v.name, layer_kind(layer) or "other")
                for layer, v, g in found]
        readings = reduce_arrays(jobs)
        self.writer.record_many(step, readings, layer_indexes=[self.depth[r.layer] for r in readings])
