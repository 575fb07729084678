"""The crash-safe trace writer of spec/trace-v1.md §Files: buffered readings → part files → one trace.

Every flush writes one complete Parquet part file (temp name, then `os.replace`; in object
storage one object, a single PUT) into `NAME.parquet.parts/`, so a killed process loses only
unflushed readings; `close` compacts the parts into `NAME.parquet` atomically and removes them
only after it is complete.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import signal
import socket
import threading
import time
import warnings
import weakref
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from actrace.format import metadata
from actrace.reduce import Reading, ReductionError, reduce_array
from actrace.reduce.reading import LayerTotals
from actrace.format.schema import MAX_NAME, SCALAR_INDEX, SCHEMA, bounds_for, safe_name
from actrace.files.lake import path_run
from actrace.files.location import location, remote, remove
from actrace.files.table import ROW_BYTES, LayerRows, row, row_bytes, rows_to_table

# floats split into byte streams before zstd: their exponent bytes (and a float64 sum's zero low
# bytes) compress apart from the noisy mantissa, 15-25 % smaller traces (bench/bench_size.py)
_FLOATS = ["sum", "sumsq", "sum3", "sum4", "min", "max", "update_norm", "wall_time", "bound_lo", "bound_hi"] + \
    [f"{c}.list.element" for c in ("unit_sum", "unit_sumsq", "unit_min", "unit_max", "unit_min_dev")]
# pages of 8 MiB, not Parquet's 1 MiB: zstd then finds what one reading's per-unit columns share with
# the readings before it (exponents, high mantissa bytes, zero counts), 10 % smaller traces from a few
# dozen readings on (an MLP 8x1024 reading 113 -> 102 KiB at 40: bench/bench_size.py); any reader reads them
PARQUET_OPTIONS = dict(compression="zstd", compression_level=3, use_dictionary=[
    "run", "layer", "kind", "stream", "param", "dtype", "mode", "probe_fingerprint"],
    use_byte_stream_split=_FLOATS, data_page_size=8 << 20, write_statistics=["run", "step", "layer", "stream"],
    write_page_checksum=True)


_open_writers: "weakref.WeakSet[Writer]" = weakref.WeakSet()
_signalled: list[str] = []  # "terminated" once SIGTERM arrived


class Terminated(SystemExit):
    """What SIGTERM raises in the main thread while a writer is open: the training loop unwinds as
    it does for Ctrl-C, every writer closes with status `terminated` (nothing buffered is lost), and
    the process exits 143, as a terminated one does."""

    def __init__(self):
        super().__init__(128 + signal.SIGTERM)


def _on_sigterm(signum, frame) -> None:
    _signalled.append("terminated")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated()


def _watch_sigterm() -> None:
    """Handle SIGTERM as above, where nobody else handles it (the main thread only can)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def status(failed: BaseException | None, *, at_exit: bool = False, missing=(), lost: int = 0) -> str:
    """The trace's `status` at close (spec §File metadata): how the run ended, or what it lacked (a
    stream `missing`; readings `lost` to a buffer full while the disk refused writes)."""
    import sys

    if at_exit:
        uncaught = getattr(sys, "last_value", None)
        return _signalled[0] if _signalled else status(uncaught) if uncaught is not None else "closed at exit"
    if isinstance(failed, KeyboardInterrupt):
        return "interrupted"
    if isinstance(failed, Terminated):
        return "terminated"
    if failed is not None and not (isinstance(failed, SystemExit) and failed.code in (0, None)):
        return f"failed: {type(failed).__name__}"
    lacks = [f"no {stream} reading" for stream in missing] + [f"{lost} readings lost"] * bool(lost)
    return "incomplete: " + ", ".join(lacks) if lacks else "complete"


@atexit.register
def _close_open_writers() -> None:
    """At interpreter exit, close every writer nobody closed (a script without `with`/`close()`):
    status `terminated` after SIGTERM, `failed: TYPE` after an uncaught exception, else `closed at
    exit` (the outcome unknown: a clean end and `sys.exit(7)` look alike from here)."""
    for w in list(_open_writers):
        if not w.closed:
            w.close(at_exit=True)


_BUCKETED = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl")


