"""Pinned host memory for offloaded tensors.

Large chunks are obtained once (cudaHostAlloc costs ~3 ms and synchronises, so never per tensor) and
blocks are carved from them by supermem's caching allocator. A block that copies used is reused
only after those copies finished: the allocator's record_stream events see to it. Without CUDA the
chunks are ordinary host memory (a SimulatedDevice), so the pool runs and is tested on CPU.
"""

from __future__ import annotations

import ctypes

import torch

from .. import _C
from ..allocator import CachingAllocator, SimulatedDevice
from ..errors import OutOfMemoryError

CHUNK_BYTES = 256 << 20


class HostBlock:
    __slots__ = ("address", "nbytes", "tensor")

    def __init__(self, address: int, nbytes: int):
        self.address = address
        self.nbytes = nbytes
        buf = (ctypes.c_uint8 * nbytes).from_address(address)
        self.tensor = torch.frombuffer(buf, dtype=torch.uint8)  # aliases the block, no copy


class HostPool:
    def __init__(self, limit_bytes: int, pinned: bool):
        if pinned:
            from ..allocator import PinnedHostDevice

            source = PinnedHostDevice(limit_bytes)
        else:
            source = SimulatedDevice(limit_bytes)
        self.pinned = pinned
        self.allocator = CachingAllocator(source, segment_bytes=min(CHUNK_BYTES, limit_bytes))

    def take(self, nbytes: int) -> HostBlock | None:
        """A block of `nbytes`, or None when the host limit is reached."""
        try:
            return HostBlock(self.allocator.malloc(nbytes), nbytes)
        except OutOfMemoryError:
            return None

    def give_back(self, block: HostBlock, streams: tuple[int, ...] = ()) -> None:
        """Frees `block`; it is reused only after the work queued on `streams` so far has finished."""
        for s in streams:
            self.allocator.record_stream(block.address, s)
        self.allocator.free(block.address)

    @property
    def reserved_bytes(self) -> int:
        return self.allocator.stats()["reserved_bytes"]


def pinned_available() -> bool:
    return _C.has_cuda and torch.cuda.is_available()
