"""What a PyTorch module or function computes, as the spec's layer kinds (spec §Kinds).

Modules of `torch.nn` by class; modules of other libraries (Hugging Face's `GELUActivation`,
timm's `Swish`) by a class name that says the activation it is; functional calls
(`F.silu`, `torch.tanh`, `Tensor.relu_`, softmax) by function name, with bounds from their arguments.
"""
from __future__ import annotations

import functools
import re

import torch
from torch import nn

from actrace.format.schema import ACTIVATION_KINDS, activation_kind, clamp_kind

from .axes import arg as _arg

_NN_ACTIVATIONS: list[tuple[type, str]] = [
    (nn.ReLU, "relu"), (nn.LeakyReLU, "leaky_relu"), (nn.RReLU, "leaky_relu"),
    (nn.PReLU, "prelu"), (nn.ELU, "elu"), (nn.CELU, "elu"), (nn.SELU, "selu"), (nn.GELU, "gelu"),
    (nn.SiLU, "silu"), (nn.Mish, "mish"), (nn.Softplus, "softplus"), (nn.Hardswish, "hard_swish"),
    (nn.Tanh, "tanh"), (nn.Softsign, "softsign"), (nn.Sigmoid, "sigmoid"),
    (nn.Hardsigmoid, "hard_sigmoid"), (nn.Softmax, "softmax"),
]
_NN_LAYERS: list[tuple[tuple[type, ...], str]] = [
    ((nn.Linear, nn.Bilinear), "linear"),
    ((nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d), "conv"),
    ((nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm), "norm"),
    ((nn.Embedding, nn.EmbeddingBag), "embedding"),
    ((nn.MultiheadAttention,), "attention"),
]
# an activation class name's core, between prefixes and suffixes that say nothing of the function
_CLASS = re.compile(r"^(?:pytorch|new|fast|quick|accurate|approx(?:imate)?)?(?P<core>[a-z0-9]+?)"
                    r"(?:activation|act|layer|module|fn)?$")
ACTIVATIONS = ACTIVATION_KINDS

# `torch.nn` modules read only at their output, their insides untraced (one op each, on its fast
# path): the unit axis of the output (an axis, (spatial dims,) for channels, or SAME as the
# input's) and the layer op that makes it. Exact classes: a subclass may compute otherwise.
SAME = "same"
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_POOL = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
         nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
         nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)
OPAQUE: dict[type, tuple] = {
    nn.Linear: (-1, "linear"), nn.Bilinear: (-1, "linear"), nn.Embedding: (-1, "embedding"),
    nn.LayerNorm: (-1, "norm"), nn.RMSNorm: (-1, "norm"), nn.MultiheadAttention: (-1, None),
    nn.RNN: (-1, None), nn.LSTM: (-1, None), nn.GRU: (-1, None),
    nn.BatchNorm1d: (1, "norm"), nn.BatchNorm2d: (1, "norm"), nn.BatchNorm3d: (1, "norm"), nn.GroupNorm: (1, "norm"),
    **{cls: ((int(cls.__name__[-2]),), "conv") for cls in _CONV},
    **{cls: ((int(cls.__name__[-2]),), None) for cls in _POOL},
    **{cls: (SAME, None) for cls in (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)},
    **{cls: (SAME, None) for cls, _ in _NN_ACTIVATIONS if cls is not nn.Softmax},
    nn.Hardtanh: (SAME, None), nn.ReLU6: (SAME, None),  # clamps, whose kind `module_kind` takes from their bounds
}

# `torch.nn` modules whose forward takes a fused fast path that skips their submodules where no
# torch-function mode is on: a module holding one is replayed with the trace's mode on (`trace`)
MODE_AWARE = (nn.TransformerEncoder, nn.TransformerEncoderLayer)


