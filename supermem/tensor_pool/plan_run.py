"""Running the planned policy's plan: the pool's part of `planned` (Pool.plans, a PlanRunner).

Each pack of a recorded step (the first of its shape) goes to the Recorder (profile.py); at the step's
end a plan is made from the profile (planner/) and cached by the shape's signature. Each pack of a
later step of that shape gets the plan's treatment for its ordinal, and the events the plan attached
to that point run: backpressure (the host waits for a copy to land before a spike) and prefetches.
A step whose saves leave the plan's shape finds a cached plan of the new shape or is recorded again;
a planned step that still rose over the budget is planned again from its profile, lower. The runner
holds the plans, the cache and the step's recorder; the entries, the budget, the step
clock and the counters it reaches through the pool that owns it.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from .. import torch_private as tp
from ..compress import packed_nbytes_of
from ..log import warn
from ..units import format_bytes
from .cast import Cast
from .entry import Entry, PlanKept, State, dedup_key, storage_extent
from .labels import label
from .lean_call import LeanCall
from .op_replay import OpReplay
from .planner import Plan
from .port import PoolOwner, owner
from .profile import EventCounter, Profile, Recorder
from .stats import PlanStats
from .step import NO_EARLY_CALL

if TYPE_CHECKING:
    from .step import Step

REPLAN_TOLERANCE = 0.01  # a planned step this far over the budget is planned again, lower
MAX_REPLANS = 3  # per shape: a plan that keeps missing stays (the reactive fallback still acts)
MAX_PLANS = 64  # plans cached, one per shape signature


class PlanRunner:
    """The planned policy's part of the pool (Pool.plans): the plans by shape and the step's recorder;
    it holds the pool weakly (the pool owns it) and reaches it for the rest."""

    def __init__(self, pool: PoolOwner) -> None:
        self._pool_ref = weakref.ref(pool)
        self.cached: dict[tuple[int, ...], Plan] = {}  # by shape signature (bytes per saved tensor)
        self.plan: Plan | None = None  # the plan this step runs (or the last one made)
        self.plan_ok = False  # this step matches the plan so far
        self.rec: Recorder | EventCounter | None = None  # this step's timeline (planned policy)
        self.record_full = False  # a step left its plan's shape: record in full until one is planned
        self.by_ordinal: dict[int, weakref.ref[Entry]] = {}  # this step's entries, for the plan
        self.pending: list[weakref.ref[Entry]] = []  # planned for recompute, their call still running
        self.aim: dict[tuple[int, ...], int] = {}  # by signature: plan this far below the budget
        self.replans: dict[tuple[int, ...], int] = {}  # by signature: plans that overshot
        self.said_infeasible: set[tuple[int, ...]] = set()  # signatures whose budget no plan met (said once)
        self.profiles: dict[tuple[int, ...], Any] = {}  # by signature: the profile its plans come from
        self.last_step_s = 0.0  # the last step's measured duration (host clock)
        self.stale = False  # compiled graphs compiled again since the plans were made (graphs_changed)
        self._compiles_at_open: int | None = None  # compiles begun when the step opened (tp.compiles)

    @property
    def _pool(self) -> PoolOwner:
        return owner(self._pool_ref)

    @property
    def running(self) -> Plan:
        """The plan this step runs, read where `plan_ok` holds (it is set only where a plan was made)."""
        if self.plan is None:
            raise RuntimeError("supermem pool: a step runs a plan, and none was made")
        return self.plan

    @property
    def timeline(self) -> Recorder | EventCounter:
        """This step's recorder or event counter, read inside a step under the planned policy (made at
        its opening, step_opened)."""
        if self.rec is None:
            raise RuntimeError("supermem pool: a step under the planned policy has no timeline")
        return self.rec

    def note_call(self, call: tuple) -> None:
        """A region call captured: (id(module), kind), in the recorded step's sequence that a resting
        pool checks (Recorder.calls). Before the step's first save its recorder is not made yet: it
        takes those at its making (Regions.early_calls)."""
        pool = self._pool
        if not pool.planning:
            return
        if pool.clock.between():
            pool.regions.early_calls.append(call)
        elif self.rec is not None and self.rec.full:
            self.rec.calls.append(call)

    def planned_pack(self, e: Entry) -> None:
        """Records the pack; runs the plan's treatment for it and whatever the plan set for this event."""
        pool = self._pool
        rec = self.timeline
        # (a storage counts once where the budget reads the allocator; the pool's own count on CPU
        # counts each save whole)
        storage = e.tensor if rec.full and pool.cuda else None
        event = rec.packed(e.ordinal, e.nbytes, pool.budget.used_bytes(), storage)
        # a recipe made at pack (a weight copy, an op's replay), for the plan a recording step makes
        if rec.full and e.recipe is not None and e.recipe.ready:
            # an op replay's cost by its site (measured later; the recipe itself holds this step's entries)
            cost = e.recipe.site.cost_s if isinstance(e.recipe, OpReplay) else e.recipe.cost_s(pool)
            self.note_recipe(e.recipe, [e], cost, offloadable=not isinstance(e.recipe, Cast))
        compress = pool.by_kind.get("compress")
        if rec.full and compress is not None and compress.takes(e):
            # Each ReLU output priced by its own nonzeros: the share packed so far, one number for all,
            # undercounts the denser ones (after a residual add), and on this repository's CPU a
            # ResNet-152's (at width 4) first plan with packs rose 7.6% over its budget and was made
            # again lower.
            rec.compressible(e.ordinal, packed_nbytes_of(e.device_tensor))
        if not self.plan_ok:
            return
        if not self.matches(e):
            return
        self.by_ordinal[e.ordinal] = weakref.ref(e)
        how = pool.by_kind.get(self.running.treatment.get(e.ordinal, ""))  # ("": kept)
        if how is not None:
            if how.rebuilds and (e.recipe is None or not e.recipe.ready):
                self.pending.append(weakref.ref(e))  # its call has not returned yet
            elif how.takes(e):
                pool.leave(e, how)
        self.run_events(event)

    def lean_pack(self, t: torch.Tensor) -> Any:
        """A save of a step that runs its plan, outside any captured region, in its two common cases
        at the least host cost: a tensor the pool leaves alone (Pool.left_alone) or one the plan
        keeps (PlanKept). None for anything else and at a step's first save: the full path
        (Pool.pack_tensor) decides, by the same rules. A planned step's forward is host-bound on the
        H100 hosts: the full path's ~25 us a save added 16 ms to GPT-24's 21 ms forward."""
        pool = self._pool
        if pool.clock.between():
            return None  # this save starts a step
        left = pool.left_alone(t)
        if left is not None:
            if pool.settlers:
                with pool.lock:
                    pool.settle()
            return left
        step = pool.clock.step
        if step.ordinals + 1 not in self.running.lean:
            return None
        key = dedup_key(t)
        with pool.lock:
            if key in pool.ledger.dedup:
                return None  # saved twice: one entry (the full path)
            return self.keep(t, key, step)

    def unseen_call(self, start: int, light_ok: bool, bypass_ok: bool) -> tuple[bool, int, Any] | None:
        """Whether the region call starting now (after `start` saves) goes unseen by the pool: with
        grad off (Plan.light: True) or with the pool's hooks off (Plan.bypass: False), with the step's
        saves at its end, and the LeanCall whose hooks it runs under (Plan.drops; else None); None:
        captured as a Region, if at all. `light_ok`, `bypass_ok`: whether the call can go either way
        (regions.py)."""
        pool = self._pool
        plan = self.plan
        if (
            plan is None
            or self.record_full
            or not ((light_ok and start in plan.light) or (bypass_ok and start in plan.bypass))
        ):
            return None
        with pool.lock:
            if start == 0 and pool.clock.between():
                pool.clock.current()  # the call opens the step: it begins now, not at its first save
            if not self.plan_ok or self.timeline.full or pool.clock.step.ordinals != start:
                return None
            plan = self.running  # (the step's opening just now may have made another)
            if light_ok and start in plan.light:
                return True, plan.light[start], None
            if bypass_ok and start in plan.bypass:
                drops = plan.drops.get(start)
                return False, plan.bypass[start], LeanCall(pool, drops, plan.reads[start]) if drops else None
            return None

    def captures(self) -> frozenset[int]:
        """Plan.captures of the plan this step runs (none in a recording step)."""
        plan = self.plan
        return plan.captures if plan is not None and self.plan_ok and not self.timeline.full else frozenset()

    def unseen_outputs(self, outputs: list, light: bool) -> None:
        """A call the pool did not see returned: each output it saved, which the recorded step saved
        again after it (a ResNet block's output, by the next block's first conv), is kept under its
        recorded ordinal, so that save finds it (Plan.outputs). Its bytes count here for a call run
        light (which saves nothing itself); a bypassed call's count them already."""
        pool = self._pool
        with pool.lock:
            step, plan = pool.clock.step, self.running
            for ordinal, k in plan.outputs.get(step.ordinals, ()):
                t = outputs[k] if k < len(outputs) else None
                if t is None or not self.expects(ordinal, storage_extent(t) * t.element_size()):
                    continue  # (the next save leaves the plan: the entry path finds out)
                nbytes = plan.signature[ordinal - 1] if light else 0
                step.held.append(self.new_kept(t, ordinal, nbytes, step, dedup_key(t)))

    def unseen_bytes(self, end: int) -> int:
        """The plan's bytes of the saves from the step's count now to `end`."""
        pool = self._pool
        return sum(self.running.signature[pool.clock.step.ordinals : end])

    def unseen_done(self, end: int, light: bool, lean: LeanCall | None) -> None:
        """A call the pool did not see returned: the step's saves skip to the plan's count at its end."""
        pool = self._pool
        with pool.lock:
            pool.clock.step.ordinals = end
            pool.count("light_calls" if light else "bypassed_calls")
            if lean is not None:
                pool.count("lean_calls")
                pool.count("lean_drops", lean.dropped)

    def keep(self, t: Any, key: tuple, step: Step) -> PlanKept | None:
        """The next saved tensor, which the plan keeps and no planned rebuild reads: a PlanKept, not an
        entry. None where the step leaves the plan's shape here (the entry path finds out why)."""
        pool = self._pool
        ordinal = step.ordinals + 1
        nbytes = storage_extent(t) * t.element_size()
        if not self.expects(ordinal, nbytes):
            return None
        step.ordinals = ordinal
        kept = self.new_kept(t, ordinal, nbytes, step, key)
        pool.count("packed")
        self.run_events(self.timeline.packed(ordinal, nbytes, pool.budget.used_bytes()))
        return kept

    def new_kept(self, t: Any, ordinal: int, nbytes: int, step: Step, key: tuple) -> PlanKept:
        """A PlanKept of `t` under `ordinal`, found by its next save, its `nbytes` in the kept count."""
        pool = self._pool
        kept = PlanKept(pool, t, ordinal, nbytes, step, key)
        pool.ledger.dedup[key] = weakref.ref(kept)
        pool.ledger.kept_bytes += nbytes
        pool.ledger.kept_live += 1
        pool.ledger.note_peak()
        return kept

    def unpack_kept(self, k: PlanKept) -> Any:
        pool = self._pool
        t = k.unpack()  # the version check autograd skips under hooks
        with pool.lock:
            event = self.used(k)
            if event is not None and self.plan_ok:
                self.run_events(event)
        return t

    def used(self, x: Entry | PlanKept) -> int | None:
        """Backward unpacked `x` (under the pool's lock): its step's backward began, and its first use
        is an event of the step being recorded or run by a plan (None for a later use)."""
        pool = self._pool
        pool.clock.unpacked(x.step)
        if self.rec is None or x.step is not pool.clock.step:
            return None
        return self.rec.used(x.ordinal, pool.budget.used_bytes())

    def forget(self, x: Entry | PlanKept) -> None:
        """`x` died (under the pool's lock): its dedup key goes (unless a newer save holds it) and the
        step being recorded notes its end."""
        pool = self._pool
        pool.ledger.forget(x)
        if self.rec is not None and x.step is pool.clock.step:
            self.rec.died(x.ordinal)

    def release_kept(self, k: PlanKept) -> None:
        try:
            pool = self._pool
            with pool.lock:
                pool.ledger.kept_bytes -= k.nbytes
                pool.ledger.kept_live -= 1
                self.forget(k)
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    def region_done(self, region: Any, outputs: list | None) -> None:
        """A region's call returned (under the lock): a recorded step notes its outputs, places and
        recipe; entries the plan drops whose call was still running leave now."""
        pool = self._pool
        if self.rec is not None and self.rec.full and region is not None:
            self.rec.call_outputs[region.start] = self.own_outputs(region.start, outputs or [])
            self.rec.call_slots[region.start] = region.places
            own = [
                x
                for ref in region.slots
                if ref is not None and (x := ref()) is not None and x.recipe is region
            ]
            regions, module = pool.regions, region.module
            self.note_recipe(
                region, own, lambda: regions.cost_s(module), start=region.start, end=pool.clock.step.ordinals
            )
        if self.pending:
            still = []
            for ref in self.pending:
                x = ref()
                if x is None or x.recipe is None or x.state is not State.RESIDENT:
                    continue
                if x.recipe.ready:
                    pool.leave(x, pool.by_kind["recompute"])
                else:
                    still.append(ref)
            self.pending = still

    def own_outputs(self, start: int, outputs: list) -> tuple[tuple[int, int], ...]:
        """(ordinal, index among `outputs`) of each output tensor the call starting after `start` saves
        saved itself (Profile.call_outputs)."""
        ledger = self._pool.ledger
        out = []
        for k, t in enumerate(outputs):
            e = ledger.saved(dedup_key(t))
            if e is not None and e.source() is t and getattr(e, "ordinal", 0) > start:
                out.append((e.ordinal, k))
        return tuple(out)

    def note_recipe(
        self,
        recipe: Any,
        entries: list[Entry],
        cost: Any,
        offloadable: bool = True,
        start: int | None = None,
        end: int | None = None,
    ) -> None:
        """Tells the step being recorded (planned policy; else nothing) that `recipe` can rebuild
        `entries` from now on, for `cost` seconds (or a call that measures them once the plan is made:
        it must not hold entries), reading the entries `_recipe_inputs` names. The one call a new kind
        of recipe needs to be weighed by the planner: at the pack of a recipe ready then (done here, in
        `planned_pack`), or wherever it becomes ready later. `start`: a region's, its step's saves
        before its call (a plan-running step captures the regions it replays by it)."""
        pool = self._pool
        step, rec = pool.clock.step, self.rec
        if rec is None or not rec.full:
            return
        own = [x.ordinal for x in entries if x.step is step]
        inputs = [x.ordinal for x in _recipe_inputs(recipe) if x.step is step]
        rec.recomputable(recipe, cost, own, offloadable, inputs, start, end)

    def matches(self, e: Entry) -> bool:
        """Whether this step still has the plan's shape; on a change, a cached plan of the new shape
        (the same saves so far) or none: then this step is profiled and planned at its end."""
        pool = self._pool
        if self.expects(e.ordinal, e.nbytes):
            return True
        seen = [*self.running.signature[: e.ordinal - 1], e.nbytes]  # the saves before matched the plan
        for plan in self.cached.values():
            if list(plan.signature[: len(seen)]) == seen:
                self.plan = plan
                rec = self.timeline
                if not rec.full:
                    rec.event_of = plan.event_of
                return True
        self.plan_ok = False
        pool.count("plan_misses")
        return False

    def expects(self, ordinal: int, nbytes: int) -> bool:
        """Whether the plan's step saves `nbytes` at `ordinal` (1-based)."""
        sig = self.running.signature
        return ordinal <= len(sig) and sig[ordinal - 1] == nbytes

    def run_events(self, event: int) -> None:
        pool, plan = self._pool, self.running
        for o in plan.wait_at.get(event, ()):  # backpressure: the copy lands before the spike
            x = self.planned_entry(o)
            if x is not None and x.state is State.LEAVING and x.event is not None and not x.event.query():
                pool.count("backpressure_waits")
                pool.copies.wait(x.event)
        for o in plan.prefetch_at.get(event, ()):
            x = self.planned_entry(o)
            if x is not None and x.state in (State.LEAVING, State.AWAY) and x.left_by.prefetch:
                pool.come_back(x)
                pool.count("prefetches")
                pool.prefetched_bytes += x.nbytes

    def planned_entry(self, ordinal: int) -> Entry | None:
        ref = self.by_ordinal.get(ordinal)
        return ref() if ref is not None else None

    def step_opened(self) -> None:
        """A step opened (StepClock.current): under the planned policy, what records it or counts its
        events."""
        pool = self._pool
        self.forget_if_stale()
        if pool.planning and pool.budget_bytes is not None:
            self._compiles_at_open = tp.compiles()
            plan = self.plan
            self.plan_ok = plan is not None
            if plan is not None and not self.record_full:
                # a plan runs: its events only (and its first step's tail timed)
                self.rec = EventCounter(plan.event_of, self.tail_from(plan), pool.cuda)
            else:
                self.rec = Recorder(pool.cuda, timed=not self.plan_ok, watermark=pool.budget.marks())
                self.rec.calls = pool.regions.early_calls  # (made before the step's first save)
            pool.regions.early_calls = []
            self.rec.regions_on = pool.regions.phase != "profiling"  # ("off": a pool without them)
            self.by_ordinal = {}
            self.pending = []

    def step_ended(self, s: Step) -> None:
        """Measures the step; plans from it if it ran without a plan of its shape."""
        pool = self._pool
        self.last_step_s = time.perf_counter() - s.started_s
        if not pool.cuda:
            pool.budget.last_peak_bytes = pool.ledger.step_peak
        pool.ledger.step_peak = 0
        rec, self.rec = self.rec, None
        budget_bytes = pool.budget_bytes
        if rec is None or rec.backward_event is None or budget_bytes is None:  # (a budget makes a rec)
            return
        if self.stale or tp.compiles() != self._compiles_at_open:
            # the compiler ran in it (its seconds and bytes the compiler's: GPT-24 on an H200 made a
            # plan of a 22 s step), or its graphs have compiled again since: neither measured nor
            # planned from; the next step records again
            return
        if self.plan_ok:
            tail_s = rec.tail() if isinstance(rec, EventCounter) else None
            if tail_s is not None:
                self.retime_tail(tail_s)
            self.say_if_infeasible(self.running, budget_bytes)
            if s.early_plan is NO_EARLY_CALL or s.early_plan is None or s.early_plan is self.plan:
                # (a step whose first call an older plan decided, before this one was made at the
                # step's opening, ran this plan but for that call: not this plan's peak. The first
                # planned step's first call, captured as the recording steps' were, runs near its plan)
                self.check_plan(self.running, budget_bytes)
            return
        if not rec.full:  # it left its plan's shape, and only counted events: the next steps record
            self.record_full = True
            return
        if not rec.regions_on:
            return
        offload, compress = pool.by_kind.get("offload"), pool.by_kind.get("compress")
        if offload:
            offload.probe(pool)
        profile = rec.profile(
            pool.budget.last_spike,
            offload.rate(pool) if offload else 1.0,
            sync_copies=not pool.cuda,
            host_s=pool.rebuild_times.cost_s,
            host_copy_s=pool.copies.issue_s(),
            compress_price=compress.price(pool) if compress else None,
        )
        if offload is None:  # a pool without the treatment: the plan must not count on copies
            for saved in profile.saved:
                saved.offloadable = False
        self.record_full = False
        self.profiles[profile.signature] = profile
        self.plan_from(profile, budget_bytes)

    def graphs_changed(self) -> None:
        """Compiled graphs compile again (compiled.py): the plans were made beside their old peak, and go
        before the next step opens (forget_if_stale)."""
        self.stale = True

    def forget_if_stale(self) -> None:
        """Between steps, where graphs changed: every plan and profile dropped, and the last step's
        recorder with them (it ran beside the old graphs); the next step records its shape anew. A shape
        said infeasible stays said."""
        if not self.stale:
            return
        self.stale = False
        self.cached.clear()
        self.profiles.clear()
        self.aim.clear()
        self.replans.clear()
        self.plan = None
        self.plan_ok = False
        self.rec = None
        self.record_full = False

    def tail_from(self, plan: Plan) -> int | None:
        """The event after which a step running `plan` times its tail: the profile's last, until one
        has (Profile.tail_s)."""
        profile = self.profiles.get(plan.signature)
        return None if profile is None or profile.retimed else len(profile.times_s) - 1

    def retime_tail(self, tail_s: float) -> None:
        """The profile's tail and the plan's step as a planned step timed it: a process's first step
        (the profiled one, often) pays first-time costs there that no later step does."""
        plan = self.running
        profile = self.profiles.get(plan.signature)
        if profile is None or profile.retimed:
            return
        added = tail_s - profile.tail_s
        profile.tail_s, profile.step_s, profile.retimed = tail_s, profile.step_s + added, True
        plan.untreated_step_s += added
        plan.predicted_step_s += added

    def plan_from(self, profile: Profile, budget_bytes: int) -> None:
        """The plan of `profile`'s shape, below the pool's budget by what its plans overshot; cached."""
        pool = self._pool
        sig = profile.signature
        with label("plan", nvtx=pool.nvtx):
            plan: Plan = pool.policy.solve(profile, max(0, budget_bytes - self.aim.get(sig, 0)))
        self.plan = plan
        self.cached[sig] = plan
        if len(self.cached) > MAX_PLANS:  # shapes that keep changing: the oldest plan goes
            oldest = next(iter(self.cached))
            del self.cached[oldest]
            self.profiles.pop(oldest, None)
        pool.count("plans")
        self.say_if_infeasible(plan, budget_bytes)

    def say_if_infeasible(self, plan: Plan, budget_bytes: int) -> None:
        """Once per shape, that no plan meets the budget; not while compiled graphs compile toward it
        (their peak is about to change: GPT-24 compiled whole read 11.08 GiB beside its first graphs, 4.89
        once their blocks were checkpointed), but at a step that runs the plan once they settled."""
        sig = plan.signature
        profile = self.profiles.get(sig)
        if plan.feasible or sig in self.said_infeasible or profile is None or self._pool.compiled.settling:
            return
        self.said_infeasible.add(sig)
        warn(infeasible_message(plan, profile, budget_bytes))

    def check_plan(self, plan: Plan, budget_bytes: int) -> None:
        """A step that ran a feasible plan and still rose over the budget (a transient that fell
        elsewhere than the profile put it, a cost that changed): the shape is planned again from its
        profile, below the budget by the overshoot, a few times at most. Not profiled again: a
        profiled step runs the reactive fallback (GPT-24 at 60% on an H100: 270 ms a step against 90
        planned), and its profile, timed anew, need not bring the plan any nearer."""
        pool = self._pool
        over = pool.budget.last_peak_bytes - budget_bytes
        sig = plan.signature
        if not plan.feasible or over <= REPLAN_TOLERANCE * budget_bytes:
            return
        if self.replans.get(sig, 0) >= MAX_REPLANS or sig not in self.profiles:
            return
        self.replans[sig] = self.replans.get(sig, 0) + 1
        self.aim[sig] = self.aim.get(sig, 0) + over
        pool.count("replans")
        self.plan_from(self.profiles[sig], budget_bytes)

    def stats(self) -> PlanStats | None:
        """The current plan's predictions beside the last step's measurements (planned policy)."""
        pool = self._pool
        p = self.plan
        if p is None:
            return None
        return {
            **p.counts(),
            "feasible": p.feasible,
            "budget_bytes": p.budget_bytes,
            "predicted_peak_bytes": p.predicted_peak_bytes,
            "measured_peak_bytes": pool.budget.last_peak_bytes,
            "predicted_step_s": p.predicted_step_s,
            "measured_step_s": self.last_step_s,
            "plan_s": p.plan_s,
            "added_s": p.added_s,
            "untreated_peak_bytes": p.untreated_peak_bytes,
            "untreated_step_s": p.untreated_step_s,
            "plans_cached": len(self.cached),
            "resting": pool.rest.resting,  # its steps run without the pool (rest.py), unmeasured
        }


