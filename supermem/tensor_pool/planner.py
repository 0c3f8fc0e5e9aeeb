"""The planner: from one profiled step, keep / offload / recompute for every saved tensor.

The simulator replays the profile's timeline with a set of treatments: an offloaded tensor is off the
device from the event its copy lands (copies serialised on one D2H stream at the link rate, from its
save) until its prefetch is issued; a recomputed unit's members are off from the unit's end until the
first of them is used (one replay brings all back). Prefetches are issued from backward progress: at
the latest event that still leaves the copy its time, and no earlier than the last over-budget event
before the use (so a prefetch never raises the peak; it is exposed instead).

The greedy: while the simulated curve is over the budget somewhere, take its highest point and, among
the treatments that lower it, apply the one with the least added seconds per byte freed there. An
offload counts only if its copy lands before that point (it then costs only the slowdown that copies
cause to compute); a recompute costs its unit's measured forward time. Decisions are never undone, so
it ends after at most one step per tensor. If nothing lowers the highest point, the plan says it is
infeasible and the pool's reactive fallback does what it can.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from .profile import Profile

COPY_INTERFERENCE = 0.08  # a step slowed 8% with copies running beside it (DESIGN.md, one H100 run)


@dataclass
class Plan:
    signature: tuple[int, ...]
    budget_bytes: int
    treatment: dict[int, str] = field(default_factory=dict)  # ordinal -> "offload" | "recompute"
    prefetch_at: dict[int, list[int]] = field(default_factory=dict)  # event -> ordinals to bring back
    wait_at: dict[int, list[int]] = field(default_factory=dict)  # event -> copies that must have landed
    predicted_peak_bytes: int = 0
    predicted_step_s: float = 0.0
    added_s: float = 0.0
    feasible: bool = True
    plan_s: float = 0.0

    def counts(self) -> dict[str, int]:
        out = {"offload": 0, "recompute": 0}
        for t in self.treatment.values():
            out[t] += 1
        out["keep"] = len(self.signature) - sum(out.values())
        return out


@dataclass
class Simulated:
    curve: list[int]
    land: dict[int, int]  # offloaded ordinal -> event from which it is off the device
    fetch: dict[int, int]  # offloaded ordinal -> event its prefetch is issued
    added_s: float
    d2h_free_s: list[tuple[float, float]]  # (save time, D2H stream free after its copy), by save time


def simulate(p: Profile, offloads: set[int], units: set[int], budget: int) -> Simulated:
    n = len(p.base_bytes)
    by = {s.ordinal: s for s in p.saved}
    diff = [0] * (n + 1)
    added = 0.0
    land: dict[int, int] = {}
    queue: list[tuple[float, float]] = []
    free_s = 0.0
    for o in sorted(offloads, key=lambda o: by[o].save):
        s = by[o]
        c = s.nbytes / p.link_bytes_per_s
        if p.sync_copies:
            land[o] = s.save + 1
            added += 2 * c  # out and back, both blocking
        else:
            free_s = max(p.times_s[s.save], free_s) + c
            land[o] = max(s.save + 1, bisect.bisect_left(p.times_s, free_s))
            queue.append((p.times_s[s.save], free_s))
            added += COPY_INTERFERENCE * c
    fetch: dict[int, int] = {}
    for o in offloads:
        s = by[o]
        c = s.nbytes / p.link_bytes_per_s
        if p.sync_copies or s.use >= n:
            fetch[o] = s.use
            continue
        # The latest event that leaves the copy its time, in backward and after it landed.
        f = bisect.bisect_right(p.times_s, p.times_s[s.use] - c) - 1
        fetch[o] = min(s.use, max(f, p.backward_event, land[o]))
    for o in offloads:
        a, b = land[o], min(fetch[o], by[o].end)
        if a < b:
            diff[a] -= by[o].nbytes
            diff[b] += by[o].nbytes
    members: dict[int, list] = {}
    for s in p.saved:
        if s.unit in units and s.ordinal not in offloads:
            members.setdefault(s.unit, []).append(s)
    for u, ms in members.items():
        a, back = p.unit_ready[u], min(s.use for s in ms)
        for s in ms:
            b = min(back, s.end)
            if a < b:
                diff[a] -= s.nbytes
                diff[b] += s.nbytes
        added += p.unit_cost_s[u]
    curve, run = [], 0
    for i in range(n):
        run += diff[i]
        curve.append(p.base_bytes[i] + p.transient_bytes[i] + run)
    # A prefetch never raises the peak: one whose window holds an over-budget point starts after it.
    over = [i for i in range(n) if curve[i] > budget]
    for o in sorted(offloads, key=lambda o: by[o].use):
        s, f = by[o], fetch[o]
        if f >= min(s.use, s.end):
            continue
        k = bisect.bisect_left(over, s.use) - 1
        if k >= 0 and over[k] >= f:
            later = over[k] + 1
            for i in range(f, min(later, s.end)):
                curve[i] -= s.nbytes
            fetch[o] = f = later
        if not p.sync_copies:
            c = s.nbytes / p.link_bytes_per_s
            added += max(0.0, c - (p.times_s[s.use] - p.times_s[f]))
    return Simulated(curve, land, fetch, added, queue)


def make_plan(p: Profile, budget: int) -> Plan:
    t0 = time.perf_counter()
    offloads: set[int] = set()
    units: set[int] = set()
    deadline: dict[int, int] = {}  # offloaded ordinal -> the first point it was chosen to lower
    unit_members: dict[int, list] = {}
    for s in p.saved:
        if s.unit is not None:
            unit_members.setdefault(s.unit, []).append(s)
    feasible = True
    while True:
        sim = simulate(p, offloads, units, budget)
        if not sim.curve:
            break
        peak = max(range(len(sim.curve)), key=sim.curve.__getitem__)
        if sim.curve[peak] <= budget:
            break
        best = _best_choice(p, sim, peak, offloads, units, unit_members)
        if best is None:
            feasible = False
            break
        kind, key = best
        if kind == "offload":
            offloads.add(key)
            deadline[key] = peak
        else:
            units.add(key)
    sim = simulate(p, offloads, units, budget)
    plan = Plan(p.signature, budget, feasible=feasible)
    for o in offloads:
        plan.treatment[o] = "offload"
        f = sim.fetch[o]
        by_use = next(s.use for s in p.saved if s.ordinal == o)
        if f < by_use:
            plan.prefetch_at.setdefault(f, []).append(o)
        if not p.sync_copies:  # backpressure: the copy must have landed before the point it lowers
            plan.wait_at.setdefault(max(deadline[o] - 1, 0), []).append(o)
    for u in units:
        for s in unit_members[u]:
            plan.treatment.setdefault(s.ordinal, "recompute")
    plan.predicted_peak_bytes = max(sim.curve, default=0)
    plan.added_s = sim.added_s
    plan.predicted_step_s = p.step_s + sim.added_s
    plan.plan_s = time.perf_counter() - t0
    return plan


def _best_choice(p: Profile, sim: Simulated, peak: int, offloads: set, units: set, unit_members: dict):
    """The treatment that lowers the curve at `peak` for the least seconds per byte freed there."""
    best, best_score = None, float("inf")
    for u, ms in unit_members.items():
        if u in units:
            continue
        free = [s for s in ms if s.ordinal not in offloads]
        if not free or not p.unit_ready[u] <= peak < min(s.use for s in free):
            continue
        freed = sum(s.nbytes for s in free if peak < s.end)
        if not freed:
            continue
        score = p.unit_cost_s[u] / freed
        if score < best_score:
            best, best_score = ("recompute", u), score
    taken = {s.ordinal for u in units for s in unit_members[u]}
    saves = [q[0] for q in sim.d2h_free_s]
    for s in p.saved:
        if not s.offloadable or s.ordinal in offloads or s.ordinal in taken or s.nbytes == 0:
            continue
        if not s.save < peak < min(s.use, s.end):
            continue
        c = s.nbytes / p.link_bytes_per_s
        if p.sync_copies:
            cost = 2 * c
        else:
            k = bisect.bisect_right(saves, p.times_s[s.save])
            free_s = sim.d2h_free_s[k - 1][1] if k else 0.0
            if max(p.times_s[s.save], free_s) + c > p.times_s[peak]:
                continue  # its copy cannot land before the point it must lower
            cost = COPY_INTERFERENCE * c
        score = cost / s.nbytes
        if score < best_score:
            best, best_score = ("offload", s.ordinal), score
    return best
