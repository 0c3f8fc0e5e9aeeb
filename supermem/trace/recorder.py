"""Recording: allocator trace rings + pool events + observations -> a Trace, written as .smtrace.

Cost model. While recording, each allocator event costs one push into the C++ ring (a mutex and a
40-byte store, no Python); pool events cost one deque append in Python; optimizer hooks read the
gradients' addresses once per step. Nothing is drained while the program runs: the rings are
drained when a trace is dumped (stop, dump(), OOM), at ~0.7 us per event. Memory is bounded by
`capacity_events` per device (~50 bytes per event in the ring plus ~50 once drained) and as many
pool events: a recording keeps the newest events, like PyTorch's _record_memory_history.
"""

from __future__ import annotations

import collections
import gc
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import control, distributed, events, registry
from ..errors import UsageError
from ..log import warn
from . import attribution, format, owners
from . import context as ctx
from .phases import CALL_ACTION, OUTPUT_ACTION, PHASE_ACTION, RETURN_ACTION
from .table import ALLOCATOR_ACTIONS, Trace, concat_columns, empty_columns

DEFAULT_CAPACITY_EVENTS = 1_000_000
# The saved-tensor hook checks the activation rule over a recording's first backwards, then comes off
# (context.py): two, so that a step after the optimizer made its state is among them.
ACTIVATION_HOOK_BACKWARDS = 2

_active: Recorder | None = None
_lock = threading.Lock()


def register_allocator(alloc: Any, device: int | None = None) -> None:
    """Makes a CachingAllocator visible to recordings (for allocators that supermem.device_allocator
    does not serve, e.g. simulated devices). `device`: the index to file its events under."""
    registry.register(alloc, device)


def unregister_allocator(alloc: Any) -> None:
    registry.unregister(alloc)


def discover_allocators() -> list[tuple[int, Any]]:
    """(device index, CachingAllocator) for every allocator supermem serves (see supermem.registry)."""
    return registry.allocators()


def _serve_cuda() -> None:
    """A recording reads supermem's allocators. Where none serves CUDA and CUDA is not initialised yet,
    it swaps supermem's in, as `supermem trace` does for a script; where PyTorch's own allocator already
    serves CUDA, it says at once that the trace will hold no device memory events."""
    import torch

    import supermem  # (its public install: the trace tool is one of its users, as `supermem trace` is)

    if registry.installed() or not torch.cuda.is_available():
        return
    if not torch.cuda.is_initialized() and supermem.install():
        return
    warn(
        "supermem: this trace records no device memory: PyTorch's own allocator serves CUDA in this "
        "process. Start the trace before the first CUDA tensor, or run with SUPERMEM=1 or `supermem trace`."
    )


def active() -> Recorder | None:
    """The recording in progress, if any."""
    return _active


def _drain_ring(alloc: Any) -> list[tuple]:
    impl = getattr(alloc, "_impl", None)
    if impl is not None:
        return impl.drain_trace()  # raw tuples: skips building a NamedTuple per event
    return [tuple(e) for e in alloc.drain_trace()]


def ring_columns(raw: list[tuple], device: int) -> dict[str, np.ndarray]:
    """Columns from drained ring tuples (time_ns, action, address, size, stream, tag)."""
    n = len(raw)
    cols = empty_columns(n)
    if not n:
        return cols
    ids = {a: i for i, a in enumerate(ALLOCATOR_ACTIONS)}
    annotate = ids["annotate"]  # a kind newer than this table: kept as a marker, not lost
    was_enabled = gc.isenabled()
    gc.disable()  # 10^6 tuples otherwise trigger many useless collections
    try:
        t, act, addr, size, stream, tag = zip(*raw, strict=True)
        cols["time_ns"] = np.array(t, np.int64)
        cols["action"] = np.fromiter((ids.get(a, annotate) for a in act), np.uint8, n)
        cols["device"][:] = device
        cols["address"] = np.array(addr, np.uint64).view(np.int64)
        cols["size"] = np.array(size, np.uint64).view(np.int64)
        cols["stream"] = np.array(stream, np.uint64).view(np.int64)
        cols["tag"] = np.array(tag, np.uint64).view(np.int64)
    finally:
        if was_enabled:
            gc.enable()
    return cols


