"""Pipeline parallel (`torch.distributed.pipelining`): each rank holds one stage of the model. The
probe runs through the stages in order, each stage's output sent to the next stage's rank, so every
stage reads its own layers on the probe as one process would; each rank's readings, and its names
in forward order, are gathered in stage order, so one trace (rank 0's) holds the whole model.
"""
from __future__ import annotations

import warnings
from collections import Counter

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from .probe import Probe
from .ranks import gather, on_device


def is_stage(model) -> bool:
    """Whether `model` is a pipeline stage (a `PipelineStage`: its module is `submod`)."""
    return hasattr(model, "submod") and hasattr(model, "stage_index_to_group_rank")


class Pipeline:
    """The stage `stage` (a `PipelineStage`) of a pipeline of one stage per rank of its group."""

    def __init__(self, stage):
        self.index, self.stages, self.group = stage.stage_index, stage.num_stages, stage.group
        self.device = torch.device(stage.device)
        ranks = stage.stage_index_to_group_rank
        if len(set(ranks.values())) != self.stages:
            raise ValueError(f"actrace: stage {self.index} of {self.stages} shares its rank with another stage "
                             "(an interleaved schedule); give the Monitor a pipeline of one stage per rank")
        peer = (lambda i: dist.get_global_rank(self.group, ranks[i])) if self.group is not None else ranks.get
        self.previous = peer(self.index - 1) if self.index > 0 else None
        self.next = peer(self.index + 1) if self.index < self.stages - 1 else None
        if type(stage.submod).__name__ == "GraphModule":
            warnings.warn(f"actrace: stage {self.index} is a traced graph (pipelining's `pipeline()`): its layers "
                          "lost their classes, so their kinds and unit axes are unknown and each is read as one unit "
                          "of kind 'other'; split the eager model by hand to read them (README, Sharded training)",
                          stacklevel=3)

    def call(self, module, chunk, axes):
        """The stage's module on what the stage before sent (the probe chunk itself at the first
        stage), its output sent on to the next with each tensor's unit axis (`axes`, the trace's)."""
        with on_device(self.device):  # where an NCCL group wants the objects' bytes
            if self.previous is not None:
                got = [None]
                dist.recv_object_list(got, self.previous, group=self.group)
                chunk, told = got[0]
                chunk = pytree.tree_map(lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t, chunk)
                for t, axis in zip(_tensors(chunk), told):
                    axes.set(t, axis)
            out = Probe.call(module, chunk)
            if self.next is not None:  # sent from the host: a stage's tensors unpickle where it says
                sent = pytree.tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, out)
                dist.send_object_list([(sent, [axes.of(t) for t in _tensors(out)])], self.next, group=self.group)
        return out

    def order(self, names: list[str], steady: bool) -> tuple[list[str], bool]:
        """Every stage's reading names in forward order, stage after stage, and whether every
        stage's two trial passes agreed. A name read in two stages is an error: the stages' modules
        must keep the model's names (a layer removed, not the rest renumbered)."""
        stages = self.gather([(names, steady)])
        every = [n for names, _ in stages for n in names]
        twice = [n for n, count in Counter(every).items() if count > 1]
        if twice:
            raise ValueError(f"actrace: {len(twice)} reading name(s) are read in more than one pipeline stage "
                             f"({', '.join(twice[:4])}{' ...' if len(twice) > 4 else ''}): give each stage the "
                             "model's own names (set the layers a stage does not hold to None, or delete them "
                             "from a ModuleDict; deleting from a ModuleList renumbers the rest)")
        return every, all(s for _, s in stages)

    def gather(self, items: list) -> list:
        """Every stage's `items`, in stage order, on every rank."""
        every = gather((self.index, items), self.group, self.device)
        return [item for _, mine in sorted(every, key=lambda got: got[0]) for item in mine]


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
