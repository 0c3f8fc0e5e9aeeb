"""The planner: from one profiled step, keep / offload / recompute for every saved tensor.

The simulator replays the profile's timeline with a set of treatments and prices them in seconds the
step loses:
- a recomputed unit's members are off from the unit's end until the unit is replayed, at the first use
  of any of them. It costs the unit's measured seconds. A member that another region's replay reads (a
  ResNet block's output is the next block's input) is never dropped by the plan: recomputing a chain
  of such units would replay all of them at the first replay in backward. A region's member that an
  op replay reads may be (the op replay replays the region first, one call). A region's replay brings
  back every member of the other units its call made (an op replay's, a weight cast's) that is away
  then: those cost nothing more.
- an offloaded tensor is off from the event its copy lands until its prefetch is issued. Copies to the
  host go one after another on one stream at the link rate, from each save; where the plan needs a copy
  to have landed (before the point it was chosen to lower) and it has not, compute waits: those seconds
  are exposed. Prefetches go one after another on the other stream, issued from backward progress as
  late as lets each land before it is needed (its first use, or the replay of a recomputed unit that
  reads it), never before backward, never before the copy out landed, never where the curve is over
  the budget (a prefetch must not raise the peak); what does not land by then is exposed. Copies
  beside compute slow it by costs.COPY_INTERFERENCE of their seconds, each way, or cost the host its seconds
  to issue one (Profile.host_copy_s), whichever is more. On CPU copies are synchronous: both ways
  exposed.
- a unit's measured seconds are the larger of its device seconds and its rebuild's own host seconds
  (Recorder.profile): where the host is the slower side (a GPT-24 step on the H100 hosts), a weight
  cast's one launch costs ten times its kernel, and a block replay is the cheapest per byte.
- a non-region unit inner to a region call (its members and what its rebuild reads are all saves of
  that call, none an output of it: a GELU's output, BatchNorm + ReLU, a weight's autocast copy) costs
  its lean price (Profile.unit_lean_s) while nothing else treats the call's saves: the call then runs
  lean (lean_call.py, Plan.drops), and treating the unit does not cost the call's kept saves the
  pool's price, but a lean call's hooks on each of them (costs.LEAN_KEPT_SHARE of it), once per call.

The greedy: while the simulated curve is over the budget somewhere, take its highest point and, among
the treatments that lower it, apply the one with the least added seconds per byte freed there, added
seconds measured by simulating the plan with it (so an offload that delays the copies queued behind it,
or that cannot come back in time, pays for that). Offloads are considered only for tensors saved in the
forward whose copy can land before that point; only where nothing else lowers it, a copy that lands
later, compute waiting for it before the point (backpressure: priced as exposed). Decisions are never
undone, so it ends after at most one step per tensor. If nothing lowers the highest point, the plan
says it is infeasible and the pool's reactive fallback does what it can.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from .. import costs
from .profile import Profile, Saved

EXACT_TRIES = 4  # candidates simulated per decision, cheapest lower bound first (late copies: 1)


@dataclass
class Plan:
    signature: tuple[int, ...]
    budget_bytes: int
    treatment: dict[int, str] = field(default_factory=dict)  # ordinal -> "offload" | "recompute" | "compress"
    lean: frozenset[int] = frozenset()  # kept, and no planned rebuild reads them: no entry needed
    region_starts: frozenset[int] = frozenset()  # the regions it replays, by the step's saves before them
    # region calls whose recording's capture made a save of the step (Profile.capture_made): captured
    # in every step it runs, which makes that save too, or the step's ordinals would skip it
    captures: frozenset[int] = frozenset()
    # regions it replays whole by checkpoint: the step's saves before the call -> at its end (light())
    light: dict[int, int] = field(default_factory=dict)
    # region calls whose saves it all keeps: run with the pool's hooks off (bypass()), same keys
    bypass: dict[int, int] = field(default_factory=dict)
    # of those calls, the outputs they save that are saved again after them: Profile.call_outputs
    outputs: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    # of those calls, the ones run lean (lean_call.py): call -> its save number -> the ordinal it drops,
    # and call -> the save numbers of what those rebuilds read
    drops: dict[int, dict[int, int]] = field(default_factory=dict)
    reads: dict[int, frozenset[int]] = field(default_factory=dict)
    event_of: dict[tuple[str, int], int] = field(default_factory=dict)  # ("p"|"u", ordinal) -> event
    prefetch_at: dict[int, list[int]] = field(default_factory=dict)  # event -> ordinals to bring back
    wait_at: dict[int, list[int]] = field(default_factory=dict)  # event -> copies that must have landed
    predicted_peak_bytes: int = 0
    predicted_step_s: float = 0.0
    added_s: float = 0.0
    feasible: bool = True
    plan_s: float = 0.0
    curve: list[int] = field(default_factory=list)  # per event of the profiled step: the bytes predicted
    untreated_peak_bytes: int = 0  # the profiled step's curve with nothing treated, the spike included
    untreated_step_s: float = 0.0  # the profiled step's seconds without the pool's own (Recorder.pause)

    def captured(self, start: int) -> bool:
        """Whether a step running it captures the region call after `start` saves: one it replays or
        runs unseen, or one whose capture makes a save of the step."""
        return start in self.region_starts or start in self.bypass or start in self.captures

    @property
    def idle(self) -> bool:
        """It moves nothing: every save kept, no call replayed, nothing waited for (PlanRunner.rests)."""
        moves = self.treatment or self.light or self.drops or self.wait_at or self.prefetch_at
        return self.feasible and not moves

    def counts(self) -> dict[str, int]:
        out = {"offload": 0, "recompute": 0, "compress": 0}
        for t in self.treatment.values():
            out[t] += 1
        out["keep"] = len(self.signature) - sum(out.values())
        return out


@dataclass
class Simulated:
    curve: list[int]
    land: dict[int, int]  # offloaded ordinal -> event from which it is off the device
    land_s: dict[int, float]  # offloaded ordinal -> when its copy out lands (seconds)
    fetch: dict[int, int]  # offloaded ordinal -> event its prefetch is issued
    need: dict[int, int]  # offloaded ordinal -> event it must be back by
    added_s: float
    late: bool = False  # a copy lands after the point it was chosen to lower (compute would wait)


class _Index:
    """What the simulator looks up per profile, built once per plan."""

    def __init__(self, p: Profile):
        self.by = {s.ordinal: s for s in p.saved}
        self.banned: set[int] = set()  # units the greedy may not choose (make_plan's last resort)
        self.packs = True  # whether the greedy may compress (make_plan weighs a plan without)
        self.readers: dict[int, list[int]] = {}  # ordinal -> units whose replay reads it
        for u, inputs in p.unit_inputs.items():
            for o in inputs:
                self.readers.setdefault(o, []).append(u)
        # What recomputing a unit drops. Not a tensor another region's replay reads (a ResNet block's
        # output, the next block's input): kept, as checkpointing keeps block boundaries, or a chain of
        # blocks each recomputed would replay all of them at the first replay in backward. Nor one an
        # op replay reads, unless it is a region's: an op replay reading it replays that region first,
        # one call, bounded (Region.droppable). Were they kept, a GPT block's replay would drop a
        # third of what the block saves (fc1's output, which GELU's replay reads, stayed) and cost
        # three times checkpointing's per byte, and the plan never chose one.
        regions = p.unit_start.keys()
        self.members: dict[int, list] = {}
        for s in p.saved:
            if s.unit is None or s.unit not in p.unit_cost_s:
                continue
            readers = self.readers.get(s.ordinal, ())
            if not readers or (s.unit in regions and not any(v in regions for v in readers)):
                self.members.setdefault(s.unit, []).append(s)
        # unit -> the region whose call made all its members (an op replay's, a weight cast's): that
        # region's replay computes them anyway, and brings back those away then (Region.rebuild)
        self.region_of: dict[int, int] = {}
        for u, start in p.unit_start.items():
            if u not in self.members:
                continue
            last = max((s.ordinal for s in p.saved if s.save < p.unit_ready[u]), default=0)
            reads = set(p.unit_inputs.get(u, ()))
            for v, ms in self.members.items():
                if v not in regions and all(start < s.ordinal <= last and s.ordinal not in reads for s in ms):
                    self.region_of[v] = u
        # Region calls the plan may run with the pool's hooks off (Plan.bypass) while it treats none of
        # their saves: ordinal -> its call, call -> its saves, unit -> the calls whose saves it treats
        # or reads. Treating one costs the host the kept saves of its call (Profile.kept_s each).
        self.call_of: dict[int, int] = {}
        self.call_saves: dict[int, int] = {}
        for u, start in p.unit_start.items():
            end = p.unit_end.get(u, start)
            inside = range(start + 1, end + 1)
            if inside and not _saved_again_after(p, start, end):
                self.call_saves[u] = len(inside)
                self.call_of.update((o, u) for o in inside)
        # A non-region unit whose members and inputs are all saves of one such call (none an output of
        # it) is inner to it: the call can run lean (lean_call.py) and drop them itself, unbroken.
        self.inner: dict[int, int] = {}
        self.touches: dict[int, set[int]] = {}
        for u, ms in self.members.items():
            ordinals = [s.ordinal for s in ms] + list(p.unit_inputs.get(u, ()))
            self.touches[u] = {self.call_of[o] for o in ordinals if o in self.call_of}
            inside = all(o in self.call_of for o in ordinals) and len(self.touches[u]) == 1
            if u not in regions and inside and u in p.unit_lean_s:
                (c,) = self.touches[u]
                start = p.unit_start[c]
                places = set(p.call_slots.get(start, {}).values())
                outputs = {o for o, _ in p.call_outputs.get(start, ())}
                if all(o in places and o not in outputs for o in ordinals):
                    self.inner[u] = c
                    self.touches[u] = set()
        self.n = len(p.base_bytes)
        # region unit -> its call's kernel seconds in the forward; the host's free seconds in backward
        self.device_s: dict[int, float] = {}
        self.slack_s = 0.0
        if not p.sync_copies and p.backward_event < len(p.times_s):
            self.slack_s = costs.BACKWARD_HOST_FREE * (p.step_s - p.times_s[p.backward_event])
            for u, start in p.unit_start.items():
                inside = range(start + 1, p.unit_end.get(u, start) + 1)
                saves = [self.by[o].save for o in inside if o in self.by]
                if saves:
                    before = p.times_s[self.by[start].save] if start in self.by else 0.0
                    self.device_s[u] = max(0.0, p.times_s[max(saves)] - before)

    def not_inner(self, calls: set[int]) -> None:
        """The units inner to these calls are priced as run through the pool from now on."""
        for u, c in list(self.inner.items()):
            if c in calls:
                del self.inner[u]
                self.touches[u] = {c}


def _broken(ix: _Index, offloads: set[int], units: set[int]) -> set[int]:
    """The region calls of which the plan treats or reads a save: none runs with the pool's hooks off."""
    broken = {ix.call_of[o] for o in offloads if o in ix.call_of}
    for u in units:
        broken |= ix.touches[u]
    return broken


