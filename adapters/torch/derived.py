"""Derived readings of a probe forward (spec §Derived readings): what an attention, an LM head and
an MoE router computed, as tensors the ordinary reductions read per head, per position, per expert.

Fused attention (SDPA, the fast path of `nn.MultiheadAttention`) never shows its scores, so they
are computed again, unfused, from the same queries, keys and masks: the probe is outside the
training step, so exact per-head numbers cost the training step nothing.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from actrace.reduce import fused, kernel
from actrace.reduce.torch import scratch, scratch_like

from .axes import arg

_LEFT_OUT = torch.finfo(torch.float32).min
_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights",
             "is_causal")


def attention(logits: torch.Tensor | None, causal: bool = False) -> dict[str, tuple] | None:
    """From pre-softmax scores `[B, H, Q, K]`, a masked key at −inf or at most half the dtype's
    lowest value (an additive mask), a key any head masks left out, and with `causal` the keys
    after the query's position (SDPA's mask): per query and head (last axis), its largest logit over
    the keys it may attend, its entropy over them divided by ln(keys), and its mass on the first key
    it may attend, as (`[B·Q, H]`, the `[B·Q]` queries that hold one: those that may attend a key;
    two keys, for the entropy): the reading keeps those (`reduce_tensor`'s `rows`), so nothing
    here waits for the device to say which they are; on the host, those queries alone and None.
    A NaN score stays: it is read as one. On a CPU, by the fused kernel (one read of the scores,
    the causal mask applied as it reads); on a GPU by its Triton twin (`fused.attention_scores`, one
    launch); elsewhere by torch."""
    if logits is None:
        return None
    lowest = torch.finfo(logits.dtype).min / 2
    x = logits.detach().float()
    if x.device.type == "cpu" and kernel.available:
        peak, entropy, sink, n = kernel.attention_scores(x.contiguous().numpy(), lowest, 0 if causal else None)
    elif fused.usable(x) and (got := fused.attention_scores(x, lowest, 0 if causal else None)) is not None:
        peak, entropy, sink, n = got
    else:
        if causal:
            x = x.masked_fill(~torch.ones(x.shape[-2:], dtype=torch.bool, device=x.device).tril(), _LEFT_OUT)
        peak, entropy, sink, n = _per_head(x, lowest)
    attends = n >= 1
    return {"attention_logit": _kept(peak, attends), "attention_entropy": _kept(entropy, n >= 2),
            "attention_sink": _kept(sink, attends)}


def _kept(per_query, rows) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[B, Q, H]` numbers as `[B·Q, H]` with the `[B·Q]` queries to read; the kernel's (numpy, on
    the host) with those queries taken at once (a view where all are, the usual case)."""
    flat, rows = per_query.reshape(-1, per_query.shape[-1]), rows.reshape(-1)
    if isinstance(flat, np.ndarray):
        return torch.as_tensor(flat if rows.all() else flat[rows]), None
    return flat, rows


def _per_head(x: torch.Tensor, lowest: float) -> tuple[torch.Tensor, ...]:
    """`kernel.attention_scores` in torch, as `[B, Q, H]` (heads last: `[B·Q, H]` is a view): the
    scores less their peak into a reused buffer, one fused softmax of them into another; the
    entropy (nats) is −log of the largest probability less the expected score about the peak (no
    logarithm per score, and no cancellation at large logits). The same kernels whatever is
    masked: nothing waits for the device to say."""
    batch, heads, queries, keys = x.shape
    masked = (x <= lowest).any(1)  # [B, Q, K]: a key some head leaves out (its NaN with it); NaN is read
    n = keys - masked.sum(-1)
    # [B, Q, H, K], every masked key at one finite value: its probability is exactly 0, and 0 · it is 0
    x = scratch((batch, queries, heads, keys), torch.float32, x.device, slot=2).copy_(x.transpose(1, 2))
    x = x.masked_fill_(masked[:, :, None], _LEFT_OUT)
    peak = x.amax(-1, keepdim=True)
    d = x.sub_(peak)
    p = torch.ops.aten._softmax.out(d, -1, False, out=scratch_like(x, torch.float32))
    first = (~masked).to(torch.int8).argmax(-1)  # each query's first key it may attend (left padding: not 0)
    sink = p.gather(-1, first[:, :, None, None].expand(-1, -1, heads, 1)).squeeze(-1)
    nats = -p.amax(-1).log() - p.mul_(d).sum(-1)  # Σ p·(x − peak) in place: p is not needed after
    entropy = nats.clamp(min=0) / n.clamp(min=2).log()[:, :, None]
    return peak.squeeze(-1), entropy, sink, n


def sdpa_attention(args: tuple, kwargs: dict) -> dict[str, tuple] | None:
    """`attention` of the scores `F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p,
    is_causal, scale, enable_gqa)` softmaxes; None unless q is `[B, H, Q, E]`."""
    q, k = arg(args, kwargs, 0, "query"), arg(args, kwargs, 1, "key")
    mask, causal = arg(args, kwargs, 3, "attn_mask"), arg(args, kwargs, 5, "is_causal", False)
    scale = arg(args, kwargs, 6, "scale")
    if not isinstance(q, torch.Tensor) or q.ndim != 4 or not isinstance(k, torch.Tensor) or k.ndim != 4:
        return None
    return attention(_masked(_scaled_scores(q, k, scale), mask, allowed=True), causal=bool(causal))


def interface_logits(module, query: torch.Tensor, key: torch.Tensor, mask, scaling: float | None = None,
                     softcap: float | None = None, sliding_window: int | None = None, is_causal: bool | None = None,
                     s_aux=None) -> torch.Tensor:
    """The scores a Hugging Face attention implementation (flash, flex, one a user registered)
    softmaxes, from its call's `[B, H, Q, E]` queries, `[B, h, K, E]` keys and mask as Hugging
    Face gives them: none, `[B, K]` padding (1 = a real token, flash's), or `[B, 1|H, Q, K]`
    boolean (True = attend) or additive; causal as the call or the module says, aligned to the last
    key, and a sliding window, as Hugging Face's masks define them; Gemma's soft cap applied."""
    if s_aux is not None:
        raise ValueError("an attention with learned sink logits (s_aux) is not read")
    if not isinstance(mask, torch.Tensor | None):
        raise ValueError(f"a {type(mask).__name__} mask is not read")
    x = _scaled_scores(query, key, scaling)
    if softcap:
        x.div_(softcap).tanh_().mul_(softcap)
    lq, lk = x.shape[-2:]
    gap = torch.arange(lq, device=x.device)[:, None] + (lk - lq) - torch.arange(lk, device=x.device)  # query − key
    causal = getattr(module, "is_causal", False) if is_causal is None else is_causal
    if causal and lq > 1 and (mask is None or mask.ndim == 2):  # a full mask given says it all, as in SDPA
        x.masked_fill_(gap < 0, _LEFT_OUT)
    if sliding_window is not None:  # a key within the window back; and ahead, where not causal (flash's)
        outside = gap >= sliding_window
        x.masked_fill_(outside if causal else outside | (gap <= -sliding_window), _LEFT_OUT)
    if mask is not None and mask.ndim == 2:  # padding: the keys of real tokens
        return x.masked_fill_(~mask.bool()[:, None, None, -lk:], _LEFT_OUT)
    return _masked(x, mask, allowed=True)


def mha_logits(module: torch.nn.MultiheadAttention, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The scores of an `nn.MultiheadAttention` call, from its inputs, projections and masks; None
    for a layer with `add_bias_kv` or `add_zero_attn` (keys the inputs do not hold). The scale is
    folded into the query weights, and self-attention's queries and keys come from one product."""
    a = dict(zip(_MHA_ARGS, args), **kwargs)
    q, k = a["query"], a["key"]
    if module.bias_k is not None or module.add_zero_attn:
        return None
    e, heads = module.embed_dim, module.num_heads
    d = e // heads
    wq, wk = (module.in_proj_weight[:e], module.in_proj_weight[e:2 * e]) if module._qkv_same_embed_dim \
        else (module.q_proj_weight, module.k_proj_weight)
    b = module.in_proj_bias
    bq, bk = (None, None) if b is None else (b[:e] / math.sqrt(d), b[e:2 * e])
    wq = wq / math.sqrt(d)
    same = q is k
    if q.ndim == 2:  # unbatched [L, E]
        q, k = q[None], k[None]
    elif not module.batch_first:
        q, k = q.transpose(0, 1), k.transpose(0, 1)
    if same and module._qkv_same_embed_dim:
        q, k = F.linear(q, torch.cat([wq, wk]), None if b is None else torch.cat([bq, bk])).split(e, -1)
    else:
        q, k = F.linear(q, wq, bq), F.linear(k, wk, bk)
    (batch, lq, _), s = q.shape, k.shape[1]
    x = _scores(q.reshape(batch, lq, heads, d).transpose(1, 2), k.reshape(batch, s, heads, d).transpose(1, 2))
    mask, padding = a.get("attn_mask"), a.get("key_padding_mask")
    if mask is not None and mask.ndim == 3:
        mask = mask.reshape(batch, heads, lq, s)
    x = _masked(x, mask, allowed=False)
    return _masked(x, None if padding is None else padding.reshape(batch, 1, 1, s), allowed=False)


def _scaled_scores(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    """`_scores` of `[B, H, Q, E]` queries scaled (by 1/√E unless given) and `[B, h, K, E]` keys, a
    key head serving each of its group of query heads (grouped-query attention)."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    return _scores(q, k, scale if scale is not None else 1 / math.sqrt(q.shape[-1]))


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """q·kᵀ·scale of `[B, H, Q, E]` and `[B, H, K, E]` in float32, into a reused buffer (slot 1: the
    softmax of `attention` takes slot 0, its masked scores slot 2): one product, the scale applied
    in it (no scaled copy of q)."""
    *lead, lq, d = q.shape
    out = scratch((*lead, lq, k.shape[-2]), torch.float32, q.device, slot=1).view(-1, lq, k.shape[-2])
    torch.baddbmm(out, q.float().reshape(-1, lq, d), k.float().reshape(-1, k.shape[-2], d).transpose(1, 2),
                  beta=0, alpha=scale, out=out)
    return out.view(*lead, lq, k.shape[-2])


def _masked(x: torch.Tensor, mask, allowed: bool) -> torch.Tensor:
    """Scores (our own buffer) with a mask applied in place: a boolean one marks the keys `allowed`
    (SDPA) or those left out (`nn.MultiheadAttention`); a float one is added, its values at half
    the dtype's lowest or below (−inf included) leaving a key out: `_LEFT_OUT`, which `attention`
    reads as masked and which, unlike −inf, times a probability of 0 is 0."""
    if mask is None:
        return x
    if mask.dtype == torch.bool:
        return x.masked_fill_(~mask if allowed else mask, _LEFT_OUT)
    return x.add_(mask.float()).masked_fill_(mask <= torch.finfo(mask.dtype).min / 2, _LEFT_OUT)


def output_logits(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per position of an LM head's output (vocabulary last): log-sum-exp (log Z) and the max logit."""
    x = logits.detach().float().reshape(-1, logits.shape[-1])
    return {"log_z": torch.logsumexp(x, -1), "max_logit": x.amax(-1)}


def routing(args: tuple, kwargs: dict) -> dict[str, torch.Tensor] | None:
    """A router's choice, from its `torch.topk(scores, k)` over experts (last axis): per token and
    expert (last axis), 1 where the token chose it (`expert_load`, whose sum per expert is its
    tokens) and the router's probability (non-negative scores normalized, logits softmaxed); per
    token the probabilities' entropy over ln(experts)."""
    scores, k = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "k")
    dim, largest = arg(args, kwargs, 2, "dim", -1), arg(args, kwargs, 3, "largest", True)
    if not (isinstance(scores, torch.Tensor) and scores.is_floating_point() and scores.ndim >= 2
            and dim in (-1, scores.ndim - 1) and largest and isinstance(k, int) and 0 < k < scores.shape[-1]):
        return None
    x = scores.detach().float().reshape(-1, scores.shape[-1])
    # scores of one sign are the router's own weights (a softmax's, a sigmoid's): normalized; logits:
    # softmaxed (both made, one kept on the device: no host sync)
    p = torch.where((x >= 0).all(), x / x.sum(-1, keepdim=True), torch.softmax(x, -1))
    chosen = torch.zeros_like(x).scatter_(-1, x.topk(k, -1).indices, 1.0)
    return {"expert_load": chosen, "router_prob": p,
            "router_entropy": torch.special.entr(p).sum(-1) / math.log(x.shape[-1])}
