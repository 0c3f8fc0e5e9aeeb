"""The C++ caching allocator and its memory sources, for direct use, tools and tests.

A source is a device that hands out segments: `SimulatedDevice` (host memory, any machine) or
`CudaDevice` (a GPU). `CachingAllocator` caches blocks over one source as PyTorch's allocator does,
and adds a hard limit, pressure handlers and a trace ring. Sizes are bytes; addresses and streams
are ints (a stream is a cudaStream_t value, 0 the default stream).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple, TypedDict, cast

import torch  # noqa: F401  (first: with a CUDA torch, supermem._C links torch's libraries)

from . import _C
from .units import parse_bytes


class TraceEvent(NamedTuple):
    time_ns: int  # steady clock
    action: str  # one of TRACE_ACTIONS
    address: int
    size: int
    stream: int
    tag: int  # free-form (pool entry id, category, ...)


TRACE_ACTIONS: tuple[str, ...] = tuple(_C.trace_kinds)


class SimulatedDevice(_C.SimDevice):
    """A device of `capacity_bytes` backed by host memory: addresses are real and writable.

    Events complete at once, unless `hold_events(True)` keeps every event recorded from then on
    pending until `hold_events(False)` (to test cross-stream reuse).

    Virtual memory (for expandable segments) in pages of `page_bytes` (a multiple of the host's page
    size; 2 MiB as on CUDA; 0 for a device without virtual memory): reserved address space is
    inaccessible, a mapped page is fresh zeroed memory that counts in used_bytes, an unmapped page
    faults again. `mapped_bytes(address, nbytes)` says how much of a range is mapped."""

    def __init__(self, capacity_bytes: int | str, page_bytes: int | str = "2MiB"):
        super().__init__(parse_bytes(capacity_bytes), _size_arg("page_bytes", page_bytes))

    def __repr__(self) -> str:
        return f"SimulatedDevice(capacity_bytes={self.total_bytes})"


if _C.has_cuda:

    class CudaDevice(_C.CudaDevice):
        """One CUDA GPU as a source (cudaMalloc/cudaFree)."""

        def __init__(self, index: int = 0):
            super().__init__(index)

        def __repr__(self) -> str:
            return f"CudaDevice({self.index})"

    class PinnedHostDevice(_C.PinnedHostDevice):
        """Page-locked host memory (cudaHostAlloc) up to `capacity_bytes`, as a source."""

        def __init__(self, capacity_bytes: int | str):
            super().__init__(parse_bytes(capacity_bytes))

        def __repr__(self) -> str:
            return f"PinnedHostDevice(capacity_bytes={self.total_bytes})"


class AllocatorStats(TypedDict):
    """CachingAllocator.stats(): bytes now and at their peak, counts, the allocator's own figures."""

    allocated_bytes: int
    allocated_bytes_peak: int
    reserved_bytes: int
    reserved_bytes_peak: int
    active_bytes: int
    active_bytes_peak: int
    requested_bytes: int
    requested_bytes_peak: int
    live_blocks: int
    num_allocs: int
    num_frees: int
    segments: int
    num_segment_allocs: int
    num_segment_frees: int
    num_ooms: int
    num_alloc_retries: int
    num_sync_all_streams: int
    cached_free_bytes: int
    largest_free_block_bytes: int
    num_pressure_calls: int
    pressure_freed_bytes: int
    limit_bytes: int
    expandable_segments: bool
    address_space_bytes: int
    num_reclaims: int
    num_reclaim_waits: int
    reclaimed_bytes: int
    num_borrows: int
    pending_at_reserved_peak: int
    fragmentation: float
    peak_unallocated_bytes: int
    peak_reserved_ratio: float


