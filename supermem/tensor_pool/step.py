"""Steps: the entries saved for one forward/backward belong to one Step, with an ordinal inside it.

A step starts at the first tensor saved after a backward began (or when the pool holds nothing) and
marks where its backward began (its first unpack). The pool uses steps to keep graphs apart
(prefetch looks only at the entries of the step being unpacked) and to carry what it learned (the
forward's duration, which bounds what the link can hide) from one step to the next.

The pool's StepClock is where a step's boundaries are found: a step opens (current), its backward
begins (backward_began), a region call starts inside it or before it (region_start). At an opening
the step before ends, and the pool's parts are told in one place: the budget learns its margin, the
plan runner measures the step (and plans from it) and opens the next one's recording.
"""

from __future__ import annotations

import gc
import time
import weakref
from typing import Any

import torch

from .. import torch_private as tp
from .port import PoolOwner

NO_EARLY_CALL = object()  # Step.early_plan of a step that opened at a save


class Step:
    __slots__ = (
        "index",
        "early_plan",
        "started_s",
        "backward_s",
        "backward_tick",
        "events",
        "ordinals",
        "saved_bytes",
        "offloaded",
        "held",
    )

    def __init__(self, index: int, cuda: bool = False):
        self.index = index
        self.started_s = time.perf_counter()
        self.backward_s: float | None = None  # when its first entry was unpacked (host clock)
        self.backward_tick: int | None = None  # the ledger's tick then: an entry touched after was used
        self.events: list | None = None  # on a GPU: the forward's start and end, on the compute stream
        if cuda:
            self.events = [torch.cuda.Event(enable_timing=True)]
            self.events[0].record()
        self.ordinals = 0
        self.saved_bytes = 0
        self.offloaded = 0  # bytes sent to host in this step's forward
        # outputs of calls the pool did not see, for their next save (PlanRunner.unseen_outputs)
        self.held: list = []
        # the plan that decided the step's first call, where a region call came before the step opened
        # (a call at the very start of the forward: the step opens inside it, and may plan the shape
        # again there); NO_EARLY_CALL where a save opened it
        self.early_plan: object = NO_EARLY_CALL

    @property
    def forward_s(self) -> float | None:
        """The forward's duration: GPU time where there is one (the host runs ahead of it)."""
        if self.backward_s is None:
            return None
        if self.events is not None and len(self.events) == 2 and self.events[1].query():
            return self.events[0].elapsed_time(self.events[1]) / 1e3
        return self.backward_s - self.started_s

    def unpacked(self) -> None:
        """Its first unpack marks where backward began (no save comes after: what was held goes)."""
        self.backward_s = time.perf_counter()
        self.held = []
        if self.events is not None:
            self.events.append(torch.cuda.Event(enable_timing=True))
            self.events[1].record()

    def __repr__(self) -> str:
        return f"Step({self.index}, {self.ordinals} entries)"


class CollectorPause:
    """Python's garbage collector off while a step's saved tensors are the pool's: from the step's
    opening (its first save) to its backward's end (autograd's queue_callback, queued at its first
    unpack) or the pool's exit, as torchtitan keeps it off for a whole run. The pool keeps a few Python
    objects per saved tensor; alive through the forward, they would be promoted by the step's young
    collections (5.5 a step: GPT-24 at toy width, planned at 30% of its saved bytes), and promoted
    objects set off a full collection of every object the process holds every 30-40 steps (145 ms on
    the development CPU). Off, they die by reference count in the backward unseen, and the collector
    runs between steps. Only where it is on: a program that turned it off keeps it off. A
    step that opens before the last one's backward ended (a forward without backward) leaves it on,
    so it is never off for more than a step."""

    def __init__(self) -> None:
        self.paused = False

    def step_opened(self) -> None:
        if self.paused:  # the last step's backward did not end
            self.resume()
        elif gc.isenabled():
            gc.disable()
            self.paused = True

    def backward_began(self) -> None:
        if self.paused:
            try:
                tp.execution_engine.queue_callback(self.resume)
            except RuntimeError:  # unpacked outside a backward (a user reading grad_fn._saved_*)
                pass

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            gc.enable()


