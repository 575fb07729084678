"""One traced forward: every layer output and every activation, wherever it is computed, handed
to a sink with its name, kind, bounds and unit axis.

A `TorchFunctionMode` sees every torch call in every `forward` (functional activations included),
and module hooks, global for the trace's duration, keep the module scope it happens in:
- a module with a kind (`_torch_kinds.module_kind`) is read at its output, under its path;
- a functional activation (`F.silu`, `torch.tanh`, `x.relu_()`, softmax) is read at its output,
  as `SCOPE.FUNCTION` (`layers.3.mlp.silu`), except inside an activation module, which is read
  once as itself; a parameter-free leaf module whose output is such a call's output (Hugging
  Face's `GELUActivation`) takes that reading under its own path;
- a recurrent module (`nn.RNN`, `nn.LSTM`, `nn.GRU`) is read per layer and direction, gates
  included (`_torch_recurrent`), in a probe forward; in a forward with gradients, at its outputs;
- in a probe forward, derived readings (`_torch_derived`, spec §Derived readings) under the scope
  they are computed in: per head of every attention (SDPA, a 4-D softmax over keys,
  `nn.MultiheadAttention`, a Hugging Face attention implementation that shows no scores, such as
  flash: `_torch_interfaces`), per position of the LM head, per expert of a router's top-k;
- repeated names in one forward get `#2`, `#3`, ...
Each tensor is handed to the sink the moment it is made, before any in-place change. Unit axes come from
`_torch_axes.Axes`. A module whose ops read no activation when last called so runs untraced in
later probe forwards (`ForwardTrace.plan`): its modules' hooks read their outputs on the axes
learned then, and its attention and router ops still give their derived readings; the probe's
trial checks the replay reads every layer as tracing does. Such a module whose only such op is
SDPA runs with the mode off, its SDPA calls seen through `torch.nn.functional` (wrapped while the
trace is on), unless it holds a module known to take another path then (`MODE_AWARE`) or did.
"""
from __future__ import annotations

import contextlib
import fnmatch
import functools
import threading
import warnings
from dataclasses import dataclass, fields, is_dataclass

import torch
import torch.nn.functional as F
from torch import overrides
from torch.nn.modules import module as nn_module
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from actrace.format.schema import ATTENTION_KINDS, LOGIT_KINDS, PER_UNIT_KINDS, ROUTER_KINDS

from . import derived, interfaces
from .axes import LOST, QUERIES, Axes, arg, op_name
from .kinds import ACTIVATIONS, MODE_AWARE, OPAQUE, SAME, attends, function_kind, module_bounds, module_kind, routes
from .recurrent import RECURRENT
from .recurrent import parts as recurrent_parts
from .recurrent import readings as recurrent_readings
from .shards import Shards, is_dtensor

WRAPPERS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def wrappers(model: torch.nn.Module):
    """The model and each module it wraps in turn (`torch.compile`, DistributedDataParallel, FSDP1),
    down to the eager module."""
    while isinstance(model, torch.nn.Module):
        yield model
        model = getattr(model, "_orig_mod", None) or (
            getattr(model, "module", None) if type(model).__name__ in (
                "DistributedDataParallel", "FullyShardedDataParallel", "DataParallel") else None)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The eager module under `torch.compile`, DistributedDataParallel and FSDP wrappers."""
    *_, inner = wrappers(model)
    return inner


def runner(model: torch.nn.Module) -> torch.nn.Module:
    """The module a probe forward calls: FSDP1's root wrapper where there is one (it gathers the
    parameters it holds sharded, which the eager module alone finds freed), else the eager module."""
    return next((m for m in wrappers(model) if type(m).__name__ == "FullyShardedDataParallel"), unwrap(model))


def module_path(name: str) -> str:
    """A module's path with wrapper segments (compiled, FSDP, checkpointed) left out."""
    return ".".join(part for part in name.split(".") if part not in WRAPPERS)


def root_name(kind: str | None) -> str | None:
    """The name of the model's own output when the model is one layer (a bare `nn.Linear`): its
    kind, as exporters name a root layer; None for any other model (its output is no layer)."""
    return kind if kind not in (None, "other") else None