@dataclass
class _Source:
    """One allocator being recorded, and what has been drained from it (bounded)."""

    device: int
    alloc: Any
    prev_capacity: int
    dropped_at_start: int
    since_ns: int  # events before this time (an allocator's ring from before the recording) are not kept
    chunks: collections.deque = field(default_factory=collections.deque)
    count: int = 0
    dropped_here: int = 0  # drained events discarded to stay within capacity

    def drain(self, capacity: int) -> None:
        cols = ring_columns(_drain_ring(self.alloc), self.device)
        if self.since_ns and len(cols["time_ns"]) and cols["time_ns"][0] < self.since_ns:
            keep = cols["time_ns"] >= self.since_ns
            cols = {k: v[keep] for k, v in cols.items()}
        if len(cols["time_ns"]):
            self.chunks.append(cols)
            self.count += len(cols["time_ns"])
        while self.count > capacity:
            extra = self.count - capacity
            oldest = self.chunks[0]
            n = len(oldest["time_ns"])
            if n <= extra:
                self.chunks.popleft()
                self.count -= n
                self.dropped_here += n
            else:
                self.chunks[0] = {k: v[extra:] for k, v in oldest.items()}
                self.count -= extra
                self.dropped_here += extra

    @property
    def dropped(self) -> int:
        return max(0, self.alloc.trace_dropped - self.dropped_at_start) + self.dropped_here


