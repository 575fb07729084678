"""On-device reductions of torch tensors: the spec's per-unit statistics in few passes, no syncs.

`reduce_tensor` queues the work: a CPU float32 tensor waits for the core's fused C kernel; other
tensors are reduced with torch kernels on their device. `settle` finishes a batch of readings
before their tensors are freed: the fused kernel on every thread (PyTorch's OpenMP team), then
one host sync to find the rare torch-path reading with a NaN or Inf, counted again exactly.
A tensor changed in place after it was queued (its version counter moved) is reported stale, not
read. A ReLU reading of a queued float32 tensor can be derived from that tensor's pass
(`derive_relu`). `to_readings` moves the numbers to the host in one transfer. Values agree with
`actrace.reduce.reduce_array` (the tests check).
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from actrace import bins, kernel
from actrace.reduce import Reading, ReductionError, centre, reduce_array
from actrace.schema import bounds_for

_EDGES_F32 = torch.tensor(np.array(bins._first_f32, dtype=np.float32))
_SUM_FIELDS = ("unit_count", "unit_zero", "unit_sum", "unit_sumsq", "hist", "shape0", "nan", "inf")
_MIN_FIELDS = ("unit_min", "unit_min_dev")
_MAX_FIELDS = ("unit_max",)


@dataclass
class Pending:
    """A reading whose statistics are not on the host yet (mergeable across chunks): numpy arrays
    from the fused kernel, tensors on the device from the torch path. `stats` may also hold
    `update_norm`, a 0-d tensor, for parameter readings."""

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
    source: torch.Tensor | None = None        # until `settle`: for the rare exact non-finite re-count
    hist_source: torch.Tensor | None = None   # until `settle`: a CPU tensor whose histogram is due
    fused: tuple | None = None                # until `settle`: a CPU float32 tensor for the fused kernel
    watch: torch.Tensor | None = None         # until `settle`: the tensor read, whose version must not move
    version: int | None = None                # its version counter when read (None: it has none)
    derive: bool = False                      # the fused pass also gives relu(x)'s statistics...
    relu_stats: dict | None = None            # ...here, when x had no NaN or Inf
    derived_from: "Pending | None" = None     # a ReLU reading whose statistics that pass gives

    def holds(self, x: torch.Tensor) -> bool:
        """Whether this unsettled reading's tensor shares memory with `x`."""
        return self.watch is not None and \
            self.watch.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()

    def merge(self, other: "Pending") -> None:
        """Fold the statistics of another (settled) chunk of the same tensor into this one."""
        for k, v in other.stats.items():
            lib = torch if isinstance(v, torch.Tensor) else np
            if k in _MIN_FIELDS:
                self.stats[k] = lib.fmin(self.stats[k], v)
            elif k in _MAX_FIELDS:
                self.stats[k] = lib.fmax(self.stats[k], v)
            else:
                self.stats[k] = self.stats[k] + v


_local = threading.local()