def _lean_calls(ix: _Index, units: set[int], broken: set[int]) -> set[int]:
    """The calls a plan of these units runs lean: one of their inner units chosen, the call itself
    neither replayed nor broken."""
    return {c for u in units if (c := ix.inner.get(u)) is not None and c not in broken}


def _unit_s(p: Profile, ix: _Index, u: int, broken: set[int]) -> float:
    """A unit's seconds: its lean price where it is inner to a call that stays unbroken."""
    c = ix.inner.get(u)
    return p.unit_lean_s[u] if c is not None and c not in broken else p.unit_cost_s[u]


def _least_s(p: Profile, ix: _Index, u: int, broken: set[int]) -> float:
    """The least a unit may add: a region's kernels where backward's host slack takes its launches."""
    s = _unit_s(p, ix, u, broken)
    return min(s, ix.device_s[u]) if u in ix.device_s and ix.slack_s else s


def _need(ix: _Index, s, back: dict[int, int]) -> int:
    """When `s` must be on the device: its first use, or the replay of a chosen unit that reads it."""
    need = s.use
    for v in ix.readers.get(s.ordinal, ()):
        if v in back:
            need = min(need, back[v])
    return need


def simulate(
    p: Profile,
    offloads: set[int],
    units: set[int],
    budget: int,
    deadline: dict[int, int] | None = None,
    ix: _Index | None = None,
    compressed: set[int] = frozenset(),
) -> Simulated:
    """The curve and added seconds of a plan; `deadline`: offloaded ordinal -> the point it must lower."""
    ix = ix or _Index(p)
    deadline = deadline or {}
    n, by, times = ix.n, ix.by, p.times_s
    diff = [0] * (n + 1)
    added = 0.0
    own = {u: min(s.use for s in ix.members[u]) for u in units}  # replayed at the first use of one,
    back = {  # or earlier, by an op replay that reads one of its members
        u: min([own[u]] + [own[v] for s in ix.members[u] for v in ix.readers.get(s.ordinal, ()) if v in own])
        for u in units
    }
    free = set()  # units a chosen region's replay brings back before their own rebuild: no cost
    for v in units:
        r = ix.region_of.get(v)
        if r in units and own[v] > back[r]:
            back[v] = back[r]
            free.add(v)
    broken = _broken(ix, offloads | compressed, units) | units
    device_s = host_s = 0.0  # of the regions replayed: their kernels, and their timed replays
    for u in units:
        a = p.unit_ready[u]
        for s in ix.members[u]:
            b = min(back[u], s.end)
            if a < b:
                diff[a] -= s.counted
                diff[b] += s.counted
        if u in free:
            continue
        unit_s = _unit_s(p, ix, u, broken)
        if u in ix.device_s and ix.slack_s:
            device_s += min(unit_s, ix.device_s[u])
            host_s += unit_s
        else:
            added += unit_s
    added += max(device_s, host_s - ix.slack_s)
    if p.kept_s:  # calls no longer run with the pool's hooks off: their kept saves cost the host
        added += p.kept_s * sum(ix.call_saves[c] for c in broken - units)
        added += (
            costs.LEAN_KEPT_SHARE * p.kept_s * sum(ix.call_saves[c] for c in _lean_calls(ix, units, broken))
        )
    for o in compressed:  # packed from its save to its first use (or a rebuild that reads it)
        s = by[o]
        a, b = s.save + 1, min(_need(ix, s, back), s.end)
        if a < b:
            diff[a] -= s.nbytes - s.packed_bytes
            diff[b] += s.nbytes - s.packed_bytes
        added += _pack_s(p, s)
    land: dict[int, int] = {}
    land_s: dict[int, float] = {}
    free_s, late = 0.0, False
    stall_s = 0.0  # compute waited this long so far; the timeline after a wait runs that much later
    for o in sorted(offloads, key=lambda o: by[o].save):
        s = by[o]
        c = s.nbytes / p.link_bytes_per_s
        if p.sync_copies:
            land[o], land_s[o] = s.save + 1, times[s.save]
            added += 2 * c  # out and back, both blocking
            continue
        free_s = max(times[s.save] + stall_s, free_s) + c
        land_s[o] = free_s - stall_s
        land[o] = max(s.save + 1, bisect.bisect_left(times, free_s - stall_s))
        d = deadline.get(o)
        if d is not None and land[o] > d:  # backpressure: compute waits for it before the point it lowers
            wait_s = max(0.0, free_s - (times[max(d - 1, 0)] + stall_s))
            stall_s += wait_s
            added += wait_s
            land[o] = d
            late = True
        added += max(costs.COPY_INTERFERENCE * c, p.host_copy_s)
    need = {o: _need(ix, by[o], back) for o in offloads}
    # Prefetches, as late as lets each land in time, one after another on the H2D stream.
    fetch: dict[int, int] = {}
    next_start = float("inf")
    for o in sorted(offloads, key=lambda o: -need[o]):
        s = by[o]
        if p.sync_copies or need[o] >= min(n, s.end):
            fetch[o] = need[o]  # copied back at its use (CPU) or never needed again
            continue
        start = min(times[need[o]], next_start) - s.nbytes / p.link_bytes_per_s
        f = bisect.bisect_right(times, start) - 1
        fetch[o] = min(need[o], max(f, p.backward_event, land[o]))
        next_start = start
    for o in offloads:
        a, b = land[o], min(fetch[o], by[o].end)
        if a < b:
            diff[a] -= by[o].nbytes
            diff[b] += by[o].nbytes
    curve, run = [], 0
    for i in range(n):
        run += diff[i]
        curve.append(p.base_bytes[i] + p.transient_bytes[i] + run)
    # A prefetch never raises the peak: one whose window holds an over-budget point starts after it.
    over = [i for i in range(n) if curve[i] > budget]
    for o in sorted(offloads, key=lambda o: need[o]):
        s, f = by[o], fetch[o]
        if f >= min(need[o], s.end):
            continue
        k = bisect.bisect_left(over, need[o]) - 1
        if k >= 0 and over[k] >= f:
            later = over[k] + 1
            for i in range(f, min(later, s.end)):
                curve[i] -= s.nbytes
            fetch[o] = later
    if not p.sync_copies:  # what the H2D stream cannot land before the need is exposed
        h2d_free = 0.0
        for o in sorted((o for o in offloads if fetch[o] < by[o].end), key=lambda o: (fetch[o], need[o])):
            h2d_free = max(times[fetch[o]], h2d_free) + by[o].nbytes / p.link_bytes_per_s
            if need[o] < n:
                added += max(0.0, h2d_free - times[need[o]])
            added += max(costs.COPY_INTERFERENCE * by[o].nbytes / p.link_bytes_per_s, p.host_copy_s)
    return Simulated(curve, land, land_s, fetch, need, added, late)


