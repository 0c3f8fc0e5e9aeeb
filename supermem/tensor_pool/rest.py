"""Resting: a pool whose plan moves nothing runs its steps without its hooks, as if it were not there.

Once a step ran a plan that moves nothing (Plan.idle) whole and within the budget, while the pool has
seen one shape only, the pool's contexts push no saved-tensor hooks. Without hooks it sees no save, so
it watches what would change them: each region call must be the recorded step's call of that place in
the step (Regions._pre), and the model's parameters must need grad as they did; else, or at the
allocator's pressure, it wakes for good. Running such a plan through the hooks still cost the host
~100 us a region call (on an H200 GPT-24 at 90% of its peak: 1.07x native).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .. import torch_private as tp
from .port import PoolOwner, owner

_top_hooks = tp.top_saved_hooks


class Resting:
    """A context of the pool entered while it rests: no hooks on, unless it is woken inside (wake)."""

    __slots__ = ("top", "hooks")

    def __init__(self) -> None:
        self.top = _top_hooks(False) if _top_hooks is not None else None  # what a wake pushes on
        self.hooks: Any = None

    def wake(self, pool: Any) -> None:
        """The pool's hooks on from here, unless other hooks were pushed since the entry (they would be
        popped first, with the pool's above them): then from the next step."""
        if self.hooks is None and _top_hooks is not None and _top_hooks(False) == self.top:
            hooks = torch.autograd.graph.saved_tensors_hooks(pool.pack, pool.unpack)
            hooks.__enter__()  # (it may raise: under disable_saved_tensors_hooks)
            self.hooks = hooks

    def __exit__(self, *exc: Any) -> None:
        if self.hooks is not None:
            self.hooks.__exit__(*exc)


class Rest:
    """Whether the pool rests, and what it watches meanwhile (Pool.rest); it holds the pool weakly."""

    def __init__(self, pool: PoolOwner) -> None:
        self._pool_ref = weakref.ref(pool)
        self.resting = False
        self.never = False  # woken once: it rests no more
        self.calls: tuple = ()  # the resting plan's recorded calls
        self.k = 0  # the resting step's region calls so far
        self.params: list[weakref.ref] = []  # the model's parameters, and whether each needs grad
        self.grads: tuple[bool, ...] = ()

    @property
    def _pool(self) -> PoolOwner:
        return owner(self._pool_ref)

    def enter(self, outermost: bool) -> bool:
        """At the entry of the pool's context: whether the step runs without the pool's hooks (the
        module's docstring says when)."""
        pool = self._pool
        plans = pool.plans
        if self.resting:
            if outermost:
                if self.grad_flags() != self.grads:
                    self.wake()  # (a frozen layer thawed: saves the plan never saw)
                    return False
                self.k = 0
                pool.count("rest_steps")
            return True
        plan = plans.plan
        if not outermost or self.never or not pool.planning or pool.always_active or plan is None:
            return False
        calls = getattr(plans.profiles.get(plan.signature), "calls", None)
        if not plan.idle or not calls or not plans.plan_ok or plans.rec is None or plans.rec.full:
            return False
        with pool.lock:
            s = pool.clock.step
            if (
                len(plans.cached) != 1
                or s is None
                or s.ordinals != len(plan.signature)
                or not pool.clock.between()
            ):
                return False
            pool.clock.current()  # the step ends here: measured, judged against the budget
            if plans.plan is not plan or not plans.plan_ok or pool.budget.last_peak_bytes > pool.budget_bytes:
                return False
            self.resting = True  # (this step counts in "steps", the next ones in "rest_steps")
            self.calls, self.k = calls, 0
            roots = (m for r in pool.regions.roots if (m := r()) is not None)  # (not bool(m): a compiled
            self.params = [weakref.ref(w) for m in roots for w in m.parameters()]  # module has __len__)
            self.grads = self.grad_flags()
        return True

    def grad_flags(self) -> tuple[bool, ...]:
        return tuple(w is not None and w.requires_grad for w in (r() for r in self.params))

    def call(self, call: tuple) -> None:
        """A region call with grad on, inside the resting pool: the step's k-th must be the recorded
        step's k-th, or its saves are not the plan's (a shape, the number of calls, a part of the
        model that now needs grad): it wakes."""
        k, self.k = self.k, self.k + 1
        if k >= len(self.calls) or self.calls[k] != call:
            self.wake()

    def wake(self) -> None:
        """The pool rests no more; this thread's context, if it rests, has its hooks on from here."""
        pool = self._pool
        self.resting, self.never = False, True
        self.params = []
        pool.count("rest_wakes")
        stack = getattr(pool.per_thread, "stack", None)
        if stack and isinstance(stack[-1], Resting):
            stack[-1].wake(pool)
