"""The fused float32 reduction kernel (_kernel.c beside it) through ctypes, with its lookup table.

`reduce_many` runs a batch of tensors on every thread at once: on the OpenMP team of a framework
already in the process (PyTorch's libgomp, whose idle threads would otherwise spin beside ours),
else, from `POOL_SPLIT` values, on two Python threads (ctypes releases the GIL). Optional: where
the compiled module is missing, `available` is False and `actrace.reduce` uses its numpy path,
which gives the same numbers (the tests hold the two to each other). `attention_scores` gives an
attention's per-head numbers (spec §Derived readings) in one read of its scores.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from actrace.format import bins

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


class _Bins(ctypes.Structure):
    _fields_ = [("key_bin", _P), ("edges", _P), ("n_edges", ctypes.c_int),
                ("zero_bin", ctypes.c_int), ("n_bins", ctypes.c_int)]


class _Job(ctypes.Structure):  # Job in _kernel.c
    _fields_ = [("x", _P), ("before", _I64), ("units", _I64), ("after", _I64), ("centre", ctypes.c_float)] + \
        [(name, ctypes.c_int32) for name in ("pieces", "relu", "hist", "done")] + \
        [("f64", _P), ("f32", _P), ("i64", _P), ("totals", _P)]


class _Batch(ctypes.Structure):
    _fields_ = [("bins", _Bins), ("jobs", _P), ("n", _I64), ("next", _I64)]


class _Scores(ctypes.Structure):  # Scores in _kernel.c
    _fields_ = [("x", _P)] + [(name, _I64) for name in ("batch", "heads", "queries", "keys", "reach")] + \
        [("lowest", ctypes.c_float)] + [(name, _P) for name in ("peak", "entropy", "sink", "n")] + [("next", _I64)]


class LayoutError(ImportError):
    """The compiled kernel and this mirror of its structs disagree (a stale or mismatched build)."""


F64_ROWS = 8  # double outputs per unit: sum, sumsq, relu's sum, sumsq, cubes, fourth powers, relu's cubes, fourth
TOTALS = ("sum", "sumsq", "sum3", "sum4", "min", "max", "zero_count", "nan_count", "inf_count")  # a job's, whole tensor


def _load():
    """The kernel's batch entry point and constants (KEY_SHIFT, EXACT, MAX_BINS), after checking its
    F64_ROWS and TOTALS and that the C structs are laid out as the ctypes ones here; None when it is
    not built."""
    spec = importlib.util.find_spec("actrace.reduce._kernel")
    if spec is None or not spec.origin:
        return None
    lib = ctypes.CDLL(spec.origin)
    lib.actrace_layout.argtypes, lib.actrace_layout.restype = [ctypes.POINTER(_I64)], ctypes.POINTER(_I64)
    n = _I64()
    got = lib.actrace_layout(ctypes.byref(n))[: n.value]
    mirror = []
    for struct in (_Bins, _Job, _Batch, _Scores):
        mirror += [ctypes.sizeof(struct)] + [getattr(struct, name).offset for name, _ in struct._fields_]
    if got[5:] != mirror or got[3:5] != [F64_ROWS, len(TOTALS)]:
        raise LayoutError(f"{spec.origin}: the kernel's struct layout {got[3:]} is not kernel.py's "
                          f"{[F64_ROWS, len(TOTALS), *mirror]}; rebuild it (pip install -e .)")
    shift, exact, max_bins = got[:3]
    if bins.N_BINS > max_bins or exact < max_bins:
        raise LayoutError(f"{spec.origin}: built for {max_bins} bins (EXACT {exact}), the spec has {bins.N_BINS}")
    fn, scores = lib.actrace_run_batch, lib.actrace_scores
    fn.argtypes, fn.restype = [_P], None
    scores.argtypes, scores.restype = [_P], None
    return fn, scores, shift, exact


def _openmp():
    """(GOMP_parallel, omp_get_max_threads) of the libgomp already loaded in this process
    (PyTorch's), or None: never loads one itself."""
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
        parallel, threads = lib.GOMP_parallel, lib.omp_get_max_threads
    except (OSError, AttributeError):
        return None
    parallel.argtypes, parallel.restype = [_P, _P, ctypes.c_uint, ctypes.c_uint], None
    threads.argtypes, threads.restype = [], ctypes.c_int
    return parallel, threads


def _key_table(shift: int, exact: int) -> np.ndarray:
    """Each key (float32 bits >> shift) its bin where every float32 with that key lands in one bin,
    else exact (the kernel's exact path)."""
    keys = np.arange(1 << (32 - shift), dtype=np.uint64)
    first = (keys << shift).astype(np.uint32).view(np.float32)
    last = ((keys << shift) | ((1 << shift) - 1)).astype(np.uint32).view(np.float32)
    with np.errstate(invalid="ignore"):
        same = ~np.isnan(first) & ~np.isnan(last)
        b_first = np.where(same, bins.bin_index(np.where(same, first, 0)), -1)
        b_last = np.where(same, bins.bin_index(np.where(same, last, 0)), -1)
    table = np.where(same & (b_first == b_last), b_first, exact).astype(np.uint8)
    table[[0, 1 << (31 - shift)]] = bins.ZERO_BIN  # ±0's keys; the kernel sends their subnormals the exact way
    return table


_loaded = _load()
available = _loaded is not None
_run, _scores = _loaded[:2] if available else (None, None)
_RUN, _SCORES = (ctypes.cast(_run, _P), ctypes.cast(_scores, _P)) if available else (None, None)
_TABLE = _key_table(*_loaded[2:]) if available else None
_EDGES = np.ascontiguousarray(bins.MAGNITUDE_EDGES, dtype=np.float64)
_BINS = _Bins(_TABLE.ctypes.data, _EDGES.ctypes.data, len(_EDGES), bins.ZERO_BIN, bins.N_BINS) \
    if available else None
_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="actrace-kernel")
_gomp: list = []  # [(GOMP_parallel, omp_get_max_threads) or None], looked up at the first batch
SPLIT = 1 << 16   # values: a tensor this large is cut in pieces, one per thread
POOL_SPLIT = 1 << 20  # values a batch needs before two Python threads share it: a hand-off costs 60-70 us