def make_plan(p: Profile, budget: int) -> Plan:
    """The greedy's plan; where it compresses, the greedy's plan without compression instead when that
    one fits and adds less. The greedy packs what frees bytes cheapest now, but a packed save breaks
    its call out of running light (Plan.light) and its region replays into op replays, which it does
    not weigh: on an H100, ResNet-152 at checkpoint's peak packed 74 tensors a step and ran no call
    light, 2.91x native, against 1.76x without compression (whose plan predicted 27 ms added against
    the packing plan's 39)."""
    t0 = time.perf_counter()
    plan = _greedy(p, budget, _Index(p))
    if plan.counts()["compress"]:
        ix = _Index(p)
        ix.packs = False
        plain = _greedy(p, budget, ix)
        if plain.feasible and (not plan.feasible or plain.added_s <= plan.added_s):
            plan = plain
    plan.plan_s = time.perf_counter() - t0
    return plan


def _greedy(p: Profile, budget: int, ix: _Index) -> Plan:
    """The greedy's plan. A unit it priced lean whose call then does not run lean (bypass() found the
    call's kept saves would count over the budget, or an event of the plan is keyed to one) would
    run through the pool at full price: those calls lose their inner units and the greedy runs again
    (on an H100, GPT-24 at 60% of its peak: 2.17x native with them, against 1.50x)."""
    while True:
        plan, units = _plan_once(p, budget, ix)
        lost = {  # (a call the plan replays whole rebuilds its inner units with it: not lost)
            c
            for u in units
            if (c := ix.inner.get(u)) is not None and p.unit_start[c] not in plan.drops and c not in units
        }
        if not lost or not plan.feasible:
            break
        ix.not_inner(lost)
    if not plan.feasible and ix.inner:
        # The greedy never takes a choice back: cheap rebuilds taken first can leave a point nothing
        # lowers (their inputs must be there for them). Without lean prices it may find its way (the
        # demo's GPT at checkpoint's peak on CPU: 3.27 MiB against a 3.51 budget, 5.76 with them).
        ix.not_inner(set(ix.inner.values()))
        again, _ = _plan_once(p, budget, ix)
        if again.feasible or again.predicted_peak_bytes < plan.predicted_peak_bytes:
            plan = again
    if not plan.feasible:
        # Still stuck. The greedy again without the whole-call replays, without the other rebuilds, or
        # copies alone: the cheapest feasible plan, if one is. The demo's GPT at checkpoint's
        # peak on this CPU, whose unit prices shift from run to run, got stuck in 3 runs of 4 (6.04 MB
        # against a 3.68 budget: each block's replay brought its inputs' rebuilds back at the top);
        # without the block replays it copies 62 tensors and rebuilds 4, under the budget.
        regions = {u for u in ix.members if u in p.unit_start}
        chosen = {s.unit for s in p.saved if plan.treatment.get(s.ordinal) == "recompute"}  # (stuck)
        for banned in (regions, set(ix.members) - regions, set(ix.members)):
            if not banned & chosen:
                continue  # (the stuck plan chose none of them: the same greedy again)
            ix.banned = banned
            again, _ = _plan_once(p, budget, ix)
            if again.feasible and (not plan.feasible or again.added_s < plan.added_s):
                plan = again
    return plan


