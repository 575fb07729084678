"""Reductions of torch tensors: the spec's per-unit statistics, taken the moment a tensor is made.

`reduce_tensor` reads a CPU float32 tensor with the core's fused C kernel (all threads, on
PyTorch's own OpenMP team), a GPU's per-unit reading with one Triton kernel (`fused`), and any
other tensor with torch kernels on its device, without a host sync, on the model's own stream (or,
with `SIDE_STREAM`, a copy on a stream of its own). Either way every statistic is taken of the
values as they are when the call returns, so a later in-place change of the tensor changes nothing.
`to_readings` moves a batch of them to the host in one transfer (the one host sync) as core
`Reading`s (merged across chunks by the core's `merge`), and `all_reduce` merges data-parallel
ranks. Values agree with `actrace.reduce.reference` (tests/test_contract.py).
"""
from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass, field, fields

import numpy as np
import torch
import torch.distributed as dist

from actrace.format import bins
from actrace.format.schema import MERGE, bounds_for

from . import fused, kernel
from .dispatch import relu_stats
from .reading import LayerTotals, Reading, ReductionError
from .reference import centre, check_reducible, sat_counts

_F64 = torch.float64
# a CUDA tensor's reductions on a copy, on its device's side stream (`_aside`), not the model's: off, as
# it measured slower on every model of bench/bench_torch.py --device cuda (H200: its `side stream` column)
SIDE_STREAM = False
_sides: dict = {}  # device -> its side stream


@dataclass
class Pending:
    """A reading on its way to the host: its statistics, all taken already, on its tensor's device:
    the fused kernels' buffer (`fused`), or torch kernels' tensors named as the spec's columns (as
    `actrace.reduce.reference` names them); or its `reading`, made already from the C kernel's."""

    layer: str
    kind: str
    stream: str
    dtype: str
    shape: tuple
    unit_axis: int | None
    bounds: tuple | None
    param: str | None = None
    per_unit: bool = True
    stats: dict = field(default_factory=dict)
    relu: dict | None = None  # the statistics of relu(x), when the pass was asked for them
    reading: Reading | None = None  # made already, from the C kernel's results (`_kernel_stats`); named at `_finish`
    rows: int | None = None  # the entries of the first axis before a device left out some (`rows`)
    histogram: bool = False  # whether a fused kernel's buffer (stats["fused"]) holds the histogram
    span: slice | None = None  # where in that buffer (a batch's: many readings') this reading's numbers lie


_scratch = threading.local()  # per thread: reused buffers (scratch_like)


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as the spec names it (`float32`), as numpy does."""
    return str(dtype).removeprefix("torch.")


def scratch_like(x: torch.Tensor, dtype: torch.dtype, slot: int = 0) -> torch.Tensor:
    """A reused buffer (one per thread and `slot`) shaped like `x`: a fresh full-size temporary per
    reading costs page faults that can exceed the reduction itself (measured on CPU: 3-4x)."""
    return scratch(x.shape, dtype, x.device, slot)


def scratch(shape, dtype: torch.dtype, device, slot: int = 0) -> torch.Tensor:
    """`scratch_like` by shape: slot 0 is the reductions' own, other slots their callers'."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None  # one per stream
    key, n = (device, dtype, slot, stream), math.prod(shape)
    buf = buffers.get(key)
    if buf is None or buf.numel() < n:
        buf = buffers[key] = torch.empty(n, dtype=dtype, device=device)
    return buf[:n].view(shape)


_ON_DEVICE: dict = {}  # (what, dtype, device) -> a tensor made once on that device


def _on(device: torch.device, what: str, dtype: torch.dtype) -> torch.Tensor:
    """The signed edges, or (0, +inf, −inf, NaN), of `dtype` on `device`, made once there: a host tensor
    copied to the device at every reading would wait for it."""
    key = (what, dtype, device)
    t = _ON_DEVICE.get(key)
    if t is None:
        t = torch.from_numpy(bins.signed_edges(_WORDS[dtype])) if what == "edges" else torch.tensor([0.0, math.inf, -math.inf, math.nan], dtype=dtype)
        t = _ON_DEVICE[key] = t.to(device)
    return t


