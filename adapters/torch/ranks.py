"""Readings across ranks that need not read the same layers: an MoE's experts placed on some ranks
only (expert parallel), an expert no probe token of one rank's share reached, a pipeline's stages.
Every rank's readings are gathered and joined by name: a layer read on one rank is taken from it;
one read on several merges by the schema's rules (shares of the probe) or is the first holder's
(a replicated layer's gradients, the same on every rank). Where every rank reads the same layers,
the probe shares all-reduce field by field instead (one collective of numbers, no pickling)."""
from __future__ import annotations

import contextlib

import torch.distributed as dist

from actrace.reduce import fold
from actrace.reduce.torch import all_reduce


def on_device(device):
    """Object collectives go through the current CUDA device under NCCL: the model's, for this."""
    import torch

    return torch.cuda.device(device) if device is not None and torch.device(device).type == "cuda" \
        else contextlib.nullcontext()


def gather(item, group=None, device=None) -> list:
    """Every rank's `item`, in rank order, on every rank (`device`: the model's)."""
    every = [None] * dist.get_world_size(group)
    with on_device(device):
        dist.all_gather_object(every, item, group=group)
    return every


def union(readings: list, add: bool, group=None, device=None) -> list:
    """Every rank's readings joined by (layer, stream, param): merged where several ranks read the
    same one (`add`: shares of the probe) or the first holder's (a replica's)."""
    joined: dict = {}
    for mine in gather(readings, group, device):
        if add:
            fold(joined, mine)
        else:
            for r in mine:
                joined.setdefault((r.layer, r.stream, r.param), r)
    return list(joined.values())


def merge_shares(readings: list, device, groups=(None,)) -> list:
    """Every data-parallel rank's readings of its share of the probe, as one process's; `groups`:
    the process groups across which the shares differ (default: every rank)."""
    keys = gather([(r.layer, r.stream, r.param) for r in readings], device=device)
    if all(k == keys[0] for k in keys):
        all_reduce(readings, device, groups)
        return readings
    return union(readings, add=True, device=device)


def names_everywhere(names: list[str], device=None) -> tuple[list[str], bool]:
    """Every rank's `names` in one forward order, and whether some rank's differ from this one's
    (experts placed on some ranks); this rank's as they are where every rank's are the same."""
    every = gather(names, device=device)
    differ = any(e != names for e in every)
    return (merged_order(every) if differ else names), differ


def merged_order(orders: list[list[str]]) -> list[str]:
    """Names in forward order from every rank's: a name one rank alone reads goes before the next
    name that rank reads which is already placed (rank 1's experts after rank 0's, before the
    layer after them both)."""
    every: list[str] = []
    for order in orders:
        placed, waiting = set(every), []
        for name in order:
            if name not in placed:
                waiting.append(name)
            elif waiting:
                at = every.index(name)
                every[at:at] = waiting
                waiting = []
        every += waiting
    return every