def scratch_like(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A reused buffer (one per thread) shaped like `x`: a fresh full-size temporary per reading
    costs page faults that can exceed the reduction itself (measured on CPU: 3-4x)."""
    scratch = _local.__dict__.setdefault("buffers", {})
    key = (x.device, dtype)
    buf = scratch.get(key)
    if buf is None or buf.numel() < x.numel():
        buf = scratch[key] = torch.empty(x.numel(), dtype=dtype, device=x.device)
    return buf[: x.numel()].view(x.shape)


def tensor_version(x: torch.Tensor) -> int | None:
    """The version counter in-place operations bump; None for inference tensors, which have none."""
    try:
        return x._version
    except RuntimeError:
        return None


def derive_relu(source: Pending, x: torch.Tensor, exact: bool = True) -> bool:
    """Ask `source`'s fused pass for relu's statistics too, if that pass is still to come and `x`
    (a ReLU's input) is exactly the tensor it read, or (`exact=False`) `x` is known by construction
    to be relu of that tensor."""
    w = source.watch
    same = source.fused is not None and w is not None and w.shape == x.shape and w.dtype == x.dtype and (
        not exact or (w.data_ptr() == x.data_ptr() and w.stride() == x.stride()
                      and source.version is not None and tensor_version(x) == source.version))
    source.derive = source.derive or same
    return same


def bucketize_histogram(x: torch.Tensor) -> torch.Tensor:
    """The histogram on any device by binary search over the float32 edges (the CUDA path)."""
    x = x.float()
    mag = torch.bucketize(x.abs(), _EDGES_F32.to(x.device), right=True)  # |v| >= f_j ⇔ |v| >= E_j
    idx = torch.where(x > 0, bins.ZERO_BIN + 1 + mag, bins.ZERO_BIN - 1 - mag)
    idx = torch.where(x == 0, bins.ZERO_BIN, idx)
    idx = torch.where(torch.isinf(x), torch.where(x > 0, bins.POS_INF_BIN, bins.NEG_INF_BIN), idx)
    idx = torch.where(torch.isnan(x), bins.N_BINS, idx)
    return torch.bincount(idx.reshape(-1), minlength=bins.N_BINS + 1)[: bins.N_BINS]


def reduce_tensor(t: torch.Tensor, unit_axis: int | None, kind: str, *, layer: str, stream: str = "activation",
                  bounds=None, param: str | None = None, per_unit: bool = True, histogram: bool = True) -> Pending:
    """Reduce a floating tensor over every axis but `unit_axis`, on its device."""
    x = t.detach()
    dtype = str(x.dtype).removeprefix("torch.")
    if not x.is_floating_point():
        raise ReductionError(f"layer {layer!r}: cannot reduce a {dtype} tensor, only floating point")
    if x.numel() == 0:
        raise ReductionError(f"layer {layer!r}: cannot reduce an empty tensor of shape {tuple(x.shape)}")
    if x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()
    bounds = bounds_for(kind, bounds)
    shape = tuple(x.shape)
    if unit_axis is None:
        x, axis = x.reshape(-1, 1), 1
    else:
        axis = unit_axis % x.ndim
    pending = Pending(layer, kind, stream, dtype, shape, unit_axis, bounds, param, per_unit, source=x,
                      watch=x, version=tensor_version(x))
    c = centre(bounds)
    shape0 = shape[0] if shape else 1
    if x.device.type == "cpu" and x.dtype == torch.float32 and kernel.available:
        # one fused pass in `settle`, on torch's own OpenMP threads (threads of ours would fight
        # them: measured slower)
        if per_unit and unit_axis is not None:
            view = x.contiguous().view(math.prod(shape[:axis]), shape[axis], -1)
        else:
            view = x.contiguous().view(1, 1, -1)
        pending.fused = (view, c, histogram and per_unit)
        pending.source = None
        pending.stats = {"shape0": np.array([shape0])}
        return pending
    dims = [d for d in range(x.ndim) if d != axis]
    zero = torch.zeros((), dtype=torch.int64, device=x.device)
    common = {"shape0": torch.tensor(shape0, device=x.device), "nan": zero, "inf": zero}
    if not per_unit:  # layer-level only (per-step gradient readings): whole-tensor kernels, one pass each
        flat = x.reshape(-1)
        lo, hi = torch.aminmax(flat)
        pending.stats = {"unit_sum": flat.sum(), "unit_sumsq": torch.dot(flat, flat), "unit_min": lo,
                         "unit_max": hi, "unit_zero": flat.numel() - torch.count_nonzero(flat),
                         "unit_count": torch.tensor(flat.numel(), device=x.device), **common}
        return pending
    # float32 accumulation uses the backends' pairwise/cascade sums (spec §Numerics); the host adds in float64
    work = scratch_like(x, x.dtype)
    s = {
        "unit_sum": x.sum(dims),
        "unit_sumsq": torch.square(x, out=work).sum(dims),
        "unit_min": x.amin(dims),
        "unit_max": x.amax(dims),
        "unit_zero": torch.eq(x, 0, out=scratch_like(x, torch.bool)).sum(dims),
        **common,
    }
    s["unit_count"] = torch.full_like(s["unit_zero"], x.numel() // s["unit_sum"].numel())
    if kind == "relu" and c == 0:  # ReLU outputs are >= 0, so min |h| is the min
        s["unit_min_dev"] = s["unit_min"]
    else:
        dev = torch.sub(x, c, out=work) if c else x
        s["unit_min_dev"] = torch.abs(dev, out=work).amin(dims)
    pending.stats = s
    if histogram and x.device.type == "cpu":
        pending.hist_source = x  # counted in `settle`, two tensors at a time
    elif histogram:
        s["hist"] = bucketize_histogram(x)
    return pending


_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="actrace-hist")


def _fuse(pending: list[Pending]) -> None:
    """Run the fused kernel on CPU float32 tensors, all threads sharing the batch: each reading's
    statistics, and with `derive` those of relu(x) (min, max and min |h| of relu(x) follow from
    x's; NaN bins nowhere, values <= 0 and -inf go to zero's bin)."""
    if not pending:
        return
    results = kernel.reduce_many([(p.fused[0].numpy(), p.fused[1], p.fused[2], p.derive) for p in pending])
    for p, st in zip(pending, results):
        out = {"unit_sum": st["sum"], "unit_sumsq": st["sumsq"], "unit_min": st["min"], "unit_max": st["max"],
               "unit_min_dev": st["min_dev"], "unit_zero": st["zero"], "unit_count": st["finite"],
               "nan": st["nan_inf"][:1], "inf": st["nan_inf"][1:]}
        if st["hist"] is not None:
            out["hist"] = st["hist"]
        p.stats.update(out)
        if p.derive and not st["nan_inf"].any():
            lo = np.maximum(st["min"], 0)
            relu = {**out, "unit_sum": st["relu_sum"], "unit_sumsq": st["relu_sumsq"], "unit_zero": st["relu_zero"],
                    "unit_min": lo, "unit_max": np.maximum(st["max"], 0), "unit_min_dev": lo}
            if st["hist"] is not None:
                hist = relu["hist"] = st["hist"].copy()
                hist[bins.ZERO_BIN] = hist[: bins.ZERO_BIN + 1].sum()
                hist[: bins.ZERO_BIN] = 0
            p.relu_stats = relu
        p.fused = None


def _units(p: Pending) -> int:
    return 1 if p.unit_axis is None else p.shape[p.unit_axis % len(p.shape)]


def _cpu_histogram(p: Pending) -> torch.Tensor:
    """The core's numpy histogram: it runs without the GIL, so two of them share the cores (torch
    kernels in these threads would start OpenMP teams that spin beside torch's)."""
    return torch.from_numpy(bins.histogram(p.hist_source.contiguous().numpy(), int(p.stats["unit_zero"].sum())))


def _exact(p: Pending) -> dict:
    """Statistics of a reading with NaN or Inf, from the numpy reference (which masks them)."""
    r = reduce_array(p.source.float().cpu().numpy(), p.unit_axis, p.kind, layer=p.layer, stream=p.stream,
                     bounds=p.bounds, param=p.param, per_unit=p.per_unit, histogram="hist" in p.stats
                     or p.hist_source is not None)
    dev = p.stats["unit_sum"].device
    whole = not p.per_unit
    stats = {
        "unit_sum": [r.sum] if whole else r.unit_sum, "unit_sumsq": [r.sumsq] if whole else r.unit_sumsq,
        "unit_min": [r.min] if whole else r.unit_min, "unit_max": [r.max] if whole else r.unit_max,
        "unit_zero": [r.zero_count] if whole else r.unit_zero,
        "unit_count": [r.count - r.nan_count - r.inf_count] if whole else r.unit_count,
        "shape0": [r.shape[0] if r.shape else 1], "nan": [r.nan_count], "inf": [r.inf_count],
    }
    if not whole:
        stats["unit_min_dev"] = r.unit_min_dev
    if r.hist is not None:
        stats["hist"] = r.hist
    out = {k: torch.as_tensor(np.asarray(v), device=dev).reshape(p.stats[k].shape if k in p.stats else -1)
           for k, v in stats.items()}
    out.update({k: v for k, v in p.stats.items() if k == "update_norm"})
    return out


def _stale(p: Pending) -> bool:
    return p.watch is not None and p.version is not None and tensor_version(p.watch) != p.version


def _drop_stale(pending: list[Pending]) -> list[Pending]:
    """The readings whose tensor moved, no longer to be read from it."""
    stale = [p for p in pending if _stale(p)]
    for p in stale:
        p.fused = p.hist_source = p.source = None
    return stale


def settle(pending: list[Pending]) -> list[Pending]:
    """Finish readings whose tensors are about to be freed: fused passes on every thread (ReLU
    readings derived from their input's pass where they can be), histograms of other CPU tensors
    on two, then one host sync for the whole batch to find readings with a NaN or Inf (a
    non-finite sum of squares), which are re-counted exactly. Drops the tensor references. Returns
    the readings whose tensor was changed in place since it was queued: they are not read."""
    stale = _drop_stale([p for p in pending if p.derived_from is None])
    _fuse([p for p in pending if p.fused is not None and p.derived_from is None])
    for p in pending:
        if p.fused is not None and p.derived_from is not None and p.derived_from.relu_stats is not None:
            p.stats.update(p.derived_from.relu_stats)
            p.fused = None
        p.derived_from = None
    rest = [p for p in pending if p.fused is not None]  # derivations that could not be
    stale += _drop_stale(rest)
    _fuse([p for p in rest if p.fused is not None])
    due = [p for p in pending if p.hist_source is not None]
    for p, hist in zip(due, _pool.map(_cpu_histogram, due)):
        p.stats["hist"] = hist
    live = [p for p in pending if p.source is not None]
    if live:
        finite = torch.stack([torch.isfinite(p.stats["unit_sumsq"]).all() for p in live]).cpu()
        for p, ok in zip(live, finite.tolist()):
            if not ok:
                p.stats = _exact(p)
    for p in pending:
        p.source = p.hist_source = p.watch = None
    return stale


def to_readings(pending: list[Pending]) -> list[Reading]:
    """Move every pending reading's statistics to the host in one transfer and finish them."""
    if not pending:
        return []
    if settle(pending):
        raise RuntimeError("actrace: a tensor was changed in place before its reading was settled")
    if not any(_on_device(v) for p in pending for v in p.stats.values()):
        return [_finish(p, {k: np.asarray(v, dtype=np.float64).reshape(-1) for k, v in p.stats.items()})
                for p in pending]  # on the host already: nothing to batch
    dev = next(v.device for p in pending for v in p.stats.values() if _on_device(v))
    flat = [torch.as_tensor(v, device=dev).reshape(-1).to(torch.float64) for p in pending for v in p.stats.values()]
    host = torch.cat(flat).cpu().numpy()
    out, pos = [], 0
    for p in pending:
        vals = {}
        for k, v in p.stats.items():
            vals[k] = host[pos: pos + _numel(v)]
            pos += _numel(v)
        out.append(_finish(p, vals))
    return out


def _on_device(v) -> bool:
    return isinstance(v, torch.Tensor) and v.device.type != "cpu"


def _numel(v) -> int:
    return v.numel() if isinstance(v, torch.Tensor) else v.size


def _finish(p: Pending, v: dict) -> Reading:
    shape = (int(v["shape0"][0]),) + tuple(p.shape[1:])
    units = _units(p)
    nan, inf = int(v["nan"][0]), int(v["inf"][0])
    r = Reading(layer=p.layer, kind=p.kind, stream=p.stream, dtype=p.dtype, shape=shape,
                unit_axis=None if p.unit_axis is None else p.unit_axis % len(p.shape), units=units,
                count=math.prod(shape), nan_count=nan, inf_count=inf, zero_count=int(v["unit_zero"].sum()),
                sum=float(v["unit_sum"].sum()), sumsq=float(v["unit_sumsq"].sum()),
                # units with no finite value hold NaN extremes, which fmin/fmax pass over
                min=float(np.fmin.reduce(v["unit_min"])), max=float(np.fmax.reduce(v["unit_max"])),
                bounds=p.bounds, param=p.param, hist=v["hist"].astype(np.int64) if "hist" in v else None,
                update_norm=float(v["update_norm"][0]) if "update_norm" in v else None)
    if p.per_unit:
        r.unit_count = v["unit_count"].astype(np.int64)
        r.unit_zero = v["unit_zero"].astype(np.int64)
        r.unit_sum, r.unit_sumsq = v["unit_sum"], v["unit_sumsq"]
        r.unit_min, r.unit_max = v["unit_min"].astype(np.float32), v["unit_max"].astype(np.float32)
        r.unit_min_dev = v["unit_min_dev"].astype(np.float32)
    return r


def all_reduce(pending: list[Pending]) -> None:
    """Merge every rank's readings of its probe shard: sums, minima and maxima across ranks."""
    import torch.distributed as dist

    for fields, op in ((_SUM_FIELDS, dist.ReduceOp.SUM), (_MIN_FIELDS, dist.ReduceOp.MIN),
                       (_MAX_FIELDS, dist.ReduceOp.MAX)):
        parts = [(p, k) for p in pending for k in fields if k in p.stats]
        if not parts:
            continue
        flat = torch.cat([torch.as_tensor(p.stats[k]).reshape(-1).to(torch.float64) for p, k in parts])
        dist.all_reduce(flat, op=op)
        pos = 0
        for p, k in parts:
            n = _numel(p.stats[k])
            old, new = p.stats[k], flat[pos: pos + n].reshape(p.stats[k].shape)
            p.stats[k] = new.to(old.dtype) if isinstance(old, torch.Tensor) else new.numpy().astype(old.dtype)
            pos += n
