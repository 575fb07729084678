"""What an exported ONNX graph's nodes were in the source framework: one reading per layer.

Exporters break layers into pieces (Linear → MatMul + Add, SiLU → Sigmoid + Mul, GELU → Erf or
Tanh chains, BatchNorm folded into Conv, attention into MatMuls and a Softmax). `layers()` finds
those patterns and names each layer by the module scope the exporter left behind (TorchScript's
`/layer1/layer1.0/conv1/Conv`, the dynamo exporter's `pkg.torch.onnx.name_scopes`), the way the
PyTorch adapter names the same layer. Unit axes follow from the ops that made each tensor; where
they cannot be followed the reading is one unit (`axis` None), never a guess.
"""
from __future__ import annotations

import math

import numpy as np
from dataclasses import dataclass

from actrace.format.schema import clamp_kind

from .recurrent import OPS as RECURRENT_OPS
from .recurrent import Op

ACTIVATION_OPS = {
    "Relu": "relu", "LeakyRelu": "leaky_relu", "PRelu": "prelu", "Elu": "elu", "Celu": "elu", "Selu": "selu",
    "Gelu": "gelu", "Mish": "mish", "Softplus": "softplus", "HardSwish": "hard_swish", "Tanh": "tanh",
    "Softsign": "softsign", "Sigmoid": "sigmoid", "HardSigmoid": "hard_sigmoid", "Softmax": "softmax",
    "Clip": "clip",
}
NORM_OPS = {"BatchNormalization", "InstanceNormalization", "GroupNormalization", "LayerNormalization"}
OP_KINDS = {**ACTIVATION_OPS, "Gemm": "linear", "MatMul": "linear", "Conv": "conv", "ConvTranspose": "conv",
            **dict.fromkeys(NORM_OPS, "norm")}
CHANNELS = {"Conv", "ConvTranspose", "BatchNormalization", "InstanceNormalization", "GroupNormalization",
            "MaxPool", "AveragePool", "LpPool"}  # outputs whose units are axis 1
KEEP = set(ACTIVATION_OPS) | {"Add", "Sub", "Mul", "Div", "Pow", "Neg", "Abs", "Sqrt", "Exp", "Log", "Erf",
                              "Dropout", "Identity", "Cast", "Resize", "Upsample", "Pad", "Where", "Max", "Min",
                              "LogSoftmax", "Reciprocal", "Floor", "Ceil", "Round", "Sign", "Not", "Equal"}


@dataclass
class Layer:
    name: str
    output: str
    kind: str
    bounds: tuple[float, float] | None
    axis: int | None  # from the start if >= 0, from the end if < 0; None: one unit
    input: str = ""   # the tensor a ReLU rectifies: read from that tensor's pass when it is read too
    recurrent: Op | None = None  # a reading of a recurrent node (its `part`), computed from the node's tensors
    part: str = ""
    scores: bool = False  # an attention's scores `[B, H, Q, K]` (`output`): its derived readings, per head
    attention: object = None  # the Attention op (opset 23) whose raw scaled scores `output` is: its mask applies


class Graph:
    """Producers, consumers, constants, inferred shapes and module scopes of an ONNX graph."""

    def __init__(self, model, input_axes: dict[str, int] | None = None):
        import onnx

        try:
            shapes = onnx.shape_inference.infer_shapes(_without_weights(model)).graph
        except Exception:  # shapes help follow Reshape and Flatten; without them those lose the axis
            shapes = model.graph
        g = model.graph
        self.nodes = list(g.node)
        self.const = {i.name for i in g.initializer} | {o for n in self.nodes if n.op_type == "Constant"
                                                        for o in n.output}
        self.init = {i.name: i for i in g.initializer}
        self.producer = {o: n for n in self.nodes for o in n.output}
        self.consumers: dict[str, list] = {}
        for n in self.nodes:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.shape = {}
        for v in list(shapes.value_info) + list(shapes.input) + list(shapes.output):
            t = v.type.tensor_type
            if t.HasField("shape"):
                self.shape[v.name] = [d.dim_value if d.HasField("dim_value") else d.dim_param or None
                                      for d in t.shape.dim]
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
        self.input_axes = dict(input_axes or {})
        self.graph_inputs = [i.name for i in g.input if i.name not in self.const]

    def is_const(self, name: str) -> bool:
        n = self.producer.get(name)
        return name in self.const or (n is not None and n.op_type == "Identity" and self.is_const(n.input[0]))

    def constant(self, name: str):
        """The value of a constant tensor (an initializer, a `Constant` node's, or an Identity of
        either) as a numpy array, else None."""
        from onnx import helper, numpy_helper

        if name in self.init:
            return numpy_helper.to_array(self.init[name])
        n = self.producer.get(name)
        if n is not None and n.op_type == "Identity":
            return self.constant(n.input[0])
        if n is not None and n.op_type == "Constant" and n.attribute:
            value = helper.get_attribute_value(n.attribute[0])
            return numpy_helper.to_array(value) if hasattr(value, "dims") else np.asarray(value)
        return None

    def data_inputs(self, node) -> list[str]:
        return [i for i in node.input if i and not self.is_const(i)]

    def only_consumer(self, name: str):
        c = self.consumers.get(name, [])
        return c[0] if len(c) == 1 else None