def bucketize_histogram(x: torch.Tensor, nan: torch.Tensor | None = None) -> torch.Tensor:
    """The histogram on any device: each value's bin by one binary search over `bins.signed_edges`
    (float64 values as they are, others as float32), NaN (`nan`, if known) left out; counted by
    `histc` over the bins' numbers, in float64 (exact, as given), which needs no host sync, or by `bincount`
    (which syncs for its size) where deterministic algorithms are asked for: CUDA's `histc` has none."""
    x = x if x.dtype == _F64 else x.float()
    idx = torch.bucketize(x, _on(x.device, "edges", x.dtype), out_int32=True)
    idx = idx.masked_fill_(torch.isnan(x) if nan is None else nan, bins.N_BINS).reshape(-1)
    if x.is_cuda and torch.are_deterministic_algorithms_enabled():
        return torch.bincount(idx, minlength=bins.N_BINS + 1)[: bins.N_BINS]
    return torch.histc(idx.to(_F64), bins=bins.N_BINS, min=-0.5, max=bins.N_BINS - 0.5)  # counts, as float64


def _flat_nested(x: torch.Tensor, unit_axis: int | None) -> tuple[torch.Tensor, int | None]:
    """A nested (ragged) tensor as its real values only: (values, units) with units last."""
    parts = x.unbind()
    if unit_axis is None:
        return torch.cat([p.reshape(-1) for p in parts]).reshape(-1, 1), None
    axis = unit_axis % x.dim() - 1  # the batch axis is not in a component
    return torch.cat([p.movedim(axis, -1).reshape(-1, p.shape[axis]) for p in parts]), 1


def reduce_tensor(t: torch.Tensor, unit_axis: int | None, kind: str, **options) -> Pending:
    """Reduce a floating tensor over every axis but `unit_axis`, now (before anything can change it
    in place), on its device: CPU float32 by the fused kernel, anything else by torch kernels.
    Options: `layer` (required), `stream`, `bounds`, `param`, `per_unit`, `histogram`, `relu_too`:
    the kernel's pass also gives relu(x)'s statistics (`Pending.relu`), where x holds no NaN or
    Inf, so a ReLU that follows is read without a pass of its own (see `relu_of`), and `rows`: a
    boolean mask of the first axis's entries to read, the others left out (on a device without a
    host sync: read as NaN, then taken out of the NaN count and the shape on the host)."""
    return reduce_tensors([(t, unit_axis, kind, options)])[0]


def reduce_tensors(calls: list[tuple[torch.Tensor, int | None, str, dict]]) -> list[Pending]:
    """`reduce_tensor(t, unit_axis, kind, **options)` of each call, now: the CPU float32 tensors in
    one kernel batch shared by every thread (many small tensors keep both threads busy), a GPU's
    per-unit readings in one batch of the fused kernels, the others by torch kernels on their devices."""
    prepared = [_prepared(t, axis, kind, **options) for t, axis, kind, options in calls]
    tasks = {i: (_kernel_view(p, x, axis), centre(p.bounds), histogram, relu_too)
             for i, (p, x, axis, histogram, relu_too) in enumerate(prepared)
             if kernel.available and x.device.type == "cpu" and x.dtype == torch.float32}
    for i, st in zip(tasks, kernel.reduce_many(list(tasks.values()))):
        _kernel_stats(prepared[i][0], tasks[i][0], st)
    taken = set(tasks) | _fused_batches(prepared, tasks)
    return [p if i in taken else _beside(p, x, axis, histogram) if _aside(x, p.per_unit)
            else _torch_stats(p, x, axis, histogram) for i, (p, x, axis, histogram, _) in enumerate(prepared)]


