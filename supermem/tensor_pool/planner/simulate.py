"""The simulator replays the profile's timeline with a set of treatments and prices them in seconds the
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
"""

from __future__ import annotations

import bisect
from collections.abc import Set as AbstractSet

from ... import costs
from ..profile import Profile, Saved
from .plan import Simulated


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
            within = all(o in self.call_of for o in ordinals) and len(self.touches[u]) == 1
            if u not in regions and within and u in p.unit_lean_s:
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
    compressed: AbstractSet[int] = frozenset(),
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
        # Compute waits at the need, and every event after it (the prefetches it issues, the needs
        # behind it) runs that much later: a wait is counted once, not again by each copy queued
        # behind it (which made a what-if of HF GPT-2 on an H200 predict 1297 ms against 176 measured).
        h2d_free = 0.0
        waits = _Prefix(n)  # seconds compute waited, at the need events so far
        for o in sorted((o for o in offloads if fetch[o] < by[o].end), key=lambda o: (fetch[o], need[o])):
            issued_s = times[fetch[o]] + waits.upto(fetch[o])
            h2d_free = max(issued_s, h2d_free) + by[o].nbytes / p.link_bytes_per_s
            if need[o] < n:
                wait_s = max(0.0, h2d_free - times[need[o]] - waits.upto(need[o]))
                if wait_s:
                    waits.add(need[o], wait_s)
                    added += wait_s
            added += max(costs.COPY_INTERFERENCE * by[o].nbytes / p.link_bytes_per_s, p.host_copy_s)
    return Simulated(curve, land, land_s, fetch, need, added, late)


class _Prefix:
    """Sums at event indices: add at an index, the sum at indices <= i, each in O(log n) (a Fenwick
    tree; a list summed at each copy made a plan of 360 late copies take seconds)."""

    def __init__(self, n: int):
        self.tree = [0.0] * (n + 1)

    def add(self, i: int, value: float) -> None:
        i += 1
        while i < len(self.tree):
            self.tree[i] += value
            i += i & -i

    def upto(self, i: int) -> float:
        total, i = 0.0, min(i + 1, len(self.tree) - 1)
        while i > 0:
            total += self.tree[i]
            i -= i & -i
        return total


def _pack_s(p: Profile, s: Saved) -> float:
    """What packing `s` (and unpacking it) adds to the step: its kernels or its host seconds, whichever
    is longer (as a copy's, simulate), and the wait for its count."""
    return max(p.compress_s_per_byte * s.nbytes, p.compress_host_s) + p.compress_wait_s


def _saved_again_after(p: Profile, start: int, end: int) -> bool:
    """Whether a save of the region call from `start` to `end` is saved again after the call, other
    than an output of the call (the pool is given those at the call's end: Profile.call_outputs)."""
    outputs = {o for o, _ in p.call_outputs.get(start, ())}
    return any(o in p.resaved and o not in outputs for o in range(start + 1, end + 1))