def _address(a: np.ndarray) -> int:
    """The array's data pointer (`ndarray.ctypes` builds an object per call: ~0.1 ms each)."""
    return a.__array_interface__["data"][0]


def _job(x3: np.ndarray, centre: float, histogram: bool, relu: bool, threads: int) -> tuple[_Job, dict]:
    """A job for the kernel and the views of its results. A large tensor is cut into a piece per
    thread (along `before`, or along `after` for a whole tensor read as one unit); the outputs have
    a row per piece, merged into row 0 by the kernel. The caller keeps `x3` alive until it has run."""
    before, units, after = x3.shape
    cut = x3.size >= SPLIT and (before >= threads or (before, units) == (1, 1))
    pieces = threads if cut else 1
    # the outputs in one allocation (one call instead of three: this runs per tensor read), the
    # tensor's TOTALS (`reduce_many`) first; the kernel sets every value it gives, so none is zeroed
    t, n64, nint = len(TOTALS), pieces * F64_ROWS * units, pieces * (3 * units + bins.N_BINS + 2)
    block = np.empty(8 * (t + n64 + nint) + 4 * pieces * 3 * units, np.uint8)
    at = _address(block)
    f64 = block[8 * t: 8 * (t + n64)].view(np.float64).reshape(pieces, F64_ROWS, units)
    i64 = block[8 * (t + n64): 8 * (t + n64 + nint)].view(np.int64).reshape(pieces, -1)
    f32 = block[8 * (t + n64 + nint):].view(np.float32).reshape(pieces, 3, units)
    job = _Job(_address(x3), before, units, after, centre, pieces, relu, histogram, 0,
               at + 8 * t, at + 8 * (t + n64 + nint), at + 8 * (t + n64), at)
    (d, f, i) = (f64[0], f32[0], i64[0])
    out = {"unit_sum": d[0], "unit_sumsq": d[1], "unit_min": f[0], "unit_max": f[1], "unit_min_dev": f[2],
           "unit_zero": i[:units], "unit_count": i[units: 2 * units], "hist": i[3 * units: -2] if histogram else None,
           "nan_count": i[-2:-1], "inf_count": i[-1:], "unit_sum3": d[4], "unit_sum4": d[5],
           "totals": block[:8 * t].view(np.float64),
           "relu": {"unit_sum": d[2], "unit_sumsq": d[3], "unit_zero": i[2 * units: 3 * units], "unit_sum3": d[6],
                    "unit_sum4": d[7]} if relu else None}
    return job, out


def _threads() -> int:
    if not _gomp:  # PyTorch, where it is used, is loaded by the first call
        _gomp.append(_openmp())
    return _gomp[0][1]() if _gomp[0] else 2


def _dispatch(address: int, n: int, pieces: int, values: int) -> None:
    """Run `n` jobs laid out at `address` (`pieces` in all, of `values` values) on every thread, or
    on this one alone (`_on_threads`)."""
    _on_threads(_run, _RUN, ctypes.byref(_Batch(_BINS, address, n, 0)), values if pieces > 1 else 0)


def _on_threads(fn, address, data, values: int) -> None:
    """`fn(data)` on every thread (the framework's OpenMP team, or two Python threads), else on this
    one alone where `values` are too few to pay for waking them: a piece's worth (`SPLIT`) for an
    OpenMP team, `POOL_SPLIT` for Python threads (bench_core.py: below it their hand-off costs about
    what the second thread saves with a histogram, more without); `address` is fn's, for OpenMP."""
    _threads()
    if values < (SPLIT if _gomp[0] else POOL_SPLIT):
        fn(data)
    elif _gomp[0]:
        _gomp[0][0](address, data, 0, 0)  # 0 threads: the team's size (torch.set_num_threads)
    else:
        helper = _pool.submit(fn, data)
        fn(data)
        helper.result()


