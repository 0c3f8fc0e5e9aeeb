"""Profiling one step: what the planner plans from.

A step's timeline is its events in order: each saved tensor's pack (its first save) and its first
unpack in backward. At each event the recorder notes the bytes resident (the allocator's count on a
GPU, the pool's own on CPU) with what the pool had taken off the device added back, so the curve is
the step's untreated memory; and the event's time (CUDA events on a GPU, read once when the plan is
made; the host clock on CPU). The transient the pool cannot see (the loss's temporaries, workspaces) is
the step's true peak (the allocator's watermark) above the most the pool saw; it is put at backward's
start, where the loss's spike falls. An allocation that came to the pressure handler (over the budget:
the allocator asked the pool for room) is a transient too, at the event before it, of the bytes it
would have taken the untreated step to. The link rate comes from the copy engine.

A recompute choice is a unit, whatever rebuilds it (a module call replayed, an autocast weight copy
cast again, an op replayed from its kept inputs): its members (the saved tensors one rebuild brings
back: `Saved.unit`), the event from which they may leave (`unit_ready`), the measured seconds of one
rebuild (`unit_cost_s`) and the saved tensors the rebuild reads (`unit_inputs`: they must be on the
device when it runs, so an offloaded input is prefetched for it and a recomputed one is rebuilt first).
A recipe becomes a unit through `Recorder.recomputable(recipe, cost, members, offloadable, inputs)`;
the planner needs nothing else to weigh it against the others.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

# What a save the plan keeps costs the host through the pool (its save, unpack and release), as a share
# of what making an entry took in the recorded step (Profile.entry_s): tiny GPT-24 on this CPU 6.5 +
# 1.8 + 1.25 us against 7.8
KEPT_SHARE = 1.2
# What a drop and its rebuild cost the host in a lean call (lean_call.py), as a share of what they cost
# through the pool (an entry, a pool rebuild): tiny GPT-24 on this CPU, a plan's drops run either way,
# 41 and 60 us a drop against 78 and 104 (kernels included)
LEAN_SHARE = 0.5


@dataclass(slots=True)
class Saved:
    """One saved tensor of the profiled step (events are indices into the profile's timeline)."""

    ordinal: int
    nbytes: int
    save: int  # its pack event
    use: int  # its first unpack event (the timeline's length when backward never used it)
    end: int = -1  # the first event after it died (the timeline's length if it outlived the step)
    unit: int | None = None  # recompute unit (dropping it frees every member at once)
    offloadable: bool = True  # autocast weight copies are rebuilt, never copied to host
    packed_bytes: int = 0  # compressible (a ReLU's output): what its pack would hold, estimated; else 0


@dataclass
class Profile:
    saved: list[Saved]
    times_s: list[float]  # per event, from the step's start
    base_bytes: list[int]  # per event: resident bytes with nothing treated
    transient_bytes: list[int]  # per event: what the pool did not see (the loss's spike)
    unit_ready: dict[int, int] = field(default_factory=dict)  # unit -> first event its members may leave
    unit_cost_s: dict[int, float] = field(default_factory=dict)  # unit -> measured recompute seconds
    unit_inputs: dict[int, tuple[int, ...]] = field(default_factory=dict)  # unit -> ordinals it reads
    unit_start: dict[int, int] = field(default_factory=dict)  # region unit -> the step's saves before it
    unit_end: dict[int, int] = field(default_factory=dict)  # region unit -> the step's saves at its end
    # non-region unit -> its seconds where its call runs lean (lean_call.py: no entries, lighter rebuilds)
    unit_lean_s: dict[int, float] = field(default_factory=dict)
    entry_s: float = 0.0  # host seconds to make one entry, in each non-region unit's cost per member
    kept_s: float = 0.0  # host seconds of a save the plan keeps through the pool (planner: Plan.bypass)
    # saved again after the region call that first saved it returned (one entry, no ordinal of its
    # own): a ResNet block's output, saved by its last ReLU and again by the next block's first conv
    resaved: set[int] = field(default_factory=set)
    # a region call (by the step's saves before it) -> (ordinal, index among the output's tensors) of
    # each output it saved itself: a call the plan does not see gives the pool these at its end
    call_outputs: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    # a region call (as above) -> the number of a save among the call's saves -> the ordinal it saved
    call_slots: dict[int, dict[int, int]] = field(default_factory=dict)
    compress_s_per_byte: float = 0.0  # a pack and its unpack (Compress.price)
    compress_wait_s: float = 0.0  # what a pack waits for its count (Compress.price: an exact one on a GPU)
    link_bytes_per_s: float = 25e9
    sync_copies: bool = False  # CPU: copies block the step
    backward_event: int = 0  # the first unpack
    step_s: float = 0.0
    host_copy_s: float = 0.0  # host seconds to issue one copy: a host-bound step is longer by it

    @property
    def signature(self) -> tuple[int, ...]:
        return tuple(s.nbytes for s in self.saved)


class EventCounter:
    """A plan-running step's events: the plan's prefetches and waits are keyed by the recorded step's
    event numbers, which this finds by the save and the first use of each ordinal (`event_of`), not
    by counting: the saves inside a call the plan checkpoints are not seen. What a Recorder keeps
    besides is for making a plan, and this step runs one (a step that leaves the plan's shape makes
    the next steps record in full: PlanRunner._step_ended)."""

    full = False

    def __init__(self, event_of: dict[tuple[str, int], int] | None = None) -> None:
        self.event_of = event_of or {}
        self.first_used: set[int] = set()
        self.backward_event: int | None = None
        self.away = 0
        self.fallback_s = 0.0
        self.regions_on = True

    def packed(self, ordinal: int, nbytes: int, used: int) -> int:
        return self.event_of.get(("p", ordinal), -1)

    def used(self, ordinal: int, used: int) -> int | None:
        if ordinal in self.first_used:
            return None
        self.first_used.add(ordinal)
        event = self.event_of.get(("u", ordinal), -1)
        if self.backward_event is None:
            self.backward_event = event
        return event

    def died(self, ordinal: int) -> None:
        pass

    def pressed(self, demand: int) -> None:
        pass


class Recorder:
    """Records one step's events as it runs; `profile()` turns them into a Profile afterwards."""

    full = True

    def __init__(self, cuda: bool, timed: bool):
        self.cuda = cuda
        self.timed = timed  # GPU: a CUDA event per event (profiling steps only)
        self.start_s = time.perf_counter()
        self.start_event = _event() if cuda and timed else None
        self.bytes: list[int] = []
        self.times: list[Any] = []
        self.saved: dict[int, Saved] = {}  # ordinal -> record
        self.away = 0  # bytes of this step's entries off the device now
        # id(recipe) -> (its cost in seconds, or a call that measures it; ordinals; ready event; input
        # ordinals; kind; a region's start and end). Not the recipe itself: a region holds its inputs'
        # entries, which must die with the step.
        self.units: dict[int, tuple[Any, list[int], int, list[int], str, int | None, int | None]] = {}
        self.entry_s: list[float] = []  # host seconds to make each entry (Pool._pack_tensor)
        self.resaved: set[int] = set()  # Profile.resaved
        self.call_outputs: dict[int, tuple[tuple[int, int], ...]] = {}  # Profile.call_outputs
        self.call_slots: dict[int, dict[int, int]] = {}  # Profile.call_slots
        self.backward_event: int | None = None
        # Seconds the step lost to the reactive fallback so far (rebuilds and copies it waited for): the
        # plan replaces those choices, so the timeline and the step's time are taken without them.
        self.fallback_s = 0.0
        self.fallback_at: list[float] = []  # per event: fallback_s when it happened
        self.regions_on = True  # regions were hooked when the step began (their inputs are entries)
        # (last event before it, untreated bytes it asked for) per allocation that came to the pressure
        # handler: a transient between two events (the loss's temporaries) the curve must hold too
        self.pressure: list[tuple[int, int]] = []

    @property
    def events(self) -> int:
        return len(self.bytes)

    def _event(self, used: int) -> int:
        self.bytes.append(used + self.away)
        self.fallback_at.append(self.fallback_s)
        if self.start_event is not None:
            self.times.append(_event())
        else:
            self.times.append(time.perf_counter() - self.start_s)
        return len(self.bytes) - 1

    def pressed(self, demand: int) -> None:
        """An allocation would take the device to `demand` bytes (over the budget) now."""
        if self.events:
            self.pressure.append((self.events - 1, demand + self.away))

    def packed(self, ordinal: int, nbytes: int, used: int) -> int:
        i = self._event(used)
        self.saved[ordinal] = Saved(ordinal, nbytes, i, -1)
        return i

    def compressible(self, ordinal: int, packed_bytes: int) -> None:
        """`ordinal` (just packed) may be compressed into about `packed_bytes`."""
        self.saved[ordinal].packed_bytes = packed_bytes

    def used(self, ordinal: int, used: int) -> int | None:
        """First unpack of `ordinal`: an event; None when it is not the first."""
        s = self.saved.get(ordinal)
        if s is None or s.use >= 0:
            return None
        i = self._event(used)
        s.use = i
        if self.backward_event is None:
            self.backward_event = i
        return i

    def died(self, ordinal: int) -> None:
        """The entry is gone (a region's input dies with the region, never unpacked by backward)."""
        s = self.saved.get(ordinal)
        if s is not None and s.end < 0:
            s.end = self.events

    def recomputable(
        self,
        recipe: Any,
        cost: Any,
        ordinals: list[int],
        offloadable: bool,
        inputs: Any = (),
        start: int | None = None,
        end: int | None = None,
    ) -> None:
        """`ordinals` may be dropped and rebuilt by `recipe` from the next event on, for `cost`
        seconds (or what `cost()` measures once the plan is made), reading the saved tensors `inputs`
        (ordinals of this step; others, a parameter say, are always there). `start`: a region's, the
        step's saves before its call, `end` at its end."""
        kind = type(recipe).__name__
        unit = self.units.setdefault(id(recipe), (cost, [], self.events, [], kind, start, end))
        unit[1].extend(o for o in ordinals if o in self.saved)
        unit[3].extend(o for o in inputs if o in self.saved and o not in ordinals)
        for o in ordinals:
            if o in self.saved:
                self.saved[o].offloadable = offloadable

    def profile(
        self,
        spike_bytes: int,
        link_bytes_per_s: float,
        sync_copies: bool,
        host_s: Any = None,
        host_copy_s: float = 0.0,
        compress_price: tuple[float, float, float] | None = None,
    ) -> Profile:
        """`host_s(kind)`: host seconds of one rebuild of that kind of recipe; a unit costs the larger of
        its device and host seconds (where the host is the slower side, the host's are the step's),
        plus, but for a region (a plan runs those under checkpoint: Plan.light), what making an entry
        of each member costs the host in the forward (the median this step took to make one): a
        planned step's forward is host-bound on the H100 hosts, ~55 us an entry against a GELU's
        0.05 ms replay. A non-region unit's price in a lean call (unit_lean_s) counts LEAN_SHARE of
        both host costs. `host_copy_s`: host seconds to issue one copy."""
        n = self.events
        entry_s = sorted(self.entry_s)[len(self.entry_s) // 2] if self.entry_s else 0.0
        if self.start_event is not None:
            self.times[-1].synchronize()
            times = [self.start_event.elapsed_time(e) / 1e3 for e in self.times]
        else:
            times = list(self.times)
        times = [t - x for t, x in zip(times, self.fallback_at)]
        saved = sorted(self.saved.values(), key=lambda s: s.save)
        for s in saved:
            if s.use < 0:
                s.use = n
            if s.end < 0:
                s.end = n
        p = Profile(
            saved,
            times,
            list(self.bytes),
            [0] * n,
            link_bytes_per_s=link_bytes_per_s,
            sync_copies=sync_copies,
            backward_event=self.backward_event if self.backward_event is not None else n,
            step_s=time.perf_counter() - self.start_s - self.fallback_s,
            host_copy_s=host_copy_s,
            compress_s_per_byte=compress_price[0] if compress_price else 0.0,
            compress_wait_s=compress_price[2] if compress_price else 0.0,
            entry_s=entry_s,
            kept_s=KEPT_SHARE * entry_s,
            resaved=set(self.resaved),
            call_outputs=dict(self.call_outputs),
            call_slots=dict(self.call_slots),
        )
        if p.backward_event < n:
            p.transient_bytes[p.backward_event] = spike_bytes
        for i, demand in self.pressure:
            p.transient_bytes[i] = max(p.transient_bytes[i], demand - p.base_bytes[i])
        for k, (cost, ordinals, ready, inputs, kind, start, end) in enumerate(self.units.values()):
            if callable(cost):
                cost = cost()
            if cost is None or not ordinals:
                continue
            host = host_s(kind) if host_s is not None else 0.0
            if kind != "Region":
                members_s = len(set(ordinals)) * entry_s
                p.unit_lean_s[k] = max(cost, LEAN_SHARE * host) + LEAN_SHARE * members_s
                cost = max(cost, host) + members_s
            else:
                cost = max(cost, host)
            p.unit_ready[k] = ready
            p.unit_cost_s[k] = cost
            p.unit_inputs[k] = tuple(dict.fromkeys(inputs))
            if start is not None:
                p.unit_start[k] = start
            if end is not None:
                p.unit_end[k] = end
            for o in ordinals:
                self.saved[o].unit = k
        return p


def _event() -> torch.cuda.Event:
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e