def _bucket(path) -> None:
    """Refuse at the start an object-store trace whose bucket (or container) is surely not there;
    where the credentials may not look (a write-only role), go on and let the first write say."""
    if path.protocol not in _BUCKETED:
        return
    bucket = path.path.split("/")[0]
    try:
        there = bool(bucket) and path.fs.exists(bucket)
    except Exception:  # not allowed to look: not a proof it is missing
        return
    if not there:
        raise FileNotFoundError(f"{path}: no bucket {bucket!r} there (or these credentials cannot see it)")


def _read_part(path) -> pa.Table:
    if isinstance(path, Path):
        return pq.read_table(path, page_checksum_verification=True)
    with path.open("rb") as f:
        return pq.read_table(f, page_checksum_verification=True)


def parts_dir(path: Path) -> Path:
    return path.with_name(path.name + ".parts")


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def writer_holds(path: Path) -> bool:
    """Whether a live writer holds the lock of the trace at `path` now (a local trace; its lock is
    released by the system when its process dies, so a killed run's reads as free). Looked at without
    creating or taking it for longer than the look."""
    try:
        import fcntl
        fd = os.open(lock_path(path), os.O_RDONLY | os.O_NONBLOCK)
    except (ImportError, OSError):  # no flock, no lock file, or not a local path: no writer seen
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # (closing drops the shared lock, if it was taken)
    return False