class Recorder:
    """Records allocator and pool events of this process. One at a time; see supermem.trace()."""

    def __init__(
        self,
        allocators: list[Any] | None = None,
        *,
        capacity_events: int = DEFAULT_CAPACITY_EVENTS,
        stacks: bool = False,
        model: Any = None,
        optimizer: Any = None,
        find_models: bool = True,
        path: str | os.PathLike | None = None,
        report: bool = False,
        context: bool = True,
        activation_hook_backwards: int | None = ACTIVATION_HOOK_BACKWARDS,
    ):
        """See supermem.trace.record. `path`/`report`: what leaving a `with` block writes.
        context: record each block's module and phase (context.py), which name activations;
        activation_hook_backwards: backwards a saved-tensor hook also observes what autograd saves, to
        name those exactly and check the rule (None: the whole recording; 0: never)."""
        if capacity_events <= 0:
            raise UsageError(f"capacity_events must be > 0, got {capacity_events}")
        self.capacity_events = capacity_events
        self._explicit = None if allocators is None else _as_pairs(allocators)
        self.sources: list[_Source] = []
        self.pool_events: collections.deque[events.Event] = collections.deque(maxlen=capacity_events)
        self.obs = attribution.Observations()
        self.scanner = attribution.ModelScanner(self.obs, _as_list(model), _as_list(optimizer), find_models)
        self.context = ctx.Context(self.obs, capacity_events, activation_hook_backwards) if context else None
        self.stack_table = attribution.StackTable() if stacks else None
        self._stack_mode: Any = None
        self._lock = threading.RLock()
        self.started_ns = 0
        self.started_unix_s = 0.0
        self.pool_events_seen = 0
        if path is not None:  # before the block runs: a bad path must not cost the user the whole run
            from .output import check_output

            path = distributed.expand_path(path)  # {rank}, {pid}: one file per process
            for out in [
                path,
                *((Path(path).with_suffix(".html"), Path(path).with_suffix(".png")) if report else ()),
            ]:
                check_output(out)
        self.path = path
        self.report = report

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> Recorder:
        global _active
        with _lock:
            if _active is not None:
                raise UsageError("a supermem trace is already recording in this process; stop it first")
            _active = self
        self.started_ns = time.monotonic_ns()
        self.started_unix_s = time.time()
        if self._explicit is None:
            _serve_cuda()
            # Device allocators are made at a device's first CUDA tensor, often after this: they are
            # born with a ring this large and join the recording when the registry finds them.
            registry.set_recording_ring_events(self.capacity_events)
        self.attach_new(fresh=True)
        if self._explicit is None:
            registry.subscribe(self._on_new_allocator)
        events.subscribe(self._on_event)
        self.scanner.scan()
        self.scanner.install_hooks()
        if self.context is not None:
            self.context.start()
        if self.stack_table is not None:
            self._stack_mode = attribution.stack_mode(self.stack_table, self.obs)
            self._stack_mode.__enter__()
        control.register_provider("trace", self.status)
        return self

    def stop(self, path: str | os.PathLike | None = None) -> Path | None:
        """Ends the recording; writes the trace to `path` first if given."""
        global _active
        try:
            out = self.dump(path) if path is not None else None
        finally:
            if self._stack_mode is not None:
                self._stack_mode.__exit__(None, None, None)
                self._stack_mode = None
            self.scanner.remove_hooks()
            if self.context is not None:
                self.context.stop()
            events.unsubscribe(self._on_event)
            if self._explicit is None:
                registry.unsubscribe(self._on_new_allocator)
                registry.set_recording_ring_events(0)
            for s in self.sources:
                if s.alloc.trace_capacity != s.prev_capacity:
                    s.alloc.trace_capacity = s.prev_capacity
            control.unregister_provider("trace")
            with _lock:
                if _active is self:
                    _active = None
        return out

    def attach_new(self, keep_rings: bool = False, fresh: bool = False) -> None:
        """Starts recording allocators that appeared since the last call. keep_rings: leave their
        rings as they are (a one-shot dump of an always-on ring). fresh: at the recording's start,
        empty their rings (else events from before the start are filtered out when drained)."""
        pairs = self._explicit if self._explicit is not None else discover_allocators()
        for device, alloc in pairs:
            self._attach(device, alloc, keep_rings, fresh)

    def _on_new_allocator(self, device: int, alloc: Any) -> None:
        """The registry found an allocator (e.g. a device's, made at its first CUDA tensor)."""
        self._attach(device, alloc, keep_rings=False, fresh=False)

    def _attach(self, device: int, alloc: Any, keep_rings: bool, fresh: bool) -> None:
        with self._lock:
            if any(registry.same(s.alloc, alloc) for s in self.sources):
                return
            used = {s.device for s in self.sources}
            while device in used:  # two allocators filed under one index (e.g. a simulated device 0)
                device += 1
            prev = registry.ring_events_at_rest(alloc)
            if keep_rings:
                pass
            elif alloc.trace_capacity < self.capacity_events:
                alloc.trace_capacity = self.capacity_events  # also empties the ring
            elif fresh:
                _drain_ring(alloc)  # events from before the recording are not part of it
            since_ns = 0 if keep_rings else self.started_ns
            self.sources.append(_Source(device, alloc, prev, alloc.trace_dropped, since_ns))

    def _on_event(self, ev: events.Event) -> None:
        self.pool_events.append(ev)
        self.pool_events_seen += 1
        if ev.address and ev.category != "unknown":
            self.obs.add(ev.address, ev.category, time_ns=ev.time_ns)

    # ---------------------------------------------------------------- output

    def drain(self) -> None:
        """Moves events from the allocators' rings into the recorder (bounded by capacity_events)."""
        with self._lock:
            if _active is self:
                self.attach_new()  # also those no one has looked for since they were made
            for s in self.sources:
                s.drain(self.capacity_events)

    def build(self) -> Trace:
        """The trace so far (recording continues)."""
        with self._lock:
            self.drain()
            trace = Trace()
            parts = [c for s in self.sources for c in s.chunks]
            pool = self._pool_columns(trace)
            if any(s.dropped for s in self.sources):
                # The allocators' windows lost their start: pool events from before it describe blocks
                # the trace no longer has, so the trace starts where its oldest allocator event is.
                start = min((int(s.chunks[0]["time_ns"][0]) for s in self.sources if s.chunks), default=0)
                keep = pool["time_ns"] >= start
                pool = {k: v[keep] for k, v in pool.items()}
            parts.append(pool)
            context = None
            if self.context is not None:
                log, paths, phases = self.context.snapshot()
                context = owners.ContextLog(log, paths, self.context.hook_off_ns)
                # from the oldest event the other parts hold (a ring that overwrote its start starts it)
                first = min((int(p["time_ns"][0]) for p in parts if len(p["time_ns"])), default=None)
                parts.append(_phase_columns(trace, phases, first))
                parts.append(_call_columns(trace, self.context.calls_snapshot(), paths, first))
            trace.cols = concat_columns(parts)
            trace.sort()
            for s in self.sources:
                d = trace.device(s.device)
                d.update(_device_info(s.alloc))
            if self.stack_table is not None:
                trace.frames = list(self.stack_table.frames)
                trace.stacks = list(self.stack_table.stacks)
            self.scanner.scan()  # what is live now: parameters, gradients, optimizer state
            check = owners.RuleCheck()
            attributed = attribution.apply(trace, self.obs.rows, context, check)
            trace.meta = self._meta(attributed)
            if context is not None and self.context is not None:
                trace.meta["activation_rule"] = {
                    **check.meta(context),
                    "hook_backwards": self.context.hooked_backwards,
                }
                trace.meta["module_types"] = dict(self.context.module_types)
            trace.meta["link_bytes_per_s"] = self._link_rates()
            return trace

    def _link_rates(self) -> dict[str, float]:
        """Device index -> its copy rate to pinned host memory, for `report --budget` (whatif.py), which
        prices the pool's copies with it and runs where no GPU may be. Probed once a process
        (offload.link_rate: ~4 ms, 64 MiB each way) after this trace's events were taken, so its own
        blocks are not in it (a later build of the same recording holds them, as any late event); on
        an H200 it reads 54-55 GB/s, where the default the what-if had priced copies at is 25."""
        import torch

        out: dict[str, float] = {}
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return out
        from ..tensor_pool.treatments.offload import link_rate

        for s in self.sources:
            if registry.same(registry.device_allocator(s.device), s.alloc):
                out[str(s.device)] = float(link_rate(torch.device("cuda", s.device)))
        return out

    def dump(self, path: str | os.PathLike) -> Path:
        """Writes the trace so far to `path` (.smtrace; {rank} and {pid} filled in); recording continues."""
        path = Path(distributed.expand_path(path))
        format.write(self.build(), path)
        return path

    def status(self) -> dict[str, Any]:
        """For `supermem top`: what this recording holds."""
        if self._explicit is None:
            registry.allocators()  # devices first used since the last look join (see _on_new_allocator)
        return {
            "devices": [s.device for s in self.sources],
            "ring_events_capacity": self.capacity_events,
            "drained_events": sum(s.count for s in self.sources),
            "dropped_events": sum(s.dropped for s in self.sources),
            "pool_events": self.pool_events_seen,
            "recording_s": (time.monotonic_ns() - self.started_ns) / 1e9,
        }

    def _pool_columns(self, trace: Trace) -> dict[str, np.ndarray]:
        evs = list(self.pool_events)
        cols = empty_columns(len(evs))
        for i, e in enumerate(evs):
            cols["time_ns"][i] = e.time_ns
            cols["action"][i] = trace.action_id(e.action)
            cols["device"][i] = e.device
            cols["address"][i] = e.address
            cols["size"][i] = e.nbytes
            cols["tag"][i] = e.tag
            cols["category"][i] = trace.category_id(e.category)
            cols["detail"][i] = trace.string_id(e.detail)
        return cols

    def _meta(self, attributed: int) -> dict[str, Any]:
        import torch

        import supermem

        return {
            "pid": os.getpid(),
            **distributed.info(),  # rank, world_size (0 and 1 outside torch.distributed)
            "host": socket.gethostname(),
            "argv": list(sys.argv),
            "created_unix_s": time.time(),
            "started_unix_s": self.started_unix_s,
            "started_ns": self.started_ns,
            "clock": "CLOCK_MONOTONIC",
            "supermem_version": supermem.__version__,
            "torch_version": torch.__version__,
            "capacity_events": self.capacity_events,
            "dropped_events": {str(s.device): s.dropped for s in self.sources},
            "pool_events_dropped": max(0, self.pool_events_seen - len(self.pool_events)),
            "stacks": self.stack_table is not None,
            "attributed_lifetimes": attributed,
        }

    # ---------------------------------------------------------------- context manager

    def __enter__(self) -> Recorder:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        out = self.stop(self.path)
        if out is not None and self.report:
            from .report_html import write_report_files

            write_report_files(out)


