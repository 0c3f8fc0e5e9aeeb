"""The region calls a plan lets run unseen by the pool: light (replayed whole with grad off, as
reentrant checkpointing), bypassed (the pool's hooks off, autograd keeping their saves) or lean (dropping
the members of the units inner to them themselves); and the outputs of those calls the pool is still given."""

from __future__ import annotations

from ..profile import Profile
from .plan import Plan
from .simulate import _Index, _saved_again_after


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
