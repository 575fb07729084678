"""Hugging Face `Trainer` adapter: a `TrainerCallback` that records the run through the PyTorch
adapter's `Monitor` at the Trainer's own points.

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[TraceCallback(probe=ds[:32])])

The probe is a dict of tensors (passed as keyword inputs), or rows of a dataset (a list of
examples, or a `datasets` slice as a dict of columns) that the Trainer's collator batches. At the
start of training a `Monitor` opens on the Trainer's model, named by `TrainingArguments.run_name`
with the arguments as config. Before each optimizer step (after gradient accumulation and the
Trainer's clipping to `max_grad_norm`) it takes the gradient reading and, every `probe_every`
steps, a probe reading in evaluation behaviour (the Trainer's train mode restored after). Steps
are the Trainer's `global_step` (1 for the first update), and what the Trainer logs (loss,
learning rate, gradient norm) is recorded as scalars at the step it logs them. It closes when
training ends; a run that raised is closed at exit with its status saying so.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import TrainerCallback

from .torch import Monitor, TrainerCallbackBase

__all__ = ["TraceCallback"]

LOG_NAMES = {"learning_rate": "lr"}  # the Trainer's log names → the spec's scalar names
NOT_LOGGED = {"epoch"}  # a position, not a signal; the Trainer repeats it in its closing log


class TraceCallback(TrainerCallbackBase, TrainerCallback):
    """Record probe and gradient readings of a `Trainer` run to `out` (default:
    `OUTPUT_DIR/actrace.parquet`); other options are `Monitor`'s (`include`, `histogram`, …)."""

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        collate = getattr(train_dataloader, "collate_fn", None)
        self.monitor = Monitor(model, _batch(self.probe, collate), self.out or Path(args.output_dir) / "actrace.parquet",
                               run=self.run or args.run_name, config=_config(args), **self.options)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.monitor.step(state.global_step + 1)  # the step being taken, as the Trainer numbers it (1 … N)

    def on_log(self, args, state, control, logs=None, **kwargs):
        """What the Trainer logs (loss, learning rate, its gradient norm, eval metrics) as scalars."""
        if self.monitor is not None and logs:
            self.monitor.log(state.global_step, **{LOG_NAMES.get(k, k): v for k, v in logs.items()
                                                   if isinstance(v, (int, float)) and not isinstance(v, bool)
                                                   and k not in NOT_LOGGED})

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.close()


def _batch(probe, collate):
    """The probe as the model takes it: tensors as given, dataset rows through the collator."""
    if isinstance(probe, dict) and probe and all(isinstance(v, torch.Tensor) for v in probe.values()):
        return dict(probe)
    if isinstance(probe, dict):  # a dataset slice: columns of rows
        probe = [dict(zip(probe, row)) for row in zip(*probe.values())]
    if isinstance(probe, (list, tuple)) and probe and isinstance(probe[0], dict):
        if collate is None:
            raise ValueError("actrace: a probe of dataset rows needs the Trainer's data collator; give tensors")
        return dict(collate(list(probe)))
    return probe


def _config(args) -> dict:
    """The TrainingArguments a trace keeps as its config (JSON values only)."""
    return {k: v for k, v in args.to_sanitized_dict().items() if isinstance(v, (str, int, float, bool, type(None)))}
