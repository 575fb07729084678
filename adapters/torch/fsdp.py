"""What FSDP needs of a monitor. After a probe forward, every unit sharded again (`reshard`).
FSDP1 (`FullyShardedDataParallel`): a unit flattens its parameters into one FlatParameter and
each rank holds a slice of it. Each original parameter is read from this rank's piece of that
slice (flat, empty where the rank holds none of it) as a `Piece`, reduced across the unit's ranks
as a DTensor's shards are, never gathered: under `use_orig_params=True` the parameter is that
piece; without it, the module holds no parameter between forwards, and a `Flat` stands for it.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from actrace.reduce.torch import Piece

from .trace import own_parameters

SHARDED = ("FULL_SHARD", "SHARD_GRAD_OP")  # one process group holds each value once


def units(model: nn.Module):
    """(unit, its FlatParamHandle) of every FSDP1 unit of `model` holding parameters sharded."""
    for unit in model.modules():
        handle = getattr(unit, "_handle", None) if type(unit).__name__ == "FullyShardedDataParallel" else None
        if handle is not None and handle.uses_sharded_strategy:  # not NO_SHARD: each rank holds them whole
            yield unit, handle


def reshard(model: nn.Module) -> None:
    """Free what a probe forward left gathered: FSDP keeps the root's parameters (FSDP1: every
    unit's under SHARD_GRAD_OP; FSDP2: any unit's with reshard_after_forward=False) whole after a
    forward, for the backward. Read between the backward and the optimizer's step, training's next
    forward would run on the weights before that step (and FSDP2's module would hold its gathered
    parameters, not the sharded ones the optimizer steps); freed, they are gathered anew, as after
    a backward."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return  # FSDP runs only in a process group
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    for _, handle in units(model):
        handle.reshard(True)
        handle.post_reshard()


@dataclass(eq=False)
class Flat:
    """An original parameter of an FSDP1 unit under use_orig_params=False: index `i` of `flat`."""

    flat: nn.Parameter
    i: int

    @property
    def requires_grad(self) -> bool:
        return self.flat.requires_grad


class FlatShards:
    """The original parameters of `model`'s FSDP1 units held in pieces: {parameter or `Flat`: (its
    unit's FlatParameter, its index there, the unit's process group)}; `owned`: {module: [(name,
    `Flat`)]}, the parameters a module holds only inside its unit's FlatParameter."""

    def __init__(self, model: nn.Module):
        self.of, self.owned = {}, {}
        said = set()
        for unit, handle in units(model):
            if handle._sharding_strategy.name not in SHARDED:
                said.add(handle._sharding_strategy.name)
                continue
            flat = handle.flat_param
            if handle._use_orig_params:
                self.of.update((p, (flat, i, unit.process_group)) for i, p in enumerate(flat._params))
                continue
            for i, info in enumerate(flat._param_infos):  # a tied parameter once, under its first holder
                self.of[key := Flat(flat, i)] = (flat, i, unit.process_group)
                self.owned.setdefault(info.module, []).append((info.param_name, key))
        if said and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
            warnings.warn(f"actrace: the gradient and parameter readings of FSDP units under {', '.join(sorted(said))} "
                          "are skipped: their shards lie across two process groups this version does not join "
                          "(FULL_SHARD or SHARD_GRAD_OP reads them)", stacklevel=3)

    def flats(self) -> list:
        """Each unit's FlatParameter once."""
        return list({id(flat): flat for flat, _, _ in self.of.values()}.values())

    def parameters(self, module: nn.Module):
        """(name, parameter or `Flat`) of a module's own parameters, those held only inside its FSDP1
        unit's FlatParameter included."""
        yield from own_parameters(module)
        yield from self.owned.get(module, ())

    def grad(self, p: nn.Parameter):
        """p's gradient as read: a `Piece` of its unit's sharded gradient (on every rank of the unit
        alike, an empty one where the rank holds none of p), None before any; p's own elsewhere."""
        if p not in self.of:
            return p.grad
        flat, i, group = self.of[p]
        return None if flat.grad is None else self._piece(flat.grad, flat, i, group)

    def grads(self, params: list) -> list:
        """`grad` of each of `params`: their own `.grad` where none is FSDP1-sharded (the usual case,
        read at every step: no lookup per parameter)."""
        return [self.grad(p) for p in params] if self.of else [p.grad for p in params]

    def value(self, p: nn.Parameter):
        """p as read: a `Piece` of its unit's shard, or p itself."""
        if p not in self.of:
            return p.detach()
        flat, i, group = self.of[p]
        return self._piece(flat.detach(), flat, i, group)

    @staticmethod
    def _piece(shard: torch.Tensor, flat, i: int, group) -> Piece:
        info = flat._shard_param_infos[i]
        local = shard.narrow(0, info.offset_in_shard, info.numel_in_shard) if info.in_shard else shard[:0]
        return Piece(local, tuple(flat._shapes[i]), (group,))
