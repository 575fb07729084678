"""A GPU's reductions as Triton kernels: a probe reading's per-unit statistics in one pass over the
tensor (`stats`: what `actrace.reduce.torch._masked` gives, the histogram and `sat_counts`; `batch`:
those of many tensors, one launch per kind of program), and a per-step gradient reading's layer
totals of every gradient at once (`totals`), without a host sync.
Torch kernels cost a launch each (~30 a per-unit reading, ~15 a gradient: bench/bench_device_ops.py),
which outweighs the bytes read when a model's own kernels are fast (bench/bench_torch.py --device
cuda). Where Triton is absent, or fails (said once), torch kernels read. On CPU tensors Triton's
interpreter runs the kernels: so tests/test_contract.py and test_torch_adapter.py hold them to the reference.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import itertools
import math
import warnings

import numpy as np
import torch

from actrace.format import bins
from actrace.format.schema import SAT_COUNTS

from .reference import centre, sat_levels

tl = None  # triton.language, imported with the kernel (`_kernel`): a run on CPU never pays its import
_tile = None  # `_tile_body` as Triton compiles it, which the per-unit kernels call (`_triton`)

_HIST = 256  # the histogram's lanes: a power of two above bins.N_BINS
_TOTALS = _HIST + 1 + len(SAT_COUNTS)  # per reading: the histogram, the NaN count, the saturation counts


def usable(x: torch.Tensor, narrow: bool = False) -> bool:
    """Whether `x` is read by the fused kernels: a CUDA float32/float64 tensor (with `narrow`, as
    `totals` reads them, also float16/bfloat16) where Triton is installed."""
    return x.is_cuda and x.dtype in (_NARROW if narrow else _WIDE) and installed() and _failure is None


_failure: Exception | None = None  # why the fused kernels are off (`_fallible`)


def _fallible(fn):
    """`fn`, whose failure (Triton installed but failing here: no compiler, a GPU it cannot target)
    is said once and turns the fused kernels off: it gives None and the caller reads with torch
    kernels, then and from then on. A monitor never takes training down."""
    @functools.wraps(fn)
    def call(*args):
        global _failure
        try:
            return fn(*args)
        except Exception as error:
            if _failure is None:
                warnings.warn(f"actrace: the fused GPU kernels failed ({type(error).__name__}: {error}); reading "
                              "with torch kernels instead", stacklevel=3)
            _failure = error
            return None
    return call


_WIDE = (torch.float32, torch.float64)
_NARROW = (*_WIDE, torch.float16, torch.bfloat16)


@functools.cache
def installed() -> bool:
    """Whether Triton can be imported (torch's CUDA wheels bring it), asked once."""
    return importlib.util.find_spec("triton") is not None


def _stats_kernel(x_ptr, edges_ptr, levels_ptr, out_ptr, counts_ptr, totals_ptr, rows, units, after, span,
                  BLOCK_R: tl.constexpr, BLOCK_U: tl.constexpr, HIST: tl.constexpr, BINS: tl.constexpr,
                  NSAT: tl.constexpr, NLOW: tl.constexpr):
    """One program: BLOCK_U units over `span` of the `rows` entries (before × after) each unit holds
    (`_tile`), its partial per-unit numbers at out[split, 9, units]."""
    split = tl.program_id(1).to(tl.int64)
    _tile(x_ptr, edges_ptr, levels_ptr, out_ptr + split * 9 * units, counts_ptr + split * 9 * units, totals_ptr,
          rows, units, after, split * span, span, tl.program_id(0) * BLOCK_U, BLOCK_R, BLOCK_U, HIST, BINS, NSAT, NLOW)


def _batch_kernel(table_ptr, edges_ptr, words_ptr, DTYPE: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_U: tl.constexpr, HIST: tl.constexpr, BINS: tl.constexpr, NSAT: tl.constexpr,
                  NLOW: tl.constexpr):
    """One program: BLOCK_U units of one tensor over all its entries (`_tile`); row p of `table` says
    which: the tensor's address, its entries per unit, units, after, the first unit, where its words
    start in `words` (9 × units, then its totals) and the address of its levels."""
    row = table_ptr + 7 * tl.program_id(0).to(tl.int64)
    x_ptr = tl.load(row).to(tl.pointer_type(DTYPE), bitcast=True)
    rows, units, after, first_unit = tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)
    words = words_ptr + tl.load(row + 5)
    levels_ptr = tl.load(row + 6).to(tl.pointer_type(DTYPE), bitcast=True)
    if BLOCK_U > 1:  # units last (`_grid`): after is 1, known here, so no division per value
        after = 1
    _tile(x_ptr, edges_ptr, levels_ptr, words.to(tl.pointer_type(tl.float64), bitcast=True), words, words + 9 * units,
          rows, units, after, 0, rows, first_unit, BLOCK_R, BLOCK_U, HIST, BINS, NSAT, NLOW)