def output_tensors(output, prefix: str = ""):
    """(suffix, tensor) for every tensor in an output: a tensor, tuple, list, dict or dataclass."""
    if isinstance(output, torch.Tensor):
        yield prefix, output
    elif isinstance(output, (tuple, list)):
        for i, o in enumerate(output):
            yield from output_tensors(o, f"{prefix}.{i}")
    elif isinstance(output, dict):
        for k, o in output.items():
            yield from output_tensors(o, f"{prefix}.{k}")
    elif is_dataclass(output) and not isinstance(output, type):
        for f in fields(output):
            yield from output_tensors(getattr(output, f.name), f"{prefix}.{f.name}")


@dataclass
class Output:
    """A tensor to read: its reading's name, kind, bounds, unit axis, and the module it belongs to.
    `feeds_relu`: a ReLU of exactly this tensor comes next, so its pass may give that reading
    too; `relu_of`: this ReLU's reading may come from that Output's pass; `rows`: a mask of the
    first axis's entries that the reading keeps (derived readings). `reading` is the sink's."""

    name: str
    kind: str
    bounds: tuple[float, float] | None
    tensor: torch.Tensor
    axis: int | None
    module: torch.nn.Module | None
    feeds_relu: bool = False
    relu_of: "Output | None" = None
    rows: torch.Tensor | None = None
    reading: object = None


class _Frame:
    __slots__ = ("path", "module", "kind", "leaf", "last", "paused", "source", "key", "replay", "events", "exits",
                 "derived", "inside")

    def __init__(self, path, module, kind, leaf):
        self.path, self.module, self.kind, self.leaf = path, module, kind, leaf
        self.paused = False  # an opaque module, run with the trace's mode off
        self.source = None   # an opaque ReLU's input, whose pass gives its reading
        self.last = None  # (tensor, Output, selected under its own name) of a wrapper's last activation
        self.key = None      # a quiet module's call (`ForwardTrace.plan`): learned at its exit, or replayed
        self.replay = None   # its plan entry (`ForwardTrace.plan`), replayed: its ops run untraced
        self.events = 0      # the trace's count of op events when it was entered
        self.exits = 0       # the trace's count of module exits then
        self.derived = 0     # and of ops that gave derived readings (`ForwardTrace.derived`'s length)
        self.inside = 0      # replayed: the exits of the modules inside it so far


class _Unknown(Exception):
    """An input a call key cannot stand for (`ForwardTrace._call_key`)."""


DERIVED_OPS = frozenset({"scaled_dot_product_attention", "softmax", "topk"})  # `_derived_of_call`'s
SDPA = frozenset({"scaled_dot_product_attention"})  # the one a replayed module with the mode off still sees


