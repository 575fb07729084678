"""The fixed probe batch of a PyTorch model (spec §Probe): any structure the model takes.

A tensor, a dict of keyword inputs, a tuple of positional ones, or any nesting of these; tensors
of any dtype (integer ids included) are cut into chunks along their first axis and moved to the
model's device, everything else is passed as it is. The fingerprint is taken again whenever the
probe changed (compared on its own device with a snapshot, so `probe.normal_()` or a new probe
is seen; on the model's device, with the readings' transfer), and the device copy with it.
"""
from __future__ import annotations

import weakref

import numpy as np
import torch
from torch.utils import _pytree as pytree

from actrace.format.fingerprint import fingerprint
from actrace.reduce import torch as reductions


def _name(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


class Probe:
    """The probe `value` as the model takes it, on `device`."""

    def __init__(self, value, device: torch.device | None):
        self.device = device
        self.value = value
        self._snapshot: list | None = None
        self._sources: list = []
        self.check()
        if not self.tensors:
            raise ValueError("actrace: the probe holds no tensor; give the inputs the model takes "
                             "(a tensor, a dict of tensors or a tuple of them)")

    @property
    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        leaves, _ = pytree.tree_flatten_with_path(self.value)
        return [(_name(path), t) for path, t in leaves if isinstance(t, torch.Tensor)]

    @property
    def size(self) -> int:
        return len(self.tensors[0][1]) if self.tensors[0][1].ndim else 1

    def check(self) -> torch.Tensor | None:
        """Take the fingerprint again (with the device copy) where the probe changed, as far as the
        host can tell at once: another structure or tensor, a host tensor's values, or those of one
        a reading copies to its device. A tensor on the device the probe runs on is read as it is,
        so its values are compared there: the answer is a device flag, to `settle` once it reaches
        the host with the readings (no host sync of its own). NaN equals NaN here."""
        now = self.tensors
        if self._snapshot is None or len(now) != len(self._snapshot) or any(
                a is not source() or a.shape != b.shape or a.dtype != b.dtype or a.device != b.device
                for (_, a), b, source in zip(now, self._snapshot, self._sources)):
            self._take(now)
            return None
        there = []
        for (_, a), b in zip(now, self._snapshot):
            if reductions.on_device(a) and a.device == self.device:
                there.append(_differ(a, b).any())
            elif not torch.equal(a, b) and bool(_differ(a, b).any()):
                self._take(now)
                return None
        return torch.stack(there).any() if there else None

    def settle(self, changed) -> str:
        """The fingerprint, taken again where `check`'s device flag, now on the host, says so."""
        if changed is not None and np.asarray(changed).any():
            self._take(self.tensors)
        return self.fingerprint

    def _take(self, now: list[tuple[str, torch.Tensor]]) -> None:
        self._snapshot = [t.detach().clone() for _, t in now]
        self._sources = [weakref.ref(t) for _, t in now]  # a tensor replaced by another is a new probe
        self.fingerprint = _fingerprint(now)
        self._moved = pytree.tree_map(self._to_device, self.value)

    def _to_device(self, leaf):
        if isinstance(leaf, torch.Tensor) and self.device is not None and leaf.device != self.device:
            return leaf.to(self.device)
        return leaf

    def chunks(self, rank: int = 0, world: int = 1, size: int | None = None):
        """This rank's share of the probe in chunks of `size` examples (all of it by default). Every
        rank runs as many chunks (sharded models run collectives in their forward): where the
        shares differ by one, a chunk may hold one example more than `size`."""
        n = self.size
        share = np.array_split(np.arange(n), world)
        idx = share[rank]
        step = size or max(len(share[0]), 1)  # the largest share
        count = max(1, min(-(-len(share[0]) // step), len(share[-1])))  # every rank's, none empty
        for part in np.array_split(idx, count):
            if not len(part):
                continue
            lo, hi = int(part[0]), int(part[-1]) + 1
            yield pytree.tree_map(
                lambda leaf: leaf[lo:hi] if isinstance(leaf, torch.Tensor) and leaf.ndim and len(leaf) == n else leaf,
                self._moved)

    def first_chunk(self, size: int | None):
        return next(self.chunks(0, 1, size))

    @staticmethod
    def call(model: torch.nn.Module, chunk):
        """The model on a chunk: a dict as keyword inputs, a tuple or list as positional ones."""
        if isinstance(chunk, dict):
            return model(**chunk)
        if isinstance(chunk, (tuple, list)):
            return model(*chunk)
        return model(chunk)

    def describe(self) -> str:
        return ", ".join(f"{name or 'probe'} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                         for name, t in self.tensors)


def _differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where `a` and `b` differ, NaN equal to NaN (a probe holding NaN has not changed)."""
    if not a.is_floating_point():
        return torch.ne(a, b)
    return torch.ne(a, b) & ~(torch.isnan(a) & torch.isnan(b))


def _fingerprint(tensors: list[tuple[str, torch.Tensor]]) -> str:
    arrays, dtypes = {}, {}
    for name, t in tensors:
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            arrays[name], dtypes[name] = t.view(torch.int16).numpy(), "bfloat16"
        else:
            arrays[name] = t.numpy()
    return fingerprint(arrays, dtypes)
