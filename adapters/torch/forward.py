"""The probe forward: the model in evaluation behaviour on the fixed probe, every selected layer
output and activation read the moment it is made (`ForwardTrace`), chunks merged and, across
data-parallel ranks, all-reduced. At construction the first chunk runs twice (`trial`): the
model takes the probe, depth is forward order, and evaluation behaviour is deterministic.
CPU float32 tensors may be held until `HOLD` bytes of them have gathered and read in one kernel
batch on every thread (a GPU's, in one batch of its fused kernels): where the trial saw no in-place
change of any (by version counter or value), and checked again at every batch: one changed in place
since it was held (its version counter moved, its storage freed) spoils the forward, which runs
again reading each at once.
"""
from __future__ import annotations

import fnmatch
import math
import warnings
from contextlib import contextmanager

import torch
from torch import nn

from actrace.reduce import fold, fused
from actrace.reduce.torch import Pending, reduce_tensors, relu_of, transfer

from . import ranks
from .fsdp import reshard
from .probe import Probe
from .shards import UNPLACED, Split, is_dtensor, join
from .trace import ForwardTrace, Output, output_tensors

HOLD = 2 << 20  # bytes of read tensors held for one kernel batch, where the trial found that safe (`trial`)
TRIAL_HOLD = 256 << 20  # bytes of read tensors the trial copies to find that out


