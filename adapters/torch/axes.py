"""Unit axis by construction (spec §Units): which axis of a tensor computed in a forward holds the
units, followed op by op from the op that made it. Layers that define units set it (features of
a linear or embedding last, channels of a convolution, norm or pool on axis 1; a softmax's are
the axis it normalizes, each distribution a row across them); elementwise ops keep it; permutes,
transposes, reshapes, indexing, reductions, cat and stack move it; any other op loses it
(`LOST`), and the reading then takes the whole tensor as one unit. Never a guess:
a tensor with no known history (an input, a parameter) carries nothing.
"""
from __future__ import annotations

import functools
import math
import re
import weakref

import torch

LOST = None  # a tensor whose unit axis could not be followed (distinct from "never seen")

# ops whose output's units are its last axis whatever came in
_LAST = frozenset({"linear", "bilinear", "embedding", "embedding_bag", "layer_norm", "rms_norm",
                   "lstm", "gru", "rnn_tanh", "rnn_relu", "multi_head_attention_forward"})
# ops whose output's units are axis 1 (channels), whatever the memory format
_CHANNELS = re.compile(r"^(conv\d?d|conv_transpose\dd|batch_norm|instance_norm|group_norm|local_response_norm|"
                       r"(adaptive_)?(max|avg|lp)_pool\dd(_with_indices)?|interpolate|upsample\w*|"
                       r"pixel_(un)?shuffle|channel_shuffle)$")
# ops that keep their input's shape (or broadcast it) and so its axis, besides aten's pointwise ops
_KEEP = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
                   "contiguous", "clone", "detach", "to", "float", "half",
                   "bfloat16", "double", "type", "type_as", "normalize", "pad", "masked_fill", "where", "glu",
                   "cumsum", "cumprod", "flip", "roll", "repeat", "expand", "expand_as", "index_select", "narrow",
                   "chunk", "split", "tensor_split", "hardswish", "requires_grad_", "cpu", "cuda",
                   "scaled_dot_product_attention", "tile", "broadcast_to", "masked_fill_", "copy_",
                   # activations that aten does not tag pointwise (Python compositions, composites)
                   "softsign", "relu6", "logsigmoid", "rrelu", "celu", "selu", "prelu", "hardsigmoid",
                   "special_expit", "clamp_min", "clamp_max"})
_RESHAPE = frozenset({"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as",
                      "squeeze_", "unsqueeze_", "ravel"})
_REDUCE = frozenset({"mean", "sum", "amax", "amin", "max", "min", "std", "var", "norm", "logsumexp", "prod",
                     "nanmean", "nansum", "median", "all", "any", "std_mean", "var_mean"})
_MATMUL = {"matmul": 1, "mm": 1, "bmm": 1, "__matmul__": 1, "__rmatmul__": 0, "addmm": 2, "baddbmm": 2,
           "addbmm": 2}


def op_name(func) -> str:
    """A torch function's plain name: `Tensor.__radd__` → `add`, `Tensor.T`'s getter → `T`; worked
    out once per function (every op of every traced forward asks)."""
    try:
        return _NAMES[func]
    except KeyError:
        name = _NAMES[func] = _plain_name(func)
        return name
    except TypeError:  # an unhashable callable
        return _plain_name(func)


_NAMES: dict = {}


def _plain_name(func) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "")
    if name in _MATMUL or name == "__getitem__" or not (name.startswith("__") and name.endswith("__")):
        return name
    core = name[2:-2]
    core = {"truediv": "div", "rtruediv": "div", "itruediv": "div_", "floordiv": "floor_divide"}.get(core, core)
    if core.startswith("i") and _pointwise(core[1:] + "_"):
        return core[1:] + "_"
    if core.startswith("r") and _pointwise(core[1:]):
        return core[1:]
    return core


# calls that read a tensor's metadata and change nothing: no event of the trace
QUERIES = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "is_sparse", "is_nested", "is_quantized",
                     "is_meta", "layout", "requires_grad", "names", "is_leaf", "size", "dim", "numel", "nelement",
                     "stride", "is_floating_point", "is_complex", "is_contiguous", "element_size", "get_device",
                     "data_ptr", "storage_offset", "__len__", "has_names"})


@functools.lru_cache(maxsize=None)
def _pointwise(name: str) -> bool:
    op = getattr(torch.ops.aten, name, None)
    try:
        return op is not None and any(torch.Tag.pointwise in getattr(op, o).tags for o in op.overloads())
    except (AttributeError, RuntimeError):
        return False