def _without_weights(model):
    """The model with its large initializers declared as typed inputs instead: shape inference
    needs their shapes, not their values, and serializing the weights dominated its cost."""
    import onnx

    light = onnx.ModelProto(ir_version=model.ir_version)
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    g = light.graph
    g.node.extend(model.graph.node)
    g.input.extend(model.graph.input)
    g.output.extend(model.graph.output)
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL or math.prod(init.dims) > 64:
            g.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
        else:
            g.initializer.append(init)
    return light


def scope(node) -> tuple[str | None, str | None]:
    """(module path, module class) of the module the node ran in; (None, None) when the exporter
    left no scope. TorchScript names nodes `/layer1/layer1.0/conv1/Conv_2` (a segment may repeat
    its parents' path); the dynamo exporter leaves `pkg.torch.onnx.name_scopes`/`class_hierarchy`."""
    meta = {p.key: p.value for p in node.metadata_props}
    if "pkg.torch.onnx.name_scopes" in meta:
        scopes = _eval_list(meta["pkg.torch.onnx.name_scopes"])
        classes = _eval_list(meta.get("pkg.torch.onnx.class_hierarchy", "[]"))
        return (scopes[-2] if len(scopes) >= 2 else ""), (classes[-2] if len(classes) >= 2 else None)
    if not node.name.startswith("/"):
        return None, None
    path = ""
    for seg in node.name.split("/")[1:-1]:
        path = seg if not path or seg.startswith(path + ".") else f"{path}.{seg}"
    return path, None


def _eval_list(text: str) -> list[str]:
    """A Python list literal of strings, as the dynamo exporter writes its metadata."""
    import ast

    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return []
    return [str(v) for v in value] if isinstance(value, list) else []


def _chain_to(graph: Graph, start, root: str, limit: int = 5):
    """From `start`, the chain of single-consumer Add/Mul/Div nodes whose other operand is a
    constant or `root`; the chain's last node if one of them multiplied by `root` (the tail of
    `x * f(x)` forms: SiLU, Mish, GELU), else None."""
    node, seen_root, last = start, False, None
    for _ in range(limit):
        nxt = graph.only_consumer(node.output[0])
        if nxt is None or nxt.op_type not in ("Add", "Mul", "Div"):
            break
        others = [i for i in nxt.input if i != node.output[0]]
        if not all(graph.is_const(o) or o == root for o in others):
            break
        seen_root |= nxt.op_type == "Mul" and root in others
        node, last = nxt, nxt
    return last if seen_root else None


def _root_of(graph: Graph, node) -> tuple[str | None, str | None]:
    """The tensor x and the kind of a decomposed activation whose Erf or Tanh `node` is:
    Erf(x / √2) → gelu, Tanh(c · (x + c·x³)) → gelu (tanh form), Tanh(Softplus(x)) → mish."""
    p = graph.producer.get(node.input[0])
    data = graph.data_inputs(p) if p is not None else []
    if p is None or len(data) != 1:
        return None, None
    if node.op_type == "Erf":
        return (data[0], "gelu") if p.op_type in ("Div", "Mul") else (None, None)
    if p.op_type == "Softplus":
        return data[0], "mish"
    q = graph.producer.get(data[0]) if p.op_type == "Mul" else None
    pair = graph.data_inputs(q) if q is not None and q.op_type == "Add" else []
    for x, cube in ((pair, pair[::-1]) if len(pair) == 2 else ()):
        if _derives(graph, cube, x):
            return x, "gelu"
    return None, None


