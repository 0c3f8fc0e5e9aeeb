"""The greedy: while the simulated curve is over the budget somewhere, take its highest point and, among
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

from ... import costs
from ..profile import Profile
from .plan import Plan, Simulated
from .simulate import _broken, _Index, _lean_calls, _least_s, _pack_s, simulate
from .unseen import _outputs_seen, bypass, light

EXACT_TRIES = 4  # candidates simulated per decision, cheapest lower bound first (late copies: 1)


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
        copy_s = s.nbytes / p.link_bytes_per_s
        lost = _lost(p, ix, s.ordinal, broken)
        if p.sync_copies:
            cost = 2 * copy_s + lost
        else:
            k = bisect.bisect_right(saves, s.save)
            free_s = queue[k - 1][1] if k else 0.0
            wait_s = max(p.times_s[s.save], free_s) + copy_s - p.times_s[peak]
            if (wait_s > 0 or copy_s > spare[k]) and not late:
                continue  # its copy, or one queued behind it, cannot land before the point it must lower
            cost = 2 * max(costs.COPY_INTERFERENCE * copy_s, p.host_copy_s) + max(0.0, wait_s) + lost
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


def _lost(p: Profile, ix: _Index, ordinal: int, broken: set[int]) -> float:
    """What treating `ordinal` one by one costs its call's kept saves (the call runs unseen no more)."""
    call = ix.call_of.get(ordinal)
    return p.kept_s * ix.call_saves[call] if call is not None and call not in broken else 0.0