class TensorMap:
    """A map from tensors, by identity, that does not keep them alive: `torch.utils.weak`'s
    WeakIdKeyDictionary less its Python objects made at every lookup (each op's inputs are looked
    up here). A tensor's entry goes when the tensor does, before its id can be reused."""

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, object]] = {}

    def __setitem__(self, t: torch.Tensor, value) -> None:
        entries, key = self._entries, id(t)

        def forget(ref, key=key):  # the entry, unless it is already another's
            if entries.get(key, (None,))[0] is ref:
                del entries[key]
        entries[key] = (weakref.ref(t, forget), value)

    def get(self, t: torch.Tensor, default=None):
        entry = self._entries.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else default

    def __contains__(self, t: torch.Tensor) -> bool:
        return self.get(t, _ABSENT) is not _ABSENT

    def __getitem__(self, t: torch.Tensor):
        value = self.get(t, _ABSENT)
        if value is _ABSENT:
            raise KeyError(t)
        return value


_ABSENT = object()


def _tensors(value) -> list:
    """The tensors in a value: a tensor, or a tuple or list of them, nested."""
    if isinstance(value, torch.Tensor):
        return [value]
    found = []
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                found.append(v)
            elif isinstance(v, (tuple, list)):
                found += _tensors(v)
    return found


def arg(args, kwargs, i: int, name: str, default=None):
    """A call's argument given by position `i` or by keyword `name`."""
    if name in kwargs:
        return kwargs[name]
    return args[i] if len(args) > i else default


def _dims(value, ndim: int) -> list[int] | None:
    if value is None:
        return None
    return [d % ndim for d in ((value,) if isinstance(value, int) else value)]


def follow_reshape(shape_in, axis: int, shape_out) -> int | None:
    """Where a C-order reshape puts the unit axis: the output axis with the same size whose
    leading dimensions hold exactly the input's leading dimensions; LOST if there is none."""
    before, units = math.prod(shape_in[:axis]), shape_in[axis]
    lead = 1
    for j, size in enumerate(shape_out):
        if lead == before and size == units:
            return j
        lead *= size
        if lead > before:
            break
    return LOST


_MADE = {"linear": "linear", "bilinear": "linear", "embedding": "embedding", "embedding_bag": "embedding",
         "layer_norm": "norm", "rms_norm": "norm", "batch_norm": "norm", "instance_norm": "norm",
         "group_norm": "norm"}
_CARRY = _RESHAPE | {"to", "contiguous", "clone", "float", "half", "bfloat16", "double", "type_as"}


