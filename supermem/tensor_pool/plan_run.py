"""Running the planned policy's plan: the pool's part of `planned` (Pool inherits it).

Each pack of a recorded step (the first of its shape) goes to the Recorder (profile.py); at the step's
end a plan is made from the profile (planner.py) and cached by the shape's signature. Each pack of a
later step of that shape gets the plan's treatment for its ordinal, and the events the plan attached
to that point run: backpressure (the compute stream waits for a copy before a spike) and prefetches.
A step whose saves leave the plan's shape finds a cached plan of the new shape or is recorded again;
a planned step that still rose over the budget is planned again from its profile, lower. The state
these methods use (the plan, the cache, the recorder, the counters) is the Pool's, made in Pool.__init__.
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
from .profile import EventCounter, Profile, Recorder
from .stats import PlanStats
from .step import NO_EARLY_CALL

if TYPE_CHECKING:
    from .step import Step

REPLAN_TOLERANCE = 0.01  # a planned step this far over the budget is planned again, lower
MAX_REPLANS = 3  # per shape: a plan that keeps missing stays (the reactive fallback still acts)
MAX_PLANS = 64  # plans cached, one per shape signature


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
            hooks = torch.autograd.graph.saved_tensors_hooks(pool._pack, pool._unpack)
            hooks.__enter__()  # (it may raise: under disable_saved_tensors_hooks)
            self.hooks = hooks

    def __exit__(self, *exc: Any) -> None:
        if self.hooks is not None:
            self.hooks.__exit__(*exc)


class PlanRunner:
    """The planned policy's methods of Pool."""

    def _rests(self, outermost: bool) -> bool:
        """At the entry of the pool's context: whether the step runs without the pool's hooks, as if
        the pool were not there. So it does once a step ran a plan that moves nothing (Plan.idle) whole
        and within the budget, while the pool has seen one shape only. Without hooks it sees no save,
        so it watches what would change them: each region call must be the recorded step's call of
        that place in the step (module, argument shapes, dtypes and requires_grad: Regions._pre), and
        the model's parameters must need grad as they did; else, or at the allocator's pressure, it
        wakes for good. Running such a plan still cost the host ~100 us a region call (on an H200
        GPT-24 at 90% of its peak: 1.07x native)."""
        if self._resting:
            if outermost:
                if self._grad_flags() != self._rest_grads:
                    self._wake()  # (a frozen layer thawed: saves the plan never saw)
                    return False
                self._rest_k = 0
                self._counters["rest_steps"] += 1
            return True
        plan = self._plan
        if not outermost or self._rest_never or not self.planning or self.always_active or plan is None:
            return False
        calls = getattr(self._profiles.get(plan.signature), "calls", None)
        if not plan.idle or not calls or not self._plan_ok or self._rec is None or self._rec.full:
            return False
        with self._lock:
            s = self.clock.step
            if (
                len(self._plans) != 1
                or s is None
                or s.ordinals != len(plan.signature)
                or not self.clock.between()
            ):
                return False
            self.clock.current()  # the step ends here: measured, judged against the budget
            if self._plan is not plan or not self._plan_ok or self.budget.last_peak_bytes > self.budget_bytes:
                return False
            self._resting = True  # (this step counts in "steps", the next ones in "rest_steps")
            self._rest_calls, self._rest_k = calls, 0
            self._rest_params = [
                weakref.ref(w) for r in self.regions.roots if (m := r()) for w in m.parameters()
            ]
            self._rest_grads = self._grad_flags()
        return True

    def _grad_flags(self) -> tuple[bool, ...]:
        return tuple(w is not None and w.requires_grad for w in (r() for r in self._rest_params))

    def _note_call(self, call: tuple) -> None:
        """A region call captured: (id(module), kind), in the recorded step's sequence that a resting
        pool checks (Recorder.calls). Before the step's first save its recorder is not made yet: it
        takes those at its making (Regions.early_calls)."""
        if not self.planning:
            return
        if self.clock.between():
            self.regions.early_calls.append(call)
        elif self._rec is not None and self._rec.full:
            self._rec.calls.append(call)

    def _rest_call(self, call: tuple) -> None:
        """A region call with grad on, inside the resting pool: the step's k-th must be the recorded
        step's k-th, or its saves are not the plan's (a shape, the number of calls, a part of the
        model that now needs grad): it wakes."""
        k, self._rest_k = self._rest_k, self._rest_k + 1
        if k >= len(self._rest_calls) or self._rest_calls[k] != call:
            self._wake()

    def _wake(self) -> None:
        """The pool rests no more; this thread's context, if it rests, has its hooks on from here."""
        self._resting, self._rest_never = False, True
        self._rest_params = []
        self._counters["rest_wakes"] += 1
        stack = getattr(self._local, "stack", None)
        if stack and isinstance(stack[-1], Resting):
            stack[-1].wake(self)

    def _planned_pack(self, e: Entry) -> None:
        """Records the pack; runs the plan's treatment for it and whatever the plan set for this event."""
        rec = self._rec
        # (a storage counts once where the budget reads the allocator; the pool's own count on CPU
        # counts each save whole)
        storage = e.tensor if rec.full and self.cuda else None
        event = rec.packed(e.ordinal, e.nbytes, self.budget.used_bytes(), storage)
        # a recipe made at pack (a weight copy, an op's replay), for the plan a recording step makes
        if rec.full and e.recipe is not None and e.recipe.ready:
            # an op replay's cost by its site (measured later; the recipe itself holds this step's entries)
            cost = e.recipe.site.cost_s if isinstance(e.recipe, OpReplay) else e.recipe.cost_s(self)
            self._plan_recipe(e.recipe, [e], cost, offloadable=not isinstance(e.recipe, Cast))
        compress = self._by_kind.get("compress")
        if rec.full and compress is not None and compress.takes(e):
            # Each ReLU output priced by its own nonzeros: the share packed so far, one number for all,
            # undercounts the denser ones (after a residual add), and on this repository's CPU a
            # ResNet-152's (at width 4) first plan with packs rose 7.6% over its budget and was made
            # again lower.
            rec.compressible(e.ordinal, packed_nbytes_of(e.tensor))
        if not self._plan_ok:
            return
        if not self._plan_matches(e):
            return
        self._by_ordinal[e.ordinal] = weakref.ref(e)
        how = self._by_kind.get(self._plan.treatment.get(e.ordinal))
        if how is not None:
            if how.rebuilds and (e.recipe is None or not e.recipe.ready):
                self._plan_pending.append(weakref.ref(e))  # its call has not returned yet
            elif how.takes(e):
                self._leave(e, how)
        self._plan_events(event)

    def _lean_pack(self, t: torch.Tensor) -> Any:
        """A save of a step that runs its plan, outside any captured region, in its two common cases
        at the least host cost: a tensor the pool leaves alone (Pool._left_alone) or one the plan
        keeps (PlanKept). None for anything else and at a step's first save: the full path
        (Pool._pack_tensor) decides, by the same rules. A planned step's forward is host-bound on the
        H100 hosts: the full path's ~25 us a save added 16 ms to GPT-24's 21 ms forward."""
        if self.clock.between():
            return None  # this save starts a step
        left = self._left_alone(t)
        if left is not None:
            if self._settlers:
                with self._lock:
                    self._settle()
            return left
        step = self.clock.step
        if step.ordinals + 1 not in self._plan.lean:
            return None
        key = dedup_key(t)
        with self._lock:
            if key in self.ledger.dedup:
                return None  # saved twice: one entry (the full path)
            return self._plan_kept(t, key, step)

    def _unseen_call(self, start: int, light_ok: bool, bypass_ok: bool) -> tuple[bool, int, Any] | None:
        """Whether the region call starting now (after `start` saves) goes unseen by the pool: with
        grad off (Plan.light: True) or with the pool's hooks off (Plan.bypass: False), with the step's
        saves at its end, and the LeanCall whose hooks it runs under (Plan.drops; else None); None:
        captured as a Region, if at all. `light_ok`, `bypass_ok`: whether the call can go either way
        (regions.py)."""
        plan = self._plan
        if (
            plan is None
            or self._record_full
            or not ((light_ok and start in plan.light) or (bypass_ok and start in plan.bypass))
        ):
            return None
        with self._lock:
            if start == 0 and self.clock.between():
                self.clock.current()  # the call opens the step: it begins now, not at its first save
            plan = self._plan
            if not self._plan_ok or self._rec.full or self.clock.step.ordinals != start:
                return None
            if light_ok and start in plan.light:
                return True, plan.light[start], None
            if bypass_ok and start in plan.bypass:
                drops = plan.drops.get(start)
                return False, plan.bypass[start], LeanCall(self, drops, plan.reads[start]) if drops else None
            return None

    def _plan_captures(self) -> frozenset[int]:
        """Plan.captures of the plan this step runs (none in a recording step)."""
        plan = self._plan
        return plan.captures if plan is not None and self._plan_ok and not self._rec.full else frozenset()

    def _unseen_outputs(self, outputs: list, light: bool) -> None:
        """A call the pool did not see returned: each output it saved, which the recorded step saved
        again after it (a ResNet block's output, by the next block's first conv), is kept under its
        recorded ordinal, so that save finds it (Plan.outputs). Its bytes count here for a call run
        light (which saves nothing itself); a bypassed call's count them already."""
        with self._lock:
            step = self.clock.step
            for ordinal, k in self._plan.outputs.get(step.ordinals, ()):
                t = outputs[k] if k < len(outputs) else None
                if t is None or not self._plan_expects(ordinal, storage_extent(t) * t.element_size()):
                    continue  # (the next save leaves the plan: the entry path finds out)
                nbytes = self._plan.signature[ordinal - 1] if light else 0
                step.held.append(self._new_kept(t, ordinal, nbytes, step, dedup_key(t)))

    def _unseen_bytes(self, end: int) -> int:
        """The plan's bytes of the saves from the step's count now to `end`."""
        return sum(self._plan.signature[self.clock.step.ordinals : end])

    def _unseen_done(self, end: int, light: bool, lean: LeanCall | None) -> None:
        """A call the pool did not see returned: the step's saves skip to the plan's count at its end."""
        with self._lock:
            self.clock.step.ordinals = end
            self._counters["light_calls" if light else "bypassed_calls"] += 1
            if lean is not None:
                self._counters["lean_calls"] += 1
                self._counters["lean_drops"] += lean.dropped

    def _plan_kept(self, t: Any, key: tuple, step: Step) -> PlanKept | None:
        """The next saved tensor, which the plan keeps and no planned rebuild reads: a PlanKept, not an
        entry. None where the step leaves the plan's shape here (the entry path finds out why)."""
        ordinal = step.ordinals + 1
        nbytes = storage_extent(t) * t.element_size()
        if not self._plan_expects(ordinal, nbytes):
            return None
        step.ordinals = ordinal
        kept = self._new_kept(t, ordinal, nbytes, step, key)
        self._counters["packed"] += 1
        self._plan_events(self._rec.packed(ordinal, nbytes, self.budget.used_bytes()))
        return kept

    def _new_kept(self, t: Any, ordinal: int, nbytes: int, step: Step, key: tuple) -> PlanKept:
        """A PlanKept of `t` under `ordinal`, found by its next save, its `nbytes` in the kept count."""
        kept = PlanKept(self, t, ordinal, nbytes, step, key)
        self.ledger.dedup[key] = weakref.ref(kept)
        self.ledger.kept_bytes += nbytes
        self.ledger.kept_live += 1
        self.ledger.note_peak()
        return kept

    def _unpack_kept(self, k: PlanKept) -> Any:
        t = k.unpack()  # the version check autograd skips under hooks
        with self._lock:
            event = self._used(k)
            if event is not None and self._plan_ok:
                self._plan_events(event)
        return t

    def _release_kept(self, k: PlanKept) -> None:
        try:
            with self._lock:
                self.ledger.kept_bytes -= k.nbytes
                self.ledger.kept_live -= 1
                self._forget(k)
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    def _plan_recipe(
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
        `_planned_pack`), or wherever it becomes ready later. `start`: a region's, its step's saves
        before its call (a plan-running step captures the regions it replays by it)."""
        step, rec = self.clock.step, self._rec
        if rec is None or not rec.full:
            return
        own = [x.ordinal for x in entries if x.step is step]
        inputs = [x.ordinal for x in _recipe_inputs(recipe) if x.step is step]
        rec.recomputable(recipe, cost, own, offloadable, inputs, start, end)

    def _plan_matches(self, e: Entry) -> bool:
        """Whether this step still has the plan's shape; on a change, a cached plan of the new shape
        (the same saves so far) or none: then this step is profiled and planned at its end."""
        if self._plan_expects(e.ordinal, e.nbytes):
            return True
        seen = [*self._plan.signature[: e.ordinal - 1], e.nbytes]  # the saves before matched the plan
        for plan in self._plans.values():
            if list(plan.signature[: len(seen)]) == seen:
                self._plan = plan
                if not self._rec.full:
                    self._rec.event_of = plan.event_of
                return True
        self._plan_ok = False
        self._counters["plan_misses"] += 1
        return False

    def _plan_expects(self, ordinal: int, nbytes: int) -> bool:
        """Whether the plan's step saves `nbytes` at `ordinal` (1-based)."""
        sig = self._plan.signature
        return ordinal <= len(sig) and sig[ordinal - 1] == nbytes

    def _plan_events(self, event: int) -> None:
        plan = self._plan
        for o in plan.wait_at.get(event, ()):  # backpressure: the copy lands before the spike
            x = self._planned_entry(o)
            if x is not None and x.state is State.LEAVING and x.event is not None and not x.event.query():
                self._counters["backpressure_waits"] += 1
                self.copies.wait(x.event)
        for o in plan.prefetch_at.get(event, ()):
            x = self._planned_entry(o)
            if x is not None and x.state in (State.LEAVING, State.AWAY) and x.treatment.prefetch:
                self._come_back(x)
                self._counters["prefetches"] += 1
                self._prefetched_bytes += x.nbytes

    def _planned_entry(self, ordinal: int) -> Entry | None:
        ref = self._by_ordinal.get(ordinal)
        return ref() if ref is not None else None

    def _step_opened(self) -> None:
        """A step opened (StepClock.current): under the planned policy, what records it or counts its
        events."""
        if self.planning and self.budget_bytes is not None:
            self._plan_ok = self._plan is not None
            if self._plan_ok and not self._record_full:
                # a plan runs: its events only (and its first step's tail timed)
                self._rec = EventCounter(self._plan.event_of, self._tail_from(), self.cuda)
            else:
                self._rec = Recorder(self.cuda, timed=not self._plan_ok, watermark=self.budget.marks())
                self._rec.calls = self.regions.early_calls  # (made before the step's first save)
            self.regions.early_calls = []
            self._rec.regions_on = self.regions.phase != "profiling"  # ("off": a pool without them)
            self._by_ordinal = {}
            self._plan_pending = []

    def _step_ended(self, s: Step) -> None:
        """Measures the step; plans from it if it ran without a plan of its shape."""
        self._last_step_s = time.perf_counter() - s.started_s
        if not self.cuda:
            self.budget.last_peak_bytes = self.ledger.step_peak
        self.ledger.step_peak = 0
        rec, self._rec = self._rec, None
        if rec is None or rec.backward_event is None:
            return
        if self._plan_ok:
            tail_s = rec.tail() if isinstance(rec, EventCounter) else None
            if tail_s is not None:
                self._retime_tail(tail_s)
            if s.early_plan is NO_EARLY_CALL or s.early_plan is None or s.early_plan is self._plan:
                # (a step whose first call an older plan decided, before this one was made at the
                # step's opening, ran this plan but for that call: not this plan's peak. The first
                # planned step's first call, captured as the recording steps' were, runs near its plan)
                self._check_plan(self._plan)
            return
        if not rec.full:  # it left its plan's shape, and only counted events: the next steps record
            self._record_full = True
            return
        if not rec.regions_on:
            return
        offload, compress = self._by_kind.get("offload"), self._by_kind.get("compress")
        if offload:
            offload.probe(self)
        profile = rec.profile(
            self.budget.last_spike,
            offload.rate(self) if offload else 1.0,
            sync_copies=not self.cuda,
            host_s=self.rebuild_times.cost_s,
            host_copy_s=self.copies.issue_s(),
            compress_price=compress.price(self) if compress else None,
        )
        if offload is None:  # a pool without the treatment: the plan must not count on copies
            for s in profile.saved:
                s.offloadable = False
        self._record_full = False
        self._profiles[profile.signature] = profile
        self._plan_from(profile)

    def _tail_from(self) -> int | None:
        """The event after which a planned step times its tail: the profile's last, until one has
        (Profile.tail_s)."""
        profile = self._profiles.get(self._plan.signature)
        return None if profile is None or profile.retimed else len(profile.times_s) - 1

    def _retime_tail(self, tail_s: float) -> None:
        """The profile's tail and the plan's step as a planned step timed it: a process's first step
        (the profiled one, often) pays first-time costs there that no later step does."""
        profile = self._profiles.get(self._plan.signature)
        if profile is None or profile.retimed:
            return
        added = tail_s - profile.tail_s
        profile.tail_s, profile.step_s, profile.retimed = tail_s, profile.step_s + added, True
        self._plan.untreated_step_s += added
        self._plan.predicted_step_s += added

    def _plan_from(self, profile: Profile) -> None:
        """The plan of `profile`'s shape, below the budget by what its plans overshot; cached."""
        sig = profile.signature
        with label("plan"):
            self._plan = self.policy.solve(profile, max(0, self.budget_bytes - self._plan_aim.get(sig, 0)))
        if not self._plan.feasible and sig not in self._said_infeasible:
            self._said_infeasible.add(sig)
            warn(infeasible_message(self._plan, profile, self.budget_bytes))
        self._plans[sig] = self._plan
        if len(self._plans) > MAX_PLANS:  # shapes that keep changing: the oldest plan goes
            oldest = next(iter(self._plans))
            del self._plans[oldest]
            self._profiles.pop(oldest, None)
        self._counters["plans"] += 1

    def _check_plan(self, plan: Plan) -> None:
        """A step that ran a feasible plan and still rose over the budget (a transient that fell
        elsewhere than the profile put it, a cost that changed): the shape is planned again from its
        profile, below the budget by the overshoot, a few times at most. Not profiled again: a
        profiled step runs the reactive fallback (GPT-24 at 60% on an H100: 270 ms a step against 90
        planned), and its profile, timed anew, need not bring the plan any nearer."""
        over = self.budget.last_peak_bytes - self.budget_bytes
        sig = plan.signature
        if not plan.feasible or over <= REPLAN_TOLERANCE * self.budget_bytes:
            return
        if self._replans.get(sig, 0) >= MAX_REPLANS or sig not in self._profiles:
            return
        self._replans[sig] = self._replans.get(sig, 0) + 1
        self._plan_aim[sig] = self._plan_aim.get(sig, 0) + over
        self._counters["replans"] += 1
        self._plan_from(self._profiles[sig])

    def _plan_stats(self) -> PlanStats | None:
        """The current plan's predictions beside the last step's measurements (planned policy)."""
        p = self._plan
        if p is None:
            return None
        return {
            **p.counts(),
            "feasible": p.feasible,
            "budget_bytes": p.budget_bytes,
            "predicted_peak_bytes": p.predicted_peak_bytes,
            "measured_peak_bytes": self.budget.last_peak_bytes,
            "predicted_step_s": p.predicted_step_s,
            "measured_step_s": self._last_step_s,
            "plan_s": p.plan_s,
            "added_s": p.added_s,
            "untreated_peak_bytes": p.untreated_peak_bytes,
            "untreated_step_s": p.untreated_step_s,
            "plans_cached": len(self._plans),
            "resting": self._resting,  # its steps run without the pool (_rests), unmeasured
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