def _plan_once(p: Profile, budget: int, ix: _Index) -> tuple[Plan, set[int]]:
    offloads: set[int] = set()
    units: set[int] = set()
    compressed: set[int] = set()
    deadline: dict[int, int] = {}  # offloaded ordinal -> the first point it was chosen to lower
    feasible = True
    sim = simulate(p, offloads, units, budget, deadline, ix)
    chosen = (offloads, units, compressed)
    while sim.curve:
        peak = max(range(len(sim.curve)), key=sim.curve.__getitem__)
        if sim.curve[peak] <= budget:
            break
        best = _best_choice(p, ix, sim, peak, chosen, deadline, budget, False)
        if best is None:  # the last resort: a copy that lands late, compute waiting for it before the point
            best = _best_choice(p, ix, sim, peak, chosen, deadline, budget, True)
        if best is None:
            feasible = False
            break
        kind, key, sim = best
        if kind == "offload":
            offloads.add(key)
            deadline[key] = peak
        elif kind == "compress":
            compressed.add(key)
        else:
            units.add(key)
    plan = Plan(p.signature, budget, feasible=feasible)
    for o in offloads:
        plan.treatment[o] = "offload"
        if sim.fetch[o] < min(sim.need[o], ix.by[o].end):
            plan.prefetch_at.setdefault(sim.fetch[o], []).append(o)
        if not p.sync_copies:  # backpressure: the copy must have landed before the point it lowers
            plan.wait_at.setdefault(max(deadline[o] - 1, 0), []).append(o)
    for o in compressed:
        plan.treatment[o] = "compress"
    for u in units:
        for s in ix.members[u]:
            plan.treatment.setdefault(s.ordinal, "recompute")
    plan.region_starts = frozenset(p.unit_start[u] for u in units if u in p.unit_start)
    plan.captures = frozenset(
        start for u, start in p.unit_start.items() if p.capture_made & set(p.unit_inputs.get(u, ()))
    )
    n = len(p.times_s)
    plan.event_of = {("p", s.ordinal): s.save for s in p.saved}
    plan.event_of.update((("u", s.ordinal), s.use) for s in p.saved if s.use < n)
    if feasible:  # (an infeasible plan leaves the rest to the reactive fallback: it needs entries)
        read = {o for u in units for o in p.unit_inputs.get(u, ())} | set(plan.treatment)
        plan.lean = frozenset(s.ordinal for s in p.saved if s.ordinal not in read)
        plan.light = light(p, plan, units, ix)
        plan.bypass = bypass(p, plan, ix, units, sim.curve, budget)
        plan.outputs = {s: kept for s in {**plan.light, **plan.bypass} if (kept := _outputs_seen(p, plan, s))}
    plan.untreated_peak_bytes = max((b + t for b, t in zip(p.base_bytes, p.transient_bytes)), default=0)
    plan.untreated_step_s = p.step_s
    plan.curve = sim.curve
    plan.predicted_peak_bytes = max(sim.curve, default=0)
    plan.added_s = sim.added_s
    plan.predicted_step_s = p.step_s + sim.added_s
    return plan, units