def infeasible_message(plan: Plan, profile: Profile, budget: int) -> str:
    """What a user is told once a shape's budget is below every plan: the lowest one reaches, and how
    much of it at that point is the step's own temporaries, which no treatment of saved tensors frees."""
    peak = max(range(len(plan.curve)), key=plan.curve.__getitem__, default=None)
    temporaries = profile.transient_bytes[peak] if peak is not None else 0
    why = ""
    if temporaries > 0:
        why = (
            f" At that point {format_bytes(temporaries)} are the step's own temporaries, which no treatment"
            " of saved tensors frees (in a language model most often its loss: supermem.linear_cross_entropy"
            " takes it a chunk of rows at a time)."
        )
    return (
        f"supermem pool: no plan keeps this step under its budget of {format_bytes(budget)}: the lowest"
        f" one reaches is {format_bytes(plan.predicted_peak_bytes)}. Below that the pool's fallback moves"
        f" what it can as the step runs, slowly.{why}"
    )


def _recipe_inputs(recipe: Any) -> list[Entry]:
    """The entries a recipe's rebuild reads: its `input_entries()` when it has one, else the entries
    behind a region's packed arguments (a weight copy reads a parameter: none)."""
    if isinstance(recipe, Cast):
        return []  # reads its parameter only (and is a step's most common recipe: no tree walk)
    get = getattr(recipe, "input_entries", None)
    if get is not None:
        return [x for x in get() if isinstance(x, Entry)]
    out: list[Entry] = []
    tp.tree_map(
        lambda x: out.append(x.packed) if isinstance(getattr(x, "packed", None), Entry) else None,
        getattr(recipe, "args", None),
    )
    return out
