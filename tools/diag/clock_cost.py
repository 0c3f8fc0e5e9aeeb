#!/usr/bin/env python3
"""What this host's clock and supermem's trace ring cost: time.monotonic_ns() per call, the kernel's
clocksource, what a page fault costs (a recording's memory grows as it records), and on a GPU a
torch.empty + del pair under SUPERMEM=1 with the allocator's ring off and on (each allocator event
reads the clock once). A clocksource other than tsc (a VM's hpet or xen)
makes each read a system call.

    SUPERMEM=1 python3 tools/diag/clock_cost.py
"""

import mmap
import statistics
import time
from pathlib import Path


def per_call_us(fn, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def page_fault_us(pages: int = 16384) -> float:
    """The time to touch a fresh page of anonymous memory: the kernel's fault, zeroing included."""
    best = float("inf")
    for _ in range(3):
        m = mmap.mmap(-1, pages * 4096)
        t = time.perf_counter()
        for i in range(0, pages * 4096, 4096):
            m[i] = 1
        best = min(best, (time.perf_counter() - t) / pages * 1e6)
        m.close()
    return best


def main() -> None:
    src = Path("/sys/devices/system/clocksource/clocksource0/current_clocksource")
    print(f"clocksource: {src.read_text().strip() if src.exists() else 'unknown'}")
    print(
        f"time.monotonic_ns: {min(per_call_us(time.monotonic_ns, 200_000) for _ in range(5)):.3f} us a call"
    )
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(f"transparent huge pages: {thp.read_text().strip() if thp.exists() else 'unknown'}")
    print(f"a page fault (fresh anonymous memory, 4 KiB pages touched): {page_fault_us():.2f} us")
    import torch

    if not torch.cuda.is_available():
        return
    import supermem

    torch.empty(1, device="cuda")
    alloc = supermem.device_allocator(0)
    if alloc is None:
        print("supermem's allocator does not serve CUDA here (run with SUPERMEM=1)")
        return

    def pair() -> None:
        del_me = torch.empty(4096, device="cuda")
        del del_me

    before = alloc.trace_capacity
    rows = {}
    for _ in range(5):  # a recording's fresh ring (its pages touched as it fills) and a small one (wraps
        for cap in (0, 1 << 20, 4096):  # in the cache: the push alone)
            alloc.trace_capacity = cap
            rows.setdefault(cap, []).append(per_call_us(pair, 50_000))
    alloc.trace_capacity = before
    off, on, small = (statistics.median(rows[c]) for c in (0, 1 << 20, 4096))
    print(
        f"torch.empty + del: ring off {off:.3f} us, ring on {on:.3f} us ({on - off:+.3f} us a pair), "
        f"a ring of 4096 events {small:.3f} us ({small - off:+.3f})"
    )


if __name__ == "__main__":
    main()
