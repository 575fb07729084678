"""Derived readings of a probe forward (spec §Derived readings): what an attention, an LM head and
an MoE router computed, as tensors the ordinary reductions read per head, per position, per expert.

Fused attention (SDPA, the fast path of `nn.MultiheadAttention`) never shows its scores, so they
are computed again, unfused, from the same queries, keys and masks: the probe is outside the
training step, so exact per-head numbers cost nothing there.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .axes import arg

# the kinds each source of derived readings gives, in the order it gives them
ATTENTION = ("attention_logit", "attention_entropy", "attention_sink")
LOGITS = ("log_z", "max_logit")
ROUTER = ("expert_load", "router_prob", "router_entropy")
_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights",
             "is_causal")


def attention(logits: torch.Tensor | None) -> dict[str, torch.Tensor] | None:
    """From pre-softmax scores `[B, H, Q, K]`, a masked key at −inf or at most half the dtype's
    lowest value (an additive mask): per head (axis 0) the logits of the (query, key) pairs no
    head masks, each query's entropy over its keys divided by ln(keys) (queries of 2 keys or more),
    and the mass on the first key it may attend. A NaN score stays: it is read as one."""
    if logits is None:
        return None
    lowest = torch.finfo(logits.dtype).min / 2
    x = logits.detach().float()
    keys = ~(x <= lowest).any(1)  # [B, Q, K]
    n = keys.sum(-1)
    p = torch.softmax(x.masked_fill(~keys[:, None], -math.inf), -1)  # a query with no key: NaN, left out
    heads = x.shape[1]
    entropy = torch.special.entr(p).sum(-1) / n.clamp(min=2).log()[:, None]
    first = keys.to(torch.int8).argmax(-1)  # the first key each query may attend
    sink = p.gather(-1, first[:, None, :, None].expand(-1, heads, -1, 1)).squeeze(-1)
    return {"attention_logit": x.transpose(0, 1)[:, keys], "attention_entropy": entropy.transpose(0, 1)[:, n >= 2],
            "attention_sink": sink.transpose(0, 1)[:, n >= 1]}


def sdpa_logits(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The scores `F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale,
    enable_gqa)` softmaxes, masked keys at −inf; None unless q is `[B, H, Q, E]`."""
    q, k = arg(args, kwargs, 0, "query"), arg(args, kwargs, 1, "key")
    mask, causal = arg(args, kwargs, 3, "attn_mask"), arg(args, kwargs, 5, "is_causal", False)
    scale = arg(args, kwargs, 6, "scale")
    if not isinstance(q, torch.Tensor) or q.ndim != 4 or not isinstance(k, torch.Tensor) or k.ndim != 4:
        return None
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each key head serves a group of query heads
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    x = (q.float() @ k.float().transpose(-2, -1)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if causal:
        x = x.masked_fill(~torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device).tril(), -math.inf)
    return _masked(x, mask, allowed=True)


def mha_logits(module: torch.nn.MultiheadAttention, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The scores of an `nn.MultiheadAttention` call, from its inputs, projections and masks; None
    for a layer with `add_bias_kv` or `add_zero_attn` (keys the inputs do not hold)."""
    a = dict(zip(_MHA_ARGS, args), **kwargs)
    q, k = a["query"], a["key"]
    if module.bias_k is not None or module.add_zero_attn:
        return None
    if q.ndim == 2:
        q, k = q[:, None], k[:, None]
    elif module.batch_first:
        q, k = q.transpose(0, 1), k.transpose(0, 1)
    e, heads = module.embed_dim, module.num_heads
    wq, wk = (module.in_proj_weight[:e], module.in_proj_weight[e:2 * e]) if module._qkv_same_embed_dim \
        else (module.q_proj_weight, module.k_proj_weight)
    b = module.in_proj_bias
    q = F.linear(q, wq, None if b is None else b[:e])
    k = F.linear(k, wk, None if b is None else b[e:2 * e])
    (lq, batch), s, d = q.shape[:2], k.shape[0], e // heads
    q = q.reshape(lq, batch, heads, d).permute(1, 2, 0, 3).float()
    k = k.reshape(s, batch, heads, d).permute(1, 2, 0, 3).float()
    x = (q @ k.transpose(-2, -1)) / math.sqrt(d)
    mask, padding = a.get("attn_mask"), a.get("key_padding_mask")
    if mask is not None and mask.ndim == 3:
        mask = mask.reshape(batch, heads, lq, s)
    x = _masked(x, mask, allowed=False)
    return _masked(x, None if padding is None else padding.reshape(batch, 1, 1, s), allowed=False)


def _masked(x: torch.Tensor, mask, allowed: bool) -> torch.Tensor:
    """Scores with a mask applied: a boolean one marks the keys `allowed` (SDPA) or those left out
    (`nn.MultiheadAttention`); a float one is added, its values at half the dtype's lowest or below
    leaving a key out (−inf)."""
    if mask is None:
        return x
    if mask.dtype == torch.bool:
        return x.masked_fill(~mask if allowed else mask, -math.inf)
    return (x + mask.float()).masked_fill(mask <= torch.finfo(mask.dtype).min / 2, -math.inf)


def output_logits(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per position of an LM head's output (vocabulary last): log-sum-exp (log Z) and the max logit."""
    x = logits.detach().float().reshape(-1, logits.shape[-1])
    return {"log_z": torch.logsumexp(x, -1), "max_logit": x.amax(-1)}


def routing(args: tuple, kwargs: dict) -> dict[str, torch.Tensor] | None:
    """A router's choice, from its `torch.topk(scores, k)` over experts (last axis): per expert
    (axis 0) and token, 1 where the token chose it (`expert_load`, whose sum per expert is its
    tokens) and the router's probability (the scores if they are some, else their softmax); per
    token the probabilities' entropy over ln(experts)."""
    scores, k = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "k")
    dim, largest = arg(args, kwargs, 2, "dim", -1), arg(args, kwargs, 3, "largest", True)
    if not (isinstance(scores, torch.Tensor) and scores.is_floating_point() and scores.ndim >= 2
            and dim in (-1, scores.ndim - 1) and largest and isinstance(k, int) and 0 < k < scores.shape[-1]):
        return None
    x = scores.detach().float().reshape(-1, scores.shape[-1])
    sums = x.sum(-1)
    p = x if bool((x >= 0).all() and torch.allclose(sums, torch.ones_like(sums), atol=1e-3)) else torch.softmax(x, -1)
    chosen = torch.zeros_like(x).scatter_(-1, x.topk(k, -1).indices, 1.0)
    return {"expert_load": chosen.T, "router_prob": p.T,
            "router_entropy": torch.special.entr(p).sum(-1) / math.log(x.shape[-1])}
