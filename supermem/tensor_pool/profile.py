"""Profiling one step: what the planner plans from.

A step's timeline is its events in order: each saved tensor's pack (its first save) and its first
unpack in backward. At each event the recorder notes the bytes resident (the allocator's count on a
GPU, the pool's own on CPU) with what the pool had taken off the device added back, so the curve is
the step's untreated memory; and the event's time: the model's own seconds so far, the pool's work
left out (Recorder.pause: on a GPU, its kernels' seconds; on CPU, the host's). The transient the pool
cannot see (the loss's temporaries, workspaces) is the step's true peak (the allocator's watermark)
above the most the pool saw; it is put at backward's start, where the loss's spike falls. An
allocation that came to the pressure handler (over the budget: the allocator asked the pool for room)
is a transient too, at the event before it, of the bytes it would have taken the untreated step to.
With supermem's allocator the model's own rise between two events is a transient too, at the first of
them: its segments' watermarks above the bytes the event left, the pool's work between them left out
(a pressure call that freed more than it was asked for hid the rest of the loss's spike from both
measures above: GPT-24 at 90% on an H100 planned 0.6 GiB short and overshot its budget).
The link rate comes from the copy engine.

A recompute choice is a unit, whatever rebuilds it (a module call replayed, an autocast weight copy
cast again, an op replayed from its kept inputs): its members (the saved tensors one rebuild brings
back: `Saved.unit`), the event from which they may leave (`unit_ready`; on a GPU, for a weight copy
autocast's cache holds, the first after autocast exited: Cast.cached), the measured seconds of one
rebuild (`unit_cost_s`) and the saved tensors the rebuild reads (`unit_inputs`: they must be on the
device when it runs, so an offloaded input is prefetched for it and a recomputed one is rebuilt first).
A recipe becomes a unit through `Recorder.recomputable(recipe, cost, members, offloadable, inputs)`;
the planner needs nothing else to weigh it against the others.
"""

from __future__ import annotations

import collections
import itertools
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from .. import costs
from .. import torch_private as tp

# A profiled step's segment's kernels wait behind a spin kernel this many times the most host seconds
# of the last SPIN_WINDOW segments (within these bounds), so that they are timed running back to back
# (Recorder.resume): on an H100, GPT-24 and ResNet-152 with a 2 ms spin, the segments' device seconds
# summed to 1.03-1.09x native's step (72 and 80 ms), their wall seconds, the stream synced at each end,
# to 1.4-1.7x. Three times the last segment's alone: a third to a half of the segments outran it.
SPIN_AHEAD = 3.0
SPIN_WINDOW = 32
SPIN_MIN_S, SPIN_MAX_S = 100e-6, 2e-3


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
    # The device bytes it alone holds: its bytes, but for a save whose storage another of the step's
    # saves holds too (attention's q, k and v, views of one projection, each spanning most of it): the
    # part of its span the ones before it do not cover. Such saves free their storage together, by a
    # rebuild of them all; a copy or a pack of one frees nothing (`shared`).
    counted: int = -1
    shared: bool = False

    def __post_init__(self) -> None:
        if self.counted < 0:
            self.counted = self.nbytes


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
    # own): a ResNet block's output, saved by its last ReLU and again by the next block's first conv.
    # Ordinal -> where each later save was: the region call open then (its start), or None
    resaved: dict[int, set[int | None]] = field(default_factory=dict)
    # region calls (as call_outputs) with no input made in the graph, or under saved-tensor hooks not
    # the pool's: never run with the pool's hooks off (light._pool_hooks: nothing would tell when
    # backward is through the call). A model's first block on its batch: planned so, it ran through
    # the pool all the same, and the step left the plan there.
    no_bypass: set[int] = field(default_factory=set)
    # region calls (as call_outputs) whose inputs' uses in the call are not known (region.consumers):
    # never run light (each use's gradient must go back in its own slot, or it rounds otherwise)
    no_light: set[int] = field(default_factory=set)
    # saves a region's capture made: its input, saved by nothing in the step before the call ended (a
    # first block's batch where the block saves only a cast of it), made an entry for the replay
    capture_made: set[int] = field(default_factory=set)
    # a region call (by the step's saves before it) -> (ordinal, index among the output's tensors) of
    # each output it saved itself: a call the plan does not see gives the pool these at its end
    call_outputs: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    # a region call (as above) -> the number of a save among the call's saves -> the ordinal it saved
    call_slots: dict[int, dict[int, int]] = field(default_factory=dict)
    # (id(module), kind) of each region call, in order (Recorder.calls): what a resting pool checks
    calls: tuple[tuple[int, tuple], ...] = ()
    compress_s_per_byte: float = 0.0  # a pack and its unpack (Compress.price)
    compress_wait_s: float = 0.0  # what a pack waits for its count (Compress.price: an exact one on a GPU)
    compress_host_s: float = 0.0  # host seconds of a pack, its unpack and trim (Compress.price, on a GPU)
    link_bytes_per_s: float = costs.GPU_LINK_BYTES_PER_S
    sync_copies: bool = False  # CPU: copies block the step
    backward_event: int = 0  # the first unpack
    step_s: float = 0.0
    # of step_s, the tail: from the last event to the next step's first save (the rest of backward, the
    # optimizer). In a process's first step it holds first-time costs (the optimizer's state made, kernels
    # loaded: +10 ms of GPT-24's 74 on an H100), so a plan's first step times it again (PlanRunner)
    tail_s: float = 0.0
    retimed: bool = False  # tail_s is a planned step's
    host_copy_s: float = 0.0  # host seconds to issue one copy: a host-bound step is longer by it

    @property
    def signature(self) -> tuple[int, ...]:
        return tuple(s.nbytes for s in self.saved)