def _derives(graph: Graph, t: str, x: str, limit: int = 4) -> bool:
    """Whether `t` is made from `x` by Mul/Pow nodes alone (x·x·x, c·x³, x^3)."""
    p = graph.producer.get(t)
    if limit == 0 or p is None or p.op_type not in ("Mul", "Pow"):
        return False
    return all(i == x or _derives(graph, i, x, limit - 1) for i in graph.data_inputs(p))


def _decomposed(graph: Graph, node) -> tuple[str, object, set[int]] | None:
    """A decomposed activation whose piece `node` is: (kind, the node giving its output, ids of
    the internal pieces) for SiLU/Swish, HardSwish, Mish and GELU (erf and tanh forms)."""
    if node.op_type in ("Sigmoid", "HardSigmoid"):
        mul = graph.only_consumer(node.output[0])
        if mul is not None and mul.op_type == "Mul" and node.input[0] in mul.input:
            return ("silu" if node.op_type == "Sigmoid" else "hard_swish"), mul, {id(node)}
        return None
    if node.op_type not in ("Erf", "Tanh"):
        return None
    root, kind = _root_of(graph, node)
    end = _chain_to(graph, node, root) if root else None
    if end is None:
        return None
    internal = {id(node)} | {id(graph.producer[i]) for i in node.input if i in graph.producer
                             and graph.producer[i].op_type == "Softplus"}
    return kind, end, internal


def _is_folded_bn(graph: Graph, node, module: str | None, cls: str | None) -> bool:
    """A Conv into which the exporter folded a BatchNorm: the dynamo exporter scopes it to the
    BatchNorm module; TorchScript renames its weight (`onnx::Conv_20`, not `conv1.weight`)."""
    if cls is not None:
        return "BatchNorm" in cls
    weight = node.input[1] if len(node.input) > 1 else ""
    return module is not None and weight in graph.init and not weight.startswith(module + ".") \
        and weight.startswith("onnx::")


def layers(model, input_axes: dict[str, int] | None = None) -> list[Layer]:
    """The framework's layers in graph order, each read at its output, named by module scope."""
    graph = Graph(model, input_axes)
    axes = _axes(graph)
    attention = {scope(n)[0] for n in graph.nodes if n.op_type == "MatMul" and len(graph.data_inputs(n)) == 2
                 or n.op_type == "Attention"}
    attention.discard(None)
    found: list[tuple[object, str, str | None, str | None, tuple]] = []  # (node, kind, module, cls, bounds)
    internal: set[int] = set()
    ends: dict[int, str] = {}  # a decomposed activation's last node → its kind
    for node in graph.nodes:
        piece = _decomposed(graph, node)
        if piece is not None:
            kind, end, inside = piece
            internal |= inside
            ends[id(end)] = kind
    for node in graph.nodes:
        if id(node) in internal or not node.output or not (node.output[0] or node.op_type in RECURRENT_OPS):
            continue
        module, cls = scope(node)
        if id(node) in ends:
            found.append((node, ends[id(node)], module, cls, None))
            continue
        op = node.op_type
        if op == "MatMul":
            if len(graph.data_inputs(node)) != 1:
                continue  # activation × activation: attention scores or their values, internal
            add = graph.only_consumer(node.output[0])
            if add is not None and add.op_type == "Add" and any(graph.is_const(i) for i in add.input):
                internal.add(id(add))
                node = add
            found.append((node, "linear", module, cls, None))
        elif op == "Gather" and node.input[0] in graph.init and len(graph.init[node.input[0]].dims) == 2 \
                and not graph.is_const(node.input[1]):
            found.append((node, "embedding", module, cls, None))  # a lookup in a weight table
        elif op in RECURRENT_OPS:
            found.append((node, "recurrent", module, cls, None))
        elif op == "Attention" and node.domain in ("", "ai.onnx"):
            found.append((node, "attention_op", module, cls, None))  # its scores, exposed, give the heads' numbers
        elif op in ("Gemm", "Conv", "ConvTranspose") or op in NORM_OPS:
            kind = OP_KINDS[op]
            if op == "Conv" and _is_folded_bn(graph, node, module, cls):
                kind, module = "norm", module if cls is not None else f"{module}+bn"
            found.append((node, kind, module, cls, None))
        elif op in ACTIVATION_OPS:
            kind, bounds = ACTIVATION_OPS[op], None
            if op == "Clip":
                kind, bounds = _clip(graph, node)
                if kind is None:
                    continue  # a one-sided guard (F.normalize's eps), not an activation
            if op == "Softmax" and module in attention:  # attention weights: internal to the attention block,
                if len(graph.shape.get(node.input[0]) or []) == 4 and _softmax_axis(graph, node) in (-1, 3):
                    found.append((node, "scores", module, cls, None))  # its scores give the heads' numbers
                continue
            found.append((node, kind, module, cls, bounds))
    return _named(graph, found, attention, axes)