def _best_choice(
    p: Profile,
    ix: _Index,
    sim: Simulated,
    peak: int,
    chosen: tuple[set, set, set],
    deadline: dict,
    budget: int,
    late: bool,
):
    """The treatment that lowers the curve at `peak` for the least added seconds per byte freed there:
    candidates in order of a lower bound on that (their own cost over the most they could free), each
    priced exactly by simulating the plan with it, until the bound passes the best exact price. `late`:
    offloads whose copies land after `peak` count too (compute waits for them: priced, not hidden)."""
    offloads, units, compressed = chosen
    cands = []  # (lower bound per byte, kind, key)
    broken = _broken(ix, offloads | compressed, units) | units
    lean = _lean_calls(ix, units, broken)
    for u, ms in ix.members.items():
        if u in units or u in ix.banned or any(s.ordinal in offloads or s.ordinal in compressed for s in ms):
            continue
        if not p.unit_ready[u] <= peak < min(s.use for s in ms):
            continue
        freed = sum(s.counted for s in ms if peak < s.end)
        if freed:
            cost = 0.0 if ix.region_of.get(u) in units else _least_s(p, ix, u, broken | units)
            if p.kept_s and u not in ix.call_saves:  # (a region chosen runs unseen: Plan.light)
                cost += p.kept_s * sum(ix.call_saves[c] for c in ix.touches[u] - broken)
            c = ix.inner.get(u)
            if p.kept_s and c is not None and c not in broken and c not in lean:  # the call turns lean
                cost += costs.LEAN_KEPT_SHARE * p.kept_s * ix.call_saves[c]
            cands.append((cost / freed, "recompute", u))
    taken = {s.ordinal for u in units for s in ix.members[u]}
    queue = sorted((ix.by[o].save, sim.land_s[o], p.times_s[deadline[o]]) for o in offloads if o in deadline)
    saves = [q[0] for q in queue]
    # A copy queued before others delays them by its own time: where they have less time to spare
    # before their points (the least over those saved later), it makes one of them late.
    spare = [float("inf")] * (len(queue) + 1)
    for k in range(len(queue) - 1, -1, -1):
        _, land_s, point_s = queue[k]
        spare[k] = min(spare[k + 1], point_s - land_s if land_s <= point_s else float("inf"))
    # A copy or a pack is made in the forward, for a point before the tensor is needed; one per tensor.
    open_ = [
        s
        for s in p.saved
        if s.ordinal not in offloads and s.ordinal not in compressed and s.ordinal not in taken
        if s.save < p.backward_event and s.save < peak < min(s.use, s.end) and not s.shared
    ]
    for s in open_:  # packs on the device: from its save on, no link
        freed = s.nbytes - s.packed_bytes
        if ix.packs and s.packed_bytes and freed > 0:
            cost = _pack_s(p, s) + _lost(p, ix, s.ordinal, broken)
            cands.append((cost / freed, "compress", s.ordinal))
    for s in open_:
        if not s.offloadable or s.nbytes == 0:
            continue
        c = s.nbytes / p.link_bytes_per_s
        lost = _lost(p, ix, s.ordinal, broken)
        if p.sync_copies:
            cost = 2 * c + lost
        else:
            k = bisect.bisect_right(saves, s.save)
            free_s = queue[k - 1][1] if k else 0.0
            wait_s = max(p.times_s[s.save], free_s) + c - p.times_s[peak]
            if (wait_s > 0 or c > spare[k]) and not late:
                continue  # its copy, or one queued behind it, cannot land before the point it must lower
            cost = 2 * max(costs.COPY_INTERFERENCE * c, p.host_copy_s) + max(0.0, wait_s) + lost
        cands.append((cost / s.nbytes, "offload", s.ordinal))
    cands.sort(key=lambda c: c[0])
    best, best_score, tries = None, float("inf"), 0
    for bound, kind, key in cands:
        if bound >= best_score or (best is not None and tries >= (1 if late else EXACT_TRIES)):
            break
        tries += 1
        if kind == "offload":
            trial = simulate(p, offloads | {key}, units, budget, {**deadline, key: peak}, ix, compressed)
        elif kind == "compress":
            trial = simulate(p, offloads, units, budget, deadline, ix, compressed | {key})
        else:
            trial = simulate(p, offloads, units | {key}, budget, deadline, ix, compressed)
        freed = sim.curve[peak] - trial.curve[peak]
        if freed <= 0 or (trial.late and not sim.late and not late):
            continue  # it frees nothing there, or it delays a copy queued behind it past its point
        score = max(0.0, trial.added_s - sim.added_s) / freed
        if score < best_score:
            best, best_score = (kind, key, trial), score
    return best


