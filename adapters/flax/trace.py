"""One traced probe forward of a Flax model: every module output of a known kind and every
activation, found once in the forward's jaxpr and read from it on every later reading.

The forward is traced once (`jax.make_jaxpr`) with each module call intercepted (linen:
`nn.intercept_methods`; nnx: the module classes' `__call__`, for that trace only). A module's
output becomes an extra result of the jaxpr, and each call opens a `jax.named_scope` of its path,
so every equation knows its module. Activations are found in the jaxpr, so
a function taken before the trace (`nn.Sequential([..., nn.relu])`, `act=nn.gelu`) is found too:
- a named call: a `jit` of an activation (`silu`, `elu`, ...) or a `custom_jvp_call` of one (`relu`);
- the equations made inside one call of a `jax.nn` Python activation (`gelu`, `softmax`), known by
  their tracebacks; a bare `tanh` or `logistic` (sigmoid) primitive.
Names are the PyTorch adapter's: a module by its path (`blk.fc`), an activation as `SCOPE.FUNCTION`
(`blk.gelu`), repeats as `#2`, `#3`. Units are on the last axis (Flax is channels last), the last
few for a `DenseGeneral` with several feature axes (attention's heads × head size), or for a
softmax the axis it normalizes. Equations
inside a nested jaxpr (`nn.scan`, `nn.remat`, a `jax.jit` inside the model) are not read; `unread`
counts what is lost there.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import jax
import jax.extend.core as jc

from actrace.format.schema import activation_kind

_MODULE_KINDS = {  # linen and nnx class names
    "linear": ("Dense", "DenseGeneral", "Linear", "LinearGeneral", "Einsum"),
    "conv": ("Conv", "ConvTranspose", "ConvLocal"),
    "norm": ("LayerNorm", "BatchNorm", "GroupNorm", "RMSNorm", "InstanceNorm"),
    "embedding": ("Embed",),
    "attention": ("MultiHeadDotProductAttention", "MultiHeadAttention", "SelfAttention"),
    "prelu": ("PReLU",),
}
_KIND_OF = {name: kind for kind, names in _MODULE_KINDS.items() for name in names}
_NN_FILE = os.path.join("jax", "_src", "nn", "functions.py")
_PRIMITIVES = {"tanh": "tanh", "logistic": "sigmoid"}
_NN_FUNCTIONS = frozenset(name for name in dir(jax.nn) if not name.startswith("_"))


def module_kind(module) -> str | None:
    """The kind of a Flax module's output, from the Flax class it is (or derives from), or None."""
    return next((_KIND_OF[c.__name__] for c in type(module).__mro__
                 if c.__name__ in _KIND_OF and c.__module__.startswith("flax.")), None)


def feature_axes(module) -> int:
    """How many trailing axes of a module's output are its units: the features of a `DenseGeneral`
    or `LinearGeneral` given as a tuple (heads, head size) are one unit each, else the last axis."""
    features = getattr(module, "features", getattr(module, "out_features", None))
    return len(features) if isinstance(features, (tuple, list)) and len(features) > 1 else 1


@dataclass
class Read:
    """One tensor of the forward to read: its reading's name and kind, its jaxpr variable, how many
    trailing axes hold its units, and which axis (of the tensor with those merged) they are."""
    name: str
    kind: str
    var: object
    feature_axes: int = 1
    unit_axis: int | None = -1  # a softmax's own axis; None: one unit


class Calls:
    """Module calls of one forward: each runs in a named scope of its path (`MARK` + `blk.fc`), so
    every equation knows its module, and its (path, module, output) joins `found`. A module's call
    inside its own call (a subclass's `super().__call__`) is the same call."""
    MARK = "actrace:"

    def __init__(self):
        self.found, self.active = [], set()

    def call(self, path, module, run):
        if id(module) in self.active:
            return run()
        self.active.add(id(module))
        try:
            with jax.named_scope(self.MARK + ".".join(map(str, path))):
                out = run()
        finally:
            self.active.discard(id(module))
        self.found.append((path, module, out))
        return out


@contextlib.contextmanager
def linen_calls(calls: Calls):
    """Every linen module's `__call__`, through `calls`."""
    import flax.linen as nn

    def interceptor(next_fun, args, kwargs, context):
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        return calls.call(context.module.path, context.module, lambda: next_fun(*args, **kwargs))

    with nn.intercept_methods(interceptor):
        yield


@contextlib.contextmanager
def nnx_calls(model, calls: Calls):
    """Every call of one of `model`'s nnx modules, through `calls`. The module classes' `__call__`
    are patched for the duration only."""
    from flax import nnx
    modules = [(path, m) for path, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)]
    paths = {id(m): path for path, m in modules}
    saved = {t: t.__dict__.get("__call__") for t in {type(m) for _, m in modules}}

    def patched(original):
        def __call__(self, *args, **kwargs):
            if id(self) not in paths:
                return original(self, *args, **kwargs)
            return calls.call(paths[id(self)], self, lambda: original(self, *args, **kwargs))
        return __call__

    for t in saved:
        t.__call__ = patched(t.__call__)
    try:
        yield
    finally:
        for t, original in saved.items():
            if original is None:
                del t.__call__
            else:
                t.__call__ = original


def _named(eqn) -> str | None:
    """The activation a call equation is: `jit` of `silu`, `custom_jvp_call` of a `jit` of `relu`."""
    name = eqn.params.get("name")
    if eqn.primitive.name == "custom_jvp_call":
        inner = eqn.params["call_jaxpr"].jaxpr.eqns
        name = inner[0].params.get("name") if len(inner) == 1 else None
    return name if isinstance(name, str) and activation_kind(name) else None


