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

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any, cast

import torch

from .. import costs, events
from ..transfer.copy import CopyEngine
from ..transfer.host import shared_host_pool
from ..units import format_bytes
from .budget import CANDIDATES, Budget  # noqa: F401  (CANDIDATES: read here by tests)
from .cast import Cast, autocast_copy_of
from .compiled import APPLY_CODE, CompiledGraphs, GraphKept
from .entry import Entry, Kept, PlanKept, State, alive_anyway, check_version, dedup_key, movable
from .labels import label, nvtx_wanted, recording
from .ledger import Ledger
from .op_replay import OpReplays
from .options import budget_bytes_of, check_graphs_and_min_bytes, device_of, host_bytes_of, policy_of
from .plan_run import PlanRunner
from .rebuild_times import RebuildTimes
from .regions import Regions
from .rest import Rest, Resting
from .stats import COUNTERS, PoolStats
from .step import StepClock
from .top import serve_to_top
from .top import top_view as _top_view  # noqa: F401  (read here by tests)
from .treatments import Offload, Recompute, Treatment, checked_treatments

_OWN = __name__.split(".")[0] + "."  # the package's frames: between a pack hook and its caller


class Pool:
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
        self.device = device_of(device)
        self.cuda = self.device.type == "cuda"
        self.nvtx = nvtx_wanted(self.cuda)  # SUPERMEM_NVTX: its work as NVTX ranges too (labels.py)
        total = torch.cuda.get_device_properties(self.device).total_memory if self.cuda else None
        self.device_total_bytes = total
        self.budget_bytes = budget_bytes_of(budget, total, self.device)
        self.policy = policy_of(policy, budget)
        check_graphs_and_min_bytes(graphs, min_bytes)
        self.graphs = graphs
        self.light_graphs: Any = None  # LightGraphs, made at the first light call on CUDA
        self.planning = self.policy.plans
        self.rest = Rest(self)  # a plan that moves nothing: its steps run without the hooks
        self.plans = PlanRunner(self)  # the planned policy's part: plans by shape, the step's recorder
        chosen = checked_treatments(treatments) if treatments is not None else ()
        self.treatments = {t.name: t for t in chosen or (Offload(), Recompute())}
        self.by_kind: dict[str, Treatment] = {}  # what the plan uses for each kind: the first given
        for t in self.treatments.values():
            self.by_kind.setdefault(t.kind, t)
        # the treatment that rebuilds from recipes, where the policy may use it: regions are profiled
        # and op recipes made only then
        self._rebuilder = next(
            (t for t in self.treatments.values() if t.rebuilds and t.kind in self.policy.kinds), None
        )
        self.settlers = [t for t in self.treatments.values() if type(t).settle is not Treatment.settle]
        host_bytes = host_bytes_of(host_limit)
        self.host = shared_host_pool(self.device, host_bytes)  # one per device, shared with the streamer
        self.copies = CopyEngine(self.device)
        self.host.copy_streams.update(self.copies.stream_ids)
        self.min_bytes = (1 << 20 if self.cuda else 0) if min_bytes is None else min_bytes
        self.regions = Regions(self)
        self.op_replays = OpReplays(self)
        # op recipes are made only where the policy may recompute (their first run verifies them)
        self._op_recipes = self._rebuilder is not None
        # torch.compile'd graphs' saved tensors: left where they are, planned through the compiler
        self.compiled = CompiledGraphs(self)
        self.lock = threading.RLock()
        self.ledger = Ledger()
        self.clock = StepClock(self, self.ledger)
        self.budget = Budget(self)
        self.closed = False  # close() was called (supermem.pool(...) then makes a new one)
        self.passthrough = False  # saves not the step's (checkpoint's own of its inputs): left alone
        self.busy_s = 0.0  # minus the seconds spent fitting the budget (CPU region timing)
        self._counters = dict.fromkeys(COUNTERS, 0)
        self.prefetched_bytes = 0
        self.per_thread = threading.local()  # per thread: the stack of entered hook contexts
        self.always_active = False  # SUPERMEM_CONF's pool: hooks pushed for every thread's backward
        self.rebuild_times = RebuildTimes()  # host seconds of each kind of rebuild, its own
        serve_to_top(self)

    # ------------------------------------------------------------------ activation

    def __enter__(self) -> Pool:
        """Re-entrant, and per thread: saved-tensor hooks are thread-local, so each thread keeps its
        own stack of entered contexts."""
        self.start()
        self.budget.watch(+1)  # (first: the watermark since the last exit is not the step's, nor _rests')
        stack = self.per_thread.__dict__.setdefault("stack", [])
        if self.rest.enter(outermost=not stack):
            stack.append(Resting())
        else:
            hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            hooks.__enter__()
            stack.append(hooks)
        self.compiled.entered()  # graphs compiled inside compile at its share (last: the rest may raise)
        return self

    def __exit__(self, *exc: Any) -> None:
        stack = self.per_thread.stack
        stack.pop().__exit__(*exc)
        if stack and isinstance(stack[-1], Resting) and not self.rest.resting:  # woken inside: the hooks
            stack[-1].wake(self)  # stay on in the context around
        self.budget.watch(-1)
        self.compiled.exited()
        self.clock.collector.resume()

    def start(self) -> None:
        """What entering does first; the SUPERMEM_CONF pool, whose hooks serve every thread, is never
        entered and calls it at its first use (factory.env_pool)."""
        self.budget.register_pressure_handler()
        self.budget.keep()
        if self._rebuilder is not None:
            self.regions.start_profiling()

    def active_here(self) -> bool:
        """Whether the pool's hooks serve this thread now."""
        return self.always_active or bool(getattr(self.per_thread, "stack", None))

    def on_pressure(self, need_bytes: int) -> int:
        """The allocator's pressure handler (Budget.on_pressure), weakly held by it."""
        return self.budget.on_pressure(need_bytes)

    # ------------------------------------------------------------------ hooks

    def own_work(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)`, the pool's own work: a step being recorded takes its pace without it
        (Recorder.pause)."""
        rec = self.plans.rec
        if rec is None or not rec.timing:
            return fn(*args)
        rec.pause()
        try:
            return fn(*args)
        finally:
            rec.resume()

    def pack(self, t: torch.Tensor) -> Any:
        """The saved-tensor pack hook."""
        if self.passthrough:
            return t
        caller: FrameType | None = sys._getframe(1)
        while caller is not None and caller.f_globals.get("__name__", "").startswith(_OWN):
            caller = caller.f_back  # (SUPERMEM_CONF's hook calls this one)
        if caller is not None and caller.f_code is APPLY_CODE:  # a custom Function saves: a graph's?
            kept = self.compiled.keep(t, caller)
            if kept is not None:
                return kept  # moving it would cost time and save nothing: compiled.py
        if self.nvtx or recording():  # (checked here: a range, even an empty one, costs every saved tensor)
            with label("pack", nvtx=self.nvtx):
                return self.own_work(self.pack_saved, t)
        return self.own_work(self.pack_saved, t)

    def pack_saved(self, t: torch.Tensor) -> Any:
        """The pack hook's work, inside own_work: what a recorded step does not count."""
        if self.plans.plan_ok and self.regions.top() is None:
            packed = self.plans.lean_pack(t)  # plan_run.py: a running plan's common saves, fast
            if packed is not None:
                return packed
        packed = self.pack_tensor(t)
        region = self.regions.top()
        if region is not None:
            region.saw(packed, t)  # before the budget is fitted: the region may claim it
        t0 = 0.0 if self.cuda else time.perf_counter()
        with self.lock:
            if isinstance(packed, Entry):
                self.budget.fit()
            else:  # a small or kept tensor: no fitting, but what finished in the background still goes
                self.settle()
        if not self.cuda:  # region timers on CPU leave the pool's work out (on a GPU they time kernels)
            self.busy_s -= time.perf_counter() - t0
        return packed

    def settle(self) -> None:
        """What finished in the background frees (only treatments that work in the background)."""
        for treatment in self.settlers:
            treatment.settle(self)

    def left_alone(self, t: torch.Tensor) -> Any:
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

    def _saved_in_open_region(self, e: Any) -> bool:
        """Whether `e` was first saved inside the region call open now (saved again, by that call)."""
        start = getattr(self.regions.top(), "start", None)
        return start is not None and getattr(e, "ordinal", 0) > start

    def pack_tensor(self, t: torch.Tensor, saved: bool = True) -> Any:
        """`saved`: autograd saves `t` (False: a region keeps its input for a replay)."""
        left = self.left_alone(t)
        if left is not None:
            return left
        t0 = time.perf_counter()
        key = dedup_key(t)
        with self.lock:
            step = self.clock.current()
            self.ledger.tick += 1
            same = self.ledger.saved(key)
            if same is not None and same.source() is t:  # saved twice: one entry
                if type(same) is not PlanKept:
                    self.ledger.touch(same)
                if (
                    saved
                    and self.plans.rec is not None
                    and self.plans.rec.full
                    and not self._saved_in_open_region(same)
                ):
                    at = getattr(self.regions.top(), "start", None)
                    self.plans.rec.resaved.setdefault(same.ordinal, set()).add(at)
                return same
            if self.plans.plan_ok and step.ordinals + 1 in self.plans.running.lean:
                kept = self.plans.keep(t, key, step)
                if kept is not None:
                    return kept
            seq = self.ledger.tick
            e = Entry(self, seq, t, key, step)
            param = autocast_copy_of(t)
            if param is not None:
                e.recipe = Cast(param, t)
            elif self._op_recipes:
                e.recipe = self.op_replays.recipe_for(e, t)
            if self._op_recipes:
                self.op_replays.remember(e, t)
            step.saved_bytes += e.nbytes
            self._counters["packed"] += 1
            self.budget.arm()
            self.ledger.add(e)
            if self.plans.rec is not None:
                if self.plans.rec.full:  # what an entry costs the host to make (its units' price: profile.py)
                    self.plans.rec.entry_s.append(time.perf_counter() - t0)
                self.plans.planned_pack(e)
                if not saved and self.plans.rec.full:  # a region's input, an entry only for its replay
                    self.plans.rec.capture_made.add(e.ordinal)
            return e

    def unpack(self, packed: Any) -> torch.Tensor:
        """The saved-tensor unpack hook."""
        if type(packed) is GraphKept:  # (the fast path: every tensor a compiled graph saves)
            return packed.unpack()
        if self.nvtx or recording():
            with label("unpack", nvtx=self.nvtx):
                return self.own_work(self._unpack_saved, packed)
        return self.own_work(self._unpack_saved, packed)

    def backward_began(self) -> None:
        """Backward unpacked a tensor the pool left where it was: the step clock is told (StepClock.
        backward_began), and region profiling ends (maybe no entry was saved at all)."""
        self.clock.backward_began()
        if self.regions.phase == "profiling":
            with self.lock:
                self.regions.end_profiling()

    def _unpack_saved(self, packed: Any) -> torch.Tensor:
        if type(packed) is PlanKept:
            return self.plans.unpack_kept(packed)
        if type(packed) is Kept:
            self.backward_began()
            return packed.unpack()
        if not isinstance(packed, Entry):
            return packed
        check_version(packed)
        with self.lock:
            if self.regions.phase == "profiling":
                self.regions.end_profiling()
            event = self.plans.used(packed)
            t = self._materialize(packed)
            self.ledger.touch(packed)
            if self.plans.plan_ok:
                if event is not None:
                    self.plans.run_events(event)
            else:
                self.budget.prefetch_before(packed)
            return t

    def unpack_input(self, packed: Any) -> Any:
        """A region's input for its replay (materialized; recursively replayed if it was dropped)."""
        if isinstance(packed, Entry):
            check_version(packed)
            return self._materialize(packed)
        if isinstance(packed, Kept):
            return packed.unpack()
        return packed

    # ------------------------------------------------------------------ moving entries

    def region_done(self, region: Any = None, outputs: list | None = None) -> None:
        """A region's entries just became recomputable: they may be what the budget needs (or what
        the plan said to drop). `outputs`: the call's output tensors."""
        # Under the lock: another thread's entry may die meanwhile, and a dying entry is still reached
        # by its weak references while its __del__ waits for the lock (found with two threads training
        # through one pool: an entry left with its tensor gone, 'NoneType' has no attribute 'data_ptr').
        with self.lock:
            self.plans.region_done(region, outputs)
            self.budget.fit()

    def leave(self, e: Entry, t: Treatment) -> bool:
        """Takes a resident entry off the device by treatment `t`; False when `t` cannot."""
        if e.treatment is not None and e.treatment is not t:
            e.treatment.forget(self, e)
        with label(t.name, nvtx=self.nvtx):
            if not t.leave(self, e):
                return False
        if t.events is not None:
            events.emit(
                t.events[0],
                e.nbytes,
                e.device_tensor.data_ptr(),
                self.device_index,
                e.seq,
                "activation",
                t.name,
            )
        e.treatment = t
        self.ledger.left(e, t, t.device_bytes(e))
        if self.plans.rec is not None and e.step is self.clock.step:
            self.plans.rec.left(e.ordinal, e.nbytes - t.device_bytes(e))
        self.clock.left = True
        return True

    def come_back(self, e: Entry) -> None:
        """Starts bringing `e` back by its treatment."""
        how = e.left_by
        with label(how.name, ".restore", self.nvtx):
            how.come_back(self, e)

    def _materialize(self, e: Entry) -> torch.Tensor:
        self.ledger.in_use.append(e)  # a replay's allocations may call the pressure handler: not this one
        try:
            if e.state in (State.LEAVING, State.AWAY):  # not brought back in time: compute waits
                self._counters["sync_restores"] += 1
                t0 = time.perf_counter()
                sampled = self._host_bound_now()
                self.rebuild_times.frames.append(0.0)
                try:
                    self.come_back(e)
                finally:
                    rebuilt = e.left_by.rebuilds and e.recipe is not None
                    self.rebuild_times.frame_end(t0, type(e.recipe).__name__ if rebuilt and sampled else None)
            if e.state is State.RETURNING:
                e.left_by.ready(self, e)
            return e.device_tensor
        finally:
            self.ledger.in_use.pop()

    def _host_bound_now(self) -> bool:
        """Whether a rebuild starting now samples its kind's host cost: on CPU always; on a GPU in a
        step recorded for a plan, only where the compute stream has nothing queued (the GPU waits for
        the host, whose seconds are then the step's). Where the GPU is busy the rebuild costs the step
        its device seconds, and the host's include waits for room in a full launch queue: a GPT-24
        block replay was priced at 100 ms so on an H100, and the plan never replayed a block."""
        if not self.cuda:
            return True
        if self.plans.rec is None or not self.plans.rec.full:
            return False
        return torch.cuda.current_stream(self.device).query()

    # ------------------------------------------------------------------ bookkeeping

    def release(self, e: Entry) -> None:
        """The entry died (autograd dropped it): give its memory back."""
        try:
            with self.lock:
                payload = self.ledger.release(e)
                self.plans.forget(e)
                if payload is not None and self.plans.rec is not None and e.step is self.clock.step:
                    self.plans.rec.left(e.ordinal, payload - e.nbytes)
                if e.treatment is not None:
                    e.treatment.forget(self, e)
        except Exception:  # noqa: BLE001  (interpreter shutdown: CUDA or modules may be gone)
            pass

    # ------------------------------------------------------------------ the port (port.py)

    def arrived(self, e: Entry, tensor: torch.Tensor, event: Any) -> None:
        """A treatment brought `e` back into `tensor` (ready after `event`, if any)."""
        how = e.left_by
        if how.events is not None:
            events.emit(how.events[1], e.nbytes, tensor.data_ptr(), self.device_index, e.seq, "activation")
        payload = how.device_bytes(e)
        if self.plans.rec is not None and e.step is self.clock.step:
            self.plans.rec.left(e.ordinal, payload - e.nbytes)
        self.budget.arm()
        self.ledger.came_back(e, payload, tensor, event)

    def count(self, name: str, n: int = 1) -> None:
        """Adds `n` to the counter `name`: stats() shows it, reset_stats() zeroes it."""
        self._counters[name] = self._counters.get(name, 0) + n

    @contextlib.contextmanager
    def using(self, e: Entry) -> Iterator[None]:
        """While it lasts, `e` is being worked on: the pool's pressure handler, called from inside
        (an allocation of the work), does not choose it."""
        self.ledger.in_use.append(e)
        try:
            yield
        finally:
            self.ledger.in_use.remove(e)

    def copy_window(self) -> tuple[float, float, int] | None:
        """Where copies out can hide behind this step's forward: (seconds since the step began, the
        last step's forward seconds, bytes this step copied out so far); None where none hides (on
        CPU copies are synchronous; urgent: the allocator waits for the bytes; no forward measured)."""
        step = self.clock.step
        if not self.cuda or step is None or not self.clock.last_forward_s or self.budget.urgent:
            return None
        return time.perf_counter() - step.started_s, self.clock.last_forward_s, step.offloaded

    def room_for(self, nbytes: int, spare: list[Entry]) -> None:
        """A rebuild is about to bring `nbytes` back at once: room first (Budget.room_for)."""
        self.budget.room_for(nbytes, spare)

    def payload_resized(self, e: Entry, delta: int) -> None:
        """The payload `e`'s treatment keeps on the device while `e` is away grew by `delta` bytes."""
        self.ledger.device_bytes += delta

    @property
    def device_bytes_per_s(self) -> float:
        return costs.GPU_MEMORY_BYTES_PER_S if self.cuda else costs.CPU_COPY_BYTES_PER_S

    @property
    def device_index(self) -> int:
        return self.device.index if self.cuda else -1

    # ------------------------------------------------------------------ inspection

    def check(self) -> None:
        """Walks the entries; raises AssertionError if the accounting or a treatment's invariant is off."""
        with self.lock:
            self.ledger.check(self)
            self.host.allocator.check()

    def stats(self) -> PoolStats:
        """Bytes by state and by treatment, totals moved, achieved copy rates (GB/s) and the share of
        copy time that compute did not wait for (hidden_fraction). Reads finished copy timings; does
        not sync."""
        with self.lock:
            by_state, count, away = self.ledger.by_state(self.treatments)
            c = self.copies.collect()
            copy_seconds = c.d2h_seconds + c.h2d_seconds
            # (keys made from the states and COUNTERS, which a type checker cannot follow: test_typing
            # checks them against PoolStats)
            stats: dict[str, Any] = {
                "tracked_bytes": sum(by_state.values()),
                "plan_kept_bytes": self.ledger.kept_bytes,  # kept by the plan without entries
                **{f"{k}_bytes": v for k, v in by_state.items()},
                "entries_by_state": count,
                "away_bytes_by_treatment": away,
                "peak_resident_bytes": self.ledger.peak_resident_bytes,
                "largest_entry_bytes": self.ledger.largest_entry,
                "budget_bytes": self.budget_bytes,
                "margin_bytes": self.budget.margin,
                "prefetched_bytes": self.prefetched_bytes,
                "regions": len(self.regions.modules),
                "light_split_misses": self.regions.split_misses,
                "compiled_kept_bytes": self.compiled.kept_bytes,
                "compiled_step_bytes": self.compiled.last_step_bytes,
                "compile_share": self.compiled.share,
                "compile_recompiles": self.compiled.recompiles,
                "steps": self.clock.steps,
                **self._counters,
                "host_reserved_bytes": self.host.reserved_bytes,
                "d2h_gbps": c.d2h_bytes / c.d2h_seconds / 1e9 if c.d2h_seconds else 0.0,
                "h2d_gbps": c.h2d_bytes / c.h2d_seconds / 1e9 if c.h2d_seconds else 0.0,
                "copy_seconds": copy_seconds,
                "wait_seconds": c.wait_seconds,
                "hidden_fraction": max(0.0, 1 - c.wait_seconds / copy_seconds) if copy_seconds else 1.0,
                "plan": self.plans.stats(),
            }
            return cast(PoolStats, stats)

    def synchronize(self) -> None:
        """Waits for every copy in flight and folds all timings into stats()."""
        self.copies.collect(block=True)

    def __repr__(self) -> str:
        budget = "none" if self.budget_bytes is None else format_bytes(self.budget_bytes)
        return (
            f"<supermem.Pool policy={self.policy.name} budget={budget} device={self.device} "
            f"treatments={','.join(self.treatments)} steps={self.clock.steps}>"
        )

    def close(self) -> None:
        """Takes the pool's module hooks off and drops it from supermem.pool's cache (the same options
        there make a new pool). Between steps, with no backward of its pending; the pool is not to be
        entered again."""
        self.regions.close()
        self.clock.collector.resume()
        self.closed = True

    def reset_stats(self) -> None:
        with self.lock:
            self.copies.collect(block=True)
            self.copies.stats = type(self.copies.stats)()
            self._counters = dict.fromkeys(self._counters, 0)
            self.prefetched_bytes = 0
            self.ledger.peak_resident_bytes = self.ledger.device_bytes + self.ledger.kept_bytes