class ForwardTrace(TorchFunctionMode):
    """Active around forwards of `model`: calls `sink(Output)` for every reading that
    `wanted(name, module)` selects, in forward order. Names count every reading, selected or not,
    so they are the model's whatever the selection. A reading a wrapper module takes over after
    the sink saw it is renamed in place (`Output.name`), or set to None when not selected."""

    def __init__(self, model: torch.nn.Module, sink, wanted=lambda name, module: True, heads=(), split=False,
                 replay=False):
        super().__init__()
        self.split = split  # tensor parallel: the slices of units each local tensor holds are followed (`shards`)
        self.shards = Shards() if split else None
        self.sink, self.wanted = sink, wanted
        # modules that compute a parameter (`parametrize`, weight_norm): run untraced, never read
        self.computing = {m for m in model.modules() if isinstance(m, parametrize.ParametrizationList)}
        inside = {sub for m in self.computing for sub in m.modules()}
        self.paths = {m: module_path(n) for n, m in model.named_modules() if m not in inside}
        self.kinds = {m: module_kind(m) for m in self.paths}
        self.leaves = {m for m in self.paths if not any(True for _ in m.children())}
        # `replay`: a module whose ops gave no event last time it was called so (no activation read,
        # no ReLU pass shared) runs untraced, the axes and makers of its modules' outputs as learned
        # then; their hooks still read them, and its derived readings are still taken: the per-op
        # cost of its insides paid once, not at every probe reading (`plan`: call key → (exits of the
        # modules inside, in order; its outputs' states; the ops inside that gave derived readings;
        # whether it may run with the mode off: True where the trial checked that, None where nothing
        # did, False where it went otherwise); a module → False once its ops read: it is not learned again)
        self.plan: dict | None = {} if replay and not split else None
        self.amended = 0  # replays that went otherwise than learned, so far (`_replayed`)
        self.quiet = {m for m in self.paths if type(m) not in OPAQUE and type(m) not in RECURRENT}
        self.mode_aware = {m for m in self.quiet if any(isinstance(sub, MODE_AWARE) for sub in m.modules())}
        self.taken = 0    # names taken so far
        self.events = 0   # ops that read an activation or shared a ReLU pass, so far
        self.derived: list[str] = []  # the ops that gave derived readings so far, by name
        self.exits: list[tuple] = []  # (module, its outputs' states) at each module's exit while one learns
        self.learning = 0  # frames on the stack whose call is being learned
        self.region: _Frame | None = None  # the module replayed now
        self.heads = output_heads(model, self.paths, heads)
        self.axes = Axes()
        self.stack: list[_Frame] = []
        self.calls: dict[str, int] = {}
        self._busy = False
        self.failed: set[str] = set()  # scopes whose derived readings could not be computed (said once)
        self._hooks, self._paused = [], []
        self._registry: dict = {}  # Hugging Face attention implementations wrapped while the trace is on
        self._outer = None  # the trace this one's forward runs inside of in this thread, if any (`_sdpa_seen`)
        self._wraps = False  # whether this trace counts in `_sdpa_wrapped` now
        self.trial = False  # the probe's trial: calls it learns may replay with the mode off (its 2nd pass checks that)
        self._inside_interface = 0  # calls of such an implementation running: their scores are read already
        # our own torch calls between the model's (readings, derived): not dispatched through this
        # mode, unless a tensor subclass must see them (tensor parallel's DTensors)
        self._own = contextlib.nullcontext if split else torch._C.DisableTorchFunction
        self.open: Output | None = None   # the newest layer output, sunk at the next event
        self.relu: tuple | None = None    # (relu's output tensor, the Output whose pass gives its reading)

    def __enter__(self):
        self.axes, self.stack, self.calls, self.open, self.relu = Axes(), [], {}, None, None
        self.exits, self.region, self.learning, self.derived = [], None, 0, []
        self.shards = Shards() if self.split else None
        self._hooks = [nn_module.register_module_forward_pre_hook(self._enter_module),
                       nn_module.register_module_forward_hook(self._exit_module, with_kwargs=True,
                                                              always_call=True)]
        if self.plan is not None:  # after the global hook, which opened the module's frame: its keyword inputs too
            self._hooks += [m.register_forward_pre_hook(self._enter_quiet, with_kwargs=True) for m in self.quiet
                            if self.plan.get(m) is not False]
        self._registry = interfaces.wrap_registry(self._interface)
        self._outer, _here.trace = getattr(_here, "trace", None), self
        self._wraps = self.plan is not None  # only a replaying trace needs SDPA shown (a training forward's has no plan)
        _sdpa_wrapped(+self._wraps)
        if self.shards is not None:  # after each parallelized module's own hooks, which make its output local
            self._hooks += [m.register_forward_hook(self._settle_shard) for m in self.paths if _parallelized(m)]
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            self._flush()
        finally:
            for h in self._hooks:
                h.remove()
            interfaces.restore(self._registry)
            _here.trace = self._outer
            _sdpa_wrapped(-self._wraps)
            self._hooks, self.stack, self._registry = [], [], {}
            # a signal's exception (Ctrl-C, SIGTERM) raised while torch ran an op's handler leaves
            # the mode off the stack already: popping again would replace that exception with its own
            if exc[0] is None or any(m is self for m in _get_current_function_mode_stack()):
                super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._busy:
            return func(*args, **kwargs)
        name = op_name(func)
        if self.region is not None:  # a replayed module's op: only its derived readings are taken
            out = func(*args, **kwargs)
            if name in DERIVED_OPS:
                self._busy = True
                try:
                    self._derived(name, args, kwargs, out)
                finally:
                    self._busy = False
            return out
        if name in QUERIES:  # metadata: changes nothing, so no event
            out = func(*args, **kwargs)
            if not isinstance(out, (torch.Tensor, tuple, list)):
                return out
            source = self._before(False, args)
        else:
            source = self._before(name in ("relu", "relu_"), args)  # before the call: it may change the open tensor
            out = func(*args, **kwargs)
            if not isinstance(out, (torch.Tensor, tuple, list)):
                return out
        self._busy, taken = True, self.taken
        try:
            self.axes.follow(name, args, kwargs, out)
            if self.shards is not None:
                self.shards.follow(name, args, kwargs, out)
            if source is not None:
                self.relu = (out, source)
            found = function_kind(name, args, kwargs) if isinstance(out, torch.Tensor) else None
            frame = self.stack[-1] if self.stack else None
            if found and out.is_floating_point() and not (frame and frame.kind in ACTIVATIONS):
                self._functional(frame, *found, out)
            self.events += source is not None or self.taken != taken
            if name in DERIVED_OPS:
                self._derived(name, args, kwargs, out)
        finally:
            self._busy = False
        return out

    def _derived(self, name: str, args, kwargs, out) -> None:
        """An op that may give derived readings, in a probe forward: under the scope it runs in."""
        frame = self.stack[-1] if self.stack else None
        if frame is not None and not torch.is_grad_enabled():
            self.derived.append(name)
            self._derived_of_call(frame, name, args, kwargs, out)

    def _sdpa_seen(self, args, kwargs, out) -> None:
        """An `F.scaled_dot_product_attention` call in this trace's thread: in a module replayed with
        the mode off (`_enter_quiet`), its derived readings, as the mode gives them where it is on."""
        region = self.region
        if region is not None and region.paused and "scaled_dot_product_attention" in region.replay[2] \
                and not self._busy:
            self._busy = True
            try:
                self._derived("scaled_dot_product_attention", args, kwargs, out)
            finally:
                self._busy = False

    def keep_mode(self) -> bool:
        """Replay with the mode on every call that ran with it off and whose SDPA that replay had to
        see (`ProbeForward.trial`: one called through another binding than `torch.nn.functional`'s);
        whether there was one."""
        keys = [key for key, entry in self.plan.items()
                if isinstance(entry, tuple) and entry[3] and "scaled_dot_product_attention" in entry[2]]
        for key in keys:
            self.plan[key] = (*self.plan[key][:3], False)
        return bool(keys)

    def _before(self, relu: bool, args) -> Output | None:
        """Sink the open output before any op runs; if the op is a ReLU of exactly that tensor, the
        one pass is asked for the ReLU's reading too (returned: the ReLU's source)."""
        opened, self.relu = self.open, None
        if opened is None:
            return None
        opened.feeds_relu = relu and bool(args) and args[0] is opened.tensor
        self._flush()
        return opened if opened.feeds_relu else None

    def _flush(self) -> None:
        if self.open is not None:
            opened, self.open = self.open, None
            busy, self._busy = self._busy, True
            try:
                with self._own():
                    self.sink(opened)
            finally:
                self._busy = busy

    def _functional(self, frame: _Frame | None, kind: str, bounds, out: torch.Tensor) -> None:
        """An activation called as a function: `PATH.KIND`, named by its kind as the ONNX adapter names it."""
        name = self._name(f"{frame.path}.{kind}" if frame and frame.path else kind)
        wrapper = frame is not None and self._wrapper(frame)
        own = self.wanted(name, None)
        if own or (wrapper and self.wanted(frame.path, frame.module)):
            read = self._sink(name, kind, bounds, out, None)
            if wrapper:
                self._settle_last(frame)
                frame.last = (out, read, own)

    def _derived_of_call(self, frame: _Frame, name: str, args, kwargs, out) -> None:
        """Derived readings of an attention's scores (SDPA; a softmax over the last axis of `[B, H,
        Q, K]`, whose input they are) and of a router's top-k, under the scope they run in."""
        if self._inside_interface and name in ("scaled_dot_product_attention", "softmax"):
            return
        if name == "scaled_dot_product_attention":
            self._derive(frame.path, frame.module, ATTENTION_KINDS,
                         lambda: derived.sdpa_attention(args, kwargs))
        elif name == "softmax" and out.ndim == 4 and arg(args, kwargs, 1, "dim") in (-1, 3) \
                and attends(frame.module, frame.path):
            self._derive(frame.path, frame.module, ATTENTION_KINDS,
                         lambda: derived.attention(arg(args, kwargs, 0, "input")))
        elif name == "topk" and isinstance(scores := arg(args, kwargs, 0, "input"), torch.Tensor) and scores.ndim \
                and routes(frame.module, frame.path, scores.shape[-1]):
            self._derive(frame.path, frame.module, ROUTER_KINDS, lambda: derived.routing(args, kwargs))

    def _derive(self, scope: str, module, kinds: tuple[str, ...], compute) -> None:
        """Sink the derived readings `compute()` gives (kind → tensor, or None), named `SCOPE.KIND`,
        computed only when one of them is selected; their names are taken once it gave them. What
        cannot be computed is said once and skipped: the model's forward goes on."""
        if self.shards is not None:  # heads, vocabulary and experts split across ranks: not placed yet
            if "tensor parallel" not in self.failed:
                self.failed.add("tensor parallel")
                if torch.distributed.get_rank() == 0:  # the same on every rank: said by one
                    warnings.warn("actrace: a tensor-parallel model's derived readings (attention heads, log Z, "
                                  "experts) are not read", stacklevel=2)
            return
        bases = {kind: f"{scope}.{kind}" if scope else kind for kind in kinds}
        names = {kind: self._name(base, take=False) for kind, base in bases.items()}
        tensors = None
        if any(self.wanted(n, module) for n in names.values()):
            try:
                tensors = compute()
            except Exception as e:  # a model's own tensors in a form not foreseen: its forward is not ours to break
                if scope not in self.failed:
                    self.failed.add(scope)
                    warnings.warn(f"actrace: the derived readings of {scope or 'the model'} are skipped: "
                                  f"{type(e).__name__}: {e}", stacklevel=2)
                return
            if not tensors:
                return
        for base in bases.values():  # names count every reading made, selected or not
            self._name(base)
        for kind, t in (tensors or {}).items():
            t, rows = t if isinstance(t, tuple) else (t, None)  # rows: those of `t` the reading keeps
            if t.numel() and self.wanted(names[kind], module):
                self.axes.set(t, -1 if kind in PER_UNIT_KINDS else None)  # queries or tokens first: chunks merge
                self._sink(names[kind], kind, None, t, module, rows=rows)

    def _interface(self, fn, module, query, key, value, mask, args, kwargs):
        """A Hugging Face attention implementation's call (`interfaces`): in a probe forward, its
        scores' derived readings from its queries, keys and mask, under the scope it runs in; then
        the call itself, whose own torch calls are not read as attention again."""
        frame = self.stack[-1] if self.stack else None
        if frame is not None and not torch.is_grad_enabled() and not self._busy:
            def logits():
                if args:
                    raise ValueError(f"{fn.__name__} called with positional arguments after the mask")
                return derived.interface_logits(module, query, key, mask, **{
                    k: kwargs[k] for k in ("scaling", "softcap", "sliding_window", "is_causal", "s_aux") if k in kwargs})
            self._busy = True
            try:
                with self._own():
                    self._derive(frame.path, frame.module, ATTENTION_KINDS, lambda: derived.attention(logits()))
            finally:
                self._busy = False
        self._inside_interface += 1
        try:
            return fn(module, query, key, value, mask, *args, **kwargs)
        finally:
            self._inside_interface -= 1

    def _settle_shard(self, module, inputs, output) -> None:
        """A parallelized module's own hook made its output local (or redistributed it): that is
        read, on the same unit axis, under the name its DTensor output took (`shards.settle`)."""
        settled = self.shards.settle(module, output)
        if settled is not None:
            local, axis, (name, kind, bounds) = settled
            self.axes.set(output, axis)
            self.axes.set(local, axis)
            self._busy = True
            try:
                self._sink(name, kind, bounds, local, module, defer=True)
            finally:
                self._busy = False

    @staticmethod
    def _settle_last(frame: _Frame) -> None:
        """The wrapper's last reading was not its output: it keeps its own name, if selected."""
        if frame.last is not None and not frame.last[2]:
            frame.last[1].name = None
        frame.last = None

    def _wrapper(self, frame: _Frame) -> bool:
        """A parameter-free leaf module of no known kind: it may be a wrapper around one activation."""
        return frame.kind is None and frame.leaf and not any(True for _ in frame.module.parameters(recurse=False))

    def _name(self, base: str, take: bool = True) -> str:
        """The next name of `base` in this forward (`#2`, `#3` for repeats); `take`: counted."""
        n = self.calls.get(base, 0) + 1
        if take:
            self.calls[base] = n
            self.taken += 1
        return base if n == 1 else f"{base}#{n}"

    def _sink(self, name: str, kind: str, bounds, t: torch.Tensor, module, defer: bool = False,
              rows: torch.Tensor | None = None) -> Output:
        """Hand a reading to the sink (of the `rows` of `t`, if given); a layer output (`defer`)
        waits for the next event, in case a ReLU of it follows."""
        axis = self.axes.of(t)
        out = Output(name, kind, bounds, t, None if axis is LOST else axis, module, rows=rows)
        if self.relu is not None and self.relu[0] is t:
            out.relu_of = self.relu[1]
        self._flush()
        if defer and self.region is None:  # a replayed module's ops do not flush it: read now
            self.open = out
        else:
            self.sink(out)
        return out

    def _enter_module(self, module, inputs):
        if module in self.computing:
            self._paused.append(overrides._get_current_function_mode() is self and overrides._pop_mode() is self)
            return
        if module in self.paths and not self._busy:
            frame = _Frame(self.paths[module], module, self.kinds[module], module in self.leaves)
            self.stack.append(frame)
            if overrides._get_current_function_mode() is not self:
                return
            if type(module) in OPAQUE:
                # read only at its output: run its insides untraced (on their fast paths), as an op
                frame.source = self._before(type(module) is torch.nn.ReLU and self.region is None, inputs)
                frame.paused = overrides._pop_mode() is self
                self.events += frame.source is not None

    def _enter_quiet(self, module, args, kwargs):
        """A quiet module's call (its frame just opened): replayed if the plan knows it, else
        traced and, if its ops give no event, learned at its exit."""
        frame = self.stack[-1] if self.stack else None
        if frame is None or frame.module is not module or self._busy or self.region is not None or \
                self.plan.get(module) is False or overrides._get_current_function_mode() is not self:
            return None
        with self._own():  # its inputs' shapes and dtypes: no op of the model's
            frame.key = self._call_key(module, args, kwargs)
        frame.replay = self.plan.get(frame.key)
        frame.events, frame.exits, frame.derived = self.events, len(self.exits), len(self.derived)
        if frame.replay is not None:
            self._before(False, args)
            self.region = frame
            # with the mode off where the trial checked that (its only derived op SDPA, which `_sdpa_seen`
            # sees; no module inside that checks for a mode), or for a leaf that gives no derived reading,
            # unless that went otherwise than learned; else on, following nothing
            mode_off, ops = frame.replay[3], frame.replay[2]
            if mode_off and ops <= SDPA and module not in self.mode_aware or \
                    mode_off is None and frame.leaf and not ops:
                frame.paused = overrides._pop_mode() is self
        elif frame.key is not None:
            self.learning += 1
        return None

    def _call_key(self, module, args, kwargs) -> tuple | None:
        """A module's call as its insides see it: its inputs (tensors by shape, dtype, unit axis and
        maker; plain values as they are; tuples and lists of these) and whether gradients are on;
        None if an input is anything else (an object whose state its forward may read)."""
        def sign(v):
            if isinstance(v, torch.Tensor):
                return tuple(v.shape), v.dtype, self.axes.state(v)
            if v is None or isinstance(v, (bool, int, float, str)):
                return v
            if isinstance(v, (tuple, list)):
                return type(v), tuple(sign(x) for x in v)
            raise _Unknown
        try:
            return module, torch.is_grad_enabled(), sign(args), tuple((k, sign(v)) for k, v in kwargs.items())
        except _Unknown:
            return None

    def _exit_module(self, module, inputs, *rest):
        # (kwargs, output); torch calls an always_call hook without kwargs after a forward raised
        kwargs, output = rest if len(rest) == 2 else ({}, rest[0])
        if module in self.computing:
            if self._paused and self._paused.pop():
                overrides._push_mode(self)
            return
        if module not in self.paths or self._busy:
            return
        self._flush()
        while self.stack and self.stack[-1].module is not module:
            self.stack.pop()  # a forward that raised inside
        if not self.stack:
            return
        frame = self.stack.pop()
        outputs = [t for _, t in output_tensors(output)]
        if frame.paused:
            overrides._push_mode(self)
        if frame is self.region:
            self._replayed(frame, outputs)
        elif self.region is not None:
            self._replayed_inside(frame, outputs)
        elif frame.paused:
            self._opaque_output(frame, inputs, output)
        elif frame.key is not None:
            self.learning -= 1
            if self.events == frame.events:
                self.plan[frame.key] = (self.exits[frame.exits:], [self.axes.state(t) for t in outputs],
                                        frozenset(self.derived[frame.derived:]), self.trial or None)
            else:
                self.plan[frame.module] = False
        if self.learning:
            self.exits.append((frame.module, [self.axes.state(t) for t in outputs]))
        self._busy = True
        try:
            with self._own():
                self._module_readings(frame, inputs, kwargs, output)
        finally:
            self._busy = False

    def _module_readings(self, frame: _Frame, inputs, kwargs, output) -> None:
        """A module's readings at its exit: its output(s), a recurrent module's parts, and in a probe
        forward the derived readings of an `nn.MultiheadAttention` and of a vocabulary head."""
        module, probe = frame.module, not torch.is_grad_enabled()
        if type(module) in RECURRENT and probe and isinstance(output, tuple):
            self._recurrent(frame, inputs, kwargs, output)
        else:
            self._module_output(frame, output)
        if probe and isinstance(module, torch.nn.MultiheadAttention):
            self._derive(frame.path, module, ATTENTION_KINDS,
                         lambda: derived.attention(derived.mha_logits(module, inputs, kwargs)))
        logits = next((t for _, t in output_tensors(output) if t.is_floating_point()), None) \
            if probe and module in self.heads else None
        if logits is not None:
            self._derive(frame.path, module, LOGIT_KINDS, lambda: derived.output_logits(logits))

    def _replayed_inside(self, frame: _Frame, outputs: list) -> None:
        """A module that ran inside the one replayed: its outputs' axes and makers as learned, for
        its hooks to read them by; from the first module other than learned on, lost."""
        region, k = self.region, self.region.inside
        exits = region.replay[0]
        region.inside += 1
        if not self._restore(outputs, exits[k][1] if k < len(exits) and exits[k][0] is frame.module else None):
            region.inside = len(exits) + 1  # off the plan from here on

    def _replayed(self, frame: _Frame, outputs: list) -> None:
        """A quiet module run untraced: its outputs' axes and makers as learned. A call the plan
        did not foresee (other modules inside, other outputs) is traced from then on, or, where it
        ran with the mode off, replayed with it on (code that checks for a mode took another path);
        the trial sees that."""
        self.region = None
        exits, states, ops, _ = frame.replay
        if not self._restore(outputs, states if frame.inside == len(exits) else None):
            self.amended += 1
            if frame.paused:
                self.plan[frame.key] = (exits, states, ops, False)
            else:
                del self.plan[frame.key]
                self.plan[frame.module] = False  # its calls differ with the data

    def _restore(self, outputs: list, states: list | None) -> bool:
        """Give a replayed call's outputs their learned states (None: off the plan); where they are
        not what was learned, their axes are lost (read as one unit, never guessed) and that counts
        as an event: a module that holds this call is not learned so. Whether they were."""
        if states is None or len(states) != len(outputs):
            self.axes.set(outputs, None)
            self.events += 1
            return False
        for t, state in zip(outputs, states):
            self.axes.restore(t, state)
        return True

    def _opaque_output(self, frame: _Frame, inputs, output) -> None:
        """An opaque module's output axis (its own rule, or its input's for elementwise ones) and
        maker; the ReLU reading its input's pass gives."""
        out = output[0] if isinstance(output, tuple) else output
        if not isinstance(out, torch.Tensor):
            return  # the forward raised
        axis, made = OPAQUE[type(frame.module)]
        x = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
        if self.shards is not None and x is not None:  # elementwise modules keep a slice; others cannot
            self.shards.carry([x], out, elementwise=axis is SAME)
        if axis is SAME:
            self.axes.set(out, LOST if x is None or x.ndim != out.ndim else self.axes.of(x))
        else:
            self.axes.set(out, self.axes.channels(out, axis) if isinstance(axis, tuple) else axis)
        if made:
            self.axes.made[out] = made
        if frame.source is not None:
            self.relu = (out, frame.source)

    def _recurrent(self, frame: _Frame, inputs, kwargs, output) -> None:
        """A recurrent module's readings per layer and direction (`_torch_recurrent`), under its
        path; only the selected ones are computed."""
        named = [(self._name(f"{frame.path}.{suffix}" if frame.path else suffix), suffix, kind)
                 for suffix, kind in recurrent_parts(frame.module)]
        wanted = {suffix for name, suffix, _ in named if self.wanted(name, frame.module)}
        tensors = recurrent_readings(frame.module, inputs, kwargs, output, wanted) if wanted else {}
        for name, suffix, kind in named:
            if suffix in tensors:
                self.axes.set(tensors[suffix], -1)
                self._sink(name, kind, None, tensors[suffix], frame.module)

    def _module_output(self, frame: _Frame, output) -> None:
        if frame.last is not None and frame.last[0] is output:
            name = self._name(frame.path)  # a wrapper that applies one activation: the reading is its own
            read = frame.last[1]
            read.name, read.module = (name, frame.module) if self.wanted(name, frame.module) else (None, None)
            return
        self._settle_last(frame)
        base = frame.path or root_name(frame.kind)
        if frame.kind is None or not base:
            return
        main = type(frame.module) in OPAQUE and isinstance(output, tuple)  # (output, state) or (output, weights)
        tensors = list(output_tensors(output))
        floats = any(t.is_floating_point() for _, t in tensors)
        for suffix, t in tensors:
            if suffix and floats and not t.is_floating_point():
                continue  # an index or a mask beside a float output (a router's top-k experts): no activation
            name = self._name(base + ("" if main and suffix == ".0" else suffix))
            # a parameterized module of another library is what its output's layer op made (GPT-2's Conv1D: linear)
            kind = (frame.kind == "other" and self.axes.made_by(t)) or frame.kind
            if self.shards is not None and is_dtensor(t) and _parallelized(frame.module) \
                    and self.wanted(name, frame.module):  # read once its own hook has made it local
                self.shards.hold(frame.module, t, self.axes.of(t), (name, kind, module_bounds(frame.module)))
            elif self.wanted(name, frame.module):
                self._sink(name, kind, module_bounds(frame.module), t, frame.module, defer=True)