def _python_activation(eqn):
    """(function, call site, offset) of the outermost `jax.nn` Python activation that made this
    equation: the call site is the caller's code and bytecode offset, so two calls on one line
    differ; the offset within the function only grows along one call, so a loop's next call shows."""
    tb = eqn.source_info.traceback
    codes, offsets = tb.raw_frames() if tb is not None else ([], [])  # innermost first
    for i in range(len(codes) - 1, -1, -1):
        code = codes[i]
        if code.co_filename.endswith(_NN_FILE) and activation_kind(code.co_name):
            site = (id(codes[i + 1]), offsets[i + 1]) if i + 1 < len(codes) else ()
            return code.co_name, site, offsets[i]
    return None


def activations(jaxpr) -> list[list]:
    """[equation index, function name, input, output variable, unit axis] of each activation at the
    jaxpr's top level: consecutive equations of one Python activation call are one activation, read
    at its last, its input the first one's. The unit axis is the last (-1), or a softmax's own (the
    axis its `reduce_max` runs along; None if several)."""
    out, call = [], None
    for i, eqn in enumerate(jaxpr.eqns):
        fname, site, offset = _named(eqn), None, -1
        if fname is None:
            made = _python_activation(eqn)
            if made is not None:
                fname, site, offset = made
            elif eqn.primitive.name in _PRIMITIVES:
                fname = _PRIMITIVES[eqn.primitive.name]
        if fname is not None and site is not None and call is not None and call[:2] == (fname, site) \
                and offset >= call[2]:
            out[-1][0], out[-1][3] = i, eqn.outvars[0]
        elif fname is not None:
            x = next((v for v in eqn.invars if not isinstance(v, jc.Literal)), None)
            out.append([i, fname, x, eqn.outvars[0], -1])
        if fname == "softmax" and eqn.primitive.name == "reduce_max":
            axes = eqn.params["axes"]
            out[-1][4] = axes[0] if len(axes) == 1 else None
        call = (fname, site, offset) if site is not None else None
    return out


def unread(jaxpr) -> int:
    """How many activations sit inside nested jaxprs (a scan, a remat, a jit), where none is read;
    the body of a `jax.nn` function (`glu`'s sigmoid) is that function's, not a layer's."""
    n = 0
    for eqn in jaxpr.eqns:
        if _named(eqn) is None and eqn.params.get("name") not in _NN_FUNCTIONS:
            for sub in jc.jaxprs_in_params(eqn.params):
                n += len(activations(sub)) + unread(sub)
    return n


def _scope(eqn) -> str:
    """The path of the innermost module call an equation was made in (`Calls`), "" for the root."""
    marked = [part for part in str(eqn.source_info.name_stack).split("/") if part.startswith(Calls.MARK)]
    return marked[-1].removeprefix(Calls.MARK) if marked else ""


class ProbeTrace:
    """The probe forward `forward(found, *args)` (which appends its module calls to `found`) traced
    once; `reads` are its readings in forward order, those `wanted(name)`; `dropped` names module
    outputs made inside a nested jaxpr."""

    def __init__(self, forward, args, wanted=lambda name: True):
        calls, kept = Calls(), []

        def traced(*a):
            forward(calls, *a)
            outer = getattr(jax.tree_util.tree_leaves(a)[-1], "_trace", None)
            self.dropped = []
            for path, module, out in calls.found:
                kind = module_kind(module)
                if kind and isinstance(out, jax.core.Tracer) and jax.numpy.issubdtype(out.dtype, jax.numpy.floating):
                    name = ".".join(map(str, path)) or kind
                    if getattr(out, "_trace", None) is outer:
                        kept.append((name, kind, out, feature_axes(module)))
                    elif name not in self.dropped:  # made inside a nested trace (nn.scan traces twice)
                        self.dropped.append(name)
            return [k[2] for k in kept]

        closed = jax.make_jaxpr(traced)(*args)
        jaxpr = closed.jaxpr
        made = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
        found_reads = [(made.get(var, -1), name, kind, None, var, axes, -1)  # (index, name, kind, input, output,
                       for (name, kind, _, axes), var in zip(kept, jaxpr.outvars)]  # feature axes, unit axis)
        for i, fname, invar, var, axis in activations(jaxpr):
            scope = _scope(jaxpr.eqns[i])
            found_reads.append((i, f"{scope}.{fname}" if scope else fname, activation_kind(fname), invar, var, 1, axis))
        counts: dict[str, int] = {}
        axes_of: dict = {}  # an elementwise activation of a head-split output keeps its units
        self.reads, self.kinds = [], {name: kind for name, kind, *_ in kept}
        for _, base, kind, invar, var, axes, axis in sorted(found_reads, key=lambda r: r[0]):
            if axis == -1 and getattr(invar, "aval", None) is not None and invar.aval.shape == var.aval.shape:
                axes = axes_of.get(invar, 1)
            axes_of[var] = axes
            n = counts[base] = counts.get(base, 0) + 1
            name = base if n == 1 else f"{base}#{n}"
            if wanted(name):
                self.reads.append(Read(name, kind, var, axes, axis))
        self.unread = unread(jaxpr)
        self.structure = jax.tree_util.tree_structure(args)
        reading = jaxpr.replace(outvars=[r.var for r in self.reads])
        self._run = jax.jit(jc.jaxpr_as_fun(jc.ClosedJaxpr(reading, closed.consts)))

    def __call__(self, *args) -> list:
        """The value of every read tensor for these arguments (the traced ones' structure)."""
        if jax.tree_util.tree_structure(args) != self.structure:
            raise ValueError(f"actrace: the probe forward was traced for arguments {self.structure}, "
                             f"not {jax.tree_util.tree_structure(args)}")
        return self._run(*jax.tree_util.tree_leaves(args))