def _fused_batches(prepared: list[tuple], skip) -> set[int]:
    """The per-unit readings of `_prepared` calls (but `skip`) on a GPU, two or more a device, by the
    fused kernels in one batch each (`fused.batch`): the indexes of those read."""
    devices: dict = {}
    for i, (p, x, _, _, _) in enumerate(prepared):
        if i not in skip and p.per_unit and not _aside(x, True) and fused.usable(x):
            devices.setdefault(x.device, []).append(i)
    taken = set()
    for group in (g for g in devices.values() if len(g) > 1):
        calls = [prepared[i] for i in group]
        got = fused.batch([(x, axis, p.bounds, histogram) for p, x, axis, histogram, _ in calls])
        for i, (words, span) in zip(group, got or ()):
            if words is not None:  # None: the fused kernels failed (torch kernels read it)
                _take_fused(prepared[i][0], words, prepared[i][3], span)
                taken.add(i)
    return taken


def _take_fused(pending: Pending, words: torch.Tensor, histogram: bool, span: slice | None = None) -> None:
    """The fused kernels' buffer (`span` of it) as the pending reading's statistics, named on the host
    (`_finish`): a batch's one buffer, every reading of it, moves to the host once (`_to_host`)."""
    pending.stats["fused"], pending.span, pending.histogram = words, span, histogram


def _aside(x: torch.Tensor, per_unit: bool) -> bool:
    """Whether `x` is reduced on its device's side stream (`SIDE_STREAM`): a CUDA tensor of a
    per-unit reading (a probe's, or an activation gradient's, read while the model runs on), not a
    layer-level one (parameters and their gradients, read between steps: a copy of each would only
    cost memory), nor one in a CUDA graph being captured."""
    return SIDE_STREAM and per_unit and x.is_cuda and not torch.cuda.is_current_stream_capturing()


def _prepared(t: torch.Tensor, unit_axis: int | None, kind: str, *, layer: str, stream: str = "activation",
              bounds=None, param: str | None = None, per_unit: bool = True, histogram: bool = True,
              relu_too: bool = False, rows: torch.Tensor | None = None
              ) -> tuple[Pending, torch.Tensor, int, bool, bool]:
    """A call of `reduce_tensor` checked (spec §Numerics, naming the layer) and set up: its pending
    reading, the tensor as it is reduced (half precision widened, a nested one flattened, one unit
    as a column; a copy of a CUDA tensor reduced on the side stream: `_beside`), the unit axis in
    it, whether to histogram it, and `relu_too`."""
    x, kept = t.detach(), None
    if rows is not None and on_device(x):  # those left out as NaN, in a copy made here
        nan = _on(x.device, "constants", x.dtype)[3]
        kept, x = len(x), torch.where(rows.reshape(-1, *[1] * (x.ndim - 1)), x, nan)
    elif rows is not None and not bool(rows.all()):  # on the host (every row kept, as usual: nothing to do)
        x = x[rows]
    fresh = kept is not None or x.is_nested or x.dtype in (torch.float16, torch.bfloat16)  # a copy already
    dtype = dtype_name(x.dtype)
    check_reducible(x.is_floating_point(), dtype, (1,), layer)
    if x.is_nested:
        x, unit_axis = _flat_nested(x, unit_axis)
    check_reducible(True, dtype, tuple(x.shape), layer)
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    elif not fresh and _aside(x, per_unit):  # the values as they are now, whatever the model does next
        x = x.clone(memory_format=torch.contiguous_format)  # contiguous: the binary search reads it so
    shape = tuple(x.shape)
    if unit_axis is None:
        x, axis = x.reshape(-1, 1), 1
    else:
        axis = unit_axis % x.ndim
    pending = Pending(layer, kind, stream, dtype, shape, unit_axis, bounds_for(kind, bounds), param, per_unit)
    if kept is not None:
        pending.rows, pending.stats["kept_rows"] = kept, rows.sum()
    return pending, x, axis, histogram and per_unit, relu_too


def _kernel_view(pending: Pending, x: torch.Tensor, axis: int) -> np.ndarray:
    """The tensor as the kernel reads it: (before, units, after), C-contiguous; one unit for a
    layer-level reading or a tensor with no unit axis."""
    shape = pending.shape
    if pending.per_unit and pending.unit_axis is not None:
        return x.contiguous().view(math.prod(shape[:axis]), shape[axis], -1).numpy()
    return x.contiguous().view(1, 1, -1).numpy()