_here = threading.local()  # `trace`: the trace whose forward runs in this thread now
_wrapped: list = [0, None]  # traces on in any thread, and the SDPA `_sdpa_call` stands in for
_lock = threading.Lock()


def _sdpa_wrapped(change: int) -> None:
    """Count a replaying trace on (+1) or off (-1): `F.scaled_dot_product_attention` is `_sdpa_call`
    while any is on, in any thread, and what it was before once none is."""
    if not change:
        return
    with _lock:
        if _wrapped[0] == 0 and change > 0:
            _wrapped[1] = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = functools.wraps(_wrapped[1])(_sdpa_call)
        _wrapped[0] += change
        if _wrapped[0] == 0:
            F.scaled_dot_product_attention = _wrapped[1]


def _sdpa_call(*args, **kwargs):
    """SDPA, then shown to the trace of this thread, if one is on (`ForwardTrace._sdpa_seen`)."""
    out = _wrapped[1](*args, **kwargs)
    trace = getattr(_here, "trace", None)
    if trace is not None:
        trace._sdpa_seen(args, kwargs, out)
    return out


def _parallelized(module: torch.nn.Module) -> bool:
    """A module `parallelize_module` distributed: a DTensor parameter of its own."""
    return any(is_dtensor(p) for p in module.parameters(recurse=False))


def output_heads(model: torch.nn.Module, paths: dict, patterns) -> set:
    """The modules whose output is the model's vocabulary logits: those `patterns` name (globs on
    module paths), and a Hugging Face model's own (`get_output_embeddings()`)."""
    heads = {m for m, path in paths.items() if any(fnmatch.fnmatchcase(path, p) for p in patterns)}
    own = getattr(model, "get_output_embeddings", None)
    try:
        head = own() if callable(own) else None
    except (AttributeError, NotImplementedError):  # a model class that declares none
        head = None
    return heads | ({head} if isinstance(head, torch.nn.Module) and head in paths else set())


def own_parameters(module: torch.nn.Module):
    """(name, parameter) of a module's own parameters, those its parametrizations compute a tensor
    from included (`weight.original0` of a weight-normed conv): what its gradients are read of. An
    FSDP1 unit's FlatParameter (its modules' parameters flattened: `fsdp.py`) is no layer's own."""
    yield from ((name, p) for name, p in module.named_parameters(recurse=False)
                if not getattr(p, "_is_flat_param", False))
    if parametrize.is_parametrized(module):
        for tensor, plist in module.parametrizations.items():
            for name, p in plist.named_parameters():
                yield f"{tensor}.{name}", p