def _lock(path: Path):
    """The lock of one trace, held for its writer's life (`flock`, released by the system if the
    process dies): a second writer of the same trace fails at once, naming the holder. It is held on
    a descriptor open for reading only, so the writer keeps no file open for writing between flushes
    (a file system can then be remounted read-only under a run; the run is told at its next write)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): one writer per trace is then the user's to keep
        return None
    while True:
        f = os.fdopen(os.open(lock_path(path), os.O_RDONLY | os.O_CREAT, 0o644))
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = f.read().strip() or "another process"
            f.close()
            raise FileExistsError(f"{path}: another writer holds this trace ({holder}); one writer per trace") from None
        if _same_file(f, lock_path(path)):
            break
        f.close()  # a file its holder removed as it let go (we opened it just before): it guards nothing now
    try:
        lock_path(path).write_text(f"pid {os.getpid()} on {socket.gethostname()}, since "
                                   f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
    except BaseException:
        f.close()
        raise
    return f


def _same_file(f, path: Path) -> bool:
    """Whether the open file `f` is the one at `path` now."""
    try:
        there = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(f.fileno())
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _is_trace(path: Path) -> bool:
    """Whether the file at `path` is an actrace trace (one an overwrite may replace)."""
    try:
        metadata.read(path)
        return True
    except metadata.TraceError:
        return False


def write_parquet(table: pa.Table, path) -> None:
    """Write `table` (pages with CRC checksums) to a temp file beside `path`, make it durable, then
    move it into place atomically and make the move durable: after a power loss the file is
    either the old one or the whole new one. An object is written whole by one PUT, which is
    atomic: readers see the old object or the new one."""
    if remote(path):
        buffer = pa.BufferOutputStream()
        pq.write_table(table, buffer, **PARQUET_OPTIONS)
        path.write_bytes(buffer.getvalue().to_pybytes())
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(table, tmp, **PARQUET_OPTIONS)
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a full disk leaves no half-written file behind; a read-only one
            tmp.unlink(missing_ok=True)  # none to remove, and its refusal is not what is said
        raise
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def script_options(out, run: str | None, config: dict | None, overwrite: bool | None) -> dict:
    """An adapter's `Writer` options, where a script run under `actrace record` leaves any of them
    out: `ACTRACE_OUT`, `ACTRACE_RUN`, `ACTRACE_CONFIG` (merged over `config`), `ACTRACE_OVERWRITE`."""
    out = out or os.environ.get("ACTRACE_OUT")
    if out is None:
        raise ValueError("a Monitor needs out='runs/NAME.parquet' (or run the script under `actrace record -o ...`)")
    cfg = dict(config or {})
    cfg.update(json.loads(os.environ.get("ACTRACE_CONFIG", "{}")))
    return dict(path=out, run=run or os.environ.get("ACTRACE_RUN"), config=cfg,
                overwrite=overwrite if overwrite is not None else os.environ.get("ACTRACE_OVERWRITE") == "1")


class Writer:
    """Record readings of any framework into one trace file; use as a context manager.

    >>> with Writer("runs/a.parquet", run="a", framework="jax") as w:   # doctest: +SKIP
    ...     w.record_activation(step=0, layer="mlp.0", x=h, unit_axis=-1, kind="relu")

    `aliases` maps each other name of a parameter read under one name (a tied one) to that name
    (`lm_head/weight` → `wte/weight`; spec §File metadata). Buffered readings become a durable
    part file every `flush_every` readings or `flush_seconds`,
    whichever comes first: a killed run loses at most its last seconds, and a part file (two
    fsyncs) is written rarely enough not to slow a training step. While the disk refuses writes,
    readings wait in memory up to `buffer_bytes` (then a flush comes at once) and are written when it
    takes writes again; past that the newest are dropped, counted in the trace's status (`incomplete:
    N readings lost`, where the run ended cleanly) and said at close.
    """

    def __init__(self, path, *, run: str | None = None, framework: str = "numpy",
                 framework_version: str | None = None, adapter: str = "actrace.numpy",
                 config: dict | None = None, probe_fingerprint: str | None = None,
                 probe_size: int | None = None, mode: str | None = None, flush_every: int = 4096,
                 flush_seconds: float = 10.0, overwrite: bool = False, expect=(), aliases: dict[str, str] | None = None,
                 buffer_bytes: int = 256 << 20):
        if config is not None and not isinstance(config, dict):  # the spec's config is a JSON object
            raise TypeError(f"config must be a dict (the run's settings by name), not a {type(config).__name__}")
        self.path = location(path)
        self.parts = parts_dir(self.path)
        for p in (self.path, self.parts):
            if not remote(p) and p.is_symlink():
                raise ValueError(f"{p} is a symbolic link: a trace is not written through one")
        if self.path.is_dir():
            raise ValueError(f"{self.path} is a folder: give the trace's file name, runs/NAME.parquet")
        try:
            self._claim(overwrite)
        except OSError as exc:  # a folder that refuses (read-only, a file where a folder should be): one line
            if exc.errno is None:  # one of ours, in its own words
                raise
            raise type(exc)(f"{self.path}: cannot start the trace there ({exc.strerror}: {exc.filename})") from None
        self._unwritable = False
        self._names: dict[str, str] = {}
        self.run = self._safe(run or path_run(self.path))
        self.mode = mode
        self.probe_fingerprint = probe_fingerprint
        self.flush_every, self.flush_seconds, self.buffer_bytes = flush_every, flush_seconds, buffer_bytes
        self.meta = metadata.make(run=self.run, framework=framework, framework_version=framework_version,
                                  adapter=adapter, config=config, probe_fingerprint=probe_fingerprint,
                                  probe_size=probe_size, mode=mode, aliases=aliases)
        self._rows: list[tuple] = []  # `table.row`s
        self._buffered, self._counted = 0, set()  # their bytes, about, and the arrays counted (`table.row_bytes`)
        self.lost = 0  # readings dropped: the buffer full while the disk refused writes
        self._layer_rows: LayerRows | None = None  # `record_totals`' rows, made for the last batch's tensors
        self._layer_index: dict[str, int] = {}
        self._previous_params: dict[tuple[str, str], np.ndarray] = {}
        self._last_step: dict[tuple[str, str, str | None], int] = {}
        self._n_parts = 0
        self._unloggable: set[str] = set()
        self.expect, self.streams = tuple(expect), set()  # streams a closed trace must hold, and those it got
        self.dropped, self._said_dropped = 0, set()  # readings at a step that did not grow
        self._pid, self._said_forked = os.getpid(), False
        _open_writers.add(self)
        _watch_sigterm()
        self._last_flush = time.monotonic()
        self.readings_written = 0
        self.closed = False

    def _claim(self, overwrite: bool) -> None:
        """Take the trace's place: its folder, its lock, its part folder (an old trace there replaced
        only with `overwrite`, and only if it is a trace)."""
        if remote(self.path):  # no folders to make, and no lock: one writer per trace is the user's to keep
            _bucket(self.path)
            self._lock = None
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock = _lock(self.path)
        try:
            if self.path.exists() or self.parts.exists():
                if not overwrite:
                    raise FileExistsError(f"{self.path}: a trace is already there; pass overwrite=True "
                                          f"(or --overwrite) to replace it")
                if self.path.exists() and not _is_trace(self.path):
                    raise FileExistsError(f"{self.path} is not an actrace trace: not replaced, even with overwrite")
                remove(self.path)
                remove(self.parts)
            if not remote(self.parts):
                self.parts.mkdir()
        except BaseException:
            self._unlock()
            raise

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not self._rows and not self.readings_written:
            self.discard()  # failed before recording anything: leave no empty trace behind
        else:
            self.close(exc)  # keep what was recorded, even when the run failed part way

    def __del__(self) -> None:  # a writer nobody closed: what it buffered is not lost
        if not getattr(self, "closed", True):
            try:
                self.close()
            except Exception:  # at interpreter shutdown modules may be gone; the part files remain
                pass

    def discard(self) -> None:
        """Close without writing a trace (only sensible when nothing was recorded)."""
        if self._forked():
            return
        self.closed = True
        remove(self.parts)
        self._unlock()

    def _unlock(self) -> None:
        """Let the next writer of this trace in: the lock file goes, its lock with it. Where the folder
        refuses (it went read-only mid-run) the file stays: its lock goes with the descriptor all the
        same, and the next writer takes the file over; nothing of the trace is in it."""
        if self._lock is not None:
            try:
                lock_path(self.path).unlink(missing_ok=True)
            except OSError:
                pass
            self._lock.close()
            self._lock = None

    def record(self, step: int, reading: Reading, *, mode: str | None = None,
               probe_fingerprint: str | None = None, layer_index: int | None = None) -> None:
        """Buffer one reading taken at `step`; flushes when the buffer or the clock says so."""
        self.record_many(step, [reading], mode=mode, probe_fingerprint=probe_fingerprint,
                         layer_indexes=None if layer_index is None else [layer_index])

    def record_many(self, step: int, readings: list[Reading], *, mode: str | None = None,
                    probe_fingerprint: str | None = None, layer_indexes: list[int] | None = None) -> None:
        """Buffer readings taken together at `step` (one probe or gradient reading of a model);
        `layer_indexes`: each one's depth, else the order layers were first recorded."""
        if self._forked(said=True):
            return
        step, mode, wall_time = self._stamp(step, mode)
        fingerprint = probe_fingerprint or self.probe_fingerprint
        for i, reading in enumerate(readings):
            reading = self._named(reading)
            key = (reading.layer, reading.stream, reading.param)
            if not self._grows(step, key):
                continue
            index = self._layer_index.setdefault(reading.layer, len(self._layer_index)) if layer_indexes is None \
                else layer_indexes[i]
            buffered = row(reading, self.run, step, int(index), mode, self._fingerprint(reading.stream, fingerprint),
                           wall_time)  # its values as they are now
            self._last_step[key] = step  # marked recorded once its row is made
            self.streams.add(reading.stream)
            size, owners = row_bytes(buffered, self._counted)
            if self._room(size):
                self._rows.append(buffered)
                self._counted |= owners
        self._flush_if_due()

    def record_totals(self, step: int, batch: LayerTotals, *, layer_indexes: list[int],
                      mode: str | None = None) -> None:
        """`record_many` of `batch.readings()` (a per-step gradient reading's parameters), whose rows
        are made from the batch's totals by `LayerRows` kept for the next batch of the same tensors."""
        if self._forked(said=True):
            return
        step, mode, wall_time = self._stamp(step, mode)
        rows = self._layer_rows
        if rows is None or not rows.fits(batch, layer_indexes):
            readings = list(map(self._named, batch.readings()))  # no frame between: warnings name the caller
            rows = self._layer_rows = LayerRows(batch, readings, self.run, layer_indexes, [
                self._fingerprint(r.stream, self.probe_fingerprint) for r in readings])
        kept = []
        for i, key in enumerate(rows.keys):
            if self._grows(step, key):
                self._last_step[key] = step
                kept.append(i)
        self.streams |= rows.streams
        if self._room(len(kept) * ROW_BYTES, len(kept)):  # layer-level rows: no list in them
            self._rows += rows.rows(batch, step, mode, wall_time, kept)
        self._flush_if_due()

    def _forked(self, said: bool = False) -> bool:
        """Whether this process is a fork of the one that opened the writer (`os.fork`, multiprocessing's
        fork start): the trace, its part files and its lock are the parent's, so here the writer never
        writes, flushes, closes or unlocks. Readings recorded here are skipped, said once (`said`); a
        child that only exits (its `atexit`, a `with` block it unwinds) is silent."""
        if os.getpid() == self._pid:
            return False
        if said and not self._said_forked:
            self._said_forked = True
            warnings.warn(f"actrace: {self.path}: process {os.getpid()} is a fork of process {self._pid}, which "
                          "writes this trace: readings recorded here are not written (a child makes a Writer or "
                          "Monitor of its own)", stacklevel=4)
        return True

    def _stamp(self, step: int, mode: str | None) -> tuple[int, str | None, float]:
        """A recording's step, mode and wall time, once the writer may still take it."""
        if self.closed:
            raise RuntimeError(f"{self.path}: writer is closed")
        if _signalled:  # SIGTERM's exception was swallowed on its way (C code that clears errors): again
            raise Terminated()
        whole = int(step)
        if whole != step or not -2 ** 63 <= whole < 2 ** 63:  # else truncated, or lost with the trace at close
            raise ValueError(f"{self.path}: step {step!r}: a step is a whole number that fits in 64 bits")
        return whole, mode or self.mode, time.time()

    @staticmethod
    def _fingerprint(stream: str, fingerprint: str | None) -> str | None:
        """The probe fingerprint a row of this stream carries: a probe's streams only."""
        return fingerprint if stream in ("activation", "activation_grad") else None

    def _room(self, size: int, readings: int = 1) -> bool:
        """Whether `readings` of `size` bytes join the buffer. While the disk takes writes they always do
        (a flush comes when the buffer reaches `buffer_bytes`); while it refuses, up to `buffer_bytes`,
        the readings kept to be written when it takes writes again, and past them the newest are dropped:
        counted in `lost` (the trace's status says it), said once now and at close. Memory stays bounded."""
        if self._unwritable and self._buffered + size > self.buffer_bytes:
            if not self.lost:
                warnings.warn(f"actrace: {self.path}: the disk still refuses writes and the readings buffered fill "
                              f"buffer_bytes ({self.buffer_bytes} bytes): newer readings are dropped until it takes "
                              "writes again, counted in the trace's status", stacklevel=4)
            self.lost += readings
            return False
        self._buffered += size
        return True

    def _flush_if_due(self) -> None:
        due = time.monotonic() - self._last_flush >= self.flush_seconds
        full = len(self._rows) >= self.flush_every or self._buffered >= self.buffer_bytes
        if due or (full and not self._unwritable):  # a refusing disk: on the clock
            self.flush()

    def _safe(self, name: str) -> str:
        """A name as the spec allows it (schema.safe_name), the change said once per name."""
        safe = self._names.get(name)
        if safe is None:
            safe = self._names[name] = safe_name(name)
            if safe != name:
                warnings.warn(f"actrace: {self.path}: the name {safe[:80]!r} is recorded with its control or "
                              f"bidirectional characters escaped, and cut to {MAX_NAME} characters where longer "
                              f"(spec §Validity)", stacklevel=4)
        return safe

    def _named(self, reading: Reading) -> Reading:
        if not reading.layer:
            raise ValueError(f"{self.path}: a reading ({reading.stream}) with an empty layer name (spec §Validity)")
        layer, param = self._safe(reading.layer), None if reading.param is None else self._safe(reading.param)
        return reading if (layer, param) == (reading.layer, reading.param) else \
            dataclasses.replace(reading, layer=layer, param=param)

    def _grows(self, step: int, key: tuple) -> bool:
        """Whether `step` is after the last one recorded for this reading's (layer, stream, param)
        `key` (a trace holds one reading per step, spec §Validity); a step that is not is dropped and
        said once, never raised into the training loop."""
        last = self._last_step.get(key)
        if last is None or step > last:
            return True
        self.dropped += 1
        repeat = step == last
        if repeat not in self._said_dropped:  # a repeated step and a restarting count, each said once
            self._said_dropped.add(repeat)
            layer, stream, param = key
            what = f"{stream} of layer {layer!r}" + (f", param {param!r}" if param else "")
            why = ("was recorded already; the second reading is dropped" if repeat else
                   f"is not after step {last}, already recorded: steps must keep growing (epoch * steps_per_epoch + "
                   "i, not a count restarting each epoch); readings at such steps are dropped")
            warnings.warn(f"actrace: {self.path}: step {step} for {what} {why} (said once)", stacklevel=3)
        return False

    def record_tensor(self, step: int, layer: str, x, *, stream: str, kind: str = "other",
                      unit_axis: int | None = -1, param: str | None = None,
                      bounds: tuple[float, float] | None = None, per_unit: bool = True,
                      histogram: bool = True, **context) -> Reading:
        """Reduce a numpy-convertible tensor with the reference reductions and record it."""
        known = bounds_for(kind, bounds)
        if (known is None and kind == "clip") or (known is not None and not known[0] < known[1]):
            raise ValueError(f"{self.path}: layer {layer!r}: a {kind} layer's bounds must be given, lower below upper "
                             f"(bounds=(lo, hi)), not {known}")
        reading = reduce_array(x, unit_axis, kind, layer=layer, stream=stream, bounds=bounds,
                               param=param, per_unit=per_unit, histogram=histogram)
        self.record(step, reading, **context)
        return reading

    def record_activation(self, step: int, layer: str, x, *, kind: str, unit_axis: int | None = -1, **kw):
        """A layer's output on the probe batch; `unit_axis` is the feature/channel axis."""
        return self.record_tensor(step, layer, x, stream="activation", kind=kind, unit_axis=unit_axis, **kw)

    def record_activation_grad(self, step: int, layer: str, g, *, kind: str, unit_axis: int | None = -1, **kw):
        """The gradient of the loss with respect to a layer's output."""
        return self.record_tensor(step, layer, g, stream="activation_grad", kind=kind, unit_axis=unit_axis, **kw)

    def record_param_grad(self, step: int, layer: str, param: str, g, *, kind: str = "other",
                          unit_axis: int | None = 0, per_unit: bool = False, histogram: bool = False, **kw):
        """The gradient of one parameter tensor, layer-level by default as the PyTorch Monitor
        records it (norm, extremes, zeros, NaN/Inf: what gradient rules read, at every step);
        `per_unit=True, histogram=True` for the full reading (unit axis 0: output features)."""
        unit_axis = unit_axis if np.ndim(g) else None
        return self.record_tensor(step, layer, g, stream="param_grad", kind=kind, unit_axis=unit_axis,
                                  param=param, per_unit=per_unit, histogram=histogram, **kw)

    def record_param(self, step: int, layer: str, param: str, w, *, kind: str = "other",
                     unit_axis: int | None = 0, per_unit: bool = True, histogram: bool = True, **context):
        """A parameter tensor; the writer keeps its last value to record the update norm ‖Δw‖."""
        w = np.asarray(w)
        reading = reduce_array(w, unit_axis if w.ndim else None, kind, layer=layer, stream="param",
                               param=param, per_unit=per_unit, histogram=histogram)
        previous = self._previous_params.get((layer, param))
        if previous is not None and previous.shape == w.shape:
            reading.update_norm = float(np.linalg.norm((w.astype(np.float64) - previous).ravel()))
        self._previous_params[(layer, param)] = w.astype(np.float64, copy=True)
        self.record(step, reading, **context)
        return reading

    def log(self, step: int, **values) -> None:
        """Training-loop values at `step` (`loss=…`, `lr=…`, any name), one `scalar` row each (spec
        §Streams), so findings can be read against the loss; None values are left out."""
        readings = []
        for name, v in values.items():
            if v is None:
                continue
            try:
                readings.append(Reading.scalar(name, v))
            except ReductionError as exc:  # a monitor never takes training down: said once, skipped
                if name not in self._unloggable:
                    self._unloggable.add(name)
                    warnings.warn(f"actrace: {self.path}: not logged: {exc}", stacklevel=2)
        self.record_many(step, readings, layer_indexes=[SCALAR_INDEX] * len(readings))

    def flush(self) -> bool:
        """Write the buffered readings as one complete part file; True when they are on disk. Where
        the disk refuses (full, read-only), the readings stay buffered for the next flush and this
        is said once: a monitor never takes training down."""
        if self._forked():
            return False
        self._last_flush = time.monotonic()
        if not self._rows:
            return True
        table = rows_to_table(self._rows)
        try:
            write_parquet(table.replace_schema_metadata(metadata.encode(self.meta)),
                          self.parts / f"part-{self._n_parts + 1:06d}.parquet")
        except self._refusals as exc:
            if not self._unwritable:
                warnings.warn(f"actrace: {self.path}: cannot write a part file ({exc}); the readings stay in "
                              "memory and are written at the next flush", stacklevel=3)
            self._unwritable = True
            return False
        self._n_parts += 1
        self.readings_written += len(self._rows)
        self._rows.clear()
        self._buffered, self._counted = 0, set()
        self._unwritable = False
        return True

    @property
    def _refusals(self) -> type | tuple:
        """What a write that did not happen raises: OSError from a disk; from an object store also
        its client's own errors (a connection refused is no OSError there)."""
        return Exception if remote(self.path) else OSError

    def _write_whole(self) -> bool:
        """A trace whose readings are all still in memory, written at once (no part file to write
        and read back); False where the disk refuses, leaving the part-file way to try."""
        try:
            write_parquet(rows_to_table(self._rows).replace_schema_metadata(metadata.encode(self.meta)),
                          self.path)
        except self._refusals:
            return False
        self.readings_written += len(self._rows)
        self._rows.clear()
        self.closed = True
        remove(self.parts)
        self._unlock()
        return True

    def close(self, failed: BaseException | None = None, *, at_exit: bool = False, no_gradient=()) -> Path:
        """Flush, compact the part files into the trace atomically, remove the parts. The trace's
        `status` says `complete`; `failed: TYPE` when the run ended with exception `failed`,
        `interrupted` (Ctrl-C) or `terminated` (SIGTERM); `incomplete: no STREAM reading` when a
        stream it was told to `expect` got none. `no_gradient`: the `LAYER/PARAM` names of parameters
        that required a gradient and never got one (spec §File metadata)."""
        if self.closed or self._forked():
            return self.path
        missing = [s for s in self.expect if s not in self.streams]
        self.meta["status"] = status(failed, at_exit=at_exit, missing=missing, lost=self.lost)
        if self.lost:
            warnings.warn(f"actrace: {self.path}: {self.lost} readings were lost: the disk refused writes while "
                          f"buffer_bytes ({self.buffer_bytes} bytes) of readings waited; the trace's status says so",
                          stacklevel=2)
        if no_gradient:
            self.meta["no_gradient"] = json.dumps(list(no_gradient))
        if self._n_parts == 0 and self._rows and self._write_whole():
            return self.path
        flushed = self.flush()
        self.closed = True
        try:
            parts = sorted(self.parts.glob("part-*.parquet"), key=str)
            if len(parts) < self._n_parts:  # a store's listing that lags its writes: the parts stay
                raise OSError(f"{len(parts)} of the {self._n_parts} part files written are listed")
            # what the last flush could not write goes into the trace with the parts (space may have come back)
            tables = [_read_part(p) for p in parts] + ([] if flushed else [rows_to_table(self._rows)])
            table = pa.concat_tables(tables) if tables else SCHEMA.empty_table()
            write_parquet(table.replace_schema_metadata(metadata.encode(self.meta)), self.path)
        except self._refusals as exc:  # the trace stays as its part files, readable, status `running`
            lost = "" if flushed else f"; {len(self._rows)} readings could not be written at all"
            warnings.warn(f"actrace: {self.path}: cannot compact the trace ({exc}): it stays as its part files in "
                          f"{self.parts}{lost}", stacklevel=2)
            self._unlock()
            return self.parts
        try:
            remove(self.parts)
        except self._refusals as exc:  # the trace is whole: readers take it over the parts left beside it
            warnings.warn(f"actrace: {self.path}: the trace is written, but its part files in {self.parts} could not "
                          f"be removed ({exc})", stacklevel=2)
        self._unlock()
        return self.path