def _pack_s(p: Profile, s: Saved) -> float:
    """What packing `s` (and unpacking it) adds to the step: its kernels or its host seconds, whichever
    is longer (as a copy's, simulate), and the wait for its count."""
    return max(p.compress_s_per_byte * s.nbytes, p.compress_host_s) + p.compress_wait_s


def _lost(p: Profile, ix: _Index, ordinal: int, broken: set[int]) -> float:
    """What treating `ordinal` one by one costs its call's kept saves (the call runs unseen no more)."""
    call = ix.call_of.get(ordinal)
    return p.kept_s * ix.call_saves[call] if call is not None and call not in broken else 0.0


def light(p: Profile, plan: Plan, units: set[int], ix: _Index) -> dict[int, int]:
    """The region calls the plan replays that can run with grad off instead (reentrant checkpointing,
    light.py's _LightFn): autograd saves nothing in the call, the pool makes no entry (on a host-bound
    step entries cost more than the replay; tiny GPT-24 on this CPU, the pool at 50% +22 ms,
    checkpointing half its blocks +8.6 ms), and the step's ordinals skip the call's.
    A call qualifies when it can go unseen (_unseen), its inputs' uses in the call are known
    (Profile.no_light), and the plan offloads or compresses none of its saves and no chosen rebuild
    outside the call reads one."""
    last: dict[int, int] = {}  # unit -> its last member's ordinal (its members are in save order)
    first: dict[int, int] = {}
    for s in p.saved:
        if s.unit in units:
            first.setdefault(s.unit, s.ordinal)
            last[s.unit] = s.ordinal
    calls = {
        start: end
        for start, end in _unseen(p, plan, units)
        if start not in p.no_light
        and not any(plan.treatment.get(o) in ("offload", "compress") for o in range(start + 1, end + 1))
    }
    unit_at = {p.unit_start[u]: u for u in units if u in p.unit_start}
    while True:  # a reader run light itself reads its inputs from its node, not the pool
        light_units = {unit_at[s] for s in calls if s in unit_at}
        out = [
            start
            for start, end in calls.items()
            if any(
                v in units and v not in light_units and not (start < first[v] and last[v] <= end)
                for o in range(start + 1, end + 1)
                for v in ix.readers.get(o, ())
            )
        ]
        if not out:
            return calls
        for start in out:
            del calls[start]