class Axes:
    """The unit axis of every tensor computed in one forward, and which layer op made it (weakly
    held: the maps do not keep activations alive)."""

    def __init__(self):
        self.known = TensorMap()
        self.made = TensorMap()

    def of(self, t: torch.Tensor) -> int | None:
        return self.known.get(t, LOST)

    @staticmethod
    def channels(t: torch.Tensor, spatial: tuple[int]) -> int | None:
        """Channels of a conv or pool output: axis 1 batched, 0 unbatched (`[C, L]`)."""
        return {spatial[0] + 2: 1, spatial[0] + 1: 0}.get(t.ndim, LOST)

    def state(self, t: torch.Tensor) -> tuple:
        """What is known of `t` (its unit axis, or that nothing is; its maker), to give another
        tensor that stands where `t` stood (`restore`)."""
        return self.known.get(t, _ABSENT), self.made.get(t)

    def restore(self, t: torch.Tensor, state: tuple) -> None:
        axis, made = state
        if axis is not _ABSENT:
            self.known[t] = axis
        if made is not None:
            self.made[t] = made

    def made_by(self, t: torch.Tensor) -> str | None:
        """The kind of layer op (linear, conv, norm, embedding) that made `t`, through reshapes."""
        return self.made.get(t)

    def _note_maker(self, name: str, args, out) -> None:
        how = _making(name)
        if how is None:
            return
        kind = how if how not in ("matmul", "carry") else None
        if how == "matmul":
            rhs = args[_MATMUL[name]] if len(args) > _MATMUL[name] else None
            kind = "linear" if isinstance(rhs, torch.Tensor) and rhs not in self.known else None
        elif how == "carry" and args and isinstance(args[0], torch.Tensor):
            kind = self.made.get(args[0])
        if kind is not None and isinstance(out, torch.Tensor):
            self.made[out] = kind

    def set(self, out, axis: int | None) -> None:
        for t in _tensors(out):
            self.known[t] = LOST if axis is None or not t.ndim else axis % t.ndim

    def follow(self, name: str, args, kwargs, out) -> None:
        """Tag the output(s) of the op `name` called on `args`, `kwargs` with their unit axis."""
        rule = _rule(name)
        self._note_maker(name, args, out)
        if rule == "last":
            outs = out[:1] if name == "multi_head_attention_forward" else out
            return self.set(outs, -1)
        if rule == "channels":
            out = out[0] if isinstance(out, tuple) else out
            spatial = re.search(r"(\d)d", name)
            return self.set(out, self.channels(out, (int(spatial[1]),)) if spatial else 1)
        if rule == "softmax":  # units: the axis it normalizes (spec §Units)
            dim = arg(args, kwargs, 1, "dim")
            return self.set(out, dim if isinstance(dim, int) else LOST)
        if rule == "matmul":
            return self.set(out, self._matmul(args[_MATMUL[name]] if len(args) > _MATMUL[name] else None))
        if rule == "einsum":
            return self.set(out, self._einsum(args))
        seen = self._seen(args, kwargs)
        if not seen:
            return None  # nothing known flowed in: the output stays unknown, not lost
        if rule == "keep":
            return self.set(out, _broadcast(seen, out, args))
        x, axis = seen[0]
        if axis is LOST:
            return self.set(out, LOST)
        if rule == "reshape":
            return self.set(out, follow_reshape(x.shape, axis, out.shape))
        if rule == "permute":
            return self.set(out, _permuted(name, x.ndim, axis, args[1:], kwargs))
        if rule == "reduce" and not any(isinstance(a, torch.Tensor) for a in args[1:]):
            return self.set(out[0] if isinstance(out, tuple) else out, _reduced(x.ndim, axis, args[1:], kwargs))
        if rule == "indexed":
            return self.set(out, _indexed(name, x, axis, seen, args, kwargs))
        return self.set(out, LOST)

    def _seen(self, args, kwargs) -> list:
        """(tensor, unit axis) of the call's inputs whose axis is known (LOST included)."""
        get, seen = self.known.get, []
        for t in _tensors(args):
            axis = get(t, _ABSENT)
            if axis is not _ABSENT:
                seen.append((t, axis))
        if kwargs:
            seen += [(t, axis) for t in _tensors(list(kwargs.values())) if (axis := get(t, _ABSENT)) is not _ABSENT]
        return seen

    def _einsum(self, args) -> int | None:
        """An einsum with one weight (a parameter, else the one operand with no history): units are
        the output subscript only the weight has ("bi,io->bo"); else where the activation's unit
        subscript lands; else lost."""
        parts = _einsum_parts(args)
        if parts is None:
            return LOST
        subs, out, ops = parts
        weights = [sub for sub, t in zip(subs, ops) if isinstance(t, torch.nn.Parameter)] or \
            [sub for sub, t in zip(subs, ops) if isinstance(t, torch.Tensor) and t not in self.known]
        acts = [(sub, self.known[t]) for sub, t in zip(subs, ops) if isinstance(t, torch.Tensor) and t in self.known]
        if len(weights) == 1:
            own = [c for c in out if c in weights[0] and not any(c in sub for sub, _ in acts)]
            if len(own) == 1:
                return out.index(own[0])
        units = {sub[axis] for sub, axis in acts if axis is not LOST}
        unit = units.pop() if len(units) == 1 else None
        return out.index(unit) if unit is not None and unit in out else LOST

    def _matmul(self, rhs) -> int | None:
        """x @ W: the output's last axis is W's last; units when W is a weight (no history) or an
        activation whose units are last."""
        if not isinstance(rhs, torch.Tensor):
            return LOST
        if rhs not in self.known:
            return -1
        axis = self.known[rhs]
        return -1 if axis is not LOST and axis == rhs.ndim - 1 else LOST


@functools.lru_cache(maxsize=None)
def _making(name: str) -> str | None:
    """How an op may make a layer's output (`Axes.made`): the kind it makes, "matmul" (a linear
    if its right operand is a weight), "carry" (its input's maker, through reshapes), or None."""
    if name in _MADE or name.startswith("conv"):
        return _MADE.get(name, "conv")
    return "matmul" if name in _MATMUL else "carry" if name in _CARRY else None


@functools.lru_cache(maxsize=None)
def _rule(name: str) -> str:
    """Which of `Axes.follow`'s rules an op's output takes, by its name."""
    if name in _LAST:
        return "last"
    if _CHANNELS.match(name):
        return "channels"
    if name in ("softmax", "log_softmax", "softmin"):
        return "softmax"
    if name in _MATMUL:
        return "matmul"
    if name == "einsum":
        return "einsum"
    if name in _KEEP or _pointwise(name):
        return "keep"
    if name in _RESHAPE:
        return "reshape"
    if name in ("permute", "transpose", "swapaxes", "swapdims", "t", "T", "mT", "mH", "movedim", "moveaxis"):
        return "permute"
    if name in _REDUCE:
        return "reduce"
    if name in ("cat", "concat", "concatenate", "stack", "unbind", "select", "__getitem__"):
        return "indexed"
    return "other"


