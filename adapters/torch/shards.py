"""Tensor parallel (`parallelize_module`, alone, inside FSDP's data-parallel shards or inside
pipeline stages on a 2-D mesh):
which slice of a layer's units each rank's local tensor holds, so that the ranks' readings join into
the whole layer's: per-unit columns in global unit order, the rest by the schema's merge rules
(spec §Columns).

A parallelized module's output reaches the trace's hook as a DTensor, before the module's own hook
makes it local: a shard on the unit axis (column parallel) is this rank's units at their global
offset; a shard on another axis (sequence parallel) is this rank's positions, merged as probe
chunks are; a partial sum (row parallel) is read after its reduction; a replica as it is. A local
tensor computed elementwise from a shard (the ReLU of a column-parallel output) holds the same
units; anything else computed from one cannot be placed, and is not read.
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from actrace.reduce.reading import join_units, merge

from .axes import TensorMap, _pointwise, _tensors

@dataclass(frozen=True)
class Split:
    """How a tensor-parallel model's ranks share the probe: the ranks of `tp` (a process group) each
    hold a slice of the same examples' units; across the groups `dp` (FSDP over tensor parallel:
    a mesh of two dimensions or more) the examples differ, this rank's being share `rank` of `size`."""

    tp: object = None
    dp: tuple = ()
    rank: int = 0
    size: int = 1


def split_of(model) -> Split | None:
    """The model's `Split`, from its DTensor parameters; None where no layer is split across ranks
    (FSDP alone shards parameters, not units). On a mesh of two dimensions or more, FSDP's and
    data-parallel dimensions come first and the tensor-parallel one last, as FSDP composes them
    (HSDP alone: the ranks of its last, sharding dimension read the same share, as one)."""
    if not dist.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule

    sharded = [p for p in model.parameters() if is_dtensor(p)]
    meshes = [p.device_mesh for p in sharded if p.device_mesh.ndim > 1]
    if not sharded or (not meshes and any(isinstance(m, FSDPModule) for m in model.modules())):
        return None
    if not meshes:  # the tensor-parallel ranks: the mesh's (pipeline stages: a stage's), not every rank
        return Split(sharded[0].device_mesh.get_group())
    mesh = meshes[0]
    outer = list(range(mesh.ndim - 1))
    where, sizes = mesh.get_coordinate(), [mesh.size(d) for d in outer]
    rank = sum(where[d] * math.prod(sizes[d + 1:]) for d in outer)
    return Split(mesh.get_group(mesh.ndim - 1), tuple(mesh.get_group(d) for d in outer), rank, math.prod(sizes))


UNPLACED = "unplaced"  # computed from a shard by an op that moves values across its units
_SAME = frozenset({"contiguous", "clone", "detach", "to", "float", "half", "bfloat16", "double", "type_as",
                   "dropout", "masked_fill", "where"})