def _kernel_stats(pending: Pending, view: np.ndarray, st: dict) -> None:
    """The kernel's statistics as the pending reading's `Reading` (`Reading.from_kernel`), with the
    saturation counts of a bounded kind, and relu(x)'s where the pass gave them and x holds no NaN or
    Inf; as its statistics where `_prepared` took some already (`kept_rows`: `_finish` needs them)."""
    relu = st.pop("relu")
    if pending.bounds is not None and pending.per_unit:
        st["sat_counts"] = sat_counts(view, pending.bounds)
    if relu is not None and not (st["nan_count"].any() or st["inf_count"].any()):
        pending.relu = relu_stats(st, relu)
    if pending.stats:  # its TOTALS row left out: it counts the left-out rows' NaN (`_finish` takes them out)
        pending.stats.update((k, v) for k, v in st.items() if v is not None and k != "totals")
    else:
        pending.reading = Reading.from_kernel(st, shape=pending.shape, unit_axis=pending.unit_axis,
                                              per_unit=pending.per_unit, layer=pending.layer, kind=pending.kind,
                                              stream=pending.stream, dtype=pending.dtype, bounds=pending.bounds,
                                              param=pending.param)


def _beside(pending: Pending, x: torch.Tensor, axis: int, histogram: bool) -> Pending:
    """`_torch_stats` of a CUDA tensor (our own copy) on its device's side stream, once the model's
    stream has made it: the model's next kernels need not wait for them (`to_readings` does), and
    its memory is not handed out again before the side stream is done with it."""
    main, side = torch.cuda.current_stream(x.device), _sides.get(x.device)
    if side is None:
        side = _sides[x.device] = torch.cuda.Stream(x.device)
    side.wait_stream(main)
    x.record_stream(side)
    with torch.cuda.stream(side):
        return _torch_stats(pending, x, axis, histogram)


def _torch_stats(pending: Pending, x: torch.Tensor, axis: int, histogram: bool) -> Pending:
    """The statistics on the tensor's device, without a host sync: a per-unit reading of a GPU by one
    fused kernel where Triton is installed (`fused`), others by torch kernels (`_masked`)."""
    per_unit, bounds = pending.per_unit, pending.bounds
    if per_unit and fused.usable(x) and (words := fused.stats(x, axis, bounds, histogram)) is not None:
        _take_fused(pending, words, histogram)
        return pending
    if not per_unit:  # layer-level only (per-step gradient readings): whole-tensor kernels
        x, axis = x.reshape(-1, 1), 1
    pending.stats.update(_masked(x, axis, centre(bounds), pending.kind == "relu", histogram, moments=per_unit))
    if bounds is not None and per_unit:
        pending.stats["sat_counts"] = sat_counts(x, bounds, torch)
    return pending


def _masked(x: torch.Tensor, axis: int, c: float, relu: bool, histogram: bool, moments: bool = True) -> dict:
    """The reference's statistics (`reference._stats`) by torch kernels on the tensor's device, over
    its finite values whatever it holds (no host sync to ask whether it holds a NaN), in few kernels
    (each costs a launch on a GPU: bench/bench_device_ops.py) into reused buffers: sums in float64
    (spec §Numerics); with `moments` (probe readings, not per-step gradients) the sums of cubes and
    fourth powers, and min |h - c|. Extremes of a unit with no finite value are ±inf, and the count
    of ±inf is left out: `_finish` makes them NaN, and the count, on the host."""
    dims = [d for d in range(x.ndim) if d != axis]
    zero, inf, minus_inf, _ = _on(x.device, "constants", x.dtype)
    size = torch.abs(x, out=scratch_like(x, x.dtype, slot=3))
    finite = torch.lt(size, inf, out=scratch_like(x, torch.bool, slot=1))  # NaN and ±inf are not below +inf
    nan = torch.isnan(x)
    work = scratch_like(x, x.dtype)
    clean = torch.where(finite, x, zero, out=work)
    s = {"unit_count": finite.sum(dims)}
    if moments:  # powers in float64 (float32's overflow above 4e9), before `work` is reused
        wide = clean.to(_F64)
        squares = wide * wide
        s.update(unit_sum=wide.sum(dims), unit_sumsq=squares.sum(dims), unit_sum3=wide.mul_(squares).sum(dims),
                 unit_sum4=squares.square_().sum(dims))
        del wide, squares
    else:  # float32 squares overflow above 1.8e19: the norm squares in float64
        s.update(unit_sum=clean.sum(dims, dtype=_F64),
                 unit_sumsq=torch.linalg.vector_norm(clean, 2, dims, dtype=_F64).square())
    s["unit_zero"] = torch.eq(x, 0, out=scratch_like(x, torch.bool)).sum(dims)
    s["unit_min"] = torch.where(finite, x, inf, out=work).amin(dims)
    s["unit_max"] = torch.where(finite, x, minus_inf, out=work).amax(dims)
    if moments and relu and c == 0:  # ReLU outputs are >= 0, so min |h| is the min
        s["unit_min_dev"] = s["unit_min"]
    elif moments:
        dev = torch.abs(torch.sub(x, c, out=work), out=work) if c else size
        s["unit_min_dev"] = torch.where(finite, dev, inf, out=work).amin(dims)
    s["nan_count"] = nan.sum()
    if histogram and not on_device(x):  # the core's numpy histogram
        s["hist"] = torch.from_numpy(bins.histogram(x.contiguous().numpy(), int(s["unit_zero"].sum())))
    elif histogram:
        s["hist"] = bucketize_histogram(x, nan)
    return s


