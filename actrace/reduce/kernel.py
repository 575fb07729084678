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


_JOBS = np.dtype(_Job)  # a job table built column by column, as numpy arrays
_T = len(TOTALS)


class _Layout:
    """A batch's jobs laid out once for tensors of these (before, units, after) shapes, histogram
    and relu flags, and thread count: the job table (its columns set as numpy arrays), where each
    job's outputs lie in one block of float64 words (TOTALS rows first, then per job its f64, i64
    and f32 rows, a row per piece), and the views a call hands back (`outputs`). A model's batches
    repeat from one reading to the next, so a reading builds no job, nor allocates per tensor."""

    def __init__(self, threads: int, shapes: tuple, flags: tuple):
        n = len(shapes)
        before, units, after = np.array(shapes, np.int64).reshape(n, 3).T
        hist, relu = np.array(flags, bool).reshape(n, 2).T
        size = before * units * after
        pieces = np.where((size >= SPLIT) & ((before >= threads) | ((before == 1) & (units == 1))), threads, 1)
        wide = 3 * units + bins.N_BINS + 2
        words = pieces * (F64_ROWS * units + wide + (3 * units + 1) // 2)  # f64, i64, f32 rows (8-byte words)
        start = _T * n + np.cumsum(words) - words  # each job's first word, after the TOTALS rows
        i64 = start + pieces * F64_ROWS * units
        f32 = i64 + pieces * wide
        self.words, self.pieces, self.values = int(_T * n + words.sum()), int(pieces.sum()), int(size.sum())
        self.table = np.zeros(n * _JOBS.itemsize, np.uint8)  # its address without a structured dtype's costly descr
        self.jobs = self.table.view(_JOBS)
        self.jobs["before"], self.jobs["units"], self.jobs["after"], self.jobs["pieces"] = before, units, after, pieces
        self.jobs["hist"], self.jobs["relu"] = hist, relu
        self.offsets = [8 * _T * np.arange(n), 8 * start, 8 * i64, 8 * f32]  # totals, f64, i64, f32 (bytes)
        self.at = None  # the block the outputs' pointers point into now
        self.views = [_views(k, *job) for k, job in enumerate(zip(
            units.tolist(), start.tolist(), i64.tolist(), (2 * f32).tolist(), hist.tolist(), relu.tolist()))]

    def run(self, addresses: list[int], block: np.ndarray, centres=None) -> None:
        """The jobs on `addresses` (the caller keeps them alive), outputs in `block` (`words` float64),
        |h - c| measured from `centres` (else 0)."""
        jobs, at = self.jobs, _address(block)
        jobs["x"], jobs["done"] = addresses, 0
        if centres is not None:
            jobs["centre"] = centres
        if at != self.at:  # the outputs' pointers, unless in the block of the last call (`reduce_totals`' own)
            self.at = at
            jobs["totals"], jobs["f64"], jobs["i64"], jobs["f32"] = (at + o for o in self.offsets)
        _dispatch(_address(self.table), len(jobs), self.pieces, self.values)

    def outputs(self, block: np.ndarray) -> list[dict]:
        """Each job's results, named as `reduce_f32` gives them: views of `block`."""
        regions = (block, block.view(np.int64), block.view(np.float32))
        out = []
        for main, relu in self.views:
            made = {name: regions[r][a:b] for name, r, a, b in main}
            made.setdefault("hist", None)
            made["relu"] = None if relu is None else {name: regions[r][a:b] for name, r, a, b in relu}
            out.append(made)
        return out


def _views(k: int, u: int, d: int, i: int, f: int, hist: bool, relu: bool) -> tuple[list, list | None]:
    """Job k's results (its own and, with `relu`, relu(x)'s) as (name, region, first, end): region 0
    float64 words (its f64 rows from word d, its TOTALS row), 1 int64 (its i64 rows from i), 2 float32
    (its f32 rows from f); row 0 of its pieces', where the kernel merges them."""
    def rows(region, at, names):
        return [(name, region, at + n * u, at + (n + 1) * u) for n, name in enumerate(names) if name]
    tail = i + 3 * u + bins.N_BINS  # after the histogram: the NaN and inf counts
    own = rows(0, d, ("unit_sum", "unit_sumsq", None, None, "unit_sum3", "unit_sum4")) + \
        rows(2, f, ("unit_min", "unit_max", "unit_min_dev")) + rows(1, i, ("unit_zero", "unit_count")) + \
        [("nan_count", 1, tail, tail + 1), ("inf_count", 1, tail + 1, tail + 2),
         ("totals", 0, _T * k, _T * (k + 1))] + ([("hist", 1, i + 3 * u, tail)] if hist else [])
    of_relu = rows(0, d, (None, None, "unit_sum", "unit_sumsq", None, None, "unit_sum3", "unit_sum4")) + \
        rows(1, i, (None, None, "unit_zero"))
    return own, (of_relu if relu else None)


_layouts = threading.local()  # `kept`: this thread's {(threads, shapes, flags): _Layout}; `totals`: reduce_totals'


def _layout(shapes: tuple, flags: tuple) -> _Layout:
    """This thread's layout of a batch of these shapes and flags (built at its first call)."""
    kept = getattr(_layouts, "kept", None)
    if kept is None or len(kept) > 256:  # a model's batches are few; anything else is not kept long
        kept = _layouts.kept = {}
    key = (_threads(), shapes, flags)
    layout = kept.get(key)
    if layout is None:
        layout = kept[key] = _Layout(*key)
    return layout


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
        try:
            helper.result()
        except KeyboardInterrupt:  # its share done first: the next call reuses the job table it reads
            helper.result()
            raise


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
    and large tensors cut in pieces, are shared among the threads, their outputs in one block.
    Each result also holds `totals`: the tensor's `TOTALS`."""
    if not tasks:
        return []
    layout = _layout(tuple(task[0].shape for task in tasks), tuple((task[2], task[3]) for task in tasks))
    block = np.empty(layout.words)  # fresh: the results are views of it, kept by the readings
    layout.run([_address(task[0]) for task in tasks], block, [task[1] for task in tasks])
    return layout.outputs(block)


def reduce_totals(addresses: list[int], sizes: list[int]) -> list[list[float]]:
    """Whole-tensor statistics (one unit, no histogram) of many C-contiguous float32 buffers (their
    data addresses and lengths; the caller keeps them alive) in one batch: per buffer, its `TOTALS`.
    For the many small tensors of a per-step gradient reading the layout and its outputs are kept
    from one call to the next of the same sizes (each step's gradients have their parameters')."""
    key, last = (_threads(), tuple(sizes)), getattr(_layouts, "totals", None)
    if last is None or last[0] != key:
        layout = _Layout(key[0], tuple((1, 1, size) for size in sizes), ((False, False),) * len(sizes))
        last = _layouts.totals = (key, layout, np.empty(layout.words))
    _, layout, block = last
    layout.run(addresses, block)
    return block[:_T * len(sizes)].reshape(-1, _T).tolist()


def reduce_f32(x3: np.ndarray, centre: float, histogram: bool, relu: bool = False) -> dict:
    """`actrace.reduce.reference`'s statistics of a C-contiguous float32 (before, units, after)
    array, named as the spec's columns; with `relu`, also (under "relu") `unit_sum`, `unit_sumsq`
    of relu(x) and, as `unit_zero`, how many finite values are <= 0."""
    return reduce_many([(x3, centre, histogram, relu)])[0]