def bypass(p: Profile, plan: Plan, ix: _Index, units: set, curve: list[int], budget: int) -> dict[int, int]:
    """The region calls whose saves the plan keeps, none read by a rebuild it chose (and none in
    Profile.no_bypass): they run with the pool's saved-tensor hooks off (autograd keeps their saves
    itself), the step's ordinals skipping theirs. A kept save through the pool cost ~6.5 us on this
    CPU (tiny GPT-24: 3.8 ms of a 9 ms forward), ~12 us on an H100 host, whose planned GPT-24 forward
    is host-bound.
    A call whose saves the plan keeps but for the members of units inner to it (and their inputs)
    runs lean, dropping those itself (Plan.drops).
    The pool sees such a call's kept saves die only together, once backward is through the call: it
    counts each until its last one died, and a call qualifies only where that keeps the curve under
    the budget."""
    out: dict[int, int] = {}
    unit_at = {start: u for u, start in p.unit_start.items()}
    later = [0] * len(curve)  # bytes the calls taken so far count beyond their deaths
    for start, end in sorted(_unseen(p, plan, set(p.unit_start))):
        inside = range(start + 1, end + 1)
        call = unit_at[start]
        inner = {u for u in units if ix.inner.get(u) == call}
        dropped = {s.ordinal for u in inner for s in ix.members[u]}
        read = {o for u in inner for o in p.unit_inputs.get(u, ())}
        readers = {o: {v for v in ix.readers.get(o, ()) if v in units} for o in read}
        if end <= start or start in plan.light or start in p.no_bypass:
            continue
        if not all(
            o in plan.lean or o in dropped or (o in read and o not in plan.treatment and readers[o] <= inner)
            for o in inside
        ):
            continue
        kept = [o for o in inside if o not in dropped]
        last = min(max(ix.by[o].end for o in kept), len(curve)) if kept else 0
        more: dict[int, int] = {}  # event -> bytes counted past their death there
        for o in kept:
            for k in range(ix.by[o].end, last):
                more[k] = more.get(k, 0) + ix.by[o].nbytes
        if all(curve[k] + later[k] + b <= budget for k, b in more.items()):
            for k, b in more.items():
                later[k] += b
            out[start] = end
            if dropped:
                places = p.call_slots[start]
                plan.drops[start] = {k: o for k, o in places.items() if o in dropped}
                plan.reads[start] = frozenset(k for k, o in places.items() if o in read)
    return out