class SegmentClock:
    """The model's own seconds between the pool's calls (pause / resume), summed into `seg`: its kernels'
    on a GPU when `synced`, the host's otherwise. The pool's work is in no segment: the plan replaces it.
    On a GPU the host's seconds are not taken: the pool's work between segments slows the model's own
    launches 1.3-2.7x (natest, H100), and both models measured there are the device's pace (GPT-24: host
    36 ms of a 72 ms step, ResNet-152: 38 of 80)."""

    def __init__(self, synced: bool, paused: int = 0, spin_s: float = SPIN_MIN_S):
        self.synced = synced
        self.paused = paused  # the pool's calls open now (one may run inside another)
        self.resumed_s = time.perf_counter()
        self.spin_s = spin_s
        self.recent_host_s: collections.deque[float] = collections.deque(maxlen=SPIN_WINDOW)
        self.seg_start: Any = None  # GPU: the event after the spin that holds back the segment's kernels
        self.late = 0  # GPU: segments whose host seconds outran their spin (timed at the host's pace)
        self.seg = 0.0  # the segment's seconds so far

    def take(self) -> float:
        """The segment's seconds; the next one starts at 0."""
        seconds, self.seg = self.seg, 0.0
        return seconds

    def pause(self) -> None:
        """One of the pool's calls begins: the model's segment ends. On a GPU its device seconds are its
        kernels' own, run back to back (resume)."""
        self.paused += 1
        if self.paused > 1:
            return
        seconds = host_s = time.perf_counter() - self.resumed_s
        if self.synced and not torch.cuda.is_current_stream_capturing():
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            if self.seg_start is not None:
                seconds = self.seg_start.elapsed_time(end) / 1e3
                self.late += host_s > self.spin_s
            self.recent_host_s.append(host_s)
            self.spin_s = min(SPIN_MAX_S, max(SPIN_MIN_S, SPIN_AHEAD * max(self.recent_host_s)))
        self.seg += seconds

    def resume(self) -> None:
        """The pool's call returns. On a GPU, once its kernels are done, a spin kernel holds back the
        segment's kernels until the host has launched them (most of them: SPIN_AHEAD times the most host
        seconds of the recent segments), so its timing events count their seconds and not the host's pace of
        launching them (which the pool's own work between segments slows down too)."""
        self.paused -= 1
        if self.paused:
            return
        if self.synced and not torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream().synchronize()
            tp.cuda_sleep(int(self.spin_s * _spin_cycles_per_s()))
            self.seg_start = torch.cuda.Event(enable_timing=True)
            self.seg_start.record()
        self.resumed_s = time.perf_counter()


