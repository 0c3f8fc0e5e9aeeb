"""Lightning's Trainer under a supermem pool:

    trainer = Trainer(callbacks=[PoolCallback(budget="8GiB")], ...)

PoolCallback subclasses `lightning.pytorch.Callback` where the `lightning` package is installed,
else `pytorch_lightning.Callback`. Lightning runs a batch's training_step and its backward (inside
the optimizer's closure, or the user's own under manual optimization) between on_train_batch_start
and on_train_batch_end, so the pool is entered at the first and left at the second: a pool step per
batch, whatever accumulate_grad_batches is.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from . import StepPoolCallback

if importlib.util.find_spec("lightning") is not None:
    from lightning.pytorch import Callback
else:
    from pytorch_lightning import Callback


class PoolCallback(StepPoolCallback, Callback):
    """Each training batch (forward, backward, optimizer step) under `pool`, or under
    `supermem.pool(budget, policy, host_limit, **options)` on the LightningModule's device."""

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.steps.begin(pl_module.device)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.steps.end()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.steps.end()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.steps.end()