class Shards:
    """The slice each local tensor of one forward holds: (unit axis, offset, units in all), or
    ("positions", axis) for a shard along another axis, or UNPLACED; a tensor not here is whole."""

    def __init__(self):
        self.tags = TensorMap()
        self.made: dict = {}  # a parallelized module → (unit axis, DTensor output, reading) until made local

    def hold(self, module, output, axis, reading) -> None:
        """A parallelized module's DTensor output, at the trace's hook (before the module's own):
        its `reading` (name, kind, bounds) waits until the module has made it what it hands on."""
        self.made[module] = (axis, output, reading)

    def settle(self, module, output):
        """What a parallelized module handed on, made of the DTensor `hold` kept (its own output
        hook, which runs after the trace's, redistributed it): (the local tensor, waited for where
        it is a collective's, its unit axis, the reading held), its slice noted; None where nothing
        was held or the module handed on partial sums."""
        axis, kept, reading = self.made.pop(module, (None, None, None))
        if kept is None or not isinstance(output, torch.Tensor):
            return None
        if is_dtensor(output):
            local = self.local(output, axis)
            return None if local is None else (local, axis, reading)
        differ = [d for d in range(output.ndim) if output.shape[d] != kept.shape[d]] if output.ndim == kept.ndim \
            else None
        plain = output.wait() if type(output).__name__ == "AsyncCollectiveTensor" else output  # a collective's result
        for t in {id(output): output, id(plain): plain}.values():
            if differ is None or len(differ) > 1:
                self.tags[t] = UNPLACED
            elif differ:  # a shard of axis d, as redistributing to Shard(d) makes it
                from torch.distributed.tensor import Shard

                self.tags[t] = _slice_of(kept.shape, kept.device_mesh, Shard(differ[0]), axis)
        return plain, axis, reading

    def local(self, t, axis: int | None):
        """A DTensor as this rank reads it, its slice noted; None for a partial sum (read only once
        its own module has reduced it: the trace never runs a collective of its own)."""
        placement = t.placements[0]
        if placement.is_partial():
            return None
        local = t.to_local()
        if placement.is_shard():
            self.tags[local] = _slice_of(t.shape, t.device_mesh, placement, axis)
        return local

    def follow(self, name: str, args, kwargs, out) -> None:
        """An op's output, as `carry` says: the op is elementwise if aten tags it pointwise."""
        inputs = [t for t in _tensors(list(args) + list(kwargs.values())) if t in self.tags]
        if inputs:
            self.carry(inputs, out, name in _SAME or _pointwise(name))

    def carry(self, inputs, out, elementwise: bool) -> None:
        """`out` holds its sharded inputs' slice if it was computed from them elementwise, in their
        shape; else it cannot be placed."""
        tagged = [(t, self.tags[t]) for t in inputs if t in self.tags]
        if not tagged:
            return
        x, tag = tagged[0]
        keeps = elementwise and isinstance(out, torch.Tensor) and out.shape == x.shape \
            and all(other == tag for _, other in tagged)
        for t in _tensors(out):
            self.tags[t] = tag if keeps else UNPLACED

    def of(self, t) -> object:
        return self.tags.get(t)


def is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "placements")


def _slice_of(shape, mesh, placement, axis: int | None):
    """The slice of a tensor of global `shape` that this rank's `placement` (a Shard) holds:
    (unit axis, offset, units in all) for the unit axis, ("positions", axis) for another."""
    dim = placement.dim % len(shape)
    if axis is None or dim != axis % len(shape):
        return ("positions", dim)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(shape, mesh, (placement,))
    return (dim, int(offset[dim]), int(shape[dim]))


def join(readings: list, tags: dict, group=None) -> list:
    """Every rank's readings of one probe reading (the same names on each; `tags`: this rank's
    slices by reading name) as the whole model's: a unit slice's joined in unit order, a position
    shard's merged, a replica's taken from the first rank. One collective over the ranks of `group`
    (the tensor-parallel ones; the readings are small)."""
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, [(r, tags.get(r.layer)) for r in readings], group=group)
    by_key = [{(r.layer, r.stream, r.param): (r, tag) for r, tag in rank} for rank in gathered]
    out = []
    for key, (first, tag) in by_key[0].items():
        parts = [rank[key] for rank in by_key if key in rank]
        if tag is None:
            out.append(first)
        elif tag[0] == "positions" and len(parts) == len(by_key):
            out.append(functools.reduce(functools.partial(merge, batch_axis=tag[1]), [r for r, _ in parts]))
        elif tag[0] != "positions" and sum(r.units for r, _ in parts) == tag[2]:  # a rank of no units reads none
            out.append(join_units([r for r, _ in sorted(parts, key=lambda part: part[1][1])]))
        elif dist.get_rank() == 0 and first.layer not in _said:
            _said.add(first.layer)
            warnings.warn(f"actrace: skipping {first.layer}: some rank did not read its slice, so the layer is not "
                          f"whole", stacklevel=3)
    return out


_said: set[str] = set()  # layers whose slices were incomplete, said once
