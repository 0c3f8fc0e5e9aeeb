"""The tests' own record of what the allocator handed out, kept independently of the allocator:
an interval set that proves blocks never overlap, and content cookies written into every block and
verified before it is freed (mimalloc test-stress style)."""

from __future__ import annotations

import bisect
import ctypes
import itertools
import struct
from typing import Protocol

from alloc_spec import MIN_BLOCK

_serials = itertools.count(1)  # unique across all Cookies (and threads: next() holds the GIL)


class DeviceMemory(Protocol):
    """Reads and writes device memory at raw addresses."""

    def write(self, address: int, data: bytes) -> None: ...
    def read(self, address: int, nbytes: int) -> bytes: ...


class HostMemory:
    """The simulated device's memory is host memory: ctypes reaches it directly."""

    def write(self, address: int, data: bytes) -> None:
        ctypes.memmove(address, data, len(data))

    def read(self, address: int, nbytes: int) -> bytes:
        return ctypes.string_at(address, nbytes)


class IntervalSet:
    """Disjoint half-open ranges [start, end); add() fails on any overlap."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._starts)

    def __contains__(self, start: int) -> bool:
        return start in self._ends

    def add(self, start: int, end: int) -> None:
        assert start < end, f"empty range at {start:#x}"
        i = bisect.bisect_left(self._starts, start)
        if i > 0:
            prev = self._starts[i - 1]
            assert self._ends[prev] <= start, (
                f"[{start:#x}, {end:#x}) overlaps the live range [{prev:#x}, {self._ends[prev]:#x})"
            )
        if i < len(self._starts):
            nxt = self._starts[i]
            assert end <= nxt, (
                f"[{start:#x}, {end:#x}) overlaps the live range [{nxt:#x}, {self._ends[nxt]:#x})"
            )
        self._starts.insert(i, start)
        self._ends[start] = end

    def remove(self, start: int) -> None:
        del self._ends[start]
        self._starts.pop(bisect.bisect_left(self._starts, start))


class Cookies:
    """Writes a pattern unique to each block into it and verifies it later. Blocks up to
    `full_bytes` are covered entirely; larger ones get 16-byte patches at a stride (at most
    `patches` of them, plus one at the very end), so multi-GiB blocks stay cheap."""

    def __init__(self, memory: DeviceMemory, full_bytes: int = 256, patches: int = 8) -> None:
        self.memory = memory
        self.full_bytes = full_bytes
        self.patches = patches
        self._written: dict[int, tuple[int, int]] = {}  # address -> (nbytes, serial)

    def _layout(self, nbytes: int, serial: int) -> list[tuple[int, bytes]]:
        if nbytes <= self.full_bytes:
            pattern = struct.pack("<Q", serial) * (nbytes // 8 + 1)
            return [(0, pattern[:nbytes])]
        stride = max(16, (nbytes // self.patches) & ~15)
        offsets = list(range(0, nbytes - 16, stride))
        if offsets[-1] + 16 <= nbytes - 16:
            offsets.append(nbytes - 16)
        return [(off, struct.pack("<QQ", serial, off)) for off in offsets]

    def write(self, address: int, nbytes: int) -> None:
        serial = next(_serials)
        for off, data in self._layout(nbytes, serial):
            self.memory.write(address + off, data)
        self._written[address] = (nbytes, serial)

    def verify(self, address: int) -> None:
        nbytes, serial = self._written[address]
        for off, data in self._layout(nbytes, serial):
            got = self.memory.read(address + off, len(data))
            assert got == data, (
                f"block {address:#x} ({nbytes} bytes) was overwritten at +{off}: "
                f"expected {data[:16].hex()}, found {got[:16].hex()}"
            )

    def verify_all(self) -> None:
        for address in self._written:
            self.verify(address)

    def hand_over(self, address: int) -> tuple[int, int]:
        """Stops tracking the block here so that another Cookies (another thread's) can adopt it."""
        return self._written.pop(address)

    def adopt(self, address: int, record: tuple[int, int]) -> None:
        self._written[address] = record

    def forget(self, address: int) -> None:
        """Verifies the block one last time and stops tracking it (call before freeing it)."""
        self.verify(address)
        del self._written[address]


class LiveBlocks:
    """Live blocks: disjoint ranges, aligned to 512 bytes, each carrying its cookie."""

    def __init__(self, memory: DeviceMemory, **cookie_options: int) -> None:
        self.ranges = IntervalSet()
        self.cookies = Cookies(memory, **cookie_options)
        self.nbytes: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.nbytes)

    def add(self, address: int, nbytes: int, span: int) -> None:
        """A block malloc(nbytes) returned at `address`, owning `span` bytes (its rounded size)."""
        assert address != 0, f"malloc({nbytes}) returned NULL"
        assert address % MIN_BLOCK == 0, f"malloc({nbytes}) returned {address:#x}, not 512-byte aligned"
        self.ranges.add(address, address + span)
        self.cookies.write(address, nbytes)
        self.nbytes[address] = nbytes

    def remove(self, address: int, keep_range: bool = False) -> int:
        """Verifies the block's cookie and forgets it; returns its requested size. With keep_range
        its bytes stay claimed (a freed block the allocator may not reuse yet) until release_range."""
        self.cookies.forget(address)
        if not keep_range:
            self.ranges.remove(address)
        return self.nbytes.pop(address)

    def release_range(self, address: int) -> None:
        self.ranges.remove(address)
