"""An Accelerate training loop under a supermem pool:

    for batch in loader:
        with pool_step(accelerator, model, budget="8GiB"):
            loss = model(batch)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

`pool_step(accelerator, *models)` is `accelerator.accumulate(*models)` (gradient accumulation as
the Accelerator was set up) with the pool on the accelerator's device around it; without models,
the pool alone. The forward and accelerator.backward must both run inside: the pool's saved-tensor
hooks are on only there. The pool counts a step per backward, one per micro-batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import accelerate  # noqa: F401  (this module is for Accelerate loops: fail at import without it)

from . import StepPool


@contextlib.contextmanager
def pool_step(
    accelerator: Any,
    *models: Any,
    budget: int | float | str | None = None,
    policy: str | None = None,
    host_limit: int | float | str | None = "50%",
    pool: Any = None,
    **options: Any,
) -> Iterator[Any]:
    """One training step (a micro-batch's forward and backward) under `pool`, or under
    `supermem.pool(budget, policy, host_limit, **options)` on accelerator.device (the same pool at
    every step: supermem.pool finds it by its options); yields the pool."""
    steps = StepPool(pool, budget=budget, policy=policy, host_limit=host_limit, **options)
    accumulating = accelerator.accumulate(*models) if models else contextlib.nullcontext()
    with accumulating:
        steps.begin(accelerator.device)
        try:
            yield steps.pool()
        finally:
            steps.end()
