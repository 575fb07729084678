"""What a gradient reading reads: every selected layer's own parameters, each once (a tied one
under its first name, a parametrization's originals under its tensor's name), their `.grad`
unscaled under a loss scaler; and, with `activation_grads`, each layer output's gradient through
the backward, one reading per layer however many backward passes ran before the step.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from actrace.reduce import fold
from actrace.reduce.dispatch import param_grad_meta
from actrace.reduce.reading import LayerTotals
from actrace.reduce.torch import layer_readings, layer_totals, reduce_tensor, to_readings

from .fsdp import FlatShards
from .forward import ProbeForward
from .recurrent import param as recurrent_param
from .trace import ForwardTrace, Output


class Gradients:
    """The gradients of `layers` ({name: (module, kind)}) of `forward.model`; activation gradients
    of the forwards that start while `due()` says so."""

    def __init__(self, forward: ProbeForward, layers: dict, flat: FlatShards, scaler=None,
                 activation_grads: bool = False, due=lambda: True):
        self.forward, self.scaler, self.due, self.flat = forward, scaler, due, flat
        self.params, self.aliases = _parameters(layers, flat)
        self._metas = [param_grad_meta(name, pname, kind) for name, kind, pname, _ in self.params]
        self._tensors = [p for *_, p in self.params]  # whose gradients each step reads (`_present`)
        self._present_key, self._present_metas = None, self._metas
        self.fresh, self._outputs, self._no_grad, self._tracing = False, [], set(), False
        # parameters that required a gradient and lacked one at a reading; ids of those one reached at any
        # backward (`_arrived`, between readings too: `grad_every`) or reading (`unreached`)
        self._lacking, self._got, self._reached, self._all_reached = set(), set(), set(), False
        self._backward_scale: float | None = None  # the loss scaler's factor in this backward's gradients
        self._handles = [p.register_post_accumulate_grad_hook(self._arrived) for *_, p in self.params
                         if p not in flat.of and p.requires_grad]  # FSDP1's: its unit's flat gradient arrives
        self._handles += [flat.register_hook(self._arrived) for flat in self.flat.flats() if flat.requires_grad]
        if activation_grads:
            model = forward.model
            self._trace = ForwardTrace(model, self._hook, forward.wanted)
            self._handles += [model.register_forward_pre_hook(self._start),
                              model.register_forward_hook(self._stop, always_call=True)]

    def _arrived(self, tensor) -> None:
        self.fresh = True
        self._got.add(id(tensor))

    def scale(self) -> float:
        """The factor gradients carry now: the scaler's scale, unless they were unscaled already."""
        if self.scaler is None or not self.scaler.is_enabled():
            return 1.0
        from torch.amp.grad_scaler import OptState

        states = getattr(self.scaler, "_per_optimizer_states", {}).values()
        return 1.0 if any(s.get("stage") is OptState.UNSCALED for s in states) else float(self.scaler.get_scale())

    def batch(self) -> LayerTotals | None:
        """Every parameter's gradient (layer-level) read by one kernel batch and kept as totals
        (`layer_totals`), or None where one batch cannot read them all: `read` them."""
        return layer_totals(*self._present(), self.scale())

    def read(self, with_params: bool = True) -> list:
        """Every parameter's gradient (layer-level) unless `batch` took them, then the activation
        gradients gathered since."""
        readings = layer_readings(*self._present(), self.scale()) if with_params else []
        readings += fold({}, to_readings(self._outputs)).values()
        self._outputs = []
        return readings

    def _present(self) -> tuple[list, list[dict]]:
        """The gradients there are and their metas: the same list for the same parameters, step after
        step, which a writer's rows for the last step's fit at once."""
        grads = self.flat.grads(self._tensors)
        if any(g is None for g in grads):
            key = tuple(i for i, g in enumerate(grads) if g is not None)
            self._lacking.update(i for i, g in enumerate(grads) if g is None and self._tensors[i].requires_grad)
            self._reached.update(key)
            grads = [g for g in grads if g is not None]
        else:
            key, self._all_reached = None, True  # all
        if key != self._present_key:
            self._present_key, self._present_metas = key, self._metas if key is None else [self._metas[i] for i in key]
        return grads, self._present_metas

    def unreached(self) -> list[str]:
        """`LAYER/PARAM` of each parameter that required a gradient at a reading and got one at no
        backward: cut off from the loss (a `.detach()`, `torch.no_grad`) or unused; a frozen one is not
        asked. (FSDP1's parameters get slices of their unit's flat gradient, never none: not named.)"""
        if self._all_reached:
            return []
        return [f"{self.params[i][0]}/{self.params[i][2]}" for i in sorted(self._lacking - self._reached)
                if id(self.params[i][3]) not in self._got]

    def _start(self, module, inputs):
        if torch.is_grad_enabled() and self.due():
            self._tracing, self._backward_scale = True, None
            self._trace.__enter__()

    def _stop(self, module, inputs, output):
        if not self._tracing:
            return
        self._tracing = False
        self._trace.__exit__(None, None, None)
        if self._no_grad and "no_grad" not in self.forward.warned:
            self.forward.warned.add("no_grad")
            blocks = sorted({name.rsplit(".", 1)[0] for name in self._no_grad})
            warnings.warn(f"actrace: the activation gradients of {len(self._no_grad)} reading(s) in "
                          f"{', '.join(blocks[:6])}{' ...' if len(blocks) > 6 else ''} cannot be read: the forward "
                          "runs them without autograd (torch.utils.checkpoint with use_reentrant=True "
                          "recomputes them inside the backward); use_reentrant=False reads them", stacklevel=2)

    def _hook(self, out: Output) -> None:
        if not torch.is_grad_enabled() and out.name:  # a block run under no_grad inside a training forward
            self._no_grad.add(out.name)
        elif out.tensor.requires_grad and self.forward.floating(out):
            axis = self.forward.axis(out)

            def hook(grad):  # read at once: the backward may reuse the gradient's memory
                if out.name:
                    if self._backward_scale is None:  # one read of the scaler per backward (a host sync on a GPU)
                        self._backward_scale = self.scale()
                    scale = self._backward_scale
                    self._outputs.append(reduce_tensor(
                        grad if scale == 1.0 else grad / scale, axis, out.kind, layer=out.name,
                        stream="activation_grad", bounds=out.bounds, histogram=self.forward.histogram))
            out.tensor.register_hook(hook)
        out.tensor = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _parameters(layers: dict, flat: FlatShards) -> tuple[list[tuple[str, str, str, nn.Parameter]], dict[str, str]]:
    """(layer, kind, parameter name, parameter) of every layer's own parameters, each once, and the
    other names of tied ones (`aliases`); a recurrent module's by layer and direction (`lstm.l1`,
    `weight_ih`)."""
    params, aliases, first = [], {}, {}
    for name, (module, kind) in layers.items():
        for pname, p in flat.parameters(module):
            layer, own = recurrent_param(name, module, pname)
            if p in first:
                aliases[f"{layer}/{own}"] = first[p]
            else:
                first[p] = f"{layer}/{own}"
                params.append((layer, kind, own, p))
    return params, aliases