class EventCounter:
    """A plan-running step's events: the plan's prefetches and waits are keyed by the recorded step's
    event numbers, which this finds by the save and the first use of each ordinal (`event_of`), not
    by counting: the saves inside a call the plan checkpoints are not seen. What a Recorder keeps
    besides is for making a plan, and this step runs one (a step that leaves the plan's shape makes
    the next steps record in full: PlanRunner.step_ended). With `tail_from` (the profile's last event)
    it times the step's tail from there to the next step's first save, as a Recorder times a segment
    (`tail()`: Profile.tail_s)."""

    full: ClassVar[Literal[False]] = False  # (against Recorder's: `rec.full` tells a type checker which)

    def __init__(
        self, event_of: dict[tuple[str, int], int] | None = None, tail_from: int | None = None, cuda=False
    ) -> None:
        self.event_of = event_of or {}
        self.tail_from = tail_from
        self.timing = tail_from is not None  # the pool's calls pause and resume the clock (Pool.own_work)
        self.cuda = cuda
        self.clock: SegmentClock | None = None
        self.depth = 0  # the pool's calls open now
        self.first_used: set[int] = set()
        self.used_at: dict[int, int] = {}  # event -> the device's bytes in use then (beside Plan.curve)
        self.backward_event: int | None = None
        self.away = 0
        self.regions_on = True

    def packed(self, ordinal: int, nbytes: int, used: int, tensor: Any = None) -> int:
        event = self.event_of.get(("p", ordinal), -1)
        self._at(event, used)
        return event

    def left(self, ordinal: int, nbytes: int) -> None:
        self.away += nbytes

    def used(self, ordinal: int, used: int) -> int | None:
        if ordinal in self.first_used:
            return None
        self.first_used.add(ordinal)
        event = self.event_of.get(("u", ordinal), -1)
        if self.backward_event is None:
            self.backward_event = event
        self._at(event, used)
        return event

    def _at(self, event: int, used: int) -> None:
        self.used_at[event] = used
        if event == self.tail_from and self.clock is None:
            # runs once the pool's calls return; its spin as long as a profiled step's longest
            self.clock = SegmentClock(self.cuda, self.depth, SPIN_MAX_S)

    def pause(self) -> None:
        self.depth += 1
        if self.clock is not None:
            self.clock.pause()

    def resume(self) -> None:
        self.depth -= 1
        if self.clock is not None:
            self.clock.resume()

    def tail(self) -> float | None:
        """The tail's seconds, once the next step's first save stopped its clock (then the clock goes)."""
        clock, self.clock = self.clock, None
        self.timing = False
        return clock.seg if clock is not None and clock.paused else None

    def died(self, ordinal: int) -> None:
        pass

    def pressed(self, demand: int) -> None:
        pass


