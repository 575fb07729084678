"""Recording: what every framework's monitor shares, so that each adapter only says how its
framework's tensors are read. A `Recorder` owns the writer, the schedule (a probe reading at the
first step and every `probe_every`, gradient readings every `grad_every`, a last probe reading at
close), the layers' forward order, the include/exclude patterns and the run's status at close.
"""
from __future__ import annotations

import fnmatch
import functools
import gc
import warnings
from contextlib import contextmanager

from actrace.files.writer import Writer, script_options
from actrace.reduce import gradient_totals, param_grad_job, reduce_arrays


def patterns(p) -> tuple[str, ...]:
    """Glob patterns as given: one string, a sequence of them, or None."""
    return () if p is None else (p,) if isinstance(p, str) else tuple(p)


@functools.lru_cache(maxsize=1 << 16)
def selected(name: str, include: tuple[str, ...], exclude: tuple[str, ...]) -> bool:
    """Whether `name` matches one of `include` (if any) and none of `exclude`: decided once per
    name, as a probe reading asks it of every layer."""
    if include and not any(fnmatch.fnmatchcase(name, p) for p in include):
        return False
    return not any(fnmatch.fnmatchcase(name, p) for p in exclude)


@contextmanager
def collector_paused():
    """Python's cyclic garbage collector held off while a reading runs: a reading allocates
    thousands of short-lived objects, and the collections they set off scan every object of the
    framework as well (a tenth of a deep model's probe reading, measured); one collection after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Recorder:
    """The base of every adapter's monitor (`adapters/torch`, `flax`, `keras`): subclasses read
    their framework's tensors in `probe_reading(step)` and hand the readings to `write`.

    `out`, `run`, `config`, `overwrite` say where and as what the trace is written (`actrace
    record` may set them from outside the script); `include`/`exclude` are glob patterns on
    reading names; `writes=False` records nothing (a data-parallel rank other than 0).
    """

    no_gradient_hint = "step() found no gradient"  # why a run that expected gradients has none

    def __init__(self, out=None, *, framework: str, framework_version: str, adapter: str,
                 probe_fingerprint: str | None, probe_size: int | None, mode: str, probe_every: int = 200,
                 grad_every: int | None = 1, run: str | None = None, config: dict | None = None, include=None,
                 exclude=None, overwrite: bool | None = None, flush_every: int = 4096, expect: tuple = (),
                 aliases: dict[str, str] | None = None, writes: bool = True):
        options = script_options(out, run, config, overwrite)
        self.probe_every, self.grad_every = probe_every, grad_every
        self.include, self.exclude = patterns(include), patterns(exclude)
        self.layer_index: dict[str, int] = {}
        self.last_step = self.last_probe = None
        self.closed = False
        self.failed: dict[str, list] = {}  # kind of reading -> [first step it failed at, why, failures]
        self.worked: set[str] = set()  # kinds of reading that have worked once (`safely`)
        self.writer = Writer(**options, framework=framework, framework_version=framework_version, adapter=adapter,
                             probe_fingerprint=probe_fingerprint, probe_size=probe_size, mode=mode,
                             flush_every=flush_every, expect=expect, aliases=aliases) if writes else None

    def wanted(self, name: str) -> bool:
        """Whether a reading of this name is recorded (`include`, then `exclude`)."""
        return selected(name, self.include, self.exclude)

    def order(self, name: str) -> int:
        """The layer's `layer_index`: the order layers were first met in, the forward's when the
        adapter names them as it runs the probe first."""
        return self.layer_index.setdefault(name, len(self.layer_index))

    def probe_due(self, step: int) -> bool:
        return step % self.probe_every == 0 or self.last_probe is None  # the first step too: where trends start

    def grads_due(self, step: int) -> bool:
        return bool(self.grad_every) and step % self.grad_every == 0

    def probe_reading(self, step: int) -> int:
        raise NotImplementedError

    alone = True  # the model runs in this process alone: not one rank of several (torch's Monitor says)

    def safely(self, what: str, read, step: int, *args) -> None:
        """`read(step, *args)`: a reading of its `what` kind, due at `step`. Where it raises after one of
        its kind has worked, in a process that runs the model alone, it is skipped and training goes on
        (a monitor never takes training down): the first failure of each kind said with its error,
        their count at close. The first of its kind raises (a set-up to fix, said at once), and on one
        rank of several any does: the others would wait for this one in a collective."""
        if not self.alone or what not in self.worked:
            read(step, *args)
            self.worked.add(what)
            return
        try:
            read(step, *args)
        except Exception as error:
            if what not in self.failed:
                warnings.warn(f"actrace: step {step}: the {what} reading failed ({type(error).__name__}: {error}); "
                              f"it is skipped and training goes on (each later {what} reading that fails is "
                              "skipped too, counted at close)", stacklevel=3)
            self.failed.setdefault(what, [step, f"{type(error).__name__}: {error}", 0])[2] += 1

    def write(self, step: int, readings, **kw) -> int:
        """Record readings taken at `step` (`mode`, `probe_fingerprint` as the writer takes them)."""
        if self.writer is None:
            return 0
        self.writer.record_many(step, readings, layer_indexes=[self.order(r.layer) for r in readings], **kw)
        return len(readings)

    def write_totals(self, step: int, batch, mode: str | None = None) -> int:
        """Record a `LayerTotals` taken at `step` (a per-step gradient reading's parameters)."""
        if self.writer is None:
            return 0
        self.writer.record_totals(step, batch, layer_indexes=[self.order(m["layer"]) for m in batch.metas], mode=mode)
        return len(batch.totals)

    def write_gradients(self, step: int, grads: list[tuple]) -> int:
        """Record the parameter gradients `grads` ((array, layer, param, kind) each, on the host) of
        the training step `step`, layer-level: in one kernel batch where it reads them all
        (`gradient_totals`), else by `reduce_arrays`, a Reading each."""
        batch = gradient_totals(grads)
        if batch is not None:
            return self.write_totals(step, batch, mode="train")
        return self.write(step, reduce_arrays([param_grad_job(*g) for g in grads]), mode="train")

    def log(self, step: int, loss=None, lr=None, **scalars) -> None:
        """Record the training loop's values at `step` (`loss`, `lr`, any other name), so findings are
        read against the loss (spec §Streams, `scalar`)."""
        if self.writer is not None:
            self.writer.log(step, **dict(scalars, loss=loss, lr=lr))

    def close(self, failed: BaseException | None = None):
        """A last probe reading at the last step if `probe_every` skipped it (trend rules need the end
        of a run), then write the trace (compacting its part files); `failed`: the exception the run
        ended with, recorded in the trace's status."""
        if self.closed:
            return None
        if failed is None and self.last_step is not None and (self.last_probe is None or
                                                              self.last_probe < self.last_step):
            self.safely("probe", self.probe_reading, self.last_step)
        self.closed = True
        self.release()
        if self.writer is None:
            return None
        for what, (step, why, n) in self.failed.items():
            warnings.warn(f"actrace: {self.writer.path}: {n} {what} reading(s) failed and were skipped, the first at "
                          f"step {step} ({why})", stacklevel=3)
        if failed is None and self.writer.expect and "param_grad" not in self.writer.streams:
            why = "step() was never called" if self.last_step is None else self.no_gradient_hint
            warnings.warn(f"actrace: {self.writer.path}: no gradient was read ({why}); the trace's status says "
                          "incomplete (grad_every=None records probe readings only)", stacklevel=3)
        unreached = self.unreached() if "param_grad" in self.writer.streams else []
        if unreached:
            warnings.warn(f"actrace: {self.writer.path}: {len(unreached)} parameter(s) required a gradient and never "
                          f"got one ({', '.join(unreached[:4])}{' …' if len(unreached) > 4 else ''}): cut off from "
                          "the loss (a .detach(), torch.no_grad) or unused; the trace says so", stacklevel=3)
        return self.writer.close(failed, no_gradient=unreached)

    def release(self) -> None:
        """What an adapter lets go of at close (hooks), before the trace is written."""

    def unreached(self) -> list[str]:
        """`LAYER/PARAM` of the parameters that required a gradient and got none at any gradient
        reading (adapters that can tell)."""
        return []

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)