def _clip(graph: Graph, node) -> tuple[str | None, tuple | None]:
    """(kind, bounds) of a Clip by the spec's one clamp rule (`schema.clamp_kind`)."""
    attrs = {a.name: a for a in node.attribute}
    if "min" in attrs or "max" in attrs:  # opset < 11
        lo, hi = (attrs["min"].f if "min" in attrs else None), (attrs["max"].f if "max" in attrs else None)
    else:
        values = [graph.constant(name) if name else None for name in (list(node.input[1:3]) + ["", ""])[:2]]
        lo, hi = (None if v is None else float(v) for v in values)
    return clamp_kind(lo, hi) or (None, None)


def _named(graph: Graph, found, attention: set, axes: dict) -> list[Layer]:
    """Names like the PyTorch adapter's: a module's output by its path, an activation called inside
    another module's forward as `PATH.function` (`#k` for repeats); the last linear of an attention
    block is the block's output, kind `attention`, and its other linears are internal."""
    last_in_block = {}
    for node, kind, module, cls, _ in found:
        if kind == "linear" and module in attention:
            last_in_block[module] = id(node)
    owned = _sole_owners(graph, found)
    out, seen = [], {}
    for node, kind, module, cls, bounds in found:
        if kind == "recurrent":  # one node per layer of the module: l0, l1, ... in graph order
            prefix = module or node.name or node.output[0]
            index = seen[prefix + "/recurrent"] = seen.get(prefix + "/recurrent", -1) + 1
            op = Op(graph, node)
            out += [Layer(f"{prefix}.{part.replace('l0', f'l{index}', 1)}", f"{node.name or prefix}:{part}", k,
                          None, -1, recurrent=op, part=part) for part, k in op.parts()]
            continue
        if kind == "scores":  # named as the PyTorch adapter names the scope's derived readings
            out.append(Layer(module or node.name, node.input[0], "attention_logit", None, 1, scores=True))
            continue
        if kind == "attention_op":
            qk = node.output[3] if len(node.output) > 3 and node.output[3] else f"{node.output[0]}/actrace_scores"
            out.append(Layer(module or node.name, qk, "attention_logit", None, 1, scores=True, attention=node))
            continue
        if kind == "linear" and module in attention:
            if last_in_block[module] != id(node):
                continue
            kind = "attention"
        if module is None:
            name = node.name or node.output[0]
        elif kind in ("linear", "conv", "norm", "attention", "embedding") or _is_module(node, kind, module, cls, owned):
            name = module or kind
        else:
            name = f"{module}.{kind}" if module else kind
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name = f"{name}#{seen[name]}"
        out.append(Layer(name, node.output[0], kind, bounds, axes.get(node.output[0]),
                         node.input[0] if node.op_type == "Relu" else ""))
    return out


def _sole_owners(graph: Graph, found) -> set[str]:
    """Module scopes (TorchScript) whose only computing nodes are one found activation's: that
    scope is the activation module itself, not a module that calls it."""
    compute = {}
    for n in graph.nodes:
        module = scope(n)[0]
        if module is not None and n.op_type not in ("Constant", "Shape", "Gather", "Unsqueeze", "Concat"):
            compute.setdefault(module, []).append(n)
    activations = {}
    for node, kind, module, _, _ in found:
        if kind not in ("linear", "conv", "norm", "embedding"):
            activations.setdefault(module, []).append(node)
    parents = {m.rsplit(".", 1)[0] for m in compute if "." in m}
    return {m for m, acts in activations.items() if len(acts) == 1 and m and m not in parents and all(
        n.op_type in KEEP for n in compute.get(m, []))}


def _is_module(node, kind: str, module: str, cls: str | None, owned: set[str]) -> bool:
    """Whether the activation is the module itself (named by its path) rather than a call inside a
    bigger module's forward: torch.nn's activation classes (dynamo's class hierarchy says), or any
    leaf module whose only computing nodes are the activation's (HF's GELUActivation and the like)."""
    return (cls is not None and ".activation." in cls) or module in owned