def attention_scores(x: np.ndarray, lowest: float, reach: int | None = None) -> tuple[np.ndarray, ...]:
    """Of C-contiguous float32 scores `[B, H, Q, K]`, a key any head scores at or below `lowest`
    left out, and one more than `reach` keys past the query's position (0: SDPA's causal mask;
    None: none): per query and head its largest logit, its softmax's entropy over ln(keys) (queries
    of 2 keys or more) and its mass on the first key it may attend (`[B, Q, H]` each), and per query
    its keys (`[B, Q]`); NaN where a NaN score or no key makes them unknown."""
    batch, heads, queries, keys = x.shape
    peak, entropy, sink = (np.empty((batch, queries, heads), np.float32) for _ in range(3))
    n = np.empty((batch, queries), np.int64)
    job = _Scores(_address(x), batch, heads, queries, keys, keys if reach is None else reach, lowest,
                  *map(_address, (peak, entropy, sink, n)), 0)
    _on_threads(_scores, _SCORES, ctypes.byref(job), x.size if batch * queries > 1 else 0)
    return peak, entropy, sink, n


def reduce_many(tasks: list[tuple[np.ndarray, float, bool, bool]]) -> list[dict]:
    """`reduce_f32` of every (x3, centre, histogram, relu) task on all threads at once: the tasks,
    and large tensors cut in pieces, are shared among the threads. Each result also holds `totals`:
    the tensor's `TOTALS`."""
    if not tasks:
        return []
    threads = _threads()
    made = [_job(*task, threads) for task in tasks]
    jobs = (_Job * len(made))(*(job for job, _ in made))
    _dispatch(ctypes.addressof(jobs), len(made), sum(job.pieces for job in jobs), sum(t[0].size for t in tasks))
    return [out for _, out in made]


_JOBS = np.dtype(_Job)  # a job table built column by column, as numpy arrays


def reduce_totals(addresses: list[int], sizes: list[int]) -> list[list[float]]:
    """Whole-tensor statistics (one unit, no histogram) of many C-contiguous float32 buffers (their
    data addresses and lengths; the caller keeps them alive) in one batch: per buffer, its `TOTALS`.
    For the many small tensors of a per-step gradient reading, where building a job per tensor
    would cost more than reducing it, the job table and outputs are whole arrays, kept from one call
    to the next of the same sizes (each step's gradients have their parameters' sizes)."""
    key, layout = (_threads(), tuple(sizes)), getattr(_layouts, "last", None)
    if layout is None or layout[0] != key:  # the threads too: they say which buffers are cut in pieces
        layout = _layouts.last = (key, *_totals_layout(*key))
    _, table, jobs, rows, totals, _scratch = layout
    jobs["x"], jobs["done"] = addresses, 0
    _dispatch(_address(table), len(sizes), rows, sum(sizes))
    return totals.tolist()


_layouts = threading.local()  # `last`: this thread's ((threads, sizes), `_totals_layout`) of `reduce_totals`


def _totals_layout(threads: int, sizes: tuple[int, ...]) -> tuple:
    """`reduce_totals`' job table for buffers of these sizes, one unit each, a large one cut in a
    piece per thread; how many pieces; the buffers' TOTALS it fills (a row each); and the pieces'
    rows of per-unit outputs (which the kernel sets before it adds to them, as it merges them)."""
    sizes = np.asarray(sizes, np.int64)
    pieces = np.where(sizes >= SPLIT, threads, 1).astype(np.int32)
    first = np.cumsum(pieces) - pieces
    rows, width = int(pieces.sum()), 3 + bins.N_BINS + 2
    f64, f32, i64 = np.empty((rows, F64_ROWS)), np.empty((rows, 3), np.float32), np.empty((rows, width), np.int64)
    totals = np.empty((len(sizes), len(TOTALS)))
    table = np.zeros(len(sizes) * _JOBS.itemsize, np.uint8)  # its address without a structured dtype's costly descr
    jobs = table.view(_JOBS)
    jobs["before"], jobs["units"], jobs["after"], jobs["pieces"] = 1, 1, sizes, pieces
    jobs["f64"], jobs["f32"] = _address(f64) + 8 * F64_ROWS * first, _address(f32) + 12 * first
    jobs["i64"] = _address(i64) + 8 * width * first
    jobs["totals"] = _address(totals) + totals.strides[0] * np.arange(len(sizes))
    return table, jobs, rows, totals, (f64, f32, i64)


def reduce_f32(x3: np.ndarray, centre: float, histogram: bool, relu: bool = False) -> dict:
    """`actrace.reduce.reference`'s statistics of a C-contiguous float32 (before, units, after)
    array, named as the spec's columns; with `relu`, also (under "relu") `unit_sum`, `unit_sumsq`
    of relu(x) and, as `unit_zero`, how many finite values are <= 0."""
    return reduce_many([(x3, centre, histogram, relu)])[0]