class ProbeForward:
    """Reads `model` on `probe` (a `Probe`): `read()` gives one Reading per selected name
    (`wanted(name, module)`), its unit axis as the trace follows it or `unit_axes` says."""

    def __init__(self, model: nn.Module, probe: Probe, wanted, unit_axes: dict[str, int], histogram: bool,
                 chunk: int | None, rank: int = 0, world: int = 1, heads=(), split: Split | None = None, pipeline=None,
                 runner: nn.Module | None = None):
        self.model, self.probe, self.wanted, self.unit_axes = model, probe, wanted, unit_axes
        self.runner = runner or model  # what a probe forward calls: `model`, or a wrapper that must run (FSDP1)
        self.histogram, self.chunk, self.rank, self.world, self.split = histogram, chunk, rank, world, split
        self.pipeline = pipeline  # a `Pipeline`: this rank's stage of the model
        self.alone = world == 1 and split is None and pipeline is None  # no other process runs the model with it
        self.trace = ForwardTrace(model, self._read, wanted, heads, split is not None, replay=pipeline is None)
        self.warned: set[str] = set()
        self._outputs: list[tuple[Output, object]] = []  # and the slice of units it holds (`shards`)
        self.batches = False  # read tensors held for one batch (`HOLD`): set by the trial where that is safe
        self._held: list[tuple] = []  # (Output, version when held, stream that wrote it (CUDA), `reduce_tensors` call)
        self._held_bytes = 0
        self._spoiled = False  # a held tensor changed in place: the chunk runs again (`_chunk`)

    def axis(self, out: Output) -> int | None:
        if out.kind == "softmax" and out.axis is not None:
            return out.axis  # the axis it normalizes, which its saturation counts across (spec §Units)
        for pattern, axis in self.unit_axes.items():
            if fnmatch.fnmatch(out.name, pattern):
                return axis
        return out.axis

    def floating(self, out: Output) -> bool:
        """Whether the output can be read: a plain floating tensor holding values (else said once per name)."""
        if type(out.tensor) not in (torch.Tensor, nn.Parameter) and not out.tensor.is_nested:
            why = f"a {type(out.tensor).__name__} is not read"  # a tensor subclass (DTensor): not all its values here
        elif not out.tensor.is_floating_point():
            why = f"non-float output ({out.tensor.dtype})"
        elif not out.tensor.numel():
            why = "an empty output (an expert no probe token reached?) holds no value"
        else:
            return True
        if out.name not in self.warned:
            self.warned.add(out.name)
            warnings.warn(f"actrace: skipping {out.name}: {why}", stacklevel=4)
        return False

    def _read(self, out: Output) -> None:
        shards = self.trace.shards
        if shards is not None and is_dtensor(out.tensor):
            out.tensor = shards.local(out.tensor, self.axis(out))
        held = shards.of(out.tensor) if shards is not None and out.tensor is not None else None
        if out.tensor is None:
            self._skipped_slice(out.name, "partial sums its module never reduced")
        elif held == UNPLACED:
            self._skipped_slice(out.name, "computed from a tensor-parallel slice by an op that moves values across "
                                          "units, so its units cannot be placed")
        elif isinstance(held, tuple) and held[0] != "positions" and not out.tensor.numel():
            pass  # a rank holding none of the layer's units (more ranks than units): the others hold them all
        elif self.floating(out):
            source = out.relu_of.reading if out.relu_of is not None else None
            if isinstance(source, Pending) and source.relu is not None and self.axis(out) == self.axis(out.relu_of):
                out.reading = relu_of(source, out.name)
            else:
                t, hold = out.tensor, self.batches and self.batchable(out)
                made = torch.cuda.current_stream(t.device) if hold and t.is_cuda else None  # where it is written
                self._held.append((out, t._version if hold else None, made, (t, self.axis(out), out.kind, dict(
                    layer=out.name, bounds=out.bounds, histogram=self.histogram, relu_too=out.feeds_relu,
                    rows=out.rows))))
                self._held_bytes += _kept_alive(t) if hold else HOLD
                if self._held_bytes >= HOLD:
                    self._read_held()
            self._outputs.append((out, held))
        out.tensor = None  # read, or held for a batch by `_held`

    def batchable(self, out: Output) -> bool:
        """Whether a reading may wait for a kernel batch (where the trial found that safe): a plain CPU
        float32 tensor (the C kernel's) or one the GPU's fused kernels read (half precision widened),
        not one a ReLU takes next (on a CPU its pass gives that ReLU's reading the moment it is made;
        an in-place ReLU would spoil every batch), in a model run by this process alone (a spoiled
        forward runs again: `_chunk`; on one rank of several, or one pipeline stage, its collectives
        would wait for the others)."""
        t = out.tensor
        return self.alone and not out.feeds_relu and type(t) is torch.Tensor and not t.is_nested \
            and not t.is_inference() and (t.dtype == torch.float32 and t.is_cpu or fused.usable(t, narrow=True))

    def _read_held(self) -> None:
        """Read every held tensor now, in one batch; if one changed in place since it was held, none
        is read, every later one is read at once, and the forward is spoiled (`_chunk`)."""
        held, self._held, self._held_bytes = self._held, [], 0
        if not held:
            return
        if any(version is not None and _changed(call[0], version) for _, version, _, call in held):
            self.batches, self._spoiled = False, True
            return
        for _, _, made, (t, *_) in held:  # one written on another stream: read once it is written, kept till then
            if made is not None and made != (now := torch.cuda.current_stream(t.device)):
                now.wait_stream(made)
                t.record_stream(now)
        for (out, *_), pending in zip(held, reduce_tensors([call for *_, call in held])):
            out.reading = pending

    def _skipped_slice(self, name: str, why: str) -> None:
        """A tensor-parallel reading skipped: the same on every rank, so said once, by rank 0."""
        if name not in self.warned and self.rank == 0:
            self.warned.add(name)
            warnings.warn(f"actrace: skipping {name}: {why}", stacklevel=5)

    @contextmanager
    def evaluation(self):
        """Eval mode and no_grad for a probe forward; the modules' own modes restored afterwards, and
        FSDP's parameters sharded again."""
        modes = [(m, m.training) for m in self.model.modules()]
        if any(training for _, training in modes):  # eval() walks every module again: only where one trains
            self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            for m, training in modes:
                if m.training != training:  # nn.Module's own attribute setter is slow: only where it changed
                    m.training = training
            reshard(self.runner)

    def call(self, chunk, trace: ForwardTrace):
        """The model on a probe chunk under `trace`; a pipeline stage's on what the stage before
        handed on, with the unit axes the trace there followed."""
        if self.pipeline is None:
            return Probe.call(self.runner, chunk)
        return self.pipeline.call(self.model, chunk, trace.axes)

    def read(self, also: torch.Tensor | None = None) -> tuple[list, object]:
        """This rank's share of the probe (all of it, tensor and pipeline parallel), chunk by chunk
        (one host transfer each), merged, and across ranks all-reduced (data parallel), joined
        (tensor parallel: each rank's slice of a layer's units) or gathered (each stage's layers);
        and `also` (a device tensor: the probe's check) moved with the first chunk's transfer."""
        merged, held, split = {}, {}, self.split
        moving = [] if also is None else [also]
        share = (split.rank, split.size) if split else (0, 1) if self.pipeline is not None else (self.rank, self.world)
        with self.evaluation():
            for chunk in self.probe.chunks(*share, self.chunk):
                self._chunk(chunk)
                for out, tag in self._outputs:
                    out.reading.layer = out.name  # the name the trace settled on, once the chunk ran
                    held[out.name] = tag
                readings, host = transfer([out.reading for out, _ in self._outputs if out.name is not None], moving)
                if moving:
                    also, moving = host[0], []
                fold(merged, [r for r in readings if r is not None])  # None: a derived reading of no query
                self._outputs = []
        readings = list(merged.values())
        if split:
            readings = join(readings, held, split.tp)
            if split.size > 1:  # FSDP over tensor parallel: each data-parallel group its share
                readings = ranks.merge_shares(readings, self.probe.device, split.dp)
        if self.pipeline is not None:
            readings = self.pipeline.gather(readings)
        elif self.world > 1 and not split:
            readings = ranks.merge_shares(readings, self.probe.device)
        return readings, also

    def _chunk(self, chunk) -> None:
        """The chunk's forward under the trace, each reading in `_outputs`; run again, every tensor
        read at once, where a held one changed in place before its batch (its reading is lost)."""
        for _ in range(2):
            self._outputs, self._held, self._held_bytes, self._spoiled = [], [], 0, False
            with self.trace:
                self.call(chunk, self.trace)
            self._read_held()
            if not self._spoiled:
                return

    def trial(self, selection: str | None) -> tuple[str, list[str]]:
        """Run the first probe chunk twice: (mode, the names in forward order); mode 'train' if the
        first and last passes differ. `selection` describes the include/exclude/types given, if any.
        The second pass replays the quiet modules the first learned (`ForwardTrace.plan`): the plan
        is kept for the readings only if it read every layer as the first pass did, once those that
        read otherwise with the mode off replay with it on (a pass more each time)."""
        trace = ForwardTrace(self.model, None, self.wanted, [self.trace.paths[m] for m in self.trace.heads],
                             self.split is not None, replay=self.trace.plan is not None)
        trace.trial = True
        first, _, _ = self._pass(trace, check=False)
        amended = trace.amended
        second, seen, unchanged = self._pass(trace)

        def replay_differs() -> bool:
            return bool(trace.plan) and [a[:3] for a in first] != [b[:3] for b in second]

        if replay_differs() and trace.amended > amended:  # one replayed with the mode off went otherwise: mode on
            second, seen, unchanged = self._pass(trace)
        if replay_differs() and trace.keep_mode():  # an SDPA the mode-off replay did not see: mode on
            second, seen, unchanged = self._pass(trace)
        if replay_differs():  # a module's insides mattered after all (a tensor it made escaped): trace them
            trace.plan = None
            second, seen, unchanged = self._pass(trace)
        self.trace.plan = trace.plan
        self.batches = unchanged
        order = list(dict.fromkeys(o.name for o, _ in seen if o.name))
        differ = next((a for a, b in zip(first, second) if not _same(a[3], b[3])), None)
        steady = steady_everywhere = differ is None and len(first) == len(second)
        if self.pipeline is not None:  # the whole model's names, in stage order; 'train' if any stage's differ
            order, steady_everywhere = self.pipeline.order(order, steady)
        elif self.world > 1 and self.split is None:  # experts placed on some ranks: every rank's names
            order, _ = ranks.names_everywhere(order, self.probe.device)
        self._say_unread(order, selection, seen)
        if steady:
            return "eval" if steady_everywhere else "train", order
        culprit = differ[0] if differ else "the set of layers"
        kinds = sorted({type(m).__name__ for m in self.model.modules()
                        if "dropout" in type(m).__name__.lower() or "noise" in type(m).__name__.lower()})
        warnings.warn(f"actrace: two identical evaluation-mode passes over the probe differ, first at {culprit!r}: "
                      f"some module ignores eval() (a custom dropout or noise{': ' + ', '.join(kinds) if kinds else ''}),"
                      f" so readings measure its randomness; they are marked mode=train", stacklevel=3)
        return "train", order

    def _pass(self, trace: ForwardTrace, check: bool = True) -> tuple[list, list, bool]:
        """One traced forward of the first probe chunk: (name, unit axis, kind, value signature) of
        every reading and model output, (Output, signature) of each reading, and (with `check`)
        whether every tensor a batch would hold (`batchable`) was, at the forward's end, bit for bit
        what it was when read: nothing changed it in place, so holding it for a batch reads what
        reading it at once does, and no in-place op ran on it even where it changed nothing (its
        version counter). Checked on copies of at most TRIAL_HOLD bytes: beyond that, no batches."""
        seen, kept, size = [], [], 0

        def note(o: Output) -> None:
            nonlocal size
            seen.append((o, _signature(o.tensor)))
            if check and self.batchable(o) and (alive := _kept_alive(o.tensor)) < HOLD:  # larger: read at once
                size += alive
                if size <= TRIAL_HOLD:  # the tensor, its version and a copy, until the forward's end
                    kept.append((o.tensor, o.tensor._version, o.tensor.clone()))
            o.tensor = o.tensor.ndim  # the ndim is all the checks need: activations are not held beyond `kept`
        trace.sink = note
        try:
            with self.evaluation(), trace:
                result = self.call(self.probe.first_chunk(self.chunk), trace)
        except Exception as e:  # the model's own error, whatever it is
            first = (str(e).strip().splitlines() or [""])[0]
            hint = "; a dict probe is passed as keyword arguments: give (probe,) to pass it as one argument" \
                if isinstance(self.probe.value, dict) and "keyword argument" in first else ""
            raise ValueError(f"actrace: the model cannot take the probe ({self.probe.describe()}): "
                             f"{type(e).__name__}: {first}{hint}") from e
        unchanged = check and size <= TRIAL_HOLD and not any(
            _changed(t, version) or not torch.equal(_bits(t), _bits(copy))
            for t, version, copy in kept)
        return [(o.name, o.axis, o.kind, s) for o, s in seen if o.name] + \
            [(f"output{k}", None, None, _signature(t)) for k, t in output_tensors(result)], seen, unchanged

    def _say_unread(self, order: list[str], selection: str | None, seen) -> None:
        """Once, at the first pass: a selection that matches nothing, and unit axes not followed."""
        if not order and selection:
            names: list[str] = []
            every = ForwardTrace(self.model, lambda o: names.append(o.name), lambda *_: True)
            with self.evaluation(), every:
                self.call(self.probe.first_chunk(self.chunk), every)
            warnings.warn(f"actrace: no reading matches {selection}, so nothing will be recorded; the model's "
                          f"readings are: {', '.join(n for n in names if n)[:300]}", stacklevel=4)
        lost = [o.name for o, _ in seen if o.name and o.axis is None and o.tensor > 1
                and not any(fnmatch.fnmatch(o.name, p) for p in self.unit_axes)]
        if lost:
            warnings.warn(f"actrace: the unit axis of {len(lost)} reading(s) cannot be followed from the "
                          f"ops that made them, so each is read as one unit (give unit_axes= to say "
                          f"which axis): {', '.join(lost[:8])}{' ...' if len(lost) > 8 else ''}", stacklevel=4)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bits as integers of its size (whatever its strides): NaN equals NaN, −0 is not +0."""
    return t.view(_INTS[t.element_size()])


_INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def _kept_alive(t: torch.Tensor) -> int:
    """The bytes holding `t` keeps alive: its storage's (a view's may be far larger than the view)."""
    return t.untyped_storage().nbytes()


def _changed(t: torch.Tensor, version: int) -> bool:
    """Whether `t` changed in place since its version counter read `version`, or its storage was
    freed (resized below what `t` spans, as offloading and FSDP do) so that it no longer holds it."""
    if t._version != version:
        return True
    span = t.storage_offset() + sum((n - 1) * stride for n, stride in zip(t.shape, t.stride())) + 1
    return t.untyped_storage().nbytes() < span * t.element_size()


def _signature(t: torch.Tensor) -> float:
    """A cheap summary of a tensor's values, to compare two passes (a DTensor's: this rank's part)."""
    if is_dtensor(t):
        t = t.to_local()
    if t.is_nested:
        t = torch.cat([c.reshape(-1) for c in t.unbind()])
    return float(t.detach().to(torch.float64).sum())


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)
