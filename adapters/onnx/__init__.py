"""ONNX Runtime adapter: `actrace record MODEL.onnx --probe probe.npz` for any framework that exports ONNX.

The model file is never changed: a copy of the graph lists the chosen intermediate tensors as
extra graph outputs. ORT keeps every graph output intact under any optimization level (it only
fuses away tensors that are not outputs), so the session runs at ORT_ENABLE_ALL: the requested
tensors are exact and the rest of the graph is optimized as usual. Reductions are the core's.
"""
from __future__ import annotations

import fnmatch
import re
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

import actrace
from actrace.format.fingerprint import fingerprint
from actrace.files.reader import expand
from actrace.reduce import fold, reduce_arrays
from actrace.reduce.derived import attention

from actrace.format.schema import ATTENTION_KINDS, KINDS, shown

from .attention_op import AttentionOp
from .graph import OP_KINDS, RECURRENT_OPS, Layer
from .graph import layers as graph_layers

ORT_TYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
             "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


class OnnxError(ValueError):
    """A model or probe that cannot be recorded; the message names the file and what is wrong."""


def _load(path: Path):
    import onnx

    if not path.is_file():
        raise OnnxError(f"{path}: no such file")
    try:
        return onnx.load(str(path))
    except Exception as exc:  # protobuf's DecodeError and onnx's own errors
        raise OnnxError(f"{path}: not an ONNX model ({type(exc).__name__}: {exc})") from None


def select_tensors(model, layers=None, op_types=None, input_axes=None) -> list[Layer]:
    """The framework's layers to read (adapters/onnx/graph.py), filtered by name glob, and by op
    type or kind (`Relu`, `Gemm`, `silu`: a decomposed activation is known by its kind)."""
    kinds = set(KINDS)
    recurrent = set(RECURRENT_OPS)
    if op_types:
        recurrent &= set(op_types)
        unknown = set(op_types) - set(OP_KINDS) - set(KINDS) - set(RECURRENT_OPS)
        if unknown:
            raise OnnxError(f"--op-types: unknown op type(s) {', '.join(sorted(unknown))}; known: "
                            f"{', '.join(sorted({*OP_KINDS, *RECURRENT_OPS}))}, or a kind ({', '.join(KINDS)})")
        kinds = {OP_KINDS.get(op, op) for op in op_types}
        kinds |= {"attention"} if "linear" in kinds else set()
        kinds |= {"relu6"} if "clip" in kinds else set()
    chosen = [t for t in graph_layers(model, input_axes) if (
        t.recurrent.op_type in recurrent if t.recurrent else t.kind in kinds) and (
        not layers or any(fnmatch.fnmatch(t.name, p) or fnmatch.fnmatch(t.output, p) for p in layers))]
    if not chosen:
        raise OnnxError("no tensor matches --layers/--op-types in this model")
    return chosen


def _session(model, names: list[str], path: Path):
    """A session on the in-memory model (never the file) with the named tensors as extra graph
    outputs; a name alone is enough, ORT infers their types (faster than shape inference)."""
    import onnx
    import onnxruntime as ort

    existing = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in existing)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # its idle threads would slow our reductions
    try:
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise OnnxError(f"{path}: ONNX Runtime cannot run this model: {exc}") from None


MAX_PROBE_BYTES = 2 ** 30  # a probe is one batch: its arrays' bytes, uncompressed, at most 1 GiB


def load_probe(path) -> dict[str, np.ndarray]:
    """A probe file: .npz (arrays by input name) or .npy (a single-input model's input). Its size
    uncompressed (an .npz's members as its zip directory declares them, which bound what is read) is
    checked against MAX_PROBE_BYTES before any array is: a zip bomb is refused unread."""
    path = Path(path)
    if not path.is_file():
        raise OnnxError(f"--probe {path}: no such file")
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                size = sum(member.file_size for member in z.infolist())
        else:
            size = path.stat().st_size
    except (zipfile.BadZipFile, OSError) as exc:
        raise OnnxError(f"--probe {path}: not a .npz or .npy file ({exc})") from None
    if size > MAX_PROBE_BYTES:
        raise OnnxError(f"--probe {path}: its arrays hold {size:,} bytes uncompressed, over the "
                        f"{MAX_PROBE_BYTES >> 20} MiB a probe may hold (one batch): not read")
    try:
        if path.suffix == ".npy":
            return {"": np.load(path, allow_pickle=False)}
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except Exception as exc:
        raise OnnxError(f"--probe {path}: not a .npz or .npy file ({exc})") from None