class Recorder:
    """Records one step's events as it runs; `profile()` turns them into a Profile afterwards."""

    full: ClassVar[Literal[True]] = True
    timing = True

    def __init__(self, cuda: bool, timed: bool, watermark: Callable[[], tuple[int, int]] | None = None):
        self.cuda = cuda
        self.bytes: list[int] = []
        # The model's own rise between two events (Recorder.rises), from `watermark()`: the device's
        # bytes allocated now and the most since the last call (supermem's allocator; None: not kept)
        self.watermark = watermark
        self.seg_used: int | None = None  # the bytes allocated when the model's segment began
        self.rise = 0  # the model's own net bytes since the last event (its segments', not the pool's)
        self.peak_rise = 0  # the most the model's own bytes rose above the last event's, so far
        self.rises: list[int] = []  # per event: the most they rose in the interval that ended at it
        self.saved: dict[int, Saved] = {}  # ordinal -> record
        # storage address -> (its storage, weakly; the first save on it; the bytes the saves on it
        # span): Saved.counted
        self.storages: dict[int, tuple[Any, int, int, int]] = {}
        self.away = 0  # bytes of this step's entries off the device now
        # Autocast's cached weight copies (Cast.cached) on a GPU: their ordinals; the bytes of those that
        # left while autocast's cache held them (the allocator still counts them: away only once it let
        # go) and their storages, weakly; the first event after autocast exited, from which they free
        # what they hold (None: not yet)
        self.cached: set[int] = set()
        self.cached_away = 0
        self.cached_held: list[Any] = []
        self.cache_gone: int | None = None
        self.storage_refs: dict[int, Any] = {}  # ordinal -> its storage, weakly (on a GPU)
        # id(recipe) -> (its cost in seconds, or a call that measures it; ordinals; ready event; input
        # ordinals; kind; a region's start and end). Not the recipe itself: a region holds its inputs'
        # entries, which must die with the step.
        self.units: dict[int, tuple[Any, list[int], int, list[int], str, int | None, int | None]] = {}
        self.entry_s: list[float] = []  # host seconds to make each entry (Pool.pack_tensor)
        self.resaved: dict[int, set[int | None]] = {}  # Profile.resaved
        self.calls: list[tuple[int, tuple]] = []  # (id(module), kind) of each region call, in order
        self.no_bypass: set[int] = set()  # Profile.no_bypass
        self.no_light: set[int] = set()  # Profile.no_light
        self.capture_made: set[int] = set()  # Profile.capture_made
        self.call_outputs: dict[int, tuple[tuple[int, int], ...]] = {}  # Profile.call_outputs
        self.call_slots: dict[int, dict[int, int]] = {}  # Profile.call_slots
        self.backward_event: int | None = None
        # The step's pace without the pool's: its segments, the model's own work between two of the
        # pool's calls (SegmentClock); on a GPU timed to their kernels' end (profiling steps only)
        self.clock = SegmentClock(cuda and timed)
        self.segs: list[float] = []  # per event: the seconds of the segment that ended at it
        self.regions_on = True  # regions were hooked when the step began (their inputs are entries)
        # (last event before it, untreated bytes it asked for) per allocation that came to the pressure
        # handler: a transient between two events (the loss's temporaries) the curve must hold too
        self.pressure: list[tuple[int, int]] = []

    @property
    def events(self) -> int:
        return len(self.bytes)

    def pause(self) -> None:
        """One of the pool's calls (a hook, a module call's wrapper) begins: the model's segment ends."""
        if self.watermark is not None and not self.clock.paused and self.seg_used is not None:
            used, high = self.watermark()
            self.peak_rise = max(self.peak_rise, self.rise + high - self.seg_used)
            self.rise += used - self.seg_used
        self.clock.pause()

    def resume(self) -> None:
        self.clock.resume()
        if self.watermark is not None and not self.clock.paused:  # the pool's own bytes are not the model's
            self.seg_used = self.watermark()[0]

    def _cache_let_go(self) -> bool:
        """Whether autocast exited and its cache let the weight copies go (often before the loss): it is
        off here and, where the pool dropped copies, one of them is freed (another may live on in a
        save the pool keeps: a Linear called twice). Its state is this thread's: backward's events run
        on autograd's device thread, where it reads off while the autocast the program runs its
        backward in still holds the copies until after the step."""
        if torch.is_autocast_enabled("cuda"):
            return False
        return not self.cached_held or any(r() is None for r in self.cached_held)

    def _event(self, used: int) -> int:
        if self.cached and self.cache_gone is None and self._cache_let_go():
            self.away += self.cached_away
            self.cached_away = 0
            self.cache_gone = len(self.bytes)
        self.bytes.append(used + self.away)
        self.segs.append(self.clock.take())
        self.rises.append(self.peak_rise)
        self.rise = self.peak_rise = 0
        return len(self.bytes) - 1

    def pressed(self, demand: int) -> None:
        """An allocation would take the device to `demand` bytes (over the budget) now. Not a point of
        the step's curve when the allocation is the pool's own work (the clock paused by that work and
        by the pressure handler's own call): a recorded step's restores and rebuilds are its reactive
        fallback's, not the step's, and a restored entry's bytes would count twice (still `away`)."""
        if self.events and self.clock.paused <= 1:
            self.pressure.append((self.events - 1, demand + self.away))

    def packed(self, ordinal: int, nbytes: int, used: int, tensor: torch.Tensor | None = None) -> int:
        """`tensor`, saved as `ordinal`: its storage is compared with the saves before it (Saved.counted)."""
        i = self._event(used)
        s = self.saved[ordinal] = Saved(ordinal, nbytes, i, -1)
        if tensor is not None:
            self._count_storage(s, tensor)
        return i

    def _count_storage(self, s: Saved, t: torch.Tensor) -> None:
        """Saved.counted and .shared: against the save that first held `t`'s storage, while the storage
        lives (one freed and allocated again is another tensor's). The weak reference is to the storage:
        the view autograd's hook is given dies with the hook, the storage's object lives as it does."""
        storage = t.untyped_storage()
        ptr, lo = storage.data_ptr(), int(t.storage_offset()) * t.element_size()
        hi = lo + s.nbytes
        held = self.storages.get(ptr)
        if held is not None:
            ref, ordinal, a, b = held
            if ref() is not None:
                s.counted = max(0, min(hi, a) - lo) + max(0, hi - max(lo, b))
                s.shared = self.saved[ordinal].shared = True
                self.storages[ptr] = (ref, ordinal, min(a, lo), max(b, hi))
                self.storage_refs[s.ordinal] = ref
                return
        ref = self.storage_refs[s.ordinal] = weakref.ref(storage)
        self.storages[ptr] = (ref, s.ordinal, lo, hi)

    def left(self, ordinal: int, nbytes: int) -> None:
        """`nbytes` of save `ordinal` left the device (came back: negative); a save that shares its
        storage counts its own part of them (Saved.counted)."""
        s = self.saved.get(ordinal)
        if s is not None and s.counted != s.nbytes:
            nbytes = (1 if nbytes > 0 else -1) * (abs(nbytes) * s.counted // max(1, s.nbytes))
        if self.cache_gone is None and ordinal in self.cached:
            self.cached_away += nbytes
            ref = self.storage_refs.get(ordinal)
            if nbytes > 0 and ref is not None:
                self.cached_held.append(ref)
        else:
            self.away += nbytes

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
                if self.cuda and getattr(recipe, "cached", False):  # (on CPU the pool counts its own bytes)
                    self.cached.add(o)

    def profile(
        self,
        spike_bytes: int,
        link_bytes_per_s: float,
        sync_copies: bool,
        host_s: Any = None,
        host_copy_s: float = 0.0,
        compress_price: tuple[float, float, float, float] | None = None,
    ) -> Profile:
        """`host_s(kind)`: host seconds of one rebuild of that kind of recipe; a unit costs the larger of
        its device and host seconds (where the host is the slower side, the host's are the step's),
        plus, but for a region (a plan runs those light: Plan.light), what making an entry
        of each member costs the host in the forward (the median this step took to make one): a
        planned step's forward is host-bound on the H100 hosts, ~55 us an entry against a GELU's
        0.05 ms replay. A non-region unit's price in a lean call (unit_lean_s) counts costs.LEAN_SHARE of
        both host costs. `host_copy_s`: host seconds to issue one copy."""
        n = self.events
        entry_s = statistics.median_high(self.entry_s) if self.entry_s else 0.0
        times = list(itertools.accumulate(self.segs))
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
            step_s=sum(self.segs) + self.clock.seg,
            tail_s=self.clock.seg,
            host_copy_s=host_copy_s,
            compress_s_per_byte=compress_price[0] if compress_price else 0.0,
            compress_wait_s=compress_price[2] if compress_price else 0.0,
            compress_host_s=compress_price[3] if compress_price else 0.0,
            entry_s=entry_s,
            kept_s=costs.KEPT_SHARE * entry_s,
            resaved={o: set(at) for o, at in self.resaved.items()},
            no_bypass=set(self.no_bypass),
            no_light=set(self.no_light),
            capture_made=set(self.capture_made),
            call_outputs=dict(self.call_outputs),
            calls=tuple(self.calls),
            call_slots=dict(self.call_slots),
        )
        if p.backward_event < n:
            p.transient_bytes[p.backward_event] = spike_bytes
        for i, demand in self.pressure:
            p.transient_bytes[i] = max(p.transient_bytes[i], demand - p.base_bytes[i])
        for i in range(1, len(self.rises)):  # what the model allocated above an event before the next
            p.transient_bytes[i - 1] = max(p.transient_bytes[i - 1], self.rises[i])
        for k, (cost, ordinals, ready, inputs, kind, start, end) in enumerate(self.units.values()):
            if callable(cost):
                cost = cost()
            if cost is None or not ordinals:
                continue
            host = host_s(kind) if host_s is not None else 0.0
            if kind != "Region":
                members_s = len(set(ordinals)) * entry_s
                p.unit_lean_s[k] = max(cost, costs.LEAN_SHARE * host) + costs.LEAN_SHARE * members_s
                cost = max(cost, host) + members_s
            else:
                cost = max(cost, host)
            if all(o in self.cached for o in ordinals):  # freed by autocast's exit, not by their drop
                ready = max(ready, self.cache_gone if self.cache_gone is not None else n)
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


_cycles_per_s: list[float] = []


def _spin_cycles_per_s() -> float:
    """torch.cuda._sleep's cycles per second on this device, measured once (its kernel loaded first)."""
    if not _cycles_per_s:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        tp.cuda_sleep(1)
        start.record()
        tp.cuda_sleep(10**6)
        end.record()
        end.synchronize()
        _cycles_per_s.append(10**6 / max(start.elapsed_time(end) / 1e3, 1e-6))
    return _cycles_per_s[0]