def module_kind(module: nn.Module) -> str | None:
    """The spec's kind of a module's output, or None for a module that is not read (containers,
    dropout, pooling: their work shows in the layers around them)."""
    if isinstance(module, nn.Hardtanh):  # and ReLU6, its subclass: a clamp, by the spec's one rule
        return clamp_kind(module.min_val, module.max_val)[0]
    for cls, kind in _NN_ACTIVATIONS:
        if isinstance(module, cls):
            return kind
    for classes, kind in _NN_LAYERS:
        if isinstance(module, classes):
            return kind
    name = type(module).__name__.lower()
    if not any(True for _ in module.children()):
        core = _CLASS.match(re.sub(r"[^a-z0-9]", "", name))
        if core and activation_kind(core["core"]):
            return activation_kind(core["core"])
    if holds_parameters(module):
        return "norm" if "norm" in name else "embedding" if "embed" in name else "other"
    return None


def holds_parameters(module: nn.Module) -> bool:
    """Whether a module has parameters of its own: registered (an FSDP1 unit's FlatParameter is the
    unit's, not its wrapper's), or flattened into its unit's by FSDP1 under use_orig_params=False,
    which leaves them plain tensors of the module."""
    if any(not getattr(p, "_is_flat_param", False) for p in module.parameters(recurse=False)):
        return True
    return getattr(module, "_fsdp_use_orig_params", None) is False and any(
        isinstance(v, torch.Tensor) for v in vars(module).values())


def module_bounds(module: nn.Module) -> tuple[float, float] | None:
    """A module's own saturation bounds (a clip's), over its kind's."""
    return clamp_kind(module.min_val, module.max_val)[1] if isinstance(module, nn.Hardtanh) else None


def function_kind(name: str, args: tuple, kwargs: dict) -> tuple[str, tuple[float, float] | None] | None:
    """(kind, bounds) of a functional activation call, or None for any other call; a clamp
    (`clamp`, `clip`, `hardtanh`, `relu6`) by the spec's one rule (`schema.clamp_kind`)."""
    base = name.rstrip("_")
    if base in ("clamp", "clip", "clamp_min", "hardtanh"):
        lo, hi = (_arg(args, kwargs, 1, "min_val", -1.0), _arg(args, kwargs, 2, "max_val", 1.0)) if base == "hardtanh" \
            else (_arg(args, kwargs, 1, "min"), None if base == "clamp_min" else _arg(args, kwargs, 2, "max"))
        numbers = all(v is None or isinstance(v, (int, float)) for v in (lo, hi))
        return clamp_kind(lo, hi) if numbers else None  # a clamp to tensors is elementwise: a guard
    return _activation(base)


@functools.lru_cache(maxsize=None)
def _activation(name: str) -> tuple[str, None] | None:
    kind = activation_kind(name)
    return (kind, None) if kind else None


# what says a module is an attention (the scope of a softmax over its scores) or a router of experts
# (the scope of a top-k over them), by its class name or the last segment of its path (spec §Derived
# readings); CamelCase and snake_case split into words first
_ATTENTION_WORDS = {"attention", "attn", "selfattention", "crossattention", "mha"}
_ROUTER_WORDS = {"router", "gate", "gating", "moe", "switch"}
# a router's count of experts: its scores' last axis must hold that many
_EXPERTS = ("num_experts", "num_local_experts", "n_experts", "n_routed_experts", "moe_num_experts")


def _words(module: nn.Module, path: str) -> set[str]:
    names = (type(module).__name__, path.rsplit(".", 1)[-1])
    return {w.lower() for name in names for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", name)}


def attends(module: nn.Module | None, path: str) -> bool:
    """Whether a softmax over the last axis of a 4-D tensor inside `module` is an attention's: the
    module says attention (`LlamaAttention`, `self_attn`, `MultiHeadSelfAttn`)."""
    return module is not None and bool(_words(module, path) & _ATTENTION_WORDS)


def routes(module: nn.Module | None, path: str, experts: int | None = None) -> bool:
    """Whether a top-k over `experts` scores inside `module` is a router's choice of experts: the
    module says router or gate (`MixtralTopKRouter`, `mlp.gate`), and where it holds a count of
    experts (`num_experts`, ...) the scores hold that many."""
    if module is None or not _words(module, path) & _ROUTER_WORDS:
        return False
    counts = [getattr(module, a) for a in _EXPERTS if isinstance(getattr(module, a, None), int)]
    return not counts or experts in counts