def _unseen(p: Profile, plan: Plan, units: set[int]) -> list[tuple[int, int]]:
    """The (start, end) of the region calls among `units` whose saves the pool may leave unseen: no
    prefetch or wait of the plan is keyed to one's save or first use (those events would not come),
    and none is saved again after the call (_saved_again_after: there the recorded step made no new
    ordinal, the running one would; a ResNet block's output, saved by the next block's first conv,
    made every later save of the step miss the plan)."""
    keyed = set(plan.wait_at) | set(plan.prefetch_at)
    out = []
    for u in units:
        start, end = p.unit_start.get(u), p.unit_end.get(u)
        if start is None or end is None:
            continue
        if not _saved_again_after(p, start, end) and not any(
            plan.event_of.get(("p", o)) in keyed or plan.event_of.get(("u", o)) in keyed
            for o in range(start + 1, end + 1)
        ):
            out.append((start, end))
    return out


def _outputs_seen(p: Profile, plan: Plan, start: int) -> tuple[tuple[int, int], ...]:
    """The outputs of the unseen call at `start` (Profile.call_outputs) the pool must be given at its
    end: a light call's all (they count there), a bypassed call's those saved again where the pool
    sees the save. One saved again only inside calls that run light or with the pool's hooks off (by
    the next ResNet bottleneck's first conv) the pool never looks up: handing each over cost ~11 us a
    call on this repository's CPU, a tenth of what a bypassed call cost the host."""
    outputs = p.call_outputs.get(start, ())
    if start in plan.light:
        return outputs
    unseen = plan.light.keys() | (plan.bypass.keys() - plan.drops.keys())
    return tuple((o, k) for o, k in outputs if not p.resaved.get(o, set()) <= unseen)


def _saved_again_after(p: Profile, start: int, end: int) -> bool:
    """Whether a save of the region call from `start` to `end` is saved again after the call, other
    than an output of the call (the pool is given those at the call's end: Profile.call_outputs)."""
    outputs = {o for o, _ in p.call_outputs.get(start, ())}
    return any(o in p.resaved and o not in outputs for o in range(start + 1, end + 1))
