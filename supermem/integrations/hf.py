"""transformers' Trainer under a supermem pool:

    trainer = Trainer(model, args, train_dataset=data, callbacks=[PoolCallback(budget="8GiB")])

Trainer calls on_step_begin before the first micro-batch of an optimizer step and on_step_end after
the optimizer step (transformers 5.23, Trainer._inner_training_loop), so every micro-batch's
training_step (compute_loss, then accelerator.backward) runs inside the pool; evaluation and saving
come after on_step_end, outside it. The pool counts a step per micro-batch's backward.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from . import StepPoolCallback


class PoolCallback(StepPoolCallback, TrainerCallback):
    """Each training step (all its micro-batches, and the optimizer step) under `pool`, or under
    `supermem.pool(budget, policy, host_limit, **options)` on Trainer's device (args.device)."""

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.begin(args.device)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.end()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.end()  # a loop that stopped between a step's begin and its end
