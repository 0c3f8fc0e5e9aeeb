"""What would fit: replays a trace's allocations on a simulated device of a given capacity through
supermem's own caching allocator, and reports predicted peak reserved, fragmentation and OOMs.

Policies (what happens when an allocation does not fit):
  none     nothing: the allocation fails (an OOM) and the replay goes on without it.
  lru      a tensor pool offloads live blocks of the offloadable categories, oldest first.
  planned  the same, choosing the block needed furthest in the future (Belady's optimal eviction).
  cost_aware  as lru: a trace has no recompute costs.
A block is taken to be needed next when the trace frees it: it is restored (re-allocated) just
before, which may evict others. That is exact for activations (used once in backward, then freed)
and a lower bound on what a real pool achieves (it restores ahead of time). Each policy is one
class in supermem/policies.py, the registry the live pool and config read too.
"""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..errors import OutOfMemoryError, UsageError
from ..policies import POLICIES as _REGISTRY
from ..units import format_bytes
from .table import Trace
from .timeline import lifetimes, series

# The one policy registry (supermem/policies.py); each policy's key(start, end) orders evictions here.
POLICIES: dict[str, Any] = {"none": None, **_REGISTRY}
MAX_CAPACITY_BYTES = 1 << 62  # the simulated device's capacity is an int64


@dataclass
class ReplayResult:
    device: int
    capacity_bytes: int
    policy: str
    blocks: int  # block lifetimes replayed
    trace_peak_active_bytes: int  # as recorded
    trace_peak_reserved_bytes: int
    peak_reserved_bytes: int  # predicted
    peak_allocated_bytes: int
    fragmentation_at_peak: float  # 1 - allocated / reserved when reserved peaked
    ooms: list[dict[str, Any]] = field(default_factory=list)  # the first 20
    num_ooms: int = 0
    offloaded_bytes: int = 0
    offloads: int = 0
    restored_bytes: int = 0
    offloadable_bytes_at_trace_peak: int = 0

    @property
    def fits(self) -> bool:
        return self.num_ooms == 0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fits"] = self.fits
        return d


def pick_device(trace: Trace, device: int | None) -> int:
    devices = trace.device_indices()
    if not devices:
        raise UsageError("the trace has no device events to replay")
    if device is None:
        counts = {d: int((trace.cols["device"] == d).sum()) for d in devices}
        return max(devices, key=lambda d: counts[d])
    if device not in devices:
        raise UsageError(f"device {device} is not in the trace (it has {devices})")
    return device


def replay(
    trace: Trace,
    capacity_bytes: int,
    policy: str = "none",
    device: int | None = None,
    offload_categories: tuple[str, ...] = ("activation",),
) -> ReplayResult:
    """Replays `device`'s block lifetimes (default: the busiest device) on a `capacity_bytes` device."""
    from ..allocator import CachingAllocator, SimulatedDevice

    if policy not in POLICIES:
        raise UsageError(f"unknown policy {policy!r}: use one of {', '.join(POLICIES)}")
    if not 0 < capacity_bytes <= MAX_CAPACITY_BYTES:
        raise UsageError(f"capacity must be in (0, {format_bytes(MAX_CAPACITY_BYTES)}], got {capacity_bytes}")
    dev = pick_device(trace, device)
    lt = lifetimes(trace, dev)
    s = series(trace, dev, lt)
    stream = trace.cols["stream"]
    offloadable_ids = [trace.categories.index(c) for c in offload_categories if c in trace.categories]
    offloadable = np.isin(lt.category, offloadable_ids)
    chooser = POLICIES[policy]() if POLICIES[policy] else None

    # The schedule: blocks live before the first event are allocated first (in address order, the best
    # guess of their original order), then every alloc and free in trace order.
    pre = np.flatnonzero(lt.start < 0)
    starts = np.flatnonzero(lt.start >= 0)
    ends = np.flatnonzero(lt.end >= 0)
    when = np.concatenate([lt.start[starts], lt.end[ends]])
    what = np.concatenate([starts, ends])
    is_free = np.concatenate([np.zeros(len(starts), bool), np.ones(len(ends), bool)])
    order = np.lexsort((is_free, when))
    schedule = [(int(i), False) for i in pre] + list(
        zip(what[order].tolist(), is_free[order].tolist(), strict=True)
    )

    sim = SimulatedDevice(capacity_bytes)
    alloc = CachingAllocator(sim)
    addr: dict[int, int] = {}  # lifetime -> replayed address, for resident blocks
    offloaded: set[int] = set()
    heap: list[tuple[float, int]] = []  # (policy key, lifetime): resident offloadable candidates
    res = ReplayResult(
        dev,
        capacity_bytes,
        policy,
        len(lt),
        int(s.active.max(initial=s.initial_active)),
        int(s.reserved.max(initial=s.initial_reserved)),
        0,
        0,
        0.0,
    )
    allocated = 0
    peak_used = 0
    size = lt.size
    start, end = lt.start, lt.end
    stream_of = [int(stream[st]) if st >= 0 else 0 for st in start.tolist()]

    def evict(need: int) -> int:
        nonlocal allocated
        freed = 0
        while heap and freed < need:
            _, victim = heapq.heappop(heap)
            a = addr.pop(victim, None)
            if a is None:
                continue  # stale: freed or already offloaded
            alloc.free(a)
            offloaded.add(victim)
            freed += int(size[victim])
            allocated -= int(size[victim])
            res.offloads += 1
            res.offloaded_bytes += int(size[victim])
        return freed

    if chooser is not None:
        alloc.add_pressure_handler(evict)

    def malloc(i: int, restoring: bool) -> bool:
        nonlocal allocated, peak_used
        nbytes = int(size[i])
        for attempt in range(3):
            try:
                addr[i] = alloc.malloc(nbytes, stream_of[i])
                break
            except OutOfMemoryError:
                # The handler ran once inside malloc; freed blocks may not have been contiguous. Evict
                # more and retry, then give up.
                if chooser is None or attempt == 2 or not evict(nbytes * (attempt + 2)):
                    res.num_ooms += 1
                    if len(res.ooms) < 20:
                        res.ooms.append(
                            {
                                "lifetime": i,
                                "requested_bytes": nbytes,
                                "allocated_bytes": allocated,
                                "restoring": restoring,
                                "trace_index": int(start[i]),
                            }
                        )
                    return False
        allocated += nbytes
        used = sim.used_bytes
        if used > peak_used:
            peak_used = used
            res.peak_reserved_bytes = used
            res.fragmentation_at_peak = 1 - allocated / used if used else 0.0
        res.peak_allocated_bytes = max(res.peak_allocated_bytes, allocated)
        if chooser is not None and offloadable[i]:
            heapq.heappush(heap, (chooser.key(int(start[i]), int(end[i])), i))
        return True

    for i, freeing in schedule:
        if not freeing:
            malloc(i, False)
            continue
        if i in offloaded:  # needed once more before it dies: bring it back
            offloaded.discard(i)
            res.restored_bytes += int(size[i])
            if not malloc(i, True):
                continue
        a = addr.pop(i, None)
        if a is not None:  # None: its allocation failed (policy none)
            alloc.free(a)
            allocated -= int(size[i])
    if len(s.index):
        p = int(np.argmax(s.active))
        res.offloadable_bytes_at_trace_peak = int(size[lt.live_at(int(s.index[p])) & offloadable].sum())
    return res