def _feeds(session, probe: dict[str, np.ndarray], path: Path) -> dict[str, np.ndarray]:
    """Match probe arrays to the model's inputs, checking names, ranks, fixed sizes and dtypes."""
    inputs = session.get_inputs()
    if "" in probe:
        if len(inputs) != 1:
            raise OnnxError(f"{path}: the model has {len(inputs)} inputs ({', '.join(i.name for i in inputs)}); "
                            f"give the probe as an .npz with one array per input name")
        probe = {inputs[0].name: probe[""]}
    feeds = {}
    for inp in inputs:
        if inp.name not in probe:
            raise OnnxError(f"{path}: the probe has no array for input {inp.name!r} "
                            f"(it has: {', '.join(probe) or 'nothing'})")
        a = probe[inp.name]
        want = ORT_TYPES.get(inp.type)
        if want is not None and a.dtype != want:
            if a.dtype.kind == np.dtype(want).kind or {a.dtype.kind, np.dtype(want).kind} <= {"i", "u"}:
                a = a.astype(want)
            else:
                raise OnnxError(f"{path}: input {inp.name!r} expects {inp.type}, the probe holds {a.dtype}")
        if len(inp.shape) != a.ndim or any(isinstance(d, int) and d != s for d, s in zip(inp.shape[1:], a.shape[1:])):
            raise OnnxError(f"{path}: input {inp.name!r} expects shape {inp.shape}, the probe holds {list(a.shape)}")
        feeds[inp.name] = a
    sizes = {len(a) for a in feeds.values()}
    if len(sizes) != 1:
        raise OnnxError(f"--probe: inputs have different numbers of examples: {sizes}")
    return feeds


def _chunks(session, feeds: dict, chunk: int, path: Path):
    n = len(next(iter(feeds.values())))
    fixed = {i.shape[0] for i in session.get_inputs() if i.shape and isinstance(i.shape[0], int)}
    if fixed:
        size = fixed.pop()
        if n % size:
            raise OnnxError(f"{path}: the model's batch size is fixed at {size}; the probe's {n} examples "
                            f"are not a multiple of it")
        chunk = size
    for start in range(0, n, chunk):
        yield {k: v[start: start + chunk] for k, v in feeds.items()}


def _unit_axis(value: np.ndarray, t: Layer) -> int | None:
    """The layer's unit axis on this output (from its start or end), None where it was lost."""
    return t.axis % value.ndim if t.axis is not None and -value.ndim <= t.axis < value.ndim else None


class Checkpoint:
    """One ONNX model ready to read: its session on the graph copy and the tensors it exposes."""

    def __init__(self, path: Path, *, layers=None, op_types=None, input_axes=None):
        self.path = Path(path)
        model = _load(self.path)
        tensors = select_tensors(model, layers, op_types, input_axes)
        # an Attention op's scores are exposed as its fourth output; one with a cache or window is not read
        ops = {t.output: AttentionOp(t.attention) for t in tensors if t.attention is not None}
        self.unread_heads = {t.name: ops[t.output].unread for t in tensors if t.output in ops and ops[t.output].unread}
        self.ops = {name: op for name, op in ops.items() if not op.unread}
        self.tensors = [t for t in tensors if t.output not in ops or t.output in self.ops]
        self.lost = [t.name for t in self.tensors if t.axis is None]
        # a ReLU of a tensor read anyway is read from that tensor's pass, its own output not fetched
        read = {t.output: t for t in self.tensors}
        self.relu_of = {t.input: t for t in self.tensors if t.input in read and read[t.input].axis == t.axis}
        self.fetched = [t for t in self.tensors if t not in self.relu_of.values() and t.recurrent is None]
        # a recurrent node's readings are computed from its inputs and outputs (adapters/onnx/recurrent.py)
        ops = list({id(t.recurrent): t.recurrent for t in self.tensors if t.recurrent}.values())
        self.recurrent = [(op, [t for t in self.tensors if t.recurrent is op]) for op in ops]  # and its readings
        self.unread = {t.name: t.recurrent.unread for t in self.tensors
                       if t.recurrent and t.recurrent.unread and t.part.count(".") == 0}
        constants = {i.name: i for i in model.graph.initializer}
        inputs = {i.name for i in model.graph.input}
        self.masks: dict[str, object] = {}  # an Attention op's mask: a constant's value, or the name to feed or fetch
        for name, op in self.ops.items():
            op.expose(name)
            if op.mask in constants:
                self.masks[op.mask] = _array(constants[op.mask])
        # an attention's scores are read as the derived readings they give, per head, under its scope
        self.heads = {t.output: {k: Layer(f"{t.name}.{k}", t.output, k, None, -1) for k in ATTENTION_KINDS}
                      for t in self.tensors if t.scores}
        self.order = {layer.name: i for i, layer in enumerate(
            layer for t in self.tensors for layer in (self.heads[t.output].values() if t.scores else [t]))}
        self.names = list(dict.fromkeys([t.output for t in self.fetched] + [
            name for op, _ in self.recurrent for name in op.expose()] + [
            op.mask for op in self.ops.values() if op.mask and op.mask not in constants and op.mask not in inputs]))
        self.session = _session(model, self.names, self.path)

    def read(self, probe: dict, chunk: int = 256) -> list:
        """One probe reading: a Reading per chosen tensor, merged over the probe's chunks."""
        feeds = _feeds(self.session, probe, self.path)
        merged: dict[str, object] = {}
        for part in _chunks(self.session, feeds, chunk, self.path):
            try:
                values = dict(zip(self.names, self.session.run(self.names, part)))
            except Exception as exc:
                raise OnnxError(f"{self.path}: ONNX Runtime failed on the probe: {exc}") from None
            jobs = [(t, np.asarray(values[t.output])) for t in self.fetched if not t.scores]
            jobs += [(self.heads[t.output][kind], v) for t in self.fetched if t.scores
                     for kind, v in attention(self._scores(t.output, values, part)).items()]
            for op, layers in self.recurrent:
                arrays = op.readings(values, {t.part for t in layers})
                jobs += [(t, arrays[t.part]) for t in layers if t.part in arrays]
            jobs = [(t, v) for t, v in jobs if v.dtype.kind == "f" and v.size]
            readings = reduce_arrays([(v, _unit_axis(v, t), t.kind, dict(
                layer=t.name, bounds=t.bounds, relu=self.relu_of[t.output].name if t.output in self.relu_of else None))
                for t, v in jobs])  # one kernel batch on every thread
            fold(merged, readings)
        return sorted(merged.values(), key=lambda r: self.order[r.layer])

    def _scores(self, name: str, values: dict, feeds: dict) -> np.ndarray:
        """The scores fetched as `name`: a Softmax's input as it is, an Attention op's with its mask applied."""
        op = self.ops.get(name)
        if op is None:
            return np.asarray(values[name])
        mask = None if not op.mask else self.masks.get(op.mask, feeds.get(op.mask, values.get(op.mask)))
        return op.scores(np.asarray(values[name]), None if mask is None else np.asarray(mask))


