"""Training frameworks' hooks that put each training step under a supermem pool.

    from supermem.integrations.hf import PoolCallback          # transformers' Trainer
    from supermem.integrations.lightning import PoolCallback   # Lightning's Trainer
    from supermem.integrations.accelerate import pool_step     # an Accelerate loop

Each module imports its framework when it is imported, never before: importing supermem or this
package imports none of them. The pool's saved-tensor hooks must be on around the forward and the
backward of a step, so each integration enters the pool where the framework's step begins and leaves
it where the step (its backward and optimizer step) has ended. The pool counts a step per backward:
with gradient accumulation, one per micro-batch (6 optimizer steps of 2 micro-batches: 12).
"""

from __future__ import annotations

from typing import Any

__all__ = ["StepPool", "StepPoolCallback"]


class StepPool:
    """A pool entered at a framework's step start and left at its end, the two calls coming from two
    hooks (no `with` block spans them). The pool is `pool` if given, else `supermem.pool(...)` of
    `options` on the device of the first step. A begin while inside (a step whose end hook never ran:
    a loop stopped between them) keeps the context entered; end() outside does nothing, so a
    framework's train-end and exception hooks may call it to leave a step cut short."""

    def __init__(self, pool: Any = None, **options: Any):
        self._pool = pool
        self.options = options
        self.inside = False

    def pool(self, device: Any = None) -> Any:
        """The pool, made at the first call: supermem.pool(**options, device=device)."""
        if self._pool is None:
            import supermem

            options = dict(self.options)
            if device is not None:
                options.setdefault("device", device)
            self._pool = supermem.pool(**options)
        return self._pool

    def begin(self, device: Any = None) -> None:
        if not self.inside:
            self.pool(device).__enter__()
            self.inside = True

    def end(self) -> None:
        if self.inside:
            self.inside = False
            self._pool.__exit__(None, None, None)


class StepPoolCallback:
    """The part a framework's callback class shares (listed before the framework's base, whose own
    __init__ it replaces): the constructor over a StepPool, and `pool`. The framework's hooks call
    self.steps.begin(device) and self.steps.end()."""

    def __init__(
        self,
        budget: int | float | str | None = None,
        policy: str | None = None,
        host_limit: int | float | str | None = "50%",
        *,
        pool: Any = None,
        **options: Any,
    ):
        self.steps = StepPool(pool, budget=budget, policy=policy, host_limit=host_limit, **options)

    @property
    def pool(self) -> Any:
        """The pool (made at the first step: None before it, unless given)."""
        return self.steps._pool