def min_capacity(
    trace: Trace,
    policy: str = "none",
    device: int | None = None,
    offload_categories: tuple[str, ...] = ("activation",),
    tolerance: float = 0.01,
) -> int:
    """The smallest capacity (within `tolerance`, rounded up to 2 MiB) at which the replay has no OOM."""
    dev = pick_device(trace, device)
    lt = lifetimes(trace, dev)
    lo = int(lt.size.max(initial=0))
    hi = max(sum(lt.size.tolist()), lo, 2 << 20) + (64 << 20)  # Python ints: no int64 wrap
    hi = min(hi, MAX_CAPACITY_BYTES)
    step = 2 << 20
    while replay(trace, hi, policy, dev, offload_categories).num_ooms:
        if hi >= MAX_CAPACITY_BYTES:
            raise UsageError(f"no simulated device up to {format_bytes(hi)} fits this trace")
        hi = min(hi * 2, MAX_CAPACITY_BYTES)
    while hi - lo > max(step, int(hi * tolerance)):
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        if replay(trace, mid, policy, dev, offload_categories).num_ooms:
            lo = mid
        else:
            hi = mid
    return hi


def format_result(r: ReplayResult, source: str = "", link_bytes_per_s: float = 0.0) -> str:
    lines = [
        f"replay of {source or 'trace'}, device {r.device}: {r.blocks} blocks on a simulated "
        f"{format_bytes(r.capacity_bytes)} device, policy {r.policy}",
        f"  recorded peak active        {format_bytes(r.trace_peak_active_bytes)}",
        f"  recorded peak reserved      {format_bytes(r.trace_peak_reserved_bytes)}",
        f"  predicted peak reserved     {format_bytes(r.peak_reserved_bytes)}",
        f"  predicted peak allocated    {format_bytes(r.peak_allocated_bytes)}",
        f"  fragmentation at the peak   {r.fragmentation_at_peak * 100:.1f}% of reserved holds no block",
        f"  OOMs                        {r.num_ooms}" + ("  -> fits" if r.fits else "  -> does not fit"),
    ]
    if r.policy != "none":
        lines.append(
            f"  offloaded                   {format_bytes(r.offloaded_bytes)} in {r.offloads} blocks, "
            f"restored {format_bytes(r.restored_bytes)}"
        )
        if link_bytes_per_s:
            secs = (r.offloaded_bytes + r.restored_bytes) / link_bytes_per_s
            lines.append(f"  copy time at {link_bytes_per_s / 1e9:.0f} GB/s     {secs:.3f} s (overlappable)")
        if not r.offloadable_bytes_at_trace_peak:
            lines.append(
                "  note: no block of an offloadable category was live at the peak; categories come from "
                "the trace (PyTorch snapshots have none: try --offload unknown)"
            )
    for o in r.ooms[:5]:
        what = "restoring" if o["restoring"] else "allocating"
        lines.append(
            f"  OOM {what} {format_bytes(o['requested_bytes'])} with {format_bytes(o['allocated_bytes'])} "
            f"allocated (trace event {o['trace_index']})"
        )
    return "\n".join(lines)
