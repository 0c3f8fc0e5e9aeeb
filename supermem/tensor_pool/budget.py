"""The budget: what the pool measures against it, and how it makes room when the device is over.

Device bytes in use are read from supermem's allocator (or PyTorch's, or on CPU the entries' own
count). The target is the budget less a margin learned from the last step: how far its true peak rose
above the most the pool saw (the loss, workspaces: transients it cannot see coming). After each new
entry the pool fits the target, the policy's cheapest choices leaving first; with supermem's allocator
the budget is also its soft limit, and the pool its pressure handler, so an allocation the pool never
saw makes entries leave before it takes the device over. During backward it prefetches what comes
next as far as the target has room.

Budget holds the pool weakly (the pool owns it) and moves entries through it: the policy, the
treatments and the ledger are the pool's.
"""

from __future__ import annotations

import bisect
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..log import warn
from ..policies import Choice
from ..units import format_bytes
from .entry import Entry, State
from .port import PoolOwner, owner

PREFETCH_SCAN = 64  # entries looked at, going back from the one just used, for prefetch
CANDIDATES = 32  # least recently used entries priced per decision (the stalest score best anyway)
OVER = 1.03  # times the budget: the device above it is over (the warning; compiled.py's cache given back)


class Budget:
    """The pool's target, its fit, its pressure handler and its prefetch room. The budget itself is
    the pool's option (Pool.budget_bytes: None for none)."""

    def __init__(self, pool: PoolOwner) -> None:
        self._pool_ref = weakref.ref(pool)
        self.margin = 0  # learned: how far a step's peak rises above the most the pool saw (bytes)
        self.seen_peak = 0  # the most device memory the pool saw in use during this step
        self.last_spike = 0  # the last step's true peak above the most the pool saw
        self.last_peak_bytes = 0  # the last step's measured peak
        # the device's highest bytes up to the last exit from this pool's contexts, since the last step's
        # end; how many are entered now (watch)
        self.inside_peak = 0
        self.entered = 0
        self.outside = False  # the last exit came after its step: the watermark from then is not its
        self.pressure_registered = False
        self.soft: Any = None  # the allocator keeping the budget as its soft limit (supermem's, on CUDA)
        self.alloc: Any = None  # supermem's allocator of the device, once it exists
        self.urgent = False  # pricing for the pressure handler: every byte is needed now
        self.high_before: int | None = None  # PyTorch's allocator: its peak before the pool's first step
        self.said_over = False
        self.stuck_bytes = 0  # the most in use at a moment nothing more could leave: this policy's floor

    @property
    def _pool(self) -> PoolOwner:
        return owner(self._pool_ref)

    # ------------------------------------------------------------------ the allocator

    def allocator(self) -> Any:
        """supermem's allocator of this device, or None; kept once found (asked at every save)."""
        pool = self._pool
        if self.alloc is None and pool.cuda:
            from ..registry import device_allocator

            self.alloc = device_allocator(pool.device.index)
        return self.alloc

    def register_pressure_handler(self) -> None:
        """The pool's pressure handler (Pool.on_pressure, held weakly) joins its device's allocator."""
        pool = self._pool
        if self.pressure_registered or not pool.cuda:
            return
        from ..registry import installed

        if installed():
            from .. import _C

            # its own device's allocator only: under DDP each rank's pool, and in one process one pool
            # per device, offloads only where memory is short
            _C.plugin_add_pressure_handler(_weak_method(pool.on_pressure), pool.device.index)
            self.pressure_registered = True

    def keep(self) -> None:
        """The budget becomes the allocator's soft limit: an allocation the pool never sees coming (the
        loss's temporaries, a workspace) that would take the device over it first makes entries leave,
        through the pressure handler. Needs supermem's allocator, and its device allocator made. Set at
        each entry: of two pools used in turn on one device, each step runs under its own pool's (the
        limit was the last made pool's, and a pool at 75% of GPT-24's peak stepped under 55%'s)."""
        budget_bytes = self._pool.budget_bytes
        if budget_bytes is None or not self.pressure_registered:
            return
        alloc = self.allocator()
        if alloc is not None:
            if alloc.soft_limit_bytes != budget_bytes:  # (setting it arms it: one pool's stays as is)
                alloc.soft_limit_bytes = budget_bytes
            if self.soft is None:
                self.soft = alloc
                # (the budget lives exactly as long as its pool)
                weakref.finalize(self, _drop_soft_limit, alloc, budget_bytes)

    def arm(self) -> None:
        """Something the soft limit's pressure handler could free again came onto the device."""
        if self.soft is not None:
            self.soft.arm_soft_limit()

    def watch(self, entered: int) -> None:
        """The step's measured peak leaves out what runs outside the pool's contexts between steps (a
        training step without the pool, at native's peak): at the last exit, if the step is over, the
        device's watermark so far is kept and the one up to the next entry let go. Without it, GPT-24's
        planned steps taken between native ones each overshot by native's peak, and the plans made
        lower for it were infeasible. (A step whose backward runs after the exit keeps counting.)"""
        pool = self._pool
        alloc = self.allocator() if pool.budget_bytes is not None else None
        if alloc is None:
            return
        with pool.lock:
            if self.entered == 0 and entered > 0 and self.outside:
                alloc.take_watermark()
                self.outside = False
            self.entered += entered
            if self.entered == 0 and pool.clock.between():
                self.inside_peak = max(self.inside_peak, alloc.take_watermark())
                self.outside = True

    # ------------------------------------------------------------------ measuring

    def used_bytes(self) -> int:
        """What the budget counts: bytes allocated on the device now (cheap with supermem's allocator,
        a stats call with PyTorch's), or on CPU the bytes the entries hold."""
        pool = self._pool
        if not pool.cuda:
            used = pool.ledger.device_bytes + pool.ledger.kept_bytes
        else:
            alloc = self.allocator()
            used = alloc.allocated_bytes if alloc is not None else torch.cuda.memory_allocated(pool.device)
        self.seen_peak = max(self.seen_peak, used)
        return used

    def target(self) -> int:
        """Device bytes the pool aims at: the budget less the learned margin; with no budget, the
        allocator's limit (or the card) less room for the largest entry, so prefetch never causes an
        OOM. On CPU: the budget (or no bound)."""
        pool = self._pool
        if pool.budget_bytes is not None:
            if pool.plans.plan_ok:
                return pool.budget_bytes  # the plan made room for the step's transients already
            return max(0, pool.budget_bytes - self.margin)
        if not pool.cuda:
            return 1 << 62
        alloc = self.allocator()
        cap = (alloc.limit_bytes if alloc is not None else 0) or torch.cuda.get_device_properties(
            pool.device
        ).total_memory
        return cap - 2 * pool.ledger.largest_entry

    def learn_margin(self) -> None:
        """The margin is the last step's spike: its true peak above the most the pool saw. Transients
        the pool cannot see (the loss, workspaces) are a property of the model, not of the target,
        so this settles in one step and does not oscillate."""
        pool = self._pool
        budget_bytes = pool.budget_bytes
        alloc = self.allocator() if budget_bytes is not None else None
        if alloc is None and pool.cuda:
            self.last_peak_bytes = self.seen_peak  # what the pool saw: PyTorch's allocator has no watermark
        if alloc is not None and budget_bytes is not None:  # (the allocator is read under a budget only)
            peak = max(self.inside_peak, alloc.take_watermark())
            self.inside_peak = 0
            if pool.clock.steps > 0:  # (as the first step opens, the mark so far is the user's, no step's)
                self.last_peak_bytes = peak
                if self.seen_peak:
                    self.last_spike = max(0, peak - self.seen_peak)
                    self.margin = min(budget_bytes, self.last_spike)
        self.seen_peak = 0
        if pool.cuda and budget_bytes is not None and not self.said_over:
            self._say_if_over(pool, alloc)

    def _say_if_over(self, pool: Any, alloc: Any) -> None:
        """Once per pool: the device went over the budget (x1.03: OVER) under the pool where the planner had
        not said that no plan fits, nor that compiled graphs cannot (their own warnings name why), and
        the step's compiled graphs were not still compiling toward it (GPT-24 compiled whole: 11.31 GiB
        over a 5.29 GiB budget in the steps before its blocks were checkpointed; the one warning was
        spent there). With PyTorch's allocator the peak is its max_memory_allocated, counted from the
        pool's first step (before it, the peak may be the user's own)."""
        compiling = pool.compiled.take_unsettled()
        if alloc is not None:
            peak = self.last_peak_bytes
        else:
            peak = torch.cuda.max_memory_allocated(pool.device)
            if self.high_before is None:
                self.high_before = peak
                return
            if peak <= self.high_before:
                return
        said = pool.plans.said_infeasible or pool.compiled.warned_unfit
        if peak <= pool.budget_bytes * OVER or said or compiling:
            return
        self.said_over = True
        why = (
            " With PyTorch's allocator the pool keeps to the budget where autograd saves a tensor;"
            " memory taken between saves (the loss, kernels' workspaces) can go over it. SUPERMEM=1"
            " (supermem's allocator) lets the pool act on every allocation."
            if alloc is None
            else " The pool could not move enough saved tensors in time."
        )
        warn(
            f"supermem pool: the device reached {format_bytes(peak)} under the pool, over its budget of"
            f" {format_bytes(pool.budget_bytes)}.{why} What the pool does not move (weights, gradients,"
            " optimizer state, tensors in use) counts against the budget too." + self.floor_said()
        )

    def floor_said(self) -> str:
        """The over-budget warning's last sentence: where nothing more could leave, if it came to that."""
        budget = self._pool.budget_bytes
        if budget is None or self.stuck_bytes <= budget:
            return ""
        return (
            f" Nothing more could leave the device at {format_bytes(self.stuck_bytes)}: under this policy"
            " the step cannot go below about that."
        )

    def marks(self) -> Callable[[], tuple[int, int]] | None:
        """With supermem's allocator and a budget: a call that returns the device's bytes allocated now
        and the most since the last call (kept in the step's peak too), for a recorded step's
        transients (Recorder.watermark)."""
        alloc = self.allocator() if self._pool.budget_bytes is not None else None
        if alloc is None:
            return None

        def marks() -> tuple[int, int]:
            high = alloc.take_watermark()
            self.inside_peak = max(self.inside_peak, high)
            return alloc.allocated_bytes, high

        return marks

    # ------------------------------------------------------------------ making room

    def fit(self) -> None:
        pool = self._pool
        if pool.budget_bytes is None:
            return
        if self.soft is None:
            self.keep()
        pool.settle()  # what finished in the background frees before the pool measures
        target = self.target()
        over = self.used_bytes() - target
        if over <= 0:
            return
        # A little below the target, so the next few saves do not each need a decision of their own.
        below = min(pool.ledger.largest_entry, target // 16)
        over += below
        # Ranked all the way down: when a treatment cannot (host memory full), the next choice frees.
        choices = self.choices(CANDIDATES)
        over = self._take(choices, over)
        if over > below and not choices:  # nothing the policy can take (a window of CANDIDATES that
            # frees too little says nothing: the next save's fit goes on; the pressure handler sees all)
            self.stuck_bytes = max(self.stuck_bytes, target + over - below)

    def room_for(self, nbytes: int, spare: list[Entry]) -> None:
        """A rebuild is about to bring `nbytes` back at once. Where no allocator asks the pool for room
        as they arrive (on CPU, or PyTorch's allocator on a GPU), entries leave first, by the policy's
        choices, until they fit the target. Only entries backward has not touched yet may leave: one it
        unpacked already is held by autograd too, so moving it frees nothing. `spare` (the replay's
        inputs) stays too. Without this a GPT-2 MLP's replay took a CPU pool at 40% of its saves to
        1.46x its budget."""
        pool = self._pool
        if pool.budget_bytes is None or self.soft is not None:
            return
        over = self.used_bytes() + nbytes - self.target()
        if over > 0:
            spared = {id(x) for x in spare}
            self._take(self.choices(None, lambda e: _untouched(e) and id(e) not in spared), over)

    def _take(self, choices: list[Choice], over: int) -> int:
        """The policy's cheapest choices leave until `over` bytes are off the device; what is left over."""
        pool = self._pool
        for c in pool.policy.choose(choices, 1 << 62, pool.ledger.tick):
            t = pool.treatments[c.treatment]
            for e in c.frees:
                if e.state is State.RESIDENT and e.tensor is not None and pool.leave(e, t):
                    over -= e.nbytes - t.device_bytes(e)  # a compressed entry keeps its payload
            if over <= 0:
                break
        return over

    def choices(self, limit: int | None = None, may: Callable[[Entry], bool] | None = None) -> list[Choice]:
        """The policy's ways to free bytes now, over the `limit` least recently used resident entries
        that one of its treatments can take (entries none can take do not use up the window), and
        `may` allows."""
        pool = self._pool
        ways = [t for t in pool.treatments.values() if t.kind in pool.policy.kinds]
        in_use = pool.ledger.in_use

        def takeable(e: Entry) -> bool:
            return (
                not any(e is x for x in in_use)
                and (may is None or may(e))
                and any(t.applies(e) for t in ways)
            )

        resident = pool.ledger.resident_entries(limit, takeable)
        out = []
        for t in ways:
            out += t.choices(pool, resident)
        return out

    def prefetch_before(self, e: Entry) -> None:
        """Prefetches the entries of the same step saved just before `e`: backward needs them next."""
        pool = self._pool
        ledger = pool.ledger
        if not ledger.away_to_fetch:
            return  # nothing to bring back: no scan (this runs at every unpack)
        room = self.target() - self.used_bytes()
        pos = bisect.bisect_left(ledger.seqs, e.seq)
        for seq in reversed(ledger.seqs[max(0, pos - PREFETCH_SCAN) : pos]):
            x = ledger.entry(seq)
            if x is None or x.step is not e.step or x.state not in (State.LEAVING, State.AWAY):
                continue
            if not x.treatment.prefetch:
                continue
            if x.nbytes > room:
                break
            room -= x.nbytes
            pool.come_back(x)
            pool.count("prefetches")
            pool.prefetched_bytes += x.nbytes

    # ------------------------------------------------------------------ the pressure handler

    def on_pressure(self, need_bytes: int) -> int:
        """The allocator is about to fail, or an allocation would take the device over the budget (its
        soft limit): entries leave, cheapest first by the policy, priced as urgent (a copy hides
        nothing now, offloads wait for theirs, so recompute wins where it is cheap), until the device
        really has `need_bytes` more free (an entry something else still references frees nothing).
        Nothing leaves while a CUDA graph is being captured: a copy or a rebuild there would break the
        capture (binomial's graphs capture inside a pooled step); the capture's pool goes over."""
        pool = self._pool
        if pool.cuda and torch.cuda.is_current_stream_capturing():
            return 0
        if pool.rest.resting:
            pool.rest.wake()  # (it holds nothing: the step goes over, its next one is the pool's)
        with pool.lock:  # the frames belong to the thread holding it (a rebuild's, maybe)
            t0 = time.perf_counter()
            pool.rebuild_times.frames.append(0.0)  # not a rebuild's own time, when one's allocation called it
            try:
                # (the pool's work inside the model's allocation: GPT-24's loss at 60% of its peak on
                # an H100 timed 18 ms in a profiled step with it, where its kernels take about 3)
                return pool.own_work(self.free_under_pressure, need_bytes)
            finally:
                pool.rebuild_times.frame_end(t0)

    def free_under_pressure(self, need_bytes: int) -> int:
        """The pressure handler's work; the caller holds the lock."""
        pool = self._pool
        pool.count("pressure_calls")
        pool.clock.left = True
        before = self.used_bytes()
        # the soft limit asks for the excess over it; a failed allocation, for its size
        soft = self.soft is not None and self.soft.in_soft_limit_call
        point = (self.soft.soft_limit_bytes if soft else before) + need_bytes  # in use once it is made
        if pool.plans.rec is not None:  # the plan's curve must hold this point too
            pool.plans.rec.pressed(point)
        for t in pool.treatments.values():
            t.settle(pool, wait=True)  # e.g. originals kept until their pack is known to fit
        # The stalest CANDIDATES first (used last in backward; pricing all ~1000 entries at each of
        # a step's dozens of calls cost more than it saved), then everything if they free too little.
        for limit in (CANDIDATES, None):
            enough = before - self.used_bytes() >= need_bytes
            if enough or self.free_by_choices(limit, before, need_bytes):
                break
        # Prefetched entries not used yet go last: they come back soonest.
        for x in pool.ledger.restoring_entries():
            if before - self.used_bytes() >= need_bytes:
                break
            if x.tensor is not None and pool.leave(x, x.treatment):
                pool.copies.wait(x.event)
        freed = max(before - self.used_bytes(), 0)
        if freed < need_bytes:  # nothing more could leave
            self.stuck_bytes = max(self.stuck_bytes, point - freed)
        return freed

    def free_by_choices(self, limit: int | None, before: int, need_bytes: int) -> bool:
        """Entries leave, the policy's cheapest choices (priced as urgent) over `limit` resident ones
        first, until `need_bytes` are free since `before`; whether they are."""
        pool = self._pool
        self.urgent = True
        try:
            choices = self.choices(limit)
        finally:
            self.urgent = False
        for c in pool.policy.choose(choices, 1 << 62, pool.ledger.tick):
            t = pool.treatments[c.treatment]
            for victim in c.frees:
                if victim.tensor is None:
                    continue  # a pressure call nested in one of these leaves (a pack's payload) took it
                if pool.leave(victim, t):
                    pool.copies.wait(victim.event)
                    t.settle(pool, wait=True)  # a pack's kept original: it must go now
            if before - self.used_bytes() >= need_bytes:
                return True
        return False


def _untouched(e: Entry) -> bool:
    """Whether backward has not touched `e` (unpacked, or brought back for its use) since its step's
    backward began."""
    began = e.step.backward_tick if e.step is not None else None
    return began is None or e.last_use <= began


def _drop_soft_limit(alloc: Any, budget: int) -> None:
    """A pool's end: its budget stops being the allocator's soft limit (unless another pool set its own)."""
    try:
        if alloc.soft_limit_bytes == budget:
            alloc.soft_limit_bytes = 0
    except Exception:  # noqa: BLE001  (interpreter shutdown)
        pass


def _weak_method(method: Any) -> Any:
    """A callable that does not keep the pool alive (the allocator holds it for the process)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        m = ref()
        return m(*args) if m is not None else 0

    return call