def layer_readings(tensors: list[torch.Tensor], metas: list[dict], scale: float = 1.0) -> list[Reading]:
    """Layer-level readings (norm, extremes, zeros, NaN/Inf; unit axis 0) of many tensors, as a
    per-step gradient reading takes them (`metas`: each one's layer, kind, stream, param): the CPU
    float32 ones in one kernel batch, a GPU's by one fused kernel a dtype (`fused.totals`), the
    others by torch kernels and one host transfer. The values carry a factor `scale` (a loss
    scaler's), divided out. A sharded tensor (a DTensor: FSDP2, tensor parallel; a `Piece`: FSDP1)
    is read from its local shard, its sums and extremes then reduced across its mesh (never
    gathered): the whole tensor's reading, on every rank. A sparse one (`nn.Embedding(sparse=True)`'s
    gradient) is read as the dense tensor it stands for, its zeros counted."""
    tensors = [t.to_dense() if getattr(t, "layout", torch.strided) is not torch.strided else t for t in tensors]
    for t, meta in zip(tensors, metas):
        check_reducible(t.is_floating_point(), t.dtype, tuple(t.shape), meta["layer"])
    shards = [_local(t, meta["layer"]) for t, meta in zip(tensors, metas)]
    if any(mesh is not None for _, mesh, _ in shards):
        return _whole(_local_readings([s for s, _, _ in shards], metas, scale), tensors, shards)
    return _local_readings(tensors, metas, scale)


def layer_totals(tensors: list[torch.Tensor], metas: list[dict], scale: float = 1.0) -> LayerTotals | None:
    """`layer_readings` of plain tensors that one batch reads (all CPU float32, by the C kernel, or
    all on one GPU, by the fused kernels), kept as their totals (a per-step gradient reading's
    parameters); None where any tensor needs another path (sharded, empty, of another dtype or
    device) or the fused kernels failed: `layer_readings` reads those."""
    if not tensors or any(type(t) is not torch.Tensor or t.layout is not torch.strided or not t.numel()
                          for t in tensors):
        return None
    if kernel.available and all(t.dtype is torch.float32 and t.is_cpu for t in tensors):
        return _totals(tensors, metas, scale, None)
    device = tensors[0].device
    if all(t.device == device and fused.usable(t, narrow=True) for t in tensors):
        return _totals(tensors, metas, scale, device)
    return None


def _totals(tensors: list[torch.Tensor], metas: list[dict], scale: float, device) -> LayerTotals | None:
    """The totals of non-empty tensors read by one batch: the C kernel's (CPU float32, `device`
    None), or the fused kernels' on `device` (None where they failed)."""
    data = [t if t.is_contiguous() else t.contiguous() for t in tensors]
    totals = kernel.reduce_totals([t.data_ptr() for t in data], [t.numel() for t in data]) if device is None \
        else fused.totals(data)
    return None if totals is None else \
        LayerTotals(totals, [t.shape for t in data], [dtype_name(t.dtype) for t in data], metas, scale)


