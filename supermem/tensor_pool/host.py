"""Pinned host memory for offloaded tensors.

Large chunks are obtained once (cudaHostAlloc costs ~3 ms and synchronises, so never per tensor) and
blocks are carved from them by supermem's caching allocator. A block that copies used is reused
only after those copies finished: the allocator's record_stream events see to it. Without CUDA the
chunks are ordinary host memory (a SimulatedDevice), so the pool runs and is tested on CPU.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from .. import _C
from ..allocator import CachingAllocator, SimulatedDevice
from ..errors import OutOfMemoryError

CHUNK_BYTES = 256 << 20


class HostBlock:
    """A block of the host pool, seen as a uint8 tensor. The tensor's storage owns the block: when the
    last view of it dies (or at `HostPool.give_back`, whichever comes first) the block returns to the
    pool, reused only after the copies queued so far on the pool's copy streams have finished. So a
    user who drops a block without giving it back (a streamer that is closed or collected) leaks
    nothing, and one who gives it back while a view lives on is the only way to alias it."""

    __slots__ = ("address", "nbytes", "tensor", "_release")

    def __init__(self, pool: HostPool, address: int, nbytes: int):
        self.address = address
        self.nbytes = nbytes
        buf = (ctypes.c_uint8 * max(nbytes, 1)).from_address(address)
        # the finalizer holds the pool, never the buffer: the storage's reference is the last one
        self._release = weakref.finalize(buf, pool._free, address)
        self._release.atexit = False  # at exit the process's memory goes anyway
        self.tensor = torch.frombuffer(buf, dtype=torch.uint8)  # aliases the block, keeps `buf` alive


class HostPool:
    def __init__(self, limit_bytes: int, pinned: bool):
        if pinned:
            from ..allocator import PinnedHostDevice

            source = PinnedHostDevice(limit_bytes)
        else:
            source = SimulatedDevice(limit_bytes)
        self.pinned = pinned
        self.allocator = CachingAllocator(source, segment_bytes=min(CHUNK_BYTES, limit_bytes))
        self.copy_streams: set[int] = set()  # what a block returned by its last view's death waits for

    def take(self, nbytes: int) -> HostBlock | None:
        """A block of `nbytes` (at least 1), or None when the host limit is reached."""
        try:
            return HostBlock(self, self.allocator.malloc(max(nbytes, 1)), nbytes)
        except OutOfMemoryError:
            return None

    def give_back(self, block: HostBlock, streams: tuple[int, ...] = ()) -> None:
        """Frees `block` now (views of it must be dead by then); it is reused only after the work queued
        on `streams` so far has finished. Giving a block back twice is harmless."""
        if block._release.alive:
            for s in streams:
                self.allocator.record_stream(block.address, s)
            block._release()

    def _free(self, address: int) -> None:
        for s in self.copy_streams:
            self.allocator.record_stream(address, s)
        self.allocator.free(address)

    @property
    def reserved_bytes(self) -> int:
        return self.allocator.stats()["reserved_bytes"]


def pinned_available() -> bool:
    return _C.has_cuda and torch.cuda.is_available()