def _tile_body(x_ptr, edges_ptr, levels_ptr, out_ptr, counts_ptr, totals_ptr, rows, units, after, first, span,
               first_unit, BLOCK_R: tl.constexpr, BLOCK_U: tl.constexpr, HIST: tl.constexpr, BINS: tl.constexpr,
               NSAT: tl.constexpr, NLOW: tl.constexpr):
    """Units first_unit .. + BLOCK_U of x, a contiguous (before, units, after) tensor, over its entries
    first .. first + span (of `rows`: before × after). Writes their per-unit numbers (sums in float64,
    extremes of finite values, ±inf where none; counts through `counts_ptr`, the same memory as
    int64) to out[9, units]; adds its NaN count, histogram (if BINS) and saturation counts (below and
    above `levels`, which ends with the centre of min |h - c|) to `totals`."""
    u = first_unit + tl.arange(0, BLOCK_U)
    um = u < units
    s1 = tl.zeros([BLOCK_R, BLOCK_U], tl.float64)
    s2 = tl.zeros([BLOCK_R, BLOCK_U], tl.float64)
    s3 = tl.zeros([BLOCK_R, BLOCK_U], tl.float64)
    s4 = tl.zeros([BLOCK_R, BLOCK_U], tl.float64)
    count = tl.zeros([BLOCK_R, BLOCK_U], tl.int32)
    zero = tl.zeros([BLOCK_R, BLOCK_U], tl.int32)
    nan = tl.zeros([BLOCK_R, BLOCK_U], tl.int32)
    lo = tl.full([BLOCK_R, BLOCK_U], float("inf"), x_ptr.dtype.element_ty)
    hi = tl.full([BLOCK_R, BLOCK_U], float("-inf"), x_ptr.dtype.element_ty)
    dev = tl.full([BLOCK_R, BLOCK_U], float("inf"), x_ptr.dtype.element_ty)
    lanes = tl.arange(0, 8)
    sat = tl.zeros([8], tl.int32)
    hist = tl.zeros([HIST], tl.int32)
    column = (u.to(tl.int64) * after)[None, :]
    centre = tl.load(levels_ptr + NSAT)
    for start in range(0, span, BLOCK_R):
        r = first + (start + tl.arange(0, BLOCK_R)).to(tl.int64)
        m = (r < rows)[:, None] & um[None, :]
        v = tl.load(x_ptr + ((r // after) * units * after + r % after)[:, None] + column, mask=m, other=0.0)
        finite = m & (tl.abs(v) < float("inf"))  # NaN and ±inf are not below +inf
        isnan = m & (v != v)
        w = tl.where(finite, v, 0.0).to(tl.float64)
        w2 = w * w
        s1 += w
        s2 += w2
        s3 += w2 * w
        s4 += w2 * w2
        count += finite.to(tl.int32)
        zero += (m & (v == 0)).to(tl.int32)
        nan += isnan.to(tl.int32)
        lo = tl.minimum(lo, tl.where(finite, v, float("inf")))
        hi = tl.maximum(hi, tl.where(finite, v, float("-inf")))
        dev = tl.minimum(dev, tl.where(finite, tl.abs(v - centre), float("inf")))
        if BINS:
            at = tl.zeros([BLOCK_R, BLOCK_U], tl.int32)  # the bin: how many signed edges lie below v
            for k in tl.static_range(8):  # over 255 edges (+inf beyond the real ones)
                at = tl.where(tl.load(edges_ptr + at + ((128 >> k) - 1)) < v, at + (128 >> k), at)
            hist += tl.histogram(tl.reshape(tl.where(m & ~isnan, at, HIST - 1), [BLOCK_R * BLOCK_U]), HIST)
        for i in tl.static_range(NSAT):
            if i < NLOW:
                hit = m & (v <= tl.load(levels_ptr + i))
            else:
                hit = m & (v >= tl.load(levels_ptr + i))
            sat += tl.where(lanes == i, tl.sum(tl.sum(hit.to(tl.int32), 1), 0), 0)
    base = out_ptr + u
    tl.store(base, tl.sum(s1, 0), mask=um)
    tl.store(base + units, tl.sum(s2, 0), mask=um)
    tl.store(base + 2 * units, tl.sum(s3, 0), mask=um)
    tl.store(base + 3 * units, tl.sum(s4, 0), mask=um)
    tl.store(base + 4 * units, tl.min(lo, 0).to(tl.float64), mask=um)
    tl.store(base + 5 * units, tl.max(hi, 0).to(tl.float64), mask=um)
    tl.store(base + 6 * units, tl.min(dev, 0).to(tl.float64), mask=um)
    counts = counts_ptr + u  # the same memory, as int64
    tl.store(counts + 7 * units, tl.sum(count.to(tl.int64), 0), mask=um)
    tl.store(counts + 8 * units, tl.sum(zero.to(tl.int64), 0), mask=um)
    tl.atomic_add(totals_ptr + HIST, tl.sum(tl.sum(nan.to(tl.int64), 1), 0))
    tl.atomic_add(totals_ptr + HIST + 1 + lanes, sat.to(tl.int64), mask=lanes < NSAT)
    if BINS:
        tl.atomic_add(totals_ptr + tl.arange(0, HIST), hist.to(tl.int64), mask=tl.arange(0, HIST) < BINS)


def _totals_kernel(table_ptr, out_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr,
                   WIDE: tl.constexpr):
    """One program: values [start, end) of one tensor (row p of `table`: its address, start, end) of
    type DTYPE, read as WIDE; their sum and sum of squares (float64), extremes of finite values
    (±inf where none), finite, zero and NaN counts to out[p, 0:7], as float64."""
    p = tl.program_id(0).to(tl.int64)
    x_ptr = tl.load(table_ptr + 3 * p).to(tl.pointer_type(DTYPE), bitcast=True)
    start = tl.load(table_ptr + 3 * p + 1)
    end = tl.load(table_ptr + 3 * p + 2)
    s1 = tl.zeros([BLOCK], tl.float64)
    s2 = tl.zeros([BLOCK], tl.float64)
    count = tl.zeros([BLOCK], tl.int32)
    zero = tl.zeros([BLOCK], tl.int32)
    nan = tl.zeros([BLOCK], tl.int32)
    lo = tl.full([BLOCK], float("inf"), WIDE)
    hi = tl.full([BLOCK], float("-inf"), WIDE)
    for i in range(0, CHUNK, BLOCK):
        at = start + i + tl.arange(0, BLOCK)
        m = at < end
        v = tl.load(x_ptr + at, mask=m, other=0.0).to(WIDE)
        finite = m & (tl.abs(v) < float("inf"))
        w = tl.where(finite, v, 0.0).to(tl.float64)
        s1 += w
        s2 += w * w
        count += finite.to(tl.int32)
        zero += (m & (v == 0)).to(tl.int32)
        nan += (m & (v != v)).to(tl.int32)
        lo = tl.minimum(lo, tl.where(finite, v, float("inf")))
        hi = tl.maximum(hi, tl.where(finite, v, float("-inf")))
    row = out_ptr + 7 * p
    tl.store(row, tl.sum(s1, 0))
    tl.store(row + 1, tl.sum(s2, 0))
    tl.store(row + 2, tl.min(lo, 0).to(tl.float64))
    tl.store(row + 3, tl.max(hi, 0).to(tl.float64))
    tl.store(row + 4, tl.sum(count.to(tl.int64), 0).to(tl.float64))
    tl.store(row + 5, tl.sum(zero.to(tl.int64), 0).to(tl.float64))
    tl.store(row + 6, tl.sum(nan.to(tl.int64), 0).to(tl.float64))


def _scores_kernel(x_ptr, peak_ptr, entropy_ptr, sink_ptr, n_ptr, heads, queries, keys, reach, lowest,
                   BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program: one query of one sequence of float32 scores [B, H, Q, K], as the C kernel's
    `score_query` reads it (`kernel.attention_scores`): keys past `reach` after the query's position,
    or that any head scores at or below `lowest`, left out for every head; per head its peak over the
    rest (NaN where one is NaN), then log Z and the expected logit about the peak in a second pass."""
    p = tl.program_id(0).to(tl.int64)  # b · Q + q
    q = p % queries
    h = tl.arange(0, BLOCK_H)
    hm = h < heads
    rows = x_ptr + (((p // queries) * heads + h) * queries + q) * keys  # each head's row of keys
    span = tl.minimum(q + reach + 1, keys)  # keys from here on are never kept: not read
    n = tl.zeros([1], tl.int64)
    first = tl.full([1], keys, tl.int64)
    hi = tl.full([BLOCK_H], float("-inf"), tl.float32)
    bad = tl.zeros([BLOCK_H], tl.int32)
    for start in range(0, span, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K).to(tl.int64)
        v = tl.load(rows[:, None] + k[None, :], mask=hm[:, None] & (k < span)[None, :], other=0.0)
        keep = (k < span) & (tl.max((hm[:, None] & (v <= lowest)).to(tl.int32), 0) == 0)  # NaN is kept: read
        live = hm[:, None] & keep[None, :]
        n += tl.sum(keep.to(tl.int64), 0)
        first = tl.minimum(first, tl.min(tl.where(keep, k, keys), 0))
        bad |= tl.max((live & (v != v)).to(tl.int32), 1)
        hi = tl.maximum(hi, tl.max(tl.where(live & (v == v), v, float("-inf")), 1))
    top = tl.where(tl.abs(hi) < float("inf"), hi, 0.0)  # a head without a finite peak is unknown: any will do
    total = tl.zeros([BLOCK_H], tl.float64)
    expected = tl.zeros([BLOCK_H], tl.float64)
    for start in range(0, span, BLOCK_K):  # e^(x - peak) and its x - peak, each no lower than -87
        k = start + tl.arange(0, BLOCK_K).to(tl.int64)
        v = tl.load(rows[:, None] + k[None, :], mask=hm[:, None] & (k < span)[None, :], other=0.0)
        keep = (k < span) & (tl.max((hm[:, None] & (v <= lowest)).to(tl.int32), 0) == 0)
        live = hm[:, None] & keep[None, :]
        d = tl.maximum(tl.where(live, v, top[:, None]) - top[:, None], -87.0)
        e = tl.where(live, tl.exp(d), 0.0)
        total += tl.sum(e, 1).to(tl.float64)
        expected += tl.sum(e * d, 1).to(tl.float64)
    unknown = (bad != 0) | (n == 0) | (tl.abs(hi) == float("inf"))
    total = tl.where(unknown, 1.0, total)
    d0 = tl.load(rows + tl.minimum(first, keys - 1), mask=hm, other=0.0) - top
    nats = tl.log(total) - expected / total
    out = p * heads + h
    tl.store(peak_ptr + out, tl.where(bad != 0, float("nan"), hi), mask=hm)
    tl.store(entropy_ptr + out, tl.where(unknown, float("nan"), tl.maximum(nats, 0.0)
                                         / tl.log(tl.maximum(n, 2).to(tl.float64))).to(tl.float32), mask=hm)
    tl.store(sink_ptr + out, tl.where(unknown, float("nan"), tl.exp(tl.maximum(d0, -87.0)).to(tl.float64)
                                      / total).to(tl.float32), mask=hm)
    tl.store(n_ptr + p + tl.arange(0, 1), n)


def _triton():
    """triton, imported at the first GPU reading, with `tl` set: the kernels' global, read when Triton
    compiles them (or interprets them, on CPU tensors, where TRITON_INTERPRET was set before the import)."""
    global tl, _tile
    import triton
    import triton.language

    tl = triton.language
    _tile = _tile or triton.jit(_tile_body)
    return triton


@functools.cache
def _kernel():
    """`_stats_kernel`, compiled at its first launch for each block shape (Triton caches it on disk)."""
    return _triton().jit(_stats_kernel, do_not_specialize=["rows", "span"])  # a program each, not per batch size


@functools.cache
def _batch():
    """`_batch_kernel`, as `_kernel` makes its own."""
    return _triton().jit(_batch_kernel)


@functools.cache
def _totals():
    """`_totals_kernel`, as `_kernel` makes its own."""
    return _triton().jit(_totals_kernel)



@functools.cache
def _scores():
    """`_scores_kernel`, as `_kernel` makes its own."""
    return _triton().jit(_scores_kernel, do_not_specialize=["queries", "keys", "reach"])

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _constants(device: torch.device, dtype: torch.dtype, bounds: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
    """On `device`, made once: the histogram's signed edges in `dtype` (+inf beyond them, 256 in all),
    and the saturation levels of `bounds` then the centre of min |h - c|, as `dtype` compares them."""
    f32 = dtype == torch.float32
    edges = bins.signed_edges(np.float32 if f32 else np.float64)
    padded = np.concatenate([edges, np.full(_HIST - len(edges), np.inf, edges.dtype)])
    lows, highs = sat_levels(bounds, f32) if bounds is not None else ([], [])
    levels = np.array([*lows, *highs, centre(bounds)], edges.dtype)
    return torch.from_numpy(padded).to(device), torch.from_numpy(levels).to(device)


@_fallible
def stats(x: torch.Tensor, axis: int, bounds: tuple | None, histogram: bool) -> torch.Tensor | None:
    """`_masked`'s statistics of `x` over every axis but `axis` (and its histogram where asked, the
    `sat_counts` of bounded kinds) in one int64 buffer on its device, which `unpack` reads on the host:
    one memset, one launch of the kernel and, for a tensor cut among programs along its values, one
    reduction of their parts."""
    x = x.contiguous()
    units, after, rows, block_u, block_r, split, span = _grid(x.shape, axis)
    edges, levels = _constants(x.device, x.dtype, bounds)
    words = torch.zeros(9 * units + _TOTALS, dtype=torch.int64, device=x.device)
    out = words[: 9 * units] if split == 1 else torch.empty(split * 9 * units, dtype=torch.int64, device=x.device)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():  # Triton launches on the current one
        _kernel()[(_cdiv(units, block_u), split)](
            x, edges, levels, out.view(torch.float64), out, words[9 * units:], rows, units, after, span,
            **_program(block_u, block_r, histogram, bounds is not None), enable_fp_fusion=False)
    if split > 1:  # the programs' parts of each unit: sums add, extremes, counts add
        parts, whole = out.view(split, 9, units), words[: 9 * units].view(9, units)
        torch.sum(parts[:, :4].view(torch.float64), 0, out=whole[:4].view(torch.float64))
        torch.amin(parts[:, 4].view(torch.float64), 0, out=whole[4].view(torch.float64))
        torch.amax(parts[:, 5].view(torch.float64), 0, out=whole[5].view(torch.float64))
        torch.amin(parts[:, 6].view(torch.float64), 0, out=whole[6].view(torch.float64))
        torch.sum(parts[:, 7:], 0, out=whole[7:])
    return words


@functools.lru_cache(maxsize=4096)
def _grid(shape: torch.Size, axis: int) -> tuple[int, ...]:
    """How the per-unit kernels read a contiguous tensor of `shape` with units on `axis`: (units, after,
    rows: the entries of each unit, units a program, entries a step, programs along the entries,
    entries each); kept per shape, which repeats from reading to reading."""
    units, after = shape[axis], math.prod(shape[axis + 1:])
    rows = math.prod(shape) // units
    block_u = 1 if after > 1 else min(32, 1 << (units - 1).bit_length())  # a power of two
    block_r = 512 // block_u
    split = min(_cdiv(rows, 64 * block_r), 65535)  # 64 tiles a program (each part costs reductions after), and
    # at most CUDA's limit of a grid's second axis
    span = _cdiv(_cdiv(rows, split), block_r) * block_r
    return units, after, rows, block_u, block_r, _cdiv(rows, span), span


@functools.cache
def _program(block_u: int, block_r: int, histogram: bool, bounded: bool) -> dict:
    """The per-unit kernels' compile-time constants for a reading read in blocks of `block_u` units
    and `block_r` entries: a kind of program (made once each: the caller does not change it)."""
    nsat = len(SAT_COUNTS) if bounded else 0
    return dict(BLOCK_R=block_r, BLOCK_U=block_u, HIST=_HIST, BINS=bins.N_BINS if histogram else 0, NSAT=nsat,
                NLOW=nsat // 2)


@_fallible
def batch(items: list[tuple[torch.Tensor, int, tuple | None, bool]]
          ) -> list[tuple[torch.Tensor | None, slice | None]] | None:
    """`stats(x, axis, bounds, histogram)` of each item, tensors on one device, as (a buffer, the slice
    of it that is the item's): those one program per block of units reads whole (a probe's many small
    tensors) in one buffer (one memset), by one launch per kind of program over a table of them (one
    copy to the device); the others by `stats`, a buffer each (the slice None)."""
    items = [(x.contiguous(), axis, bounds, histogram) for x, axis, bounds, histogram in items]
    device, starts, size, groups = items[0][0].device, {}, 0, {}
    for i, (x, axis, bounds, histogram) in enumerate(items):
        units, after, rows, block_u, block_r, split, _ = _grid(x.shape, axis)
        if split > 1:
            continue
        program = (x.dtype, block_u, block_r, histogram, bounds is not None)  # a launch per kind of program
        levels = _constants(device, x.dtype, bounds)[1].data_ptr()
        groups.setdefault(program, []).append((x.data_ptr(), rows, units, after, 0, size, levels))
        starts[i], size = size, size + 9 * units + _TOTALS
    words = torch.zeros(size, dtype=torch.int64, device=device)
    if groups:
        tables = [_programs(tensors, block_u) for (_, block_u, *_), tensors in groups.items()]
        table = torch.from_numpy(np.concatenate(tables))
        table = table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table
        launch, at = _batch(), 0  # and `tl`, for the dtypes
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            for (dtype, block_u, block_r, histogram, bounded), n in zip(groups, map(len, tables)):
                launch[(n,)](table[at: at + n], _constants(device, dtype, None)[0], words,
                             DTYPE=getattr(tl, str(dtype).removeprefix("torch.")),
                             **_program(block_u, block_r, histogram, bounded),
                             enable_fp_fusion=False)
                at += n
    return [(words, slice(starts[i], starts[i] + 9 * x.shape[axis] + _TOTALS)) if i in starts
            else (stats(*items[i]), None) for i, (x, axis, _, _) in enumerate(items)]


def _programs(tensors: list[tuple], block_u: int) -> np.ndarray:
    """The table of `_batch_kernel`'s programs that read `tensors` (a row each: address, entries a
    unit, units, after, 0, where its words start, its levels' address) in blocks of `block_u` units:
    each tensor's row once per block, the block's first unit in column 4."""
    each = np.array(tensors, np.int64)
    blocks = -(-each[:, 2] // block_u)
    table = np.repeat(each, blocks, axis=0)
    table[:, 4] = (np.arange(len(table)) - np.repeat(np.cumsum(blocks) - blocks, blocks)) * block_u
    return table



@_fallible
def attention_scores(x: torch.Tensor, lowest: float, reach: int | None) -> tuple[torch.Tensor, ...] | None:
    """`kernel.attention_scores` of float32 scores `[B, H, Q, K]` on a GPU: one launch, a program per
    query reading its keys for every head at once, nothing moved to the host."""
    x = x.contiguous()
    batch, heads, queries, keys = x.shape
    peak, entropy, sink = (torch.empty((batch, queries, heads), dtype=torch.float32, device=x.device)
                           for _ in range(3))
    n = torch.empty((batch, queries), dtype=torch.int64, device=x.device)
    block_h = 1 << (heads - 1).bit_length()
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _scores()[(batch * queries,)](x, peak, entropy, sink, n, heads, queries, keys,
                                       keys if reach is None else reach, lowest, BLOCK_H=block_h,
                                       BLOCK_K=max(16, min(1 << (keys - 1).bit_length(), 4096 // block_h)))
    return peak, entropy, sink, n

def unpack(words: np.ndarray, histogram: bool, bounded: bool, count: int, narrow: bool, left_out: int = 0) -> dict:
    """`stats`' buffer on the host as `kernel.reduce_many` gives a tensor's statistics, for
    `Reading.from_kernel`: the TOTALS row (the layer's numbers from the units', `count` values read in
    all, `left_out` of them NaN standing for entries a device left out: not counted) and the per-unit
    columns, views of the buffer; the extremes of a `narrow` tensor (float32 or narrower, exact in
    float32) as float32, a float64 one's in float64 (`from_kernel` rounds them outward), NaN where a
    unit has no finite value."""
    words = np.asarray(words)
    units = (len(words) - _TOTALS) // 9
    per, totals = words[: 9 * units].reshape(9, units), words[9 * units:]
    sums = per[:7].view(np.float64)
    s1, s2, s3, s4 = np.add.reduce(sums[:4], axis=1).tolist()
    finite, zeros = np.add.reduce(per[7:], axis=1).tolist()
    nans = int(totals[_HIST])
    lo, hi = float(np.fmin.reduce(sums[4])), float(np.fmax.reduce(sums[5]))  # as `from_stats` (0 before -0)
    extremes = sums[4:].astype(np.float32 if narrow else np.float64)  # a copy: the buffer stays as it came
    if finite < count and not per[7].all():  # ±inf where a unit has no finite value: NaN there
        extremes[:, per[7] == 0] = np.nan
    st = dict(totals=np.array([s1, s2, s3, s4, lo if lo < math.inf else math.nan, hi if hi > -math.inf else math.nan,
                               zeros, nans - left_out, count - finite - nans]),
              unit_count=per[7], unit_zero=per[8], unit_sum=sums[0], unit_sumsq=sums[1], unit_min=extremes[0],
              unit_max=extremes[1], unit_min_dev=extremes[2], hist=totals[: bins.N_BINS] if histogram else None)
    if bounded:
        st["sat_counts"] = totals[_HIST + 1:]
    return st


_CHUNK = 1 << 16  # the values of one tensor a `_totals_kernel` program reads at most


@_fallible
def totals(tensors: list[torch.Tensor]) -> list[list[float]] | None:
    """`kernel.reduce_totals`' statistics (a row of `kernel.TOTALS` each) of many floating tensors on
    one GPU, as a per-step gradient reading takes them: one launch per dtype over every tensor of it
    (a table of their addresses, cut in chunks: one program each) and one transfer, the chunks added
    on the host."""
    pieces = [_cdiv(t.numel(), _CHUNK) for t in tensors]
    order = sorted(range(len(tensors)), key=lambda i: str(tensors[i].dtype))  # a launch per dtype
    first, rows, n = {}, [], 0
    for i in order:
        first[i], t = n, tensors[i]
        n += pieces[i]
        for k in range(pieces[i]):
            rows.append((t.data_ptr(), k * _CHUNK, min((k + 1) * _CHUNK, t.numel())))
    device = tensors[0].device
    table = torch.tensor(rows, dtype=torch.int64).pin_memory() if device.type == "cuda" else torch.tensor(rows)
    table = table.to(device, non_blocking=True)
    out = torch.empty((n, 7), dtype=torch.float64, device=device)
    launch = _totals()  # and `tl`, for the dtypes
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for dtype, group in itertools.groupby(order, key=lambda i: tensors[i].dtype):
            group = list(group)
            at, count = first[group[0]], sum(pieces[i] for i in group)
            wide = "float64" if dtype == torch.float64 else "float32"
            launch[(count,)](table[at: at + count], out[at: at + count], CHUNK=_CHUNK, BLOCK=1024,
                                DTYPE=getattr(tl, str(dtype).removeprefix("torch.")), WIDE=getattr(tl, wide),
                                enable_fp_fusion=False)
    parts = out.cpu().numpy()
    starts = [first[i] for i in order]  # ascending: the chunks lie in `order`
    add = np.add.reduceat(parts, starts, axis=0)
    lo = np.minimum.reduceat(parts[:, 2], starts)
    hi = np.maximum.reduceat(parts[:, 3], starts)
    back = np.argsort(order)  # each tensor's row among them
    add, lo, hi = add[back], lo[back], hi[back]
    none = np.isinf(lo)  # a tensor with no finite value: NaN extremes
    lo, hi = np.where(none, np.nan, lo), np.where(none, np.nan, hi)
    sizes = np.array([t.numel() for t in tensors], np.float64)
    count, zeros, nans = add[:, 4], add[:, 5], add[:, 6]
    unknown = np.full(len(tensors), np.nan)  # sum3, sum4: not read per step
    return np.column_stack([add[:, 0], add[:, 1], unknown, unknown, lo, hi, zeros, nans,
                            sizes - count - nans]).tolist()