def _local_readings(tensors: list[torch.Tensor], metas: list[dict], scale: float) -> list[Reading]:
    """`layer_readings` of plain tensors; an empty one (a rank's share of a small sharded tensor)
    reads as no values."""
    empty = [i for i, t in enumerate(tensors) if t.numel() == 0]
    if empty:
        kept = [i for i in range(len(tensors)) if i not in empty]
        got = iter(_local_readings([tensors[i] for i in kept], [metas[i] for i in kept], scale))
        return [Reading(shape=tuple(tensors[i].shape), unit_axis=0, units=0, count=0, nan_count=0, inf_count=0,
                        zero_count=0, sum=0.0, sumsq=0.0, min=math.nan, max=math.nan,
                        dtype=dtype_name(tensors[i].dtype), **metas[i])
                if i in empty else next(got) for i in range(len(tensors))]
    out: list = [None] * len(tensors)
    groups: dict = {}  # the CPU float32 tensors (None), read by the C kernel; each GPU's, by the fused kernels
    for i, t in enumerate(tensors):
        if t.is_cpu and t.dtype is torch.float32 and kernel.available:
            groups.setdefault(None, []).append(i)
        elif fused.usable(t, narrow=True):
            groups.setdefault(t.device, []).append(i)
    for device, group in groups.items():
        got = _totals([tensors[i] for i in group], [metas[i] for i in group], scale, device)
        if got is not None:  # None: the fused kernels failed (torch kernels below)
            for i, r in zip(group, got.readings()):
                out[i] = r
    rest = [i for i in range(len(tensors)) if out[i] is None]
    pending = [reduce_tensor(tensors[i] / scale if scale != 1.0 else tensors[i], 0 if tensors[i].ndim else None,
                             per_unit=False, histogram=False, **metas[i]) for i in rest]
    for i, r in zip(rest, to_readings(pending)):
        out[i] = r
    return out


@dataclass(frozen=True)
class Piece:
    """This rank's piece of a tensor sharded without DTensor (an FSDP1 flat shard): `local`, flat
    and possibly empty; the whole tensor's `shape`; the process `groups` whose ranks hold the rest."""

    local: torch.Tensor
    shape: tuple
    groups: tuple

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    def is_floating_point(self) -> bool:
        return self.local.is_floating_point()

    def detach(self) -> Piece:
        return self


def _local(t, layer: str):
    """A sharded tensor (DTensor, or a `Piece`) as (its local shard, the process groups across which
    its shards lie, how many ranks hold each of its values); a plain tensor as (itself, None, 1)."""
    if isinstance(t, Piece):
        return t.local, t.groups, 1
    placements = getattr(t, "placements", None)
    if placements is None or not hasattr(t, "to_local"):
        return t, None, 1
    if any(p.is_partial() for p in placements):
        raise ReductionError(f"layer {layer!r}: a sharded tensor holding partial sums (a Partial placement) "
                             "is not its values until reduced")
    mesh = t.device_mesh
    return (t.to_local(), tuple(mesh.get_group(d) for d in range(mesh.ndim)),
            math.prod(mesh.size(d) for d, p in enumerate(placements) if p.is_replicate()))


