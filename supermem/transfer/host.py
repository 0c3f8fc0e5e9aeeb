"""Pinned host memory for offloaded tensors.

Large chunks are obtained once (cudaHostAlloc costs ~3 ms and synchronises, so never per tensor) and
blocks are carved from them by supermem's caching allocator. A block that copies used is reused
only after those copies finished: the allocator's record_stream events see to it. Without CUDA the
chunks are ordinary host memory (a SimulatedDevice), so the pool runs and is tested on CPU.

One pool per device (`shared_host_pool`) serves the tensor pool and the weight streamer, each through
a HostShare that keeps it within its own host_limit: one host budget per device, not one per user.
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import psutil
import torch

from .. import _C
from ..allocator import CachingAllocator, SimulatedDevice
from ..errors import OutOfMemoryError

CHUNK_BYTES = 256 << 20


class HostBlock:
    """A block of the host pool, seen as a uint8 tensor. The tensor's storage owns the block: when the
    last view of it dies (or at `give_back`, whichever comes first) the block returns to the pool,
    reused only after the copies queued so far on the pool's copy streams have finished. So a user who
    drops a block without giving it back (a streamer that is closed or collected) leaks nothing, and
    one who gives it back while a view lives on is the only way to alias it."""

    __slots__ = ("address", "nbytes", "tensor", "_release")

    def __init__(self, owner: HostPool | HostShare, address: int, nbytes: int):
        self.address = address
        self.nbytes = nbytes
        buf = (ctypes.c_uint8 * max(nbytes, 1)).from_address(address)
        # the finalizer holds the owner, never the buffer: the storage's reference is the last one
        self._release = weakref.finalize(buf, owner._free, address, nbytes)
        self._release.atexit = False  # at exit the process's memory goes anyway
        self.tensor = torch.frombuffer(buf, dtype=torch.uint8)  # aliases the block, keeps `buf` alive


class HostPool:
    """Host memory for one device's copies, at most `limit_bytes` of it reserved. One per device is
    shared by the tensor pool and the streamer (`shared_host_pool`), each within its own share."""

    def __init__(self, limit_bytes: int, pinned: bool):
        # the source may hold all of RAM: the allocator's limit is what `raise_limit` moves
        capacity = max(limit_bytes, psutil.virtual_memory().total)
        if pinned:
            from ..allocator import PinnedHostDevice

            source = PinnedHostDevice(capacity)
        else:
            source = SimulatedDevice(capacity)
        self.pinned = pinned
        # limit 0 would mean none to the allocator: here it means nothing may be taken
        limit = max(limit_bytes, 1)
        self.allocator = CachingAllocator(source, limit, segment_bytes=min(CHUNK_BYTES, limit_bytes))
        self.copy_streams: set[int] = set()  # what a block returned by its last view's death waits for

    @property
    def limit_bytes(self) -> int:
        return self.allocator.limit_bytes

    def raise_limit(self, limit_bytes: int) -> None:
        """At least `limit_bytes` from now on (a smaller value changes nothing)."""
        if limit_bytes > self.allocator.limit_bytes:
            self.allocator.limit_bytes = limit_bytes

    def take(self, nbytes: int, owner: HostPool | HostShare | None = None) -> HostBlock | None:
        """A block of `nbytes` (at least 1), or None when the host limit is reached."""
        try:
            return HostBlock(owner or self, self.allocator.malloc(max(nbytes, 1)), nbytes)
        except OutOfMemoryError:
            return None

    def give_back(self, block: HostBlock, streams: tuple[int, ...] = ()) -> None:
        """Frees `block` now (views of it must be dead by then); it is reused only after the work queued
        on `streams` so far has finished. Giving a block back twice is harmless."""
        if block._release.alive:
            for s in streams:
                self.allocator.record_stream(block.address, s)
            block._release()

    def _free(self, address: int, nbytes: int) -> None:
        for s in tuple(self.copy_streams):  # a copy: a pool or a streamer may add its streams meanwhile
            self.allocator.record_stream(address, s)
        self.allocator.free(address)

    @property
    def reserved_bytes(self) -> int:
        """Host memory held, blocks in use and cached ones, by every share."""
        return self.allocator.stats()["reserved_bytes"]


class HostShare:
    """One user's part of its device's HostPool: blocks come from the pool (its chunks, its cache, its
    copy streams), and this user holds at most `limit_bytes` of them at once."""

    def __init__(self, pool: HostPool, limit_bytes: int):
        self.pool = pool
        self.limit_bytes = limit_bytes
        self.in_use_bytes = 0
        self._lock = threading.Lock()  # a block may die on any thread

    def take(self, nbytes: int) -> HostBlock | None:
        """A block of `nbytes`, or None when this share's or the pool's limit is reached."""
        with self._lock:
            if self.in_use_bytes + nbytes > self.limit_bytes:
                return None
            self.in_use_bytes += nbytes
        block = self.pool.take(nbytes, owner=self)
        if block is None:
            with self._lock:
                self.in_use_bytes -= nbytes
        return block

    def give_back(self, block: HostBlock, streams: tuple[int, ...] = ()) -> None:
        """As HostPool.give_back."""
        self.pool.give_back(block, streams)

    def _free(self, address: int, nbytes: int) -> None:
        self.pool._free(address, nbytes)
        with self._lock:
            self.in_use_bytes -= nbytes

    @property
    def allocator(self) -> CachingAllocator:
        return self.pool.allocator

    @property
    def copy_streams(self) -> set[int]:
        return self.pool.copy_streams

    @property
    def reserved_bytes(self) -> int:
        return self.pool.reserved_bytes


_shared: dict[str, HostPool] = {}
_shared_lock = threading.Lock()


def shared_host_pool(device: torch.device, limit_bytes: int) -> HostShare:
    """A share of `device`'s host pool, holding at most `limit_bytes`. The pool is made at the first
    call for the device and is pinned there when the device is a CUDA one. Its own limit is the largest
    any share asked for (the first sets it, a larger later one raises it): so the tensor pool and the
    streamer, each with the default host_limit of 50% of RAM, pin at most 50% together, not 100%."""
    key = str(device)
    with _shared_lock:
        pool = _shared.get(key)
        if pool is None:
            pool = _shared[key] = HostPool(limit_bytes, pinned=device.type == "cuda" and pinned_available())
        else:
            pool.raise_limit(limit_bytes)
    return HostShare(pool, limit_bytes)


def pinned_available() -> bool:
    return _C.has_cuda and torch.cuda.is_available()
