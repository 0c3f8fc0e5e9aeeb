"""The tensor pool: autograd's saved tensors, kept under a device memory budget.

Entered through torch.autograd.graph saved-tensor hooks, every tensor saved for backward becomes an
Entry of the current Step. When device memory would exceed the budget, the policy picks which entries
leave the device and by which treatment (treatments.py): offload to pinned host memory (asynchronously,
on the copy engine's D2H stream, as soon as they are saved; prefetched back during backward as far
ahead as the budget has room) or recompute (dropped, and rebuilt by replaying the module call that made
them, region.py, or the cheap op that made them, op_replay.py). With supermem's allocator installed,
the pool is also its pressure handler: before an OOM is raised, entries leave synchronously.

Budget: device bytes for everything on the device (parameters, gradients, temporaries and the
activations the pool keeps), measured from the allocator as the step runs. Between the pool's moves
the step allocates transients it cannot see coming (the loss, say); with supermem's allocator the pool
reads each step's true peak and lowers its working target by the overshoot, so after a step or two
the peak settles at the budget. On CPU, where there is no device, the budget is the bytes of saved
tensors the pool keeps.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import torch

from .. import costs, events
from ..errors import ConfigError
from ..policies import Choice, make_policy
from ..transfer.copy import CopyEngine
from ..transfer.host import shared_host_pool
from ..units import format_bytes, parse_bytes
from .cast import Cast, autocast_copy_of
from .compiled import CompiledGraphs
from .entry import Entry, Kept, PlanKept, State, alive_anyway, check_version, dedup_key, movable
from .labels import label, recording
from .op_replay import OpReplays
from .plan_run import PlanRunner, Resting
from .planner import Plan
from .profile import EventCounter, Recorder
from .regions import Regions
from .stats import PoolStats
from .step import NO_EARLY_CALL, Step
from .treatments import Offload, Recompute, Treatment, checked_treatments

PREFETCH_SCAN = 64  # entries looked at, going back from the one just used, for prefetch
CANDIDATES = 32  # least recently used entries priced per decision (the stalest score best anyway)


class Pool(PlanRunner):
    """Keeps saved activations under `budget` by offloading them to pinned host memory and by
    recomputing them, bringing them back for backward.

    budget: device bytes (int, "8GiB", "60%" or 0.6 of the card); None: act only when the supermem
        allocator would otherwise run out of memory. On CPU: bytes of saved tensors kept.
    policy: a name from supermem.policies ("lru": offload least recently used; "cost_aware": offload
        or recompute, whichever frees bytes at the least exposed cost; "planned": profile the first
        step of each shape, plan every saved tensor's treatment, run the plan after). Default: planned
        when a budget is given (faster than cost_aware at 7 of the 10 budgets of an H100 sweep, and at
        every one of 60-90% of native's peak: docs/measurements.md#planned-against-cost_aware), else
        cost_aware.
    host_limit: pinned host bytes the pool may use (int, size string or percentage of host RAM).
    min_bytes: smaller saved tensors stay where they are (default 1 MiB on GPU, 0 on CPU).
    treatments: the ways out, objects or names ("offload", "recompute", "compress", "compress:full";
        or one string, "offload,compress"), default offload and recompute; the policy chooses among them.
    graphs: on CUDA, the backward of calls a plan runs light replays CUDA graphs where a structure
        repeats (light_graphs.py); False runs them eagerly.
    """

    def __init__(
        self,
        budget: int | float | str | None = None,
        policy: str | None = None,
        host_limit: int | float | str | None = "50%",
        *,
        device: torch.device | str | None = None,
        min_bytes: int | None = None,
        treatments: tuple[Treatment | str, ...] | str | None = None,
        graphs: bool = True,
    ):
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.device.type != "cpu" and not (self.cuda and torch.cuda.is_available()):
            raise ConfigError(f"bad pool option device={device!r}: give cpu, or cuda where PyTorch has CUDA")
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        total = torch.cuda.get_device_properties(self.device).total_memory if self.cuda else None
        self._device_total = total
        if budget is not None and total is None and _is_fraction(budget):
            raise ConfigError(
                f"bad pool option budget={budget!r}: a fraction or percentage needs a device total, and "
                f"{self.device} has no device memory to take it of; give bytes (e.g. 64MiB)"
            )
        self.budget_bytes = None if budget is None else _size("budget", budget, total)
        if policy is None:  # a plan needs a budget to plan under
            policy = "planned" if budget is not None else "cost_aware"
        self.policy = _checked("policy", make_policy, policy)
        if not isinstance(graphs, bool):
            raise ConfigError(f"bad pool option graphs={graphs!r}: give True or False")
        if min_bytes is not None and (type(min_bytes) is not int or min_bytes < 0):
            raise ConfigError(f"bad pool option min_bytes={min_bytes!r}: give an int >= 0 (bytes)")
        self.graphs = graphs
        self._light_graphs: Any = None  # LightGraphs, made at the first light call on CUDA
        self.planning = self.policy.plans
        self._plans: dict[tuple[int, ...], Plan] = {}  # by shape signature (bytes per saved tensor)
        self._plan: Plan | None = None  # the plan this step runs (or the last one made)
        self._plan_ok = False  # this step matches the plan so far
        self._rec: Recorder | EventCounter | None = None  # this step's timeline (planned policy)
        self._record_full = False  # a step left its plan's shape: record in full until one is planned
        self._by_ordinal: dict[int, weakref.ref[Entry]] = {}  # this step's entries, for the plan
        self._plan_pending: list[weakref.ref[Entry]] = []  # planned for recompute, their call still running
        self._last_spike = 0  # the last step's true peak above the most the pool saw
        self._last_peak_bytes = 0  # the last step's measured peak
        self._early_plan: Any = NO_EARLY_CALL  # the plan a call before the next step's opening ran under
        # the device's highest bytes up to the last exit from this pool's contexts, since the last step's
        # end; how many are entered now (_watch)
        self._inside_peak = 0
        self._entered = 0
        self._outside = False  # the last exit came after its step: the watermark from then is not its
        self._plan_aim: dict[tuple[int, ...], int] = {}  # by signature: plan this far below the budget
        self._replans: dict[tuple[int, ...], int] = {}  # by signature: plans that overshot
        self._said_infeasible: set[tuple[int, ...]] = set()  # signatures whose budget no plan met (said once)
        self._profiles: dict[tuple[int, ...], Any] = {}  # by signature: the profile its plans come from
        # A plan that moves nothing: the steps entered through the pool run without its hooks (_rests)
        self._resting = False
        self._rest_never = False  # woken once: it rests no more
        self._rest_calls: tuple = ()  # the resting plan's recorded calls
        self._rest_k = 0  # the resting step's region calls so far
        self._rest_params: list[weakref.ref] = []  # the model's parameters, and whether each needs grad
        self._rest_grads: tuple[bool, ...] = ()
        self._last_step_s = 0.0  # the last step's measured duration (host clock)
        self._step_peak = 0
        chosen = checked_treatments(treatments) if treatments is not None else ()
        self.treatments = {t.name: t for t in chosen or (Offload(), Recompute())}
        self._by_kind: dict[str, Treatment] = {}  # what the plan uses for each kind: the first given
        for t in self.treatments.values():
            self._by_kind.setdefault(t.kind, t)
        # the treatment that rebuilds from recipes, where the policy may use it: regions are profiled
        # and op recipes made only then
        self._rebuilder = next(
            (t for t in self.treatments.values() if t.rebuilds and t.kind in self.policy.kinds), None
        )
        self._settlers = [t for t in self.treatments.values() if type(t).settle is not Treatment.settle]
        host_bytes = _size(
            "host_limit", "50%" if host_limit is None else host_limit, psutil.virtual_memory().total
        )
        self.host = shared_host_pool(self.device, host_bytes)  # one per device, shared with the streamer
        self.copies = CopyEngine(self.device)
        self.host.copy_streams.update(self.copies.stream_ids)
        self.min_bytes = (1 << 20 if self.cuda else 0) if min_bytes is None else min_bytes
        self.regions = Regions(self)
        self.op_replays = OpReplays(self)
        # op recipes are made only where the policy may recompute (their first run verifies them)
        self._op_recipes = self._rebuilder is not None
        self.compiled = CompiledGraphs()  # torch.compile'd graphs' saved tensors: left to the compiler
        self._lock = threading.RLock()
        self.closed = False  # close() was called (supermem.pool(...) then makes a new one)
        self._entries: dict[int, weakref.ref[Entry]] = {}  # live entries by pack order
        self._seqs: list[int] = []  # pack order, with dead seqs compacted away now and then
        self._lru: dict[int, weakref.ref[Entry]] = {}  # resident entries, least recently used first
        self._dedup: dict[tuple, weakref.ref[Entry]] = {}  # live entries by tensor identity
        self._tick = 0
        self._steps = 0
        self._step: Step | None = None
        self._last_forward_s = 0.0  # the previous step's forward: what bounds hidden copies
        self._device_bytes = 0  # held by entries: resident tensors and away payloads on the device
        self._kept_bytes = 0  # held by the plan's PlanKept tensors (no entries)
        self._kept_live = 0  # PlanKept tensors alive
        self._unseen_live = 0  # calls the pool did not see (light.py: _Alive) whose saves autograd holds
        self._passthrough = False  # saves not the step's (checkpoint's own of its inputs): left alone
        self._margin = 0  # learned: how far a step's peak rises above the most the pool saw (bytes)
        self._seen_peak = 0  # the most device memory the pool saw in use during this step
        self._busy_s = 0.0  # minus the seconds spent fitting the budget (CPU region timing)
        self._left = False  # did anything leave the device during this step (or pressure come)
        self._capture = True  # capture regions this step (off when the last step did not need them)
        self._largest_entry = 0
        self._in_use: list[Entry] = []  # entries being materialized (under the lock): never chosen
        self._counters = dict.fromkeys(
            (
                "packed",
                "offloads",
                "dropped",
                "recomputes",
                "prefetches",
                "sync_restores",
                "host_full",
                "pressure_calls",
                "backpressure_waits",
                "plans",
                "replans",
                "plan_misses",
                "light_calls",
                "bypassed_calls",
                "lean_calls",
                "lean_drops",
                "replays",
                "graph_replays",
                "rest_steps",
                "rest_wakes",
                "offloaded_bytes",
                "dropped_bytes",
            ),
            0,
        )
        self._prefetched_bytes = 0
        self._peak_resident_bytes = 0
        self._local = threading.local()  # per thread: the stack of entered hook contexts
        self.always_active = False  # SUPERMEM_CONF's pool: hooks pushed for every thread's backward
        self._pressure_registered = False
        self._soft: Any = None  # the allocator keeping the budget as its soft limit (supermem's, on CUDA)
        self._alloc: Any = None  # supermem's allocator of the device, once it exists
        self._away_to_fetch: set[int] = set()  # seqs off the device by a treatment that prefetches
        self._urgent = False  # pricing for the pressure handler: every byte is needed now
        # Host seconds of each kind of rebuild (its own: nested rebuilds and pressure calls left out),
        # the last ones: where the host is the slower side, a rebuild costs the step these.
        self._host_s: dict[str, collections.deque[float]] = {}
        self._frames: list[float] = []  # per rebuild or pressure call running: its inner ones' seconds
        _serve_to_top(self)

    # ------------------------------------------------------------------ activation

    def __enter__(self) -> Pool:
        """Re-entrant, and per thread: saved-tensor hooks are thread-local, so each thread keeps its
        own stack of entered contexts."""
        self._start()
        self._watch(+1)  # (first: the watermark since the last exit is not the step's, nor _rests')
        stack = self._local.__dict__.setdefault("stack", [])
        if self._rests(outermost=not stack):
            stack.append(Resting())
        else:
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            hooks.__enter__()
            stack.append(hooks)
        return self

    def __exit__(self, *exc: Any) -> None:
        stack = self._local.stack
        stack.pop().__exit__(*exc)
        if stack and isinstance(stack[-1], Resting) and not self._resting:  # woken inside: the hooks
            stack[-1].wake(self)  # stay on in the context around
        self._watch(-1)

    def _watch(self, entered: int) -> None:
        """The step's measured peak leaves out what runs outside the pool's contexts between steps (a
        training step without the pool, at native's peak): at the last exit, if the step is over, the
        device's watermark so far is kept and the one up to the next entry let go. Without it, GPT-24's
        planned steps taken between native ones each overshot by native's peak, and the plans made
        lower for it were infeasible. (A step whose backward runs after the exit keeps counting.)"""
        alloc = self._supermem_allocator() if self.budget_bytes is not None else None
        if alloc is None:
            return
        with self._lock:
            if self._entered == 0 and entered > 0 and self._outside:
                alloc.take_watermark()
                self._outside = False
            self._entered += entered
            if self._entered == 0 and self._between_steps():
                self._inside_peak = max(self._inside_peak, alloc.take_watermark())
                self._outside = True

    def _start(self) -> None:
        self._register_pressure_handler()
        self._keep_budget()
        if self._rebuilder is not None:
            self.regions.start_profiling()

    def _active_here(self) -> bool:
        return self.always_active or bool(getattr(self._local, "stack", None))

    def _register_pressure_handler(self) -> None:
        if self._pressure_registered or not self.cuda:
            return
        from ..registry import installed

        if installed():
            from .. import _C

            # its own device's allocator only: under DDP each rank's pool, and in one process one pool
            # per device, offloads only where memory is short
            _C.plugin_add_pressure_handler(_weak_method(self._on_pressure), self.device.index)
            self._pressure_registered = True

    def _keep_budget(self) -> None:
        """The budget becomes the allocator's soft limit: an allocation the pool never sees coming (the
        loss's temporaries, a workspace) that would take the device over it first makes entries leave,
        through the pressure handler. Needs supermem's allocator, and its device allocator made. Set at
        each entry: of two pools used in turn on one device, each step runs under its own pool's (the
        limit was the last made pool's, and a pool at 75% of GPT-24's peak stepped under 55%'s)."""
        if self.budget_bytes is None or not self._pressure_registered:
            return
        alloc = self._supermem_allocator()
        if alloc is not None:
            if alloc.soft_limit_bytes != self.budget_bytes:  # (setting it arms it: one pool's stays as is)
                alloc.soft_limit_bytes = self.budget_bytes
            if self._soft is None:
                self._soft = alloc
                weakref.finalize(self, _drop_soft_limit, alloc, self.budget_bytes)

    # ------------------------------------------------------------------ hooks

    def _own(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)`, the pool's own work: a step being recorded takes its pace without it
        (Recorder.pause)."""
        rec = self._rec
        if rec is None or not rec.timing:
            return fn(*args)
        rec.pause()
        try:
            return fn(*args)
        finally:
            rec.resume()

    def _pack(self, t: torch.Tensor) -> Any:
        if self._passthrough:
            return t
        if recording():  # (checked here: a range, even an empty one, costs every saved tensor)
            with label("pack"):
                return self._own(self._pack_saved, t)
        return self._own(self._pack_saved, t)

    def _pack_saved(self, t: torch.Tensor) -> Any:
        if self.compiled.saved_by_graph(t):
            return Kept(t)  # moving it would cost time and save nothing: compiled.py
        if self._plan_ok and self.regions.top() is None:
            packed = self._lean_pack(t)  # plan_run.py: a running plan's common saves, fast
            if packed is not None:
                return packed
        packed = self._pack_tensor(t)
        region = self.regions.top()
        if region is not None:
            region.saw(packed, t)  # before the budget is fitted: the region may claim it
        t0 = 0.0 if self.cuda else time.perf_counter()
        with self._lock:
            if isinstance(packed, Entry):
                self._fit_budget()
            else:  # a small or kept tensor: no fitting, but what finished in the background still goes
                self._settle()
        if not self.cuda:  # region timers on CPU leave the pool's work out (on a GPU they time kernels)
            self._busy_s -= time.perf_counter() - t0
        return packed

    def _settle(self) -> None:
        """What finished in the background frees (only treatments that work in the background)."""
        for treatment in self._settlers:
            treatment.settle(self)

    def _left_alone(self, t: torch.Tensor) -> Any:
        """What the pool does not track: `t` itself where it is not ours to move (sparse, nested, meta,
        subclasses: no version to check either), a Kept where moving it frees nothing or is not worth
        it (its version still checked at unpack); None for a tensor the pool tracks."""
        if not movable(t):
            return t
        if (
            t.device != self.device
            or t.numel() * t.element_size() < max(self.min_bytes, 1)
            or alive_anyway(t)
        ):
            return Kept(t)
        return None

    def _own_outputs(self, start: int, outputs: list) -> tuple[tuple[int, int], ...]:
        """(ordinal, index among `outputs`) of each output tensor the call starting after `start` saves
        saved itself (Profile.call_outputs)."""
        out = []
        for k, t in enumerate(outputs):
            ref = self._dedup.get(dedup_key(t))
            e = ref() if ref is not None else None
            if e is not None and e.source() is t and getattr(e, "ordinal", 0) > start:
                out.append((e.ordinal, k))
        return tuple(out)

    def _saved_in_open_region(self, e: Any) -> bool:
        """Whether `e` was first saved inside the region call open now (saved again, by that call)."""
        start = getattr(self.regions.top(), "start", None)
        return start is not None and getattr(e, "ordinal", 0) > start

    def _pack_tensor(self, t: torch.Tensor, saved: bool = True) -> Any:
        """`saved`: autograd saves `t` (False: a region keeps its input for a replay)."""
        left = self._left_alone(t)
        if left is not None:
            return left
        t0 = time.perf_counter()
        key = dedup_key(t)
        with self._lock:
            step = self._current_step()
            self._tick += 1
            same = self._dedup.get(key)
            same = same() if same is not None else None
            if same is not None and same.source() is t:  # saved twice: one entry
                if type(same) is not PlanKept:
                    self._touch(same)
                if (
                    saved
                    and self._rec is not None
                    and self._rec.full
                    and not self._saved_in_open_region(same)
                ):
                    at = getattr(self.regions.top(), "start", None)
                    self._rec.resaved.setdefault(same.ordinal, set()).add(at)
                return same
            if self._plan_ok and step.ordinals + 1 in self._plan.lean:
                kept = self._plan_kept(t, key, step)
                if kept is not None:
                    return kept
            seq = self._tick
            e = Entry(self, seq, t, key, step)
            param = autocast_copy_of(t)
            if param is not None:
                e.recipe = Cast(param, t)
            elif self._op_recipes:
                e.recipe = self.op_replays.recipe_for(e, t)
            if self._op_recipes:
                self.op_replays.remember(e, t)
            step.saved_bytes += e.nbytes
            self._largest_entry = max(self._largest_entry, e.nbytes)
            self._entries[seq] = weakref.ref(e)
            self._seqs.append(seq)
            self._dedup[key] = weakref.ref(e)
            self._counters["packed"] += 1
            self._add_resident(e)  # at the LRU's most recent end already: only its use is stamped
            self._tick += 1
            e.last_use = self._tick
            if self._rec is not None:
                if self._rec.full:  # what an entry costs the host to make (its units' price: profile.py)
                    self._rec.entry_s.append(time.perf_counter() - t0)
                self._planned_pack(e)
                if not saved and self._rec.full:  # a region's input, an entry only for its replay
                    self._rec.capture_made.add(e.ordinal)
            return e

    def _unpack(self, packed: Any) -> torch.Tensor:
        if recording():
            with label("unpack"):
                return self._own(self._unpack_saved, packed)
        return self._own(self._unpack_saved, packed)

    def _unpack_saved(self, packed: Any) -> torch.Tensor:
        if type(packed) is PlanKept:
            return self._unpack_kept(packed)
        if type(packed) is Kept:
            self._backward_began()
            if self.regions.phase == "profiling":  # backward began, and maybe no entry was saved at all
                with self._lock:
                    self.regions.end_profiling()
            return packed.unpack()
        if not isinstance(packed, Entry):
            return packed
        check_version(packed)
        with self._lock:
            if self.regions.phase == "profiling":
                self.regions.end_profiling()
            event = self._used(packed)
            t = self._materialize(packed)
            self._touch(packed)
            if self._plan_ok:
                if event is not None:
                    self._plan_events(event)
            else:
                self._prefetch_before(packed)
            return t

    def _used(self, x: Entry | PlanKept) -> int | None:
        """Backward unpacked `x` (under the lock): its step's backward began, and its first use is an
        event of the step being recorded or run by a plan (None for a later use)."""
        if x.step.backward_s is None:
            x.step.unpacked()
        if self._rec is None or x.step is not self._step:
            return None
        return self._rec.used(x.ordinal, self._used_bytes())

    def _forget(self, x: Entry | PlanKept) -> None:
        """`x` died (under the lock): its dedup key goes (unless a newer save holds it) and the step
        being recorded notes its end."""
        ref = self._dedup.get(x.key)
        if ref is not None and ref() in (x, None):
            del self._dedup[x.key]
        if self._rec is not None and x.step is self._step:
            self._rec.died(x.ordinal)

    def _unpack_input(self, packed: Any) -> Any:
        """A region's input for its replay (materialized; recursively replayed if it was dropped)."""
        if isinstance(packed, Entry):
            check_version(packed)
            return self._materialize(packed)
        if isinstance(packed, Kept):
            return packed.unpack()
        return packed

    def _current_step(self) -> Step:
        """A new step starts at the first tensor saved after backward began, or on an empty pool."""
        s = self._step
        if self._between_steps():
            if s is not None and s.forward_s is not None:
                self._last_forward_s = s.forward_s
            if self.regions.phase == "profiling" and self._steps:
                self.regions.end_profiling()  # the first step ended without a backward
            self._learn_margin()  # a new step begins: the last one's peak is known
            self.copies.collect()  # finished copy timings: the link rate the policy prices copies at
            if s is not None:
                self._step_ended(s)
            self._capture = self._needed_last_step()
            self._left = False
            self._steps += 1
            s = self._step = Step(self._steps, self.cuda)
            s.early_plan, self._early_plan = self._early_plan, NO_EARLY_CALL
            if self.planning and self.budget_bytes is not None:
                self._plan_ok = self._plan is not None
                if self._plan_ok and not self._record_full:
                    # a plan runs: its events only (and its first step's tail timed)
                    self._rec = EventCounter(self._plan.event_of, self._tail_from(), self.cuda)
                else:
                    self._rec = Recorder(self.cuda, timed=not self._plan_ok, watermark=self._marks())
                    self._rec.calls = self.regions.early_calls  # (made before the step's first save)
                self.regions.early_calls = []
                self._rec.regions_on = self.regions.phase != "profiling"  # ("off": a pool without them)
                self._by_ordinal = {}
                self._plan_pending = []
        return s

    def _between_steps(self) -> bool:
        """The next save starts a step: none yet, its backward began, every tensor saved so far died
        (a forward with no backward, say; PlanKept tensors count: a plan keeping everything holds no
        entry)."""
        s = self._step
        return (
            s is None
            or s.backward_s is not None
            or not (self._entries or self._kept_live or self._unseen_live)
        )

    def _backward_began(self) -> None:
        """Backward unpacked a tensor the pool left alone, or went through a call it did not see: the
        step's backward began, though none of its entries may be unpacked (every call unseen; on an
        H100 a ResNet-152 planned step now and then ran on into the next one's image: a plan miss, and
        a step of the reactive fallback, 2 s)."""
        s = self._step
        if s is not None and s.backward_s is None:
            s.unpacked()

    def _region_start(self) -> int | None:
        """Whether a region starting now is captured: None if not, else the step's saves so far (0
        between steps: a region call comes before the next step's first save, and the next step's
        decision is taken). A step that runs a feasible plan (without recording) captures only the
        calls the plan replays or runs unseen, known by that count: capturing the rest cost ~40 us
        each on a CPU for nothing, on the host that bounds a planned step."""
        s = self._step
        if self._between_steps():
            self._early_plan = self._plan  # what decides this call (the step opens later: Step.early_plan)
            if not self._needed_last_step():
                return None
            if self._record_full or self._plan is None or not self.planning:
                return 0
            # the step's shape is not known yet: captured if a plan of any shape may replay it
            plans = self._plans.values()
            return 0 if any(not p.feasible or p.captured(0) for p in plans) else None
        else:
            if not self._capture:
                return None
            start, plan = s.ordinals, self._plan if self._plan_ok and not self._rec.full else None
        if plan is None or not self.planning or not plan.feasible:
            return start
        return start if plan.captured(start) else None

    def _needed_last_step(self) -> bool:
        """Capture regions only when the pool may need them: on the first steps, and after a step in
        which something left the device (an unneeded budget costs nothing per region; a step that
        newly needs room offloads, and the next one captures)."""
        return self._steps < 2 or self._left or self.planning  # a plan's ordinals count the regions' inputs

    # ------------------------------------------------------------------ moving entries

    def _fit_budget(self) -> None:
        if self.budget_bytes is None:
            return
        if self._soft is None:
            self._keep_budget()
        self._settle()  # what finished in the background frees before the pool measures
        target = self._target()
        over = self._used_bytes() - target
        if over <= 0:
            return
        # A little below the target, so the next few saves do not each need a decision of their own.
        over += min(self._largest_entry, target // 16)
        # Ranked all the way down: when a treatment cannot (host memory full), the next choice frees.
        for c in self.policy.choose(self._choices(CANDIDATES), 1 << 62, self._tick):
            t = self.treatments[c.treatment]
            for e in c.frees:
                if e.state is State.RESIDENT and e.tensor is not None and self._leave(e, t):
                    over -= e.nbytes - t.device_bytes(e)  # a compressed entry keeps its payload
            if over <= 0:
                break

    def _region_done(self, region: Any = None, outputs: list | None = None) -> None:
        """A region's entries just became recomputable: they may be what the budget needs (or what
        the plan said to drop). `outputs`: the call's output tensors."""
        # Under the lock: another thread's entry may die meanwhile, and a dying entry is still reached
        # by its weak references while its __del__ waits for the lock (found with two threads training
        # through one pool: an entry left with its tensor gone, 'NoneType' has no attribute 'data_ptr').
        with self._lock:
            self._region_done_locked(region, outputs)

    def _region_done_locked(self, region: Any, outputs: list | None) -> None:
        if self._rec is not None and self._rec.full and region is not None:
            self._rec.call_outputs[region.start] = self._own_outputs(region.start, outputs or [])
            self._rec.call_slots[region.start] = region.places
            own = [
                x
                for ref in region.slots
                if ref is not None and (x := ref()) is not None and x.recipe is region
            ]
            regions, module = self.regions, region.module
            self._plan_recipe(
                region, own, lambda: regions.cost_s(module), start=region.start, end=self._step.ordinals
            )
        if self._plan_pending:
            still = []
            for ref in self._plan_pending:
                x = ref()
                if x is None or x.recipe is None or x.state is not State.RESIDENT:
                    continue
                if x.recipe.ready:
                    self._leave(x, self._by_kind["recompute"])
                else:
                    still.append(ref)
            self._plan_pending = still
        self._fit_budget()

    def _choices(self, limit: int | None = None) -> list[Choice]:
        """The policy's ways to free bytes now, over the `limit` least recently used resident entries
        that one of its treatments can take (entries none can take do not use up the window)."""
        ways = [t for t in self.treatments.values() if t.kind in self.policy.kinds]

        def takeable(e: Entry) -> bool:
            return not any(e is x for x in self._in_use) and any(t.applies(e) for t in ways)

        resident = self._resident_entries(limit, takeable)
        out = []
        for t in ways:
            out += t.choices(self, resident)
        return out

    def _leave(self, e: Entry, t: Treatment) -> bool:
        """Takes a resident entry off the device by treatment `t`; False when `t` cannot."""
        if e.treatment is not None and e.treatment is not t:
            e.treatment.forget(self, e)
        with label(t.name):
            if not t.leave(self, e):
                return False
        if t.events is not None:
            events.emit(
                t.events[0], e.nbytes, e.tensor.data_ptr(), self.device_index, e.seq, "activation", t.name
            )
        e.treatment = t
        self._drop_resident(e)
        if t.prefetch:
            self._away_to_fetch.add(e.seq)
        self._device_bytes += t.device_bytes(e)
        if self._rec is not None and e.step is self._step:
            self._rec.left(e.ordinal, e.nbytes - t.device_bytes(e))
        self._left = True
        return True

    def _come_back(self, e: Entry) -> None:
        """Starts bringing `e` back by its treatment."""
        with label(e.treatment.name, ".restore"):
            e.treatment.come_back(self, e)

    def _materialize(self, e: Entry) -> torch.Tensor:
        self._in_use.append(e)  # a replay's allocations may call the pressure handler: not this one
        try:
            if e.state in (State.LEAVING, State.AWAY):  # not brought back in time: compute waits
                self._counters["sync_restores"] += 1
                t0 = time.perf_counter()
                sampled = self._host_bound_now()
                self._frames.append(0.0)
                try:
                    self._come_back(e)
                finally:
                    rebuilt = e.treatment.rebuilds and e.recipe is not None
                    self._frame_end(t0, type(e.recipe).__name__ if rebuilt and sampled else None)
            if e.state is State.RETURNING:
                e.treatment.ready(self, e)
            return e.tensor
        finally:
            self._in_use.pop()

    def _host_bound_now(self) -> bool:
        """Whether a rebuild starting now samples its kind's host cost: on CPU always; on a GPU in a
        step recorded for a plan, only where the compute stream has nothing queued (the GPU waits for
        the host, whose seconds are then the step's). Where the GPU is busy the rebuild costs the step
        its device seconds, and the host's include waits for room in a full launch queue: a GPT-24
        block replay was priced at 100 ms so on an H100, and the plan never replayed a block."""
        if not self.cuda:
            return True
        if self._rec is None or not self._rec.full:
            return False
        return torch.cuda.current_stream(self.device).query()

    def _frame_end(self, t0: float, kind: str | None = None) -> None:
        """A rebuild or pressure call that began at `t0` ended: its seconds count as its outer one's
        inner time; a rebuild's own seconds are a sample of its kind's host cost."""
        s = time.perf_counter() - t0
        inner = self._frames.pop()
        if self._frames:
            self._frames[-1] += s
        if kind is not None:
            self._host_s.setdefault(kind, collections.deque(maxlen=64)).append(s - inner)

    def _host_cost_s(self, kind: str) -> float:
        """Host seconds of one rebuild of `kind`: the least of the last ones (0 before one ran). The
        least, as for device seconds: a first call of a shape pays one-time costs (GPT-24's first
        block replay on an H100: 123 ms, 84 of them cuDNN building its attention plan; the next: 2)."""
        samples = self._host_s.get(kind)
        return min(samples) if samples else 0.0

    def _prefetch_before(self, e: Entry) -> None:
        """Prefetches the entries of the same step saved just before `e`: backward needs them next."""
        if not self._away_to_fetch:
            return  # nothing to bring back: no scan (this runs at every unpack)
        room = self._target() - self._used_bytes()
        pos = bisect.bisect_left(self._seqs, e.seq)
        for seq in reversed(self._seqs[max(0, pos - PREFETCH_SCAN) : pos]):
            ref = self._entries.get(seq)
            x = ref() if ref is not None else None
            if x is None or x.step is not e.step or x.state not in (State.LEAVING, State.AWAY):
                continue
            if not x.treatment.prefetch:
                continue
            if x.nbytes > room:
                break
            room -= x.nbytes
            self._come_back(x)
            self._counters["prefetches"] += 1
            self._prefetched_bytes += x.nbytes

    def _on_pressure(self, need_bytes: int) -> int:
        """The allocator is about to fail, or an allocation would take the device over the budget (its
        soft limit): entries leave, cheapest first by the policy, priced as urgent (a copy hides
        nothing now, offloads wait for theirs, so recompute wins where it is cheap), until the device
        really has `need_bytes` more free (an entry something else still references frees nothing).
        Nothing leaves while a CUDA graph is being captured: a copy or a rebuild there would break the
        capture (binomial's graphs capture inside a pooled step); the capture's pool goes over."""
        if self.cuda and torch.cuda.is_current_stream_capturing():
            return 0
        if self._resting:
            self._wake()  # (it holds nothing: the step goes over, its next one is the pool's)
        with self._lock:  # the frames belong to the thread holding it (a rebuild's, maybe)
            t0 = time.perf_counter()
            self._frames.append(0.0)  # not a rebuild's own time, when one's allocation called it
            try:
                # (the pool's work inside the model's allocation: GPT-24's loss at 60% of its peak on
                # an H100 timed 18 ms in a profiled step with it, where its kernels take about 3)
                return self._own(self._free_under_pressure, need_bytes)
            finally:
                self._frame_end(t0)

    def _free_under_pressure(self, need_bytes: int) -> int:
        """The pressure handler's work; the caller holds the lock."""
        self._counters["pressure_calls"] += 1
        self._left = True
        before = self._used_bytes()
        if self._rec is not None:  # the plan's curve must hold this point too
            # the soft limit asks for the excess over it; a failed allocation, for its size
            soft = self._soft is not None and self._soft.in_soft_limit_call
            self._rec.pressed((self._soft.soft_limit_bytes if soft else before) + need_bytes)
        for t in self.treatments.values():
            t.settle(self, wait=True)  # e.g. originals kept until their pack is known to fit
        # The stalest CANDIDATES first (used last in backward; pricing all ~1000 entries at each of
        # a step's dozens of calls cost more than it saved), then everything if they free too little.
        for limit in (CANDIDATES, None):
            enough = before - self._used_bytes() >= need_bytes
            if enough or self._free_by_choices(limit, before, need_bytes):
                break
        # Prefetched entries not used yet go last: they come back soonest.
        for x in self._restoring_entries():
            if before - self._used_bytes() >= need_bytes:
                break
            if x.tensor is not None and self._leave(x, x.treatment):
                self.copies.wait(x.event)
        return max(before - self._used_bytes(), 0)

    def _free_by_choices(self, limit: int | None, before: int, need_bytes: int) -> bool:
        """Entries leave, the policy's cheapest choices (priced as urgent) over `limit` resident ones
        first, until `need_bytes` are free since `before`; whether they are."""
        self._urgent = True
        try:
            choices = self._choices(limit)
        finally:
            self._urgent = False
        for c in self.policy.choose(choices, 1 << 62, self._tick):
            t = self.treatments[c.treatment]
            for victim in c.frees:
                if victim.tensor is None:
                    continue  # a pressure call nested in one of these leaves (a pack's payload) took it
                if self._leave(victim, t):
                    self.copies.wait(victim.event)
                    t.settle(self, wait=True)  # a pack's kept original: it must go now
            if before - self._used_bytes() >= need_bytes:
                return True
        return False

    # ------------------------------------------------------------------ bookkeeping

    def _release(self, e: Entry) -> None:
        """The entry died (autograd dropped it): give its memory back."""
        try:
            with self._lock:
                self._entries.pop(e.seq, None)
                self._away_to_fetch.discard(e.seq)
                self._forget(e)
                if e.state in (State.RESIDENT, State.RETURNING):
                    self._device_bytes -= e.nbytes
                    self._lru.pop(e.seq, None)
                elif e.treatment is not None:
                    self._device_bytes -= e.treatment.device_bytes(e)
                    if self._rec is not None and e.step is self._step:
                        self._rec.left(e.ordinal, e.treatment.device_bytes(e) - e.nbytes)
                e.tensor = None
                if e.treatment is not None:
                    e.treatment.forget(self, e)
                if len(self._seqs) > 64 and len(self._seqs) > 2 * len(self._entries):
                    self._seqs = [s for s in self._seqs if s in self._entries]
        except Exception:  # noqa: BLE001  (interpreter shutdown: CUDA or modules may be gone)
            pass

    def _add_resident(self, e: Entry) -> None:
        if self._soft is not None:
            self._soft.arm_soft_limit()  # something it could free again
        self._device_bytes += e.nbytes
        self._note_peak()
        self._lru[e.seq] = weakref.ref(e)

    def _note_peak(self) -> None:
        held = self._device_bytes + self._kept_bytes
        self._peak_resident_bytes = max(self._peak_resident_bytes, held)
        self._step_peak = max(self._step_peak, held)

    def _drop_resident(self, e: Entry) -> None:
        self._device_bytes -= e.nbytes
        self._lru.pop(e.seq, None)
        e.watch_version()
        e.tensor = None

    def _touch(self, e: Entry) -> None:
        self._tick += 1
        e.last_use = self._tick
        if e.seq in self._lru:  # move to the most recently used end
            self._lru[e.seq] = self._lru.pop(e.seq)

    def _restoring_entries(self) -> list[Entry]:
        return [x for ref in self._lru.values() if (x := ref()) is not None and x.state is State.RETURNING]

    def _resident_entries(self, limit: int | None = None, keep: Any = None) -> list[Entry]:
        """Resident entries, least recently used first (in-flight returns excluded), those `keep`
        accepts when given; the first `limit` of them when given."""
        out = []
        for ref in self._lru.values():
            x = ref()
            if (
                x is not None
                and x.state is State.RESIDENT
                and x.tensor is not None
                and (keep is None or keep(x))
            ):
                out.append(x)
                if limit is not None and len(out) >= limit:
                    break
        return out

    def _target(self) -> int:
        """Device bytes the pool aims at: the budget less the learned margin; with no budget, the
        allocator's limit (or the card) less room for the largest entry, so prefetch never causes an
        OOM. On CPU: the budget (or no bound)."""
        if self.budget_bytes is not None:
            if self._plan_ok:
                return self.budget_bytes  # the plan made room for the step's transients already
            return max(0, self.budget_bytes - self._margin)
        if not self.cuda:
            return 1 << 62
        alloc = self._supermem_allocator()
        cap = (alloc.limit_bytes if alloc is not None else 0) or torch.cuda.get_device_properties(
            self.device
        ).total_memory
        return cap - 2 * self._largest_entry

    def _learn_margin(self) -> None:
        """The margin is the last step's spike: its true peak above the most the pool saw. Transients
        the pool cannot see (the loss, workspaces) are a property of the model, not of the target,
        so this settles in one step and does not oscillate."""
        alloc = self._supermem_allocator() if self.budget_bytes is not None else None
        if alloc is None and self.cuda:
            self._last_peak_bytes = self._seen_peak  # what the pool saw: PyTorch's allocator has no watermark
        if alloc is not None:
            peak = max(self._inside_peak, alloc.take_watermark())
            self._inside_peak = 0
            self._last_peak_bytes = peak
            if self._seen_peak:
                self._last_spike = max(0, peak - self._seen_peak)
                self._margin = min(self.budget_bytes, self._last_spike)
        self._seen_peak = 0

    def _marks(self) -> Callable[[], tuple[int, int]] | None:
        """With supermem's allocator and a budget: a call that returns the device's bytes allocated now
        and the most since the last call (kept in the step's peak too), for a recorded step's
        transients (Recorder.watermark)."""
        alloc = self._supermem_allocator() if self.budget_bytes is not None else None
        if alloc is None:
            return None

        def marks() -> tuple[int, int]:
            high = alloc.take_watermark()
            self._inside_peak = max(self._inside_peak, high)
            return alloc.allocated_bytes, high

        return marks

    def _supermem_allocator(self) -> Any:
        """supermem's allocator of this device, or None; kept once found (asked at every save)."""
        if self._alloc is None and self.cuda:
            from ..registry import device_allocator

            self._alloc = device_allocator(self.device.index)
        return self._alloc

    def _used_bytes(self) -> int:
        """What the budget counts: bytes allocated on the device now (cheap with supermem's allocator,
        a stats call with PyTorch's), or on CPU the bytes the entries hold."""
        if not self.cuda:
            used = self._device_bytes + self._kept_bytes
        else:
            alloc = self._supermem_allocator()
            used = alloc.allocated_bytes if alloc is not None else torch.cuda.memory_allocated(self.device)
        self._seen_peak = max(self._seen_peak, used)
        return used

    # ------------------------------------------------------------------ costs (for the policy)

    # ------------------------------------------------------------------ the port (port.py)

    def arrived(self, e: Entry, tensor: torch.Tensor, event: Any) -> None:
        """A treatment brought `e` back into `tensor` (ready after `event`, if any)."""
        if e.treatment.events is not None:
            events.emit(
                e.treatment.events[1], e.nbytes, tensor.data_ptr(), self.device_index, e.seq, "activation"
            )
        self._device_bytes -= e.treatment.device_bytes(e)
        self._away_to_fetch.discard(e.seq)
        if self._rec is not None and e.step is self._step:
            self._rec.left(e.ordinal, e.treatment.device_bytes(e) - e.nbytes)
        e.tensor = tensor
        e.event = event
        e.state = State.RETURNING if event is not None else State.RESIDENT
        self._add_resident(e)
        self._touch(e)

    def count(self, name: str, n: int = 1) -> None:
        """Adds `n` to the counter `name`: stats() shows it, reset_stats() zeroes it."""
        self._counters[name] = self._counters.get(name, 0) + n

    @contextlib.contextmanager
    def using(self, e: Entry) -> Iterator[None]:
        """While it lasts, `e` is being worked on: the pool's pressure handler, called from inside
        (an allocation of the work), does not choose it."""
        self._in_use.append(e)
        try:
            yield
        finally:
            self._in_use.remove(e)

    def copy_window(self) -> tuple[float, float, int] | None:
        """Where copies out can hide behind this step's forward: (seconds since the step began, the
        last step's forward seconds, bytes this step copied out so far); None where none hides (on
        CPU copies are synchronous; urgent: the allocator waits for the bytes; no forward measured)."""
        step = self._step
        if not self.cuda or step is None or not self._last_forward_s or self._urgent:
            return None
        return time.perf_counter() - step.started_s, self._last_forward_s, step.offloaded

    def payload_resized(self, e: Entry, delta: int) -> None:
        """The payload `e`'s treatment keeps on the device while `e` is away grew by `delta` bytes."""
        self._device_bytes += delta

    @property
    def device_bytes_per_s(self) -> float:
        return costs.GPU_MEMORY_BYTES_PER_S if self.cuda else costs.CPU_COPY_BYTES_PER_S

    @property
    def device_index(self) -> int:
        return self.device.index if self.cuda else -1

    # ------------------------------------------------------------------ inspection

    def check(self) -> None:
        """Walks the entries; raises AssertionError if the accounting or a treatment's invariant is off."""
        with self._lock:
            device = 0
            for ref in self._entries.values():
                e = ref()
                if e is None:
                    continue
                holds_device = e.state in (State.RESIDENT, State.RETURNING)
                assert (e.tensor is not None) == holds_device, f"{e}: device tensor vs state"
                if holds_device:
                    device += e.nbytes
                else:
                    assert e.treatment is not None, f"{e}: off the device without a treatment"
                    e.treatment.check(self, e)
                    device += e.treatment.device_bytes(e)
            assert device == self._device_bytes, f"device bytes {device} != counter {self._device_bytes}"
            assert set(self._lru) <= set(self._entries), "LRU names dead entries"
            self.host.allocator.check()

    def stats(self) -> PoolStats:
        """Bytes by state and by treatment, totals moved, achieved copy rates (GB/s) and the share of
        copy time that compute did not wait for (hidden_fraction). Reads finished copy timings; does
        not sync."""
        with self._lock:
            by_state = {s.value: 0 for s in State}
            count = {s.value: 0 for s in State}
            away = {name: 0 for name in self.treatments}
            for ref in self._entries.values():
                e = ref()
                if e is not None:
                    if e.state is State.LEAVING and (e.event is None or e.event.query()):
                        e.state = State.AWAY
                    by_state[e.state.value] += e.nbytes
                    count[e.state.value] += 1
                    if e.state is not State.RESIDENT and e.treatment is not None:
                        away[e.treatment.name] = away.get(e.treatment.name, 0) + e.nbytes
            c = self.copies.collect()
            copy_seconds = c.d2h_seconds + c.h2d_seconds
            return {
                "tracked_bytes": sum(by_state.values()),
                "plan_kept_bytes": self._kept_bytes,  # kept by the plan without entries
                **{f"{k}_bytes": v for k, v in by_state.items()},
                "entries_by_state": count,
                "away_bytes_by_treatment": away,
                "peak_resident_bytes": self._peak_resident_bytes,
                "largest_entry_bytes": self._largest_entry,
                "budget_bytes": self.budget_bytes,
                "margin_bytes": self._margin,
                "prefetched_bytes": self._prefetched_bytes,
                "regions": len(self.regions.modules),
                "light_split_misses": self.regions.split_misses,
                "compiled_kept_bytes": self.compiled.kept_bytes,
                "steps": self._steps,
                **self._counters,
                "host_reserved_bytes": self.host.reserved_bytes,
                "d2h_gbps": c.d2h_bytes / c.d2h_seconds / 1e9 if c.d2h_seconds else 0.0,
                "h2d_gbps": c.h2d_bytes / c.h2d_seconds / 1e9 if c.h2d_seconds else 0.0,
                "copy_seconds": copy_seconds,
                "wait_seconds": c.wait_seconds,
                "hidden_fraction": max(0.0, 1 - c.wait_seconds / copy_seconds) if copy_seconds else 1.0,
                "plan": self._plan_stats(),
            }

    def synchronize(self) -> None:
        """Waits for every copy in flight and folds all timings into stats()."""
        self.copies.collect(block=True)

    def __repr__(self) -> str:
        budget = "none" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        return (
            f"<supermem.Pool policy={self.policy.name} budget={budget} device={self.device} "
            f"treatments={','.join(self.treatments)} steps={self._steps}>"
        )

    def close(self) -> None:
        """Takes the pool's module hooks off and drops it from supermem.pool's cache (the same options
        there make a new pool). Between steps, with no backward of its pending; the pool is not to be
        entered again."""
        self.regions.close()
        self.closed = True

    def reset_stats(self) -> None:
        with self._lock:
            self.copies.collect(block=True)
            self.copies.stats = type(self.copies.stats)()
            self._counters = dict.fromkeys(self._counters, 0)
            self._prefetched_bytes = 0
            self._peak_resident_bytes = self._device_bytes + self._kept_bytes


_live_pools: weakref.WeakSet[Pool] = weakref.WeakSet()


def _serve_to_top(pool: Pool) -> None:
    """Lists the pool in the control server's "pool" section (what `supermem top` shows)."""
    from .. import config, control

    _live_pools.add(pool)
    if config.current().control:
        control.start_server()
        control.register_provider("pool", _top_view)


def _top_view() -> dict[str, Any]:
    entries: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    host = host_limit = d2h = h2d = 0
    plans = []
    for p in list(_live_pools):
        s = p.stats()
        if s["plan"] is not None:
            plans.append(s["plan"])
        for state, n in s["entries_by_state"].items():
            entries[state] = entries.get(state, 0) + n
            nbytes[state] = nbytes.get(state, 0) + s[f"{state}_bytes"]
        d2h += s["d2h_gbps"] * 1e9
        h2d += s["h2d_gbps"] * 1e9
    for h in {id(p.host.pool): p.host.pool for p in list(_live_pools)}.values():  # shared: once each
        host, host_limit = host + h.reserved_bytes, host_limit + h.limit_bytes
    link = {"d2h_bytes_per_s": d2h, "h2d_bytes_per_s": h2d}
    return {
        "entries_by_state": entries,
        "bytes_by_state": nbytes,
        "host_bytes": host,
        "host_limit_bytes": host_limit,
        "link": link,
        "plans": plans,  # each planned pool's predictions beside its last step's measurements
    }


def _checked(name: str, parse: Any, value: Any) -> Any:
    try:
        return parse(value)
    except ValueError as e:
        raise ConfigError(f"bad pool option {name}={value!r}: {e}") from None


def _is_fraction(value: Any) -> bool:
    return (isinstance(value, float) and 0 < value <= 1) or (
        isinstance(value, str) and value.strip().endswith("%")
    )


def _size(name: str, value: Any, total: int | None) -> int:
    return _checked(name, lambda v: parse_bytes(v, total), value)


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
