"""What expandable segments pay the driver per 2 MiB page on this GPU: supermem's allocator over a
CudaDevice (no PyTorch tensors), mapping N pages at once (cuMemCreate + cuMemMap each, one
cuMemSetAccess) and unmapping them (empty_cache: one device wait, cuMemUnmap each), and the moves a
growth past the allocated peak makes (holes' pages unmapped, mapped at the end). Medians of 5.

    python3 tools/diag/vm_costs.py [MiB]     # default 1024
"""

import statistics
import sys
import time

from supermem.allocator import CachingAllocator, CudaDevice

MiB = 1 << 20


def main() -> int:
    size = int(sys.argv[1]) * MiB if len(sys.argv) > 1 else 1024 * MiB
    pages = size // (2 * MiB)
    a = CachingAllocator(CudaDevice(0), expandable_segments=True)
    maps, unmaps, moves = [], [], []
    for _ in range(6):
        t0 = time.perf_counter()
        p = a.malloc(size)
        t1 = time.perf_counter()
        a.free(p)
        a.empty_cache()
        t2 = time.perf_counter()
        maps.append((t1 - t0) / pages)
        unmaps.append((t2 - t1) / pages)
        # holes: 8 blocks of size/8, every other freed; a request of half the size moves their pages
        blocks = [a.malloc(size // 8) for _ in range(8)]
        for b in blocks[::2]:
            a.free(b)
        r0 = a.stats()["num_reclaims"]
        t3 = time.perf_counter()
        q = a.malloc(size // 2)
        t4 = time.perf_counter()
        assert a.stats()["num_reclaims"] > r0, "no move"
        moves.append((t4 - t3) / (pages // 2))
        a.free(q)
        for b in blocks[1::2]:
            a.free(b)
        a.empty_cache()
    us = lambda xs: statistics.median(xs[1:]) * 1e6  # noqa: E731  (the first warms the driver)
    costs = f"map {us(maps):.1f} us, unmap {us(unmaps):.1f} us, move {us(moves):.1f} us"
    print(f"per 2 MiB page ({pages} pages): {costs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