class CachingAllocator:
    """PyTorch-style caching allocator over `source`.

    limit_bytes: reserved memory never exceeds this (bytes, "8GiB" or "60%" of the source); None: no
        limit. Beyond it, malloc raises supermem.OutOfMemoryError (a torch.OutOfMemoryError).
    passthrough: no caching (one segment per block, returned on free), for sanitizers.
    debug: 1 walks the invariants after each slow-path call, 2 after every call.
    trace_capacity: events kept in the trace ring (0: off).
    segment_bytes: smallest segment to ask the source for (0: PyTorch's sizes); large values make a
        few big chunks that blocks are carved from (the pinned host pool uses this).
    expandable_segments: one segment per (pool, stream, size class), a reserved virtual address range
        into which the source's pages are mapped on demand and from which free pages are unmapped
        when cached memory is released (OOM retry, empty_cache, a lower limit): PyTorch's
        expandable_segments. The source must have virtual memory (`source.page_bytes > 0`).
    """

    def __init__(
        self,
        source: _C.Device,
        limit_bytes: int | str | None = None,
        *,
        passthrough: bool = False,
        debug: int = 0,
        trace_capacity: int = 0,
        segment_bytes: int | str = 0,
        expandable_segments: bool = False,
    ):
        if not isinstance(source, _C.Device):  # checked first: the limit may be a fraction of it
            raise TypeError(
                "CachingAllocator needs a supermem device (SimulatedDevice, CudaDevice, PinnedHostDevice), "
                f"got {source!r}"
            )
        limit = 0 if limit_bytes is None else _size_arg("limit_bytes", limit_bytes, source.total_bytes)
        segment = _size_arg("segment_bytes", segment_bytes)
        self._impl = _C.CachingAllocator(
            source, limit, passthrough, debug, trace_capacity, segment, expandable_segments
        )

    @classmethod
    def wrap(cls, impl: _C.CachingAllocator) -> CachingAllocator:
        """A view of an allocator owned elsewhere (e.g. the one serving PyTorch on a GPU)."""
        self = cls.__new__(cls)
        self._impl = impl
        return self

    def malloc(self, nbytes: int, stream: int = 0) -> int:
        """Address of a block of at least `nbytes` (512-byte aligned); 0 for 0 bytes."""
        return self._impl.malloc(nbytes, stream)

    def free(self, address: int) -> None:
        """Frees a block malloc returned. Double, interior or foreign frees raise UsageError."""
        self._impl.free(address)

    def record_stream(self, address: int, stream: int) -> None:
        """`stream` uses the block too: after free, it is reused only once that stream's work is done."""
        self._impl.record_stream(address, stream)

    def allocation_size(self, address: int) -> int:
        """Rounded size of a live block."""
        return self._impl.allocation_size(address)

    def empty_cache(self) -> None:
        """Returns every wholly free cached segment to the source."""
        self._impl.empty_cache()

    def check(self) -> None:
        """Walks the invariants; raises InvariantError on any violation."""
        self._impl.check()

    def add_pressure_handler(self, handler: Callable[[int], int | None]) -> int:
        """`handler(need_bytes) -> freed_bytes` runs (allocator lock released) before an OOM is raised.
        Returns an id for remove_pressure_handler."""
        return self._impl.add_pressure_handler(handler)

    def remove_pressure_handler(self, handler_id: int) -> None:
        self._impl.remove_pressure_handler(handler_id)

    def begin_allocate_to_pool(self, pool_id: tuple[int, int], streams: Iterable[int]) -> None:
        """Routes allocations on `streams` to a private pool (what a CUDA graph capture does)."""
        self._impl.begin_allocate_to_pool(pool_id, list(streams))

    def end_allocate_to_pool(self, pool_id: tuple[int, int]) -> None:
        self._impl.end_allocate_to_pool(pool_id)

    def release_pool(self, pool_id: tuple[int, int]) -> None:
        """The pool's owner (a graph) is gone: its memory returns to the device once free."""
        self._impl.release_pool(pool_id)

    @property
    def limit_bytes(self) -> int:
        """0 when unlimited."""
        return self._impl.limit_bytes

    @limit_bytes.setter
    def limit_bytes(self, value: int | str | None) -> None:
        self._impl.limit_bytes = (
            0 if value is None else _size_arg("limit_bytes", value, self.device.total_bytes)
        )

    def set_memory_fraction(self, fraction: float) -> None:
        """As torch.cuda.set_per_process_memory_fraction: new segments only up to `fraction` (in [0, 1]) of
        the device's capacity; 0 allows none. Cached blocks stay usable. `limit_bytes = None` lifts it."""
        self._impl.set_memory_fraction(fraction)

    def memory_fraction(self) -> float:
        """The fraction last set, else limit_bytes / capacity, else 1.0 (get_per_process_memory_fraction)."""
        return self._impl.memory_fraction()

    @property
    def device(self) -> _C.Device:
        return self._impl.device

    @property
    def passthrough(self) -> bool:
        return self._impl.passthrough

    @property
    def expandable_segments(self) -> bool:
        return self._impl.expandable_segments

    @property
    def allocated_bytes(self) -> int:
        """Bytes in allocated blocks now (cheap: no stats dict)."""
        return self._impl.allocated_bytes

    def nested_stats(self) -> dict:
        """Stats shaped like torch.cuda.memory_stats_as_nested_dict, plus a "supermem" section."""
        return self._impl.nested_stats()

    def stats(self) -> AllocatorStats:
        """Flat stats: *_bytes (current) and *_bytes_peak, counts, and fragmentation figures:
        fragmentation: 1 - largest cached free block / all cached free bytes (0 when nothing is cached);
        peak_unallocated_bytes: reserved_bytes_peak - allocated_bytes_peak, memory held but unused at
            the peak; peak_reserved_ratio: reserved_bytes_peak / allocated_bytes_peak (1.0 before any
            allocation), what a tight memory limit has to leave room for.
        reserved_bytes is memory (for expandable segments, their mapped pages); address_space_bytes is
        the address space expandable segments reserved, with or without memory behind it; num_reclaims
        counts the free blocks whose pages expandable segments moved to a request instead of growing,
        num_reclaim_waits the host's waits for a stream before such moves, reclaimed_bytes their pages;
        num_borrows: misses served by another stream's free block whose last use had completed;
        pending_at_reserved_peak: of peak_unallocated_bytes, the freed blocks still awaiting another
        stream's work (record_stream, a borrow) when reserved memory set its peak: in flight, not
        fragmentation."""
        n = self._impl.nested_stats()
        out: dict = {}
        for key in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes"):
            out[key] = n[key]["all"]["current"]
            out[key + "_peak"] = n[key]["all"]["peak"]
        out["live_blocks"] = n["allocation"]["all"]["current"]
        out["num_allocs"] = n["allocation"]["all"]["allocated"]
        out["num_frees"] = n["allocation"]["all"]["freed"]
        out["segments"] = n["segment"]["all"]["current"]
        out["num_segment_allocs"] = n["segment"]["all"]["allocated"]
        out["num_segment_frees"] = n["segment"]["all"]["freed"]
        for key in ("num_ooms", "num_alloc_retries", "num_sync_all_streams"):
            out[key] = n[key]
        own = n["supermem"]
        out.update(own)
        cached = own["cached_free_bytes"]
        out["fragmentation"] = 1 - own["largest_free_block_bytes"] / cached if cached else 0.0
        reserved_peak, allocated_peak = out["reserved_bytes_peak"], out["allocated_bytes_peak"]
        out["peak_unallocated_bytes"] = reserved_peak - allocated_peak
        out["peak_reserved_ratio"] = reserved_peak / allocated_peak if allocated_peak else 1.0
        return cast(AllocatorStats, out)

    def take_watermark(self) -> int:
        """Highest allocated bytes since the last call; restarts from the current value. Separate from
        the peak stats, so the tensor pool can watch each step's peak without resetting the user's."""
        return self._impl.take_watermark()

    @property
    def soft_limit_bytes(self) -> int:
        """The tensor pool's budget as the allocator keeps it: an allocation that would take allocated
        bytes over it first asks the pressure handlers for the excess, then goes ahead whatever they
        freed (0: off). After a call that freed less than asked, they are asked again only after
        arm_soft_limit()."""
        return self._impl.soft_limit_bytes

    @soft_limit_bytes.setter
    def soft_limit_bytes(self, nbytes: int) -> None:
        self._impl.soft_limit_bytes = nbytes

    def arm_soft_limit(self) -> None:
        """The pressure handlers hold more that they could free: ask them again at the soft limit
        (lock-free; an arm while the handlers run keeps it armed after their call)."""
        self._impl.arm_soft_limit()

    @property
    def in_soft_limit_call(self) -> bool:
        """Whether the pressure handlers now running were called for the soft limit (they are asked
        for the excess over it), not for an allocation that failed (asked for its size)."""
        return self._impl.in_soft_limit_call

    def reset_peak_stats(self) -> None:
        self._impl.reset_peak_stats()

    def reset_accumulated_stats(self) -> None:
        self._impl.reset_accumulated_stats()

    def snapshot(self) -> list[dict]:
        """Segments and their blocks, in the shape of PyTorch's memory snapshot "segments"."""
        return self._impl.snapshot()

    @property
    def trace_capacity(self) -> int:
        return self._impl.trace_capacity

    @trace_capacity.setter
    def trace_capacity(self, n: int) -> None:
        self._impl.trace_capacity = n

    @property
    def trace_dropped(self) -> int:
        """Events lost undrained: overwritten because the ring was full, or emptied by a resize."""
        return self._impl.trace_dropped

    def drain_trace(self) -> list[TraceEvent]:
        """Events recorded since the last drain, oldest first (the ring keeps the newest)."""
        return [TraceEvent(*e) for e in self._impl.drain_trace()]

    def push_trace(self, action: str, address: int = 0, size: int = 0, stream: int = 0, tag: int = 0) -> None:
        """Adds an event of the pool's (offload, prefetch, ...) to the ring."""
        self._impl.push_trace(action, address, size, stream, tag)

    def __repr__(self) -> str:
        extra = ", expandable_segments=True" if self.expandable_segments else ""
        return f"CachingAllocator({self.device!r}, limit_bytes={self.limit_bytes}{extra})"


def _size_arg(name: str, value: int | str, total_bytes: int | None = None) -> int:
    """parse_bytes, with the argument named in its error."""
    try:
        return parse_bytes(value, total_bytes)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
