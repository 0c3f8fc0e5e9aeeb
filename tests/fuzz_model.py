"""A model of the caching allocator on a simulated device, for the random and Hypothesis fuzzers.

Every operation is applied to the allocator and to the model, then `check()` compares them:
  - the invariant walker passes;
  - live blocks, and blocks whose reuse waits on held events, never overlap (the model's own
    interval set), and every live block still carries its cookie (verified before it is freed);
  - allocated / requested / active bytes and the live block count equal the model's sums;
  - reserved bytes equal what the simulated device says it handed out, and a segment is never
    added beyond the limit;
  - an OOM happens only when it may: an allocator with no live blocks and no graph pools must
    serve any request that fits under the limit and the device;
  - a block freed on its own stream while events are held (that stream's work may still be queued) is
    never handed to another stream before the hold ends. A block lent by another stream (a miss served
    by another stream's settled free block: `num_borrows`) is pending after its free, like one that
    another stream used.
Graph captures route one stream to a private pool; frees of blocks other streams used are deferred
while a capture runs (no events may be recorded then) and handled by the first malloc after it.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from alloc_spec import MAX_REQUEST, PAGE, MiB, round_up, rounded
from live_blocks import HostMemory, LiveBlocks

from supermem.allocator import CachingAllocator, SimulatedDevice
from supermem.errors import OutOfMemoryError


@dataclass
class Block:
    nbytes: int
    size: int  # allocation_size: the rounded size, or more when the rest was too small to split
    stream: int
    other_streams: set[int] = field(default_factory=set)
    borrowed: bool = False  # another stream's free block: its free waits for an event of `stream`


class AllocatorModel:
    def __init__(
        self,
        capacity_bytes: int,
        streams: tuple[int, ...] = (0, 1, 2),
        passthrough: bool = False,
        expandable: bool = False,
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.streams = streams
        self.expandable = expandable
        self.device = SimulatedDevice(capacity_bytes)
        self.alloc = CachingAllocator(self.device, passthrough=passthrough, expandable_segments=expandable)
        self.live = LiveBlocks(HostMemory())
        self.blocks: dict[int, Block] = {}
        # Freed blocks that other streams used. `deferred`: freed during a capture, no events yet.
        # `waiting`: their events are held, so the allocator must not reuse them before it syncs.
        # `done`: events complete, reused from the next malloc.
        self.deferred: dict[int, int] = {}
        self.waiting: dict[int, int] = {}
        self.done: dict[int, int] = {}
        # (start, end, stream) of blocks freed on their own stream while events are held: that stream's
        # work may still use them, so no other stream may be given them until the hold ends.
        self.unsettled: list[tuple[int, int, int]] = []
        # The device's waits: for the whole device (it forgets every stream's), for a stream's event (that
        # stream's work is done).
        self.device_waits = 0
        self.stream_waits: dict[int, int] = {}
        self.capture: tuple[int, int] | None = None  # the pool allocations are routed to
        self.capture_stream = streams[-1]
        self.pools: list[tuple[int, int]] = []  # pools whose graphs are alive
        self.pool_serial = 0
        self.held = False
        self.limit_bytes = 0
        self.ooms = 0
        self.syncs = 0
        self.reserved_before = 0
        self.ops = 0

    # ------------------------------------------------------------ operations

    def malloc(self, nbytes: int, stream: int) -> int | None:
        if nbytes and not self.capture:  # malloc processes events first, unless capturing
            self._process_deferred()
            self._retire(self.done)
        empty = not self.blocks and not self.pools and not self.capture
        borrows = self.alloc.stats()["num_borrows"]
        try:
            p = self.alloc.malloc(nbytes, stream)
        except OutOfMemoryError as e:
            self.ooms += 1
            assert str(e).startswith("CUDA out of memory."), str(e)
            need = round_up(rounded(nbytes), PAGE) if self.expandable else rounded(nbytes)  # whole pages
            fits = need <= min(self.limit_bytes or self.capacity_bytes, self.capacity_bytes)
            assert not (empty and fits and nbytes <= MAX_REQUEST), (
                f"OOM for {nbytes} bytes with no live blocks: {e}"
            )
            self._after_possible_sync()
            return None
        self._after_possible_sync()  # a retry may have synced: waiting blocks may be reused now
        if nbytes == 0:
            assert p == 0
            return None
        size = self.alloc.allocation_size(p)
        assert size >= rounded(nbytes), f"malloc({nbytes}) gave a block of {size} bytes"
        self.live.add(p, nbytes, rounded(nbytes))
        for lo, hi, other in self.unsettled:
            assert other == stream or p + size <= lo or hi <= p, (
                f"stream {stream} got [{p:#x}, +{size}) which stream {other} freed while its work may run"
            )
        self.blocks[p] = Block(nbytes, size, stream, borrowed=self.alloc.stats()["num_borrows"] > borrows)
        return p

    def free(self, p: int) -> None:
        b = self.blocks.pop(p)
        pending = bool(b.other_streams) or b.borrowed
        self.live.remove(p, keep_range=pending)
        device_frees = self.alloc.stats()["num_segment_frees"]
        self.alloc.free(p)
        if self.alloc.stats()["num_segment_frees"] != device_frees:  # cudaFree synchronizes the device
            self.unsettled.clear()
        elif self.held and not pending:
            self.unsettled.append((p, p + b.size, b.stream))
        if pending:
            pending = self.deferred if self.capture else self.waiting if self.held else self.done
            pending[p] = b.size

    def record_stream(self, p: int, stream: int) -> None:
        self.alloc.record_stream(p, stream)
        b = self.blocks[p]
        if stream != b.stream:
            b.other_streams.add(stream)

    def hold_events(self, hold: bool) -> None:
        self.device.hold_events(hold)
        if self.held and not hold:
            self.done.update(self.waiting)
            self.waiting.clear()
            self.unsettled.clear()
        self.held = hold

    def begin_capture(self) -> None:
        assert self.capture is None
        self.pool_serial += 1
        self.capture = (self.pool_serial, 0)
        self.alloc.begin_allocate_to_pool(self.capture, [self.capture_stream])
        self.pools.append(self.capture)

    def end_capture(self) -> None:
        assert self.capture is not None
        self.alloc.end_allocate_to_pool(self.capture)
        self.capture = None

    def release_pool(self, pool: tuple[int, int]) -> None:
        self.pools.remove(pool)
        self.alloc.release_pool(pool)
        self._after_possible_sync()

    def empty_cache(self) -> None:
        self.alloc.empty_cache()
        self._after_possible_sync()
        if self.capture:
            return  # nothing may be synced or returned during a capture
        assert not self.deferred and not self.waiting and not self.done
        if not self.blocks and not self.pools:
            assert self.device.used_bytes == 0, "empty_cache with nothing live left memory reserved"

    def set_limit(self, limit_bytes: int) -> None:
        self.alloc.limit_bytes = limit_bytes
        self.limit_bytes = limit_bytes
        self._after_possible_sync()

    def free_all(self) -> None:
        for p in list(self.blocks):
            self.free(p)
        if self.capture:
            self.end_capture()
        for pool in list(self.pools):
            self.release_pool(pool)
        self.hold_events(False)
        self.empty_cache()
        s = self.alloc.stats()
        assert s["allocated_bytes"] == s["active_bytes"] == s["reserved_bytes"] == 0

    # ------------------------------------------------------------ checks

    def _retire(self, pending: dict[int, int]) -> None:
        for p in pending:
            self.live.release_range(p)
        pending.clear()

    def _process_deferred(self) -> None:
        """Events are recorded for blocks freed during a capture (held or complete at once)."""
        (self.waiting if self.held else self.done).update(self.deferred)
        self.deferred.clear()

    def _after_possible_sync(self) -> None:
        device_waits, stream_waits = self.device.waits[0], self.device.stream_waits
        if device_waits != self.device_waits:
            self.device_waits = device_waits
            self.unsettled.clear()
        waited = {st for st, n in stream_waits.items() if self.stream_waits.get(st) != n}
        if waited:
            self.stream_waits = stream_waits
            self.unsettled = [u for u in self.unsettled if u[2] not in waited]
        syncs = self.alloc.stats()["num_sync_all_streams"]
        if syncs != self.syncs:  # every outstanding event was waited for (cached memory went back,
            self.syncs = syncs  # which on CUDA synchronizes the device)
            self.unsettled.clear()
            self._retire(self.deferred)
            self._retire(self.waiting)
            self._retire(self.done)

    def check(self) -> None:
        self.alloc.check()
        s = self.alloc.stats()
        allocated = sum(b.size for b in self.blocks.values())
        assert s["allocated_bytes"] == allocated
        assert s["requested_bytes"] == sum(b.nbytes for b in self.blocks.values())
        assert s["live_blocks"] == len(self.blocks)
        pending = (self.deferred, self.waiting, self.done)
        assert s["active_bytes"] == allocated + sum(sum(d.values()) for d in pending)
        assert s["num_ooms"] == self.ooms
        reserved = s["reserved_bytes"]
        assert reserved == self.device.used_bytes
        if self.limit_bytes and reserved > self.reserved_before:
            assert reserved <= self.limit_bytes, f"reserved {reserved} grew past the limit {self.limit_bytes}"
        self.reserved_before = reserved


# ---------------------------------------------------------------- the random op stream

LIMITS = (0, 48 * MiB, 96 * MiB, 160 * MiB)
CAPACITY = 192 * MiB
BOUNDARY = (1, 512, 513, MiB, MiB + 1, 2 * MiB, 10 * MiB - 1, 10 * MiB, 20 * MiB, 20 * MiB + 1)


def realistic_size(rng: random.Random) -> int:
    """Mostly small activations, some medium and large tensors, a few exact boundaries and misfits."""
    r = rng.random()
    if r < 0.02:
        return rng.choice(BOUNDARY)
    if r < 0.70:
        return int(2 ** rng.uniform(0, 20))  # 1 B .. 1 MiB
    if r < 0.93:
        return int(2 ** rng.uniform(20, 23.3))  # 1 .. 10 MiB
    if r < 0.995:
        return int(2 ** rng.uniform(23.3, 25.4))  # 10 .. 44 MiB
    return rng.choice((CAPACITY + 1, 1 << 50, 1 << 61, 0))


def run_random_ops(
    seed: int, n_ops: int, passthrough: bool = False, expandable: bool = False
) -> AllocatorModel:
    rng = random.Random(seed)
    m = AllocatorModel(CAPACITY, passthrough=passthrough, expandable=expandable)
    for i in range(n_ops):
        op = random_op(rng, m)
        try:
            op()
            m.check()
        except AssertionError as e:
            raise AssertionError(f"seed {seed}, op {i}: {describe(op)}: {e}") from e
        m.ops += 1
    m.live.cookies.verify_all()
    m.free_all()
    m.check()
    return m


def describe(op: Callable[[], object]) -> str:
    if isinstance(op, functools.partial):
        return f"{op.func.__name__}{op.args}"
    return getattr(op, "__name__", repr(op))


def random_op(rng: random.Random, m: AllocatorModel) -> Callable[[], object]:
    r = rng.random()
    crowded = len(m.blocks) > 150
    if r < (0.42 if crowded else 0.5):
        return functools.partial(m.malloc, realistic_size(rng), rng.choice(m.streams))
    if r < 0.85 and m.blocks:
        return functools.partial(m.free, rng.choice(list(m.blocks)))
    if r < 0.95 and m.blocks:
        return functools.partial(m.record_stream, rng.choice(list(m.blocks)), rng.choice(m.streams))
    if r < 0.97:
        return functools.partial(m.hold_events, not m.held)
    if r < 0.98:
        return m.empty_cache
    if r < 0.985:
        return functools.partial(m.set_limit, rng.choice(LIMITS))
    if r < 0.99:
        return m.end_capture if m.capture else m.begin_capture
    if r < 0.995 and m.pools and not m.capture:
        return functools.partial(m.release_pool, rng.choice(m.pools))
    return m.live.cookies.verify_all