def _array(tensor) -> np.ndarray:
    import onnx.numpy_helper

    return onnx.numpy_helper.to_array(tensor)


def checkpoint_steps(paths: list[Path], steps=None, step_pattern=None) -> list[tuple[int, Path]]:
    """(step, path) sorted by step: from --steps, or a number in each file name."""
    if steps:
        values = [int(s) for s in str(steps).split(",")]
        if len(values) != len(paths):
            raise OnnxError(f"--steps gives {len(values)} steps for {len(paths)} models")
        return sorted(zip(values, paths))
    pattern = re.compile(step_pattern or r"(\d+)(?!.*\d)")
    out = []
    for p in paths:
        m = pattern.search(p.stem)
        if m is None and len(paths) > 1:
            raise OnnxError(f"{p}: no step number in the file name; use --steps or --step-pattern")
        out.append((int(m.group(1)) if m else 0, p))
    return sorted(out)


def record_onnx(models, probe, out, *, run=None, config=None, layers=None, op_types=None, steps=None,
                step_pattern=None, chunk: int = 256, overwrite: bool = False, progress: bool = True,
                input_axes: dict[str, int] | None = None) -> Path:
    """Record one probe reading per ONNX checkpoint, in step order, into one trace. `input_axes`
    names the unit axis of graph inputs an activation reads directly (else: one unit)."""
    import onnxruntime as ort

    paths = []
    for m in models:
        found = expand(m)
        if not found:
            raise OnnxError(f"{m}: no model matches this pattern")
        paths += [Path(f) for f in found]
    if not probe:
        raise OnnxError("--probe is required with an ONNX model (.npz by input name, or .npy)")
    probe_arrays = load_probe(probe)
    op_types = op_types.split(",") if isinstance(op_types, str) else op_types
    order = checkpoint_steps(paths, steps, step_pattern)
    n_probe = len(next(iter(probe_arrays.values())))
    with actrace.Writer(out, run=run, framework="onnxruntime", framework_version=ort.__version__,
                        adapter="actrace.adapters.onnx", config=dict(config or {}, graph_optimization="ORT_ENABLE_ALL"),
                        probe_fingerprint=fingerprint(probe_arrays),
                        probe_size=n_probe, mode="eval", overwrite=overwrite) as w:
        terminal = sys.__stderr__  # the bar's own \r and cursor moves, drawn only on a terminal
        bar = tqdm(order, unit="checkpoint", file=terminal, disable=not (progress and terminal and terminal.isatty()))
        for i, (step, path) in enumerate(bar):
            bar.set_description(shown(f"step {step}: {path.name}")[:60])
            checkpoint = Checkpoint(path, layers=layers, op_types=op_types, input_axes=input_axes)
            if checkpoint.lost and i == 0:
                warnings.warn(f"actrace: the unit axis of {len(checkpoint.lost)} reading(s) cannot be followed "
                              f"through the graph, so each is read as one unit: {', '.join(checkpoint.lost[:12])}",
                              stacklevel=2)
            if checkpoint.unread and i == 0:
                warnings.warn("actrace: the gates of these recurrent nodes are not read (their formulas differ "
                              "from the standard ones) and their states are kind `other`: " + "; ".join(
                                  f"{name} ({why})" for name, why in checkpoint.unread.items()), stacklevel=2)
            if checkpoint.unread_heads and i == 0:
                warnings.warn("actrace: the heads of these Attention ops are not read: " + "; ".join(
                    f"{name} ({why})" for name, why in checkpoint.unread_heads.items()), stacklevel=2)
            for index, reading in enumerate(checkpoint.read(probe_arrays, chunk)):
                w.record(step, reading, layer_index=index)
        bar.close()
    return w.path
