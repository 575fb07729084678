"""Lightning adapter: a `Callback` that records a `Trainer.fit` run through the PyTorch adapter's
`Monitor`.

    trainer = L.Trainer(callbacks=[TraceCallback(probe=x_probe, out="runs/a.parquet")])

At the start of fitting a `Monitor` opens on the LightningModule (its `forward` takes the probe);
before each optimizer step (after gradient accumulation, with gradients unscaled by Lightning's
precision plugin) it takes the gradient reading and, every `probe_every` steps, a probe reading
in evaluation behaviour; the training loss and learning rate are recorded as scalars at the same
step. Under DDP every rank reads its shard of the probe and rank 0 writes. It closes when fitting
ends, or with the exception that stopped it.
"""
from __future__ import annotations

from lightning.pytorch import Callback

from .torch import Monitor, TrainerCallbackBase

__all__ = ["TraceCallback"]


class TraceCallback(TrainerCallbackBase, Callback):
    """Record probe and gradient readings of a Lightning run to `out` (default:
    `LOG_DIR/actrace.parquet`); other options are `Monitor`'s (`include`, `histogram`, …)."""

    def on_fit_start(self, trainer, pl_module):
        out = self.out or f"{trainer.log_dir or trainer.default_root_dir}/actrace.parquet"
        config = {k: v for k, v in dict(pl_module.hparams).items() if isinstance(v, (str, int, float, bool, type(None)))}
        self.monitor = Monitor(pl_module, self.probe, out, run=self.run, config=config, **self.options)
        self._stepped, self._losses = None, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.monitor.step(trainer.global_step)
        self._stepped = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        """The training loss (the mean over the micro-batches of one optimizer step) and the learning
        rate, as scalars at the step whose update they made."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            self._losses.append(float(loss.detach()) if hasattr(loss, "detach") else float(loss))
        if getattr(self, "_stepped", None) is not None:
            lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None
            self.monitor.log(self._stepped, loss=sum(self._losses) / len(self._losses) if self._losses else None,
                             lr=lr)
            self._stepped, self._losses = None, []

    def on_fit_end(self, trainer, pl_module):
        self.monitor.close()

    def on_exception(self, trainer, pl_module, exception):
        if self.monitor is not None:
            self.monitor.close(exception)
