"""The one way a tensor becomes a Reading: `reduce_arrays` takes a batch of (tensor, unit axis, kind,
options) and sends each to its backend: float32 numpy arrays to the fused C kernel, in one batch
on every thread, anything else to the numpy reference. (PyTorch tensors go to `actrace.reduce.torch`,
which gives the same statistics on their device.)
"""
from __future__ import annotations

import numpy as np

from actrace.format import bins
from actrace.format.schema import STREAMS, bounds_for

from . import kernel
from .reading import LayerTotals, Reading, ReductionError
from .reference import centre, reference, sat_counts, view3


def reduce_array(x, unit_axis: int | None, kind: str, *, layer: str = "?", stream: str = "activation",
                 bounds: tuple[float, float] | None = None, param: str | None = None,
                 per_unit: bool = True, histogram: bool = True) -> Reading:
    """Reduce `x` over every axis but `unit_axis` (None: the whole tensor is one unit)."""
    return reduce_arrays([(x, unit_axis, kind, dict(layer=layer, stream=stream, bounds=bounds, param=param,
                                                    per_unit=per_unit, histogram=histogram))])[0]

def relu_stats(stats: dict, sums: dict) -> dict:
    """relu(x)'s statistics from x's fused kernel pass (x without NaN or Inf): its sums and zeros
    come from the kernel (`sums`, the pass's "relu"); min, max and min |h| follow from x's;
    values <= 0 land in zero's bin."""
    lo = np.maximum(stats["unit_min"], 0)
    relu = {**{k: v for k, v in stats.items() if k not in ("sat_counts", "totals")}, **sums, "unit_min": lo,
            "unit_max": np.maximum(stats["unit_max"], 0), "unit_min_dev": lo}
    if stats.get("hist") is not None:
        hist = relu["hist"] = stats["hist"].copy()
        hist[bins.ZERO_BIN] = hist[: bins.ZERO_BIN + 1].sum()
        hist[: bins.ZERO_BIN] = 0
    return relu

def reduce_arrays(tensors: list[tuple]) -> list[Reading]:
    """`reduce_array(x, unit_axis, kind, **options)` of each (x, unit_axis, kind, options), the
    float32 ones in one kernel batch shared among all threads. An option `relu="NAME"` also
    gives the reading of relu(x) as layer NAME, right after x's: from x's own pass where it can
    (float32 without NaN or Inf), else from a pass over relu(x)."""
    jobs, out = [], []
    for x, unit_axis, kind, opt in tensors:
        layer, stream = opt.get("layer", "?"), opt.get("stream", "activation")
        if stream not in STREAMS:
            raise ReductionError(f"layer {layer!r}: unknown stream {stream!r}; expected one of {STREAMS}")
        bounds = bounds_for(kind, opt.get("bounds"))
        x3 = view3(x, unit_axis, layer)
        meta = dict(shape=np.shape(x), unit_axis=unit_axis, per_unit=opt.get("per_unit", True), layer=layer,
                    kind=kind, stream=stream, dtype=str(np.asarray(x).dtype), bounds=bounds, param=opt.get("param"))
        jobs.append((x3, bounds, opt.get("histogram", True), meta, opt.get("relu")))
    fused = [i for i, job in enumerate(jobs) if kernel.available and job[0].dtype == np.float32]
    stats = dict(zip(fused, kernel.reduce_many([(np.ascontiguousarray(jobs[i][0]), centre(jobs[i][1]), jobs[i][2],
                                                 jobs[i][4] is not None) for i in fused])))
    for i, (x3, bounds, histogram, meta, relu) in enumerate(jobs):
        if i in stats:
            st = stats[i]
            sums = st.pop("relu")
            if bounds is not None:
                st["sat_counts"] = sat_counts(x3, bounds)
            out.append(Reading.from_kernel(st, **meta))
        else:
            st, sums = reference(x3, 1, bounds=bounds, histogram=histogram), None
            out.append(Reading.from_stats(st, **meta))
        if relu is not None:
            relu_meta = dict(meta, layer=relu, kind="relu", bounds=None)
            if sums is not None and not (st["nan_count"].any() or st["inf_count"].any()):
                out.append(Reading.from_stats(relu_stats(st, sums), **relu_meta))
            else:  # NaN stays NaN through a ReLU, as in the frameworks
                out.append(Reading.from_stats(reference(np.maximum(x3, 0), 1, histogram=histogram), **relu_meta))
    return out


def param_grad_meta(layer: str, param: str, kind: str) -> dict:
    """What a parameter gradient's layer-level reading is besides its values (`LayerTotals.metas`):
    a bounded kind's rows carry its bounds, as every row of that kind does (spec §Validity)."""
    return dict(layer=layer, kind=kind, bounds=bounds_for(kind), stream="param_grad", param=param)


def gradient_totals(grads: list[tuple]) -> LayerTotals | None:
    """The parameter gradients `grads` ((array, layer, param, kind) each, on the host) read
    layer-level in one kernel batch and kept as totals, as a per-step gradient reading takes them:
    no `Reading` per gradient (`table.LayerRows`), and, as for PyTorch's, no sum3 or sum4; None
    where one batch cannot read them all (one not float32, or empty; no compiled kernel): then
    `reduce_arrays` of their `param_grad_job`s reads them (and refuses an empty one)."""
    arrays = [np.asarray(g) for g, *_ in grads]
    if not arrays or not kernel.available or any(a.dtype != np.float32 or not a.size for a in arrays):
        return None
    arrays = [a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in arrays]  # a 0-d one stays 0-d
    totals = kernel.reduce_totals([a.__array_interface__["data"][0] for a in arrays], [a.size for a in arrays])
    return LayerTotals(totals, [a.shape for a in arrays], ["float32"] * len(arrays),
                       [param_grad_meta(layer, param, kind) for _, layer, param, kind in grads])


def param_grad_job(g, layer: str, param: str, kind: str) -> tuple:
    """The `reduce_arrays` task of one parameter's gradient, read layer-level (norm, extremes, zeros,
    NaN/Inf; units on axis 0) as every adapter reads gradients at each step."""
    g = np.asarray(g)
    return g, 0 if g.ndim else None, kind, dict(layer=layer, stream="param_grad", param=param, per_unit=False,
                                                histogram=False)