def _axes(graph: Graph) -> dict[str, int | None]:
    """Each tensor's unit axis, following from the op that made it (module docstring)."""
    axes: dict[str, int | None] = {name: graph.input_axes.get(name) for name in graph.graph_inputs}
    for node in graph.nodes:
        op, data = node.op_type, graph.data_inputs(node)
        src = axes.get(data[0]) if data else None
        if op in CHANNELS:
            axis = 1
        elif op in ("Gemm", "LayerNormalization") or (op == "MatMul" and len(data) == 1) or (
                op == "Gather" and node.input[0] in graph.init and len(graph.init[node.input[0]].dims) == 2):
            axis = -1  # features last (an embedding lookup's too)
        elif op in ("Softmax", "LogSoftmax"):
            axis = _softmax_axis(graph, node)
        elif op in KEEP:
            axis = src
        elif op == "Transpose" and src is not None:
            perm = [a.ints for a in node.attribute if a.name == "perm"]
            axis = list(perm[0]).index(src % len(perm[0])) if perm else None
        elif op in ("Reshape", "Flatten") and src is not None:
            axis = _reshaped(graph.shape.get(data[0]), graph.shape.get(node.output[0]), src)
        elif op in ("Concat", "Split", "Gather", "Slice", "ReduceMean", "ReduceSum", "ReduceMax",
                    "GlobalAveragePool", "GlobalMaxPool"):
            axis = _kept_by(graph, node, op, src)
        else:
            axis = None
        for out in node.output:
            axes[out] = axis
    return axes


def _softmax_axis(graph: Graph, node) -> int | None:
    """A softmax's units are the axis it normalizes: `axis` (default -1) from opset 13; before, the
    axes from `axis` (default 1) on, flattened, which is one axis only when it is the last."""
    attrs = {a.name: a.i for a in node.attribute}
    if graph.opset >= 13:
        return attrs.get("axis", -1)
    rank = len(graph.shape.get(node.input[0]) or [])
    return -1 if rank and attrs.get("axis", 1) % rank == rank - 1 else None


def _kept_by(graph: Graph, node, op: str, src: int | None) -> int | None:
    """The unit axis through an op that acts along other axes; None if it touches the unit axis
    (or changes the rank in a way not followed here)."""
    if src is None:
        return None
    if op in ("GlobalAveragePool", "GlobalMaxPool"):
        return src if src == 1 else None
    attrs = {a.name: a for a in node.attribute}
    rank = len(graph.shape.get(node.input[0]) or []) or None
    pos = src % rank if rank else src
    if op in ("Concat", "Split", "Gather"):
        axis = attrs["axis"].i if "axis" in attrs else 0
        return src if rank and axis % rank != pos else None
    if op.startswith("Reduce"):
        keep = attrs.get("keepdims")
        return src if (keep is None or keep.i) and _axes_attr(graph, node, rank, pos) else None
    if op == "Slice":
        return src if _axes_attr(graph, node, rank, pos) else None
    return None


def _axes_attr(graph: Graph, node, rank: int | None, pos: int) -> bool:
    """Whether the axes a Reduce*/Slice node acts on are known and leave out `pos`."""
    attrs = {a.name: a for a in node.attribute}
    if "axes" in attrs:
        axes = list(attrs["axes"].ints)
    else:
        name = node.input[3] if node.op_type == "Slice" and len(node.input) > 3 else \
            node.input[1] if node.op_type != "Slice" and len(node.input) > 1 else ""
        value = graph.constant(name) if name else None
        if value is None:
            return False
        axes = value.reshape(-1).tolist()
    return bool(rank) and pos not in [a % rank for a in axes]


def _reshaped(before, after, src: int) -> int | None:
    """The unit axis after a reshape (C order): followed when it is the last axis before and after
    with one size, or when the dims before it multiply to the same size and it keeps its size
    (shapes from ONNX shape inference)."""
    if not before or not after:
        return None
    pos = src % len(before)
    if pos == len(before) - 1 and isinstance(before[-1], int) and before[-1] == after[-1]:
        return len(after) - 1
    if not all(isinstance(d, int) and d > 0 for d in before[1: pos + 1] + after[1:]):
        return None
    size, lead = before[pos], 1
    for d in before[1:pos]:
        lead *= d
    acc = 1
    for j, d in enumerate(after[1:], 1):
        if acc == lead and d == size:
            return j
        acc *= d
    return None
