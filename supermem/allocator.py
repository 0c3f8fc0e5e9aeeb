"""The C++ caching allocator and its memory sources, for direct use and tests.

A source is a device that hands out segments: `SimulatedDevice` (host memory, any machine) or
`CudaDevice` (a GPU). `CachingAllocator` caches blocks over one source exactly as PyTorch's allocator
does, adds a hard limit, pressure handlers and a trace ring. All sizes are bytes, addresses and
streams are ints (a stream is a cudaStream_t value; 0 is the default stream).
"""

from __future__ import annotations

from typing import NamedTuple

from . import _C
from .units import parse_bytes


class TraceEvent(NamedTuple):
    time_ns: int
    action: str  # alloc, free_requested, free_completed, segment_alloc, segment_free, oom, ...
    address: int
    size: int
    stream: int
    tag: int


class SimulatedDevice(_C.SimDevice):
    """A device of `capacity_bytes` backed by host memory: addresses are real and writable.

    Events complete at once, unless `hold_events(True)` keeps every event recorded from then on
    pending until `hold_events(False)` (to test cross-stream reuse)."""

    def __init__(self, capacity_bytes: int | str):
        super().__init__(parse_bytes(capacity_bytes))

    def __repr__(self) -> str:
        return f"SimulatedDevice(capacity_bytes={self.total_bytes})"


if _C.has_cuda:

    class CudaDevice(_C.CudaDevice):
        """One CUDA GPU as a source (cudaMalloc/cudaFree)."""

        def __init__(self, index: int = 0):
            super().__init__(index)

        def __repr__(self) -> str:
            return f"CudaDevice({self.index})"


class CachingAllocator(_C.CachingAllocator):
    """PyTorch-style caching allocator over `source`.

    limit_bytes: reserved memory never exceeds this (an OOM happens on demand); None: no limit.
    passthrough: no caching (one segment per block), for sanitizers.
    debug: 1 walks the invariants after each slow-path call, 2 after every call.
    trace_capacity: events kept in the trace ring (0: off).
    """

    def __init__(
        self,
        source: _C.Device,
        limit_bytes: int | str | None = None,
        *,
        passthrough: bool = False,
        debug: int = 0,
        trace_capacity: int = 0,
    ):
        limit = 0 if limit_bytes is None else parse_bytes(limit_bytes, source.total_bytes)
        super().__init__(source, limit, passthrough, debug, trace_capacity)

    def stats(self) -> dict:
        """Flat stats: *_bytes (current) and *_bytes_peak, counts, and a fragmentation figure:
        1 - largest cached free block / all cached free bytes (0 when nothing is cached)."""
        n = self.nested_stats()
        out = {}
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
        return out

    def drain_trace(self) -> list[TraceEvent]:
        """Events recorded since the last drain, oldest first (the ring keeps the newest)."""
        return [TraceEvent(*e) for e in super().drain_trace()]

    def __repr__(self) -> str:
        return f"CachingAllocator({self.device!r}, limit_bytes={self.limit_bytes})"
