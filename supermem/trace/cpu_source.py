"""CPU tensors' allocations as a recording's source, from torch.profiler's memory events.

PyTorch's CPU allocator has no hook Python can set, but it reports every allocation and free to the
profiler when memory profiling is on (what torch.profiler._memory_profiler reads). ProfiledCPU wraps
that as the allocator interface a Recorder drains (trace_capacity, drain_trace, snapshot, stats), so a
CPU run is traced, categorised and attributed as a GPU run is: the trace tool's tests use it on real
models. It costs what the profiler costs (every op recorded, ~10 us each): a test tool, not one to
leave on. Blocks live before the recording are not seen; CPU memory has no cache, so reserved is
active.

The profiler's times are CLOCK_REALTIME (converted from its approximate clock); they are moved onto
CLOCK_MONOTONIC, the recording's clock, by the offset between the two read at the start (to within
a microsecond: tests/cpu/trace/test_trace_owners.py checks that each alloc falls between the calls around it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass
class _Device:
    name: str = "cpu (torch.profiler memory events)"
    total_bytes: int = 0


class ProfiledCPU:
    """An allocator-like source of CPU allocation events. `Recorder(allocators=[ProfiledCPU()])`."""

    def __init__(self) -> None:
        self.device = _Device()
        self.limit_bytes = 0
        self.trace_dropped = 0
        self._capacity = 0
        self._prof: Any = None
        self._events: list[tuple] = []

    @property
    def trace_capacity(self) -> int:
        return self._capacity

    @trace_capacity.setter
    def trace_capacity(self, n: int) -> None:
        """Starts (n > 0) or stops profiling; empties what was collected, as a ring's resize does."""
        self._stop()
        self._events = []
        self._capacity = n
        if n > 0:
            self._start()

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._offset_ns = time.time_ns() - time.monotonic_ns()
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()

    def _stop(self) -> None:
        if self._prof is None:
            return
        from .. import torch_private as tp

        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        allocation = tp.allocation_event_type()
        out = []
        todo = list(prof.profiler.kineto_results.experimental_event_tree())
        while todo:
            e = todo.pop()
            todo.extend(e.children)
            if e.tag == allocation:
                f = e.extra_fields
                if f.device.type != "cpu" or not f.ptr:
                    continue
                t = e.start_time_ns - self._offset_ns
                size = int(f.alloc_size)
                out.append((t, "alloc" if size > 0 else "free_completed", int(f.ptr), abs(size), 0, 0))
        out.sort(key=lambda r: r[0])
        self._events.extend(out)
        if len(self._events) > self._capacity:
            self.trace_dropped += len(self._events) - self._capacity
            del self._events[: len(self._events) - self._capacity]

    def drain_trace(self) -> list[tuple]:
        """(time_ns, action, address, size, stream, tag) since the last drain; profiling goes on."""
        self._stop()
        out, self._events = self._events, []
        if self._capacity > 0:
            self._start()
        return out

    def snapshot(self) -> list[dict[str, Any]]:
        return []

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self.trace_capacity = 0