class StepClock:
    """The pool's current step, and the events that open and divide steps. It holds the pool weakly
    (the pool owns it) and reaches it for what happens at a boundary."""

    def __init__(self, pool: PoolOwner, ledger: Any) -> None:
        self._pool: PoolOwner = weakref.proxy(pool)
        self._ledger = ledger  # (the pool's Ledger: whether anything saved so far lives)
        self.steps = 0  # steps opened
        self.step: Step | None = None
        self.last_forward_s = 0.0  # the previous step's forward: what bounds hidden copies
        self.left = False  # did anything leave the device during this step (or pressure come)
        self.capture = True  # capture regions this step (off when the last step did not need them)
        self.early_plan: Any = NO_EARLY_CALL  # the plan a call before the next step's opening ran under
        self.collector = CollectorPause()

    def current(self) -> Step:
        """A new step starts at the first tensor saved after backward began, or on an empty pool."""
        pool = self._pool
        s = self.step
        if s is None or self.between():
            pool.regions.outside_uses.step_opened()
            if s is not None and s.forward_s is not None:
                self.last_forward_s = s.forward_s
            if pool.regions.phase == "profiling" and self.steps:
                pool.regions.end_profiling()  # the first step ended without a backward
            pool.budget.learn_margin()  # a new step begins: the last one's peak is known
            pool.copies.collect()  # finished copy timings: the link rate the policy prices copies at
            if s is not None:
                pool.plans.step_ended(s)
            self.capture = self.needed_last_step()
            self.left = False
            self.steps += 1
            s = self.step = Step(self.steps, pool.cuda)
            s.early_plan, self.early_plan = self.early_plan, NO_EARLY_CALL
            pool.plans.step_opened()
            self.collector.step_opened()
        return s

    def between(self) -> bool:
        """The next save starts a step: none yet, its backward began, every tensor saved so far died
        (a forward with no backward, say; PlanKept tensors count: a plan keeping everything holds no
        entry)."""
        s = self.step
        ledger = self._ledger
        return (
            s is None
            or s.backward_s is not None
            or not (ledger.entries or ledger.kept_live or ledger.unseen_live)
        )

    def backward_began(self) -> None:
        """Backward unpacked a tensor the pool left alone, or went through a call it did not see: the
        step's backward began, though none of its entries may be unpacked (every call unseen; on an
        H100 a ResNet-152 planned step now and then ran on into the next one's image: a plan miss, and
        a step of the reactive fallback, 2 s)."""
        self.unpacked(self.step)

    def unpacked(self, s: Step | None) -> None:
        """Backward unpacked a tensor of step `s`: if the first, its backward began (the graph is
        whole: the calls verified in it count their inputs' uses outside them, outside_uses.py)."""
        if s is not None and s.backward_s is None:
            s.unpacked()
            s.backward_tick = self._pool.ledger.tick
            if s is self.step:
                self._pool.regions.outside_uses.backward_began()
                self.collector.backward_began()

    def region_start(self) -> int | None:
        """Whether a region starting now is captured: None if not, else the step's saves so far (0
        between steps: a region call comes before the next step's first save, and the next step's
        decision is taken). A step that runs a feasible plan (without recording) captures only the
        calls the plan replays or runs unseen, known by that count: capturing the rest cost ~40 us
        each on a CPU for nothing, on the host that bounds a planned step."""
        pool = self._pool
        plans = pool.plans
        s = self.step
        if s is None or self.between():
            plans.forget_if_stale()  # (this call is the next step's: not a plan of the old graphs')
            self.early_plan = plans.plan  # what decides this call (the step opens later: Step.early_plan)
            if not self.needed_last_step():
                return None
            if plans.record_full or plans.plan is None or not pool.planning:
                return 0
            # the step's shape is not known yet: captured if a plan of any shape may replay it
            cached = plans.cached.values()
            return 0 if any(not p.feasible or p.captured(0) for p in cached) else None
        else:
            if not self.capture:
                return None
            start, plan = s.ordinals, plans.plan if plans.plan_ok and not plans.rec.full else None
        if plan is None or not pool.planning or not plan.feasible:
            return start
        return start if plan.captured(start) else None

    def needed_last_step(self) -> bool:
        """Capture regions only when the pool may need them: on the first steps, and after a step in
        which something left the device (an unneeded budget costs nothing per region; a step that
        newly needs room offloads, and the next one captures)."""
        return (
            self.steps < 2 or self.left or self._pool.planning
        )  # a plan's ordinals count the regions' inputs