def _phase_columns(trace: Trace, phases: list[tuple[int, str]], first: int | None) -> dict[str, np.ndarray]:
    """context.py's phase changes as "phase" events (device -1, the phase in detail), from time `first`
    (None: all)."""
    phases = [p for p in phases if first is None or p[0] >= first]
    cols = empty_columns(len(phases))
    if phases:
        cols["time_ns"] = np.array([p[0] for p in phases], np.int64)
        cols["action"][:] = trace.action_id(PHASE_ACTION)
        cols["device"][:] = -1
        cols["detail"] = np.array([trace.string_id(p[1]) for p in phases], np.int32)
    return cols


def _call_columns(
    trace: Trace, calls: list[tuple], paths: list[str], first: int | None
) -> dict[str, np.ndarray]:
    """context.py's module calls as "call", "return" and "output" events (device -1; phases.py), from
    time `first` (None: all)."""
    calls = [c for c in calls if first is None or c[0] >= first]
    n = len(calls)
    outputs = [(k, c[1], ptr) for k, c in enumerate(calls) for ptr in c[5]]
    cols = empty_columns(2 * n + len(outputs))
    if calls:
        m = 2 * n
        cols["time_ns"] = np.array(
            [c[0] for c in calls] + [c[1] for c in calls] + [o[1] for o in outputs], np.int64
        )
        cols["action"][:n] = trace.action_id(CALL_ACTION)
        cols["action"][n:m] = trace.action_id(RETURN_ACTION)
        cols["action"][m:] = trace.action_id(OUTPUT_ACTION)
        cols["device"][:] = -1
        cols["address"][:n] = np.array([c[3] for c in calls], np.uint64).view(np.int64)
        cols["address"][m:] = np.array([o[2] for o in outputs], np.uint64).view(np.int64)
        cols["tag"] = np.array(list(range(n)) * 2 + [o[0] for o in outputs], np.int64)
        cols["detail"][:n] = np.array([trace.string_id(paths[c[2]]) for c in calls], np.int32)
        cols["detail"][n:m] = np.array([trace.string_id(c[4]) for c in calls], np.int32)
    return cols


def one_shot_trace(allocators: list[Any] | None = None) -> Trace:
    """What the allocators' always-on rings hold (option trace:N) plus their current segments, with no
    recording in progress: the cheap mode's dump. Drains the rings; categories from a gc scan."""
    rec = Recorder(allocators if allocators is not None else discover_allocators(), capacity_events=1 << 62)
    rec.attach_new(keep_rings=True)
    return rec.build()


def _device_info(alloc: Any) -> dict[str, Any]:
    segments = alloc.snapshot()
    dev = alloc.device
    return {
        "name": dev.name,
        "total_bytes": dev.total_bytes,
        "limit_bytes": alloc.limit_bytes,
        "segments": segments,
        "stats": {k: v for k, v in alloc.stats().items() if isinstance(v, (int, float))},
    }


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _as_pairs(allocators: list[Any]) -> list[tuple[int, Any]]:
    out = []
    for i, a in enumerate(allocators):
        out.append(a if isinstance(a, tuple) else (i, a))
    return out