def _whole(readings: list[Reading], tensors: list, shards: list[tuple]) -> list[Reading]:
    """The readings of sharded tensors from their local shards' readings: sums added, extremes
    taken across their process groups (one collective per merge rule and group), each value counted once."""
    meshes: dict[tuple, list[int]] = {}
    for i, (_, groups, _) in enumerate(shards):
        if groups is not None:
            meshes.setdefault(tuple(map(id, groups)), []).append(i)
    for members in meshes.values():
        group = [readings[i] for i in members]
        for r in group:  # an extreme of no finite value is NaN, which MIN and MAX would not skip
            r.min, r.max = (math.inf if math.isnan(r.min) else r.min), (-math.inf if math.isnan(r.max) else r.max)
        all_reduce(group, shards[members[0]][0].device, shards[members[0]][1])
        for i, r in zip(members, group):
            copies, shape = shards[i][2], tuple(tensors[i].shape)
            for name in ("nan_count", "inf_count", "zero_count"):
                setattr(r, name, getattr(r, name) // copies)
            r.sum, r.sumsq = r.sum / copies, r.sumsq / copies
            r.min, r.max = (math.nan if math.isinf(r.min) else r.min), (math.nan if math.isinf(r.max) else r.max)
            r.shape, r.units, r.count = shape, shape[0] if shape else 1, math.prod(shape)
    return readings


def update_norms(now: list[torch.Tensor], before: list[torch.Tensor | None]) -> list[float | None]:
    """‖w − w_before‖ of each parameter (None where there is no before), sharded ones (DTensor,
    `Piece`) from their local shards, their squares added across their groups; `before` holds local shards."""
    out: list = [None] * len(now)
    sets: dict = {}  # process groups (None: not sharded) -> [groups, [(index, squared distance, copies)]]
    for i, (w, prev) in enumerate(zip(now, before)):
        if prev is not None:
            local, groups, copies = _local(w.detach(), "?")
            sq = torch.linalg.vector_norm(local - prev, dtype=_F64).square()
            sets.setdefault(groups and tuple(map(id, groups)), [groups, []])[1].append((i, sq, copies))
    for groups, items in sets.values():  # one host transfer per set of groups
        flat = torch.stack([sq for _, sq, _ in items])
        for group in groups or ():
            dist.all_reduce(flat, group=group)
        for (i, _, copies), v in zip(items, flat.cpu().tolist()):
            out[i] = math.sqrt(v / copies)
    return out


def keep(w: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """The parameter's values held here (a sharded one's local shard) copied into `kept`, its copy
    from the last reading, for `update_norms`; a new copy the first time."""
    local = _local(w.detach(), "?")[0]
    return local.clone() if kept is None else kept.copy_(local)


def relu_of(source: Pending, layer: str) -> Pending:
    """The reading of relu(x), from the pass over x that was asked for it."""
    return Pending(layer, "relu", source.stream, source.dtype, source.shape, source.unit_axis,
                   bounds_for("relu"), stats=dict(source.relu))


def to_readings(pending: list[Pending]) -> list[Reading | None]:
    """Move every pending reading's statistics to the host in one transfer and finish them, one
    reading each: None for one given `rows` of which a device kept none."""
    return transfer(pending)[0]


def transfer(pending: list[Pending], also: list = ()) -> tuple[list[Reading | None], list]:
    """`to_readings`, and the host values of `also` (device tensors moved in the same transfer)."""
    # a reading's statistics lie on one device, its tensor's: one look at each reading says where
    if not also and not any(on_device(next(iter(p.stats.values()), None)) for p in pending):
        return [_finish(p, dict(p.stats)) for p in pending], []  # on the host: nothing to batch, nor to convert
    host = _to_host([v for p in pending for v in p.stats.values()] + list(also))
    values = iter(host)
    return [_finish(p, {k: next(values) for k in p.stats}) for p in pending], list(values)


_WORDS = {torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64, torch.int32: np.int32}


def _to_host(values: list) -> list:
    """Each value on the host: arrays and CPU tensors as they are, device tensors in one transfer per
    device once its side stream is done, their bits joined as 32-bit words (no conversion kernel
    per value) and each seen again as an array of its own type; a tensor given many times (a fused
    batch's buffer, every reading of it) moved once."""
    devices: dict = {}  # device -> {id: tensor}
    for v in values:
        if on_device(v):
            devices.setdefault(v.device, {})[id(v)] = v
    moved = {}
    for dev, tensors in devices.items():
        if dev in _sides:  # statistics taken on the side stream: the model's stream waits for them
            torch.cuda.current_stream(dev).wait_stream(_sides[dev])
        flat = [v.reshape(-1) for v in tensors.values()]
        flat = [v if v.dtype in _WORDS else v.to(_F64) for v in flat]
        words = [v.contiguous().view(torch.int32) for v in flat]
        host = (words[0] if len(words) == 1 else torch.cat(words)).cpu().numpy()  # one: no copy on the device
        pos = 0
        for key, v in zip(tensors, flat):
            n = v.numel() * v.element_size() // 4
            moved[key], pos = host[pos: pos + n].view(_WORDS[v.dtype]), pos + n
    return [moved.get(id(v), v) for v in values]


def on_device(v) -> bool:
    """Whether `v` is a tensor on an accelerator: its values reach the host only by a transfer."""
    return isinstance(v, torch.Tensor) and v.device.type != "cpu"


def _finish(p: Pending, v: dict) -> Reading | None:
    """The reading from its statistics on the host; None where a device left out every row."""
    if p.reading is not None:
        p.reading.layer = p.layer  # the name the trace settled on
        return p.reading
    shape, left_out = p.shape, 0
    if p.rows is not None:  # entries a device left out, as NaN: out of the count and the shape
        kept = int(np.asarray(v.pop("kept_rows")).sum())
        if not kept:
            return None
        shape = (kept, *shape[1:])
        left_out = (p.rows - kept) * math.prod(shape[1:])
    meta = dict(shape=shape, unit_axis=p.unit_axis, per_unit=p.per_unit, layer=p.layer, kind=p.kind, stream=p.stream,
                dtype=p.dtype, bounds=p.bounds, param=p.param)
    if "fused" in v:
        words = v["fused"] if p.span is None else v["fused"][p.span]
        return Reading.from_kernel(fused.unpack(words, p.histogram, p.bounds is not None, math.prod(p.shape),
                                                p.dtype != "float64", left_out), **meta)
    if left_out:
        v["nan_count"] = int(np.asarray(v["nan_count"]).sum()) - left_out
    if "inf_count" not in v and "unit_count" in v:  # the torch path's (`_masked`): what it left to the host
        finite, nan = np.asarray(v["unit_count"]).sum(), np.asarray(v["nan_count"]).sum()
        v["inf_count"] = math.prod(shape) - int(finite) - int(nan)
        for k in ("unit_min", "unit_max", "unit_min_dev"):  # a unit with no finite value: NaN
            if k in v:
                a = np.asarray(v[k])
                v[k] = np.where(np.isinf(a), np.nan, a)
    return Reading.from_stats(v, **meta)


def all_reduce(readings: list[Reading], device: torch.device | None = None, groups=(None,)) -> None:
    """Merge every rank's readings of its probe shard in place, field by field by the schema's
    merge rules (sums and the batch extents add; minima, and maxima as minima of their negatives,
    skipping NaN): one collective per process group (the default: every rank), an all-gather of
    every field at once, on `device` (where the group's backend wants its tensors)."""
    parts = [(r, name, rule) for rules in (("sum", "concat"), ("min", "max")) for r in readings for name in _FIELDS
             if (rule := MERGE.get(name)) in rules and getattr(r, name) is not None and (name != "shape" or r.shape)]
    if not parts:
        return
    values = [np.atleast_1d(np.asarray(_as_min(getattr(r, n), n), np.float64)) for r, n, _ in parts]
    sizes = np.array([v.size for v in values])
    added = np.repeat([rule in ("sum", "concat") for _, _, rule in parts], sizes)
    flat = np.concatenate(values)
    for group in groups:
        mine = torch.from_numpy(flat).to(device or "cpu")
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
        stacked = torch.stack(every).cpu().numpy()
        flat = np.where(added, stacked.sum(0), np.fmin.reduce(stacked, axis=0))
    pos = 0
    for (r, name, _), v in zip(parts, values):
        new, pos = _as_min(flat[pos: pos + v.size], name), pos + v.size
        old = getattr(r, name)
        if name == "shape":  # `concat`: the batch extent adds
            r.shape = (int(new[0]), *r.shape[1:])
        elif isinstance(old, np.ndarray):
            setattr(r, name, new.astype(old.dtype))
        else:
            setattr(r, name, type(old)(new[0]))


def _as_min(value, name: str):
    """A field's values as a MIN collective takes them (a maximum negated) and back; the batch
    extent of a shape alone."""
    if name == "shape":
        return value[:1]
    return -np.asarray(value) if MERGE[name] == "max" else value


_FIELDS = [f.name for f in fields(Reading)]