def _einsum_parts(args) -> tuple[list[str], str, list] | None:
    if not args or not isinstance(args[0], str) or "->" not in args[0] or "." in args[0]:
        return None
    ops = list(args[1][0] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:])
    ins, out = args[0].replace(" ", "").split("->")
    return ins.split(","), out, ops


def _broadcast(seen, out, args=()) -> int | None:
    """Elementwise: every known input, aligned from the right, must agree on the output's axis;
    an input whose axis was lost may join only where it is broadcast along that axis (a
    per-position statistic such as an RMS norm's, reduced over the units with keepdim). Where every
    input's axis was lost, a parameter that varies along one axis of the output alone (a norm's
    gain, a bias: one number per unit) names the units."""
    ref = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(ref, torch.Tensor):
        return LOST
    axes = {ref.ndim - (x.ndim - axis) for x, axis in seen if axis is not LOST}
    if not axes:
        axes = {ref.ndim - p.ndim + i for p in args if isinstance(p, torch.nn.Parameter) and 0 < p.ndim <= ref.ndim
                and sum(n > 1 for n in p.shape) == 1 for i, n in enumerate(p.shape) if n > 1}
        return axes.pop() if len(axes) == 1 else LOST
    if len(axes) != 1:
        return LOST
    axis = axes.pop()
    for x, a in seen:
        at = axis - (ref.ndim - x.ndim)
        if a is LOST and at >= 0 and x.shape[at] != 1:
            return LOST
    return axis


def _permuted(name: str, ndim: int, axis: int, rest, kwargs) -> int | None:
    if name == "permute":
        dims = rest[0] if len(rest) == 1 and not isinstance(rest[0], int) else (rest or kwargs.get("dims"))
        return [d % ndim for d in dims].index(axis)
    if name in ("transpose", "swapaxes", "swapdims", "t", "T", "mT", "mH"):
        if name in ("t", "T"):
            a, b = 0, ndim - 1
        elif name in ("mT", "mH"):
            a, b = ndim - 2, ndim - 1
        else:
            a, b = _dims(arg(rest, kwargs, 0, "dim0"), ndim)[0], _dims(arg(rest, kwargs, 1, "dim1"), ndim)[0]
        return b if axis == a else a if axis == b else axis
    src = _dims(arg(rest, kwargs, 0, "source"), ndim)
    dst = _dims(arg(rest, kwargs, 1, "destination"), ndim)
    order = [d for d in range(ndim) if d not in src]
    for s, d in sorted(zip(dst, src)):
        order.insert(s, d)
    return order.index(axis)


def _reduced(ndim: int, axis: int, rest, kwargs) -> int | None:
    dims = _dims(arg(rest, kwargs, 0, "dim"), ndim)
    if dims is None or axis in dims:
        return LOST
    if arg(rest, kwargs, 1, "keepdim", False):
        return axis
    return axis - sum(d < axis for d in dims)


def _indexed(name: str, x: torch.Tensor, axis: int, seen, args, kwargs) -> int | None:
    if name in ("cat", "concat", "concatenate"):
        return axis if all(a == axis and t.ndim == x.ndim for t, a in seen) else LOST
    if name == "stack":
        dim = arg(args, kwargs, 1, "dim", 0) % (x.ndim + 1)
        return axis + (axis >= dim) if all(a == axis for _, a in seen) else LOST
    if name in ("unbind", "select"):
        dim = arg(args, kwargs, 1, "dim", 0) % x.ndim
        return LOST if dim == axis else axis - (dim < axis)
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    if any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) for i in index):
        return LOST  # advanced indexing
    consumed = sum(isinstance(i, (int, slice)) for i in index)
    pos_in, pos_out = 0, 0
    for i in index:
        if i is Ellipsis:
            skip = x.ndim - consumed
            if pos_in <= axis < pos_in + skip:
                return pos_out + axis - pos_in
            pos_in, pos_out = pos_in + skip, pos_out + skip
        elif i is None:
            pos_out += 1
        else:
            if pos_in == axis:
                return LOST if isinstance(i, int) else pos_out
            pos_in, pos_out = pos_in + 1, pos_out + (not isinstance(i, int))
    return pos_out + axis - pos_in
