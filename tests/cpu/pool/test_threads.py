"""Concurrency: threads allocating and freeing at once, with blocks handed between threads
(mimalloc test-stress style). malloc and free release the GIL, so the C++ side really runs in
parallel."""

import os
import random
import subprocess
import sys
import textwrap
import threading

import pytest
from alloc_spec import MiB, rounded
from live_blocks import Cookies, HostMemory, IntervalSet

from supermem.allocator import CachingAllocator, SimulatedDevice
from supermem.errors import OutOfMemoryError


class SharedRanges:
    """The interval set of every thread's live blocks (a lock makes it thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ranges = IntervalSet()

    def add(self, address, nbytes):
        with self._lock:
            self._ranges.add(address, address + rounded(nbytes))

    def remove(self, address):
        with self._lock:
            self._ranges.remove(address)


def stress_size(rng):
    """Powers of two with a tail: 1% large (up to 16 MiB), 0.1% huge (up to 64 MiB)."""
    r = rng.random()
    if r < 0.001:
        return rng.randrange(16 * MiB, 64 * MiB)
    if r < 0.011:
        return rng.randrange(MiB, 16 * MiB)
    return rng.randrange(1, 1 << rng.randrange(1, 18))


def run_stress(alloc, n_threads, rounds, iters, transfer_slots=64):
    ranges = SharedRanges()
    transfer = [None] * transfer_slots  # (address, stream, cookie record), survives between rounds
    transfer_lock = threading.Lock()
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        stream = seed % 4  # threads share streams in pairs of rounds: same and different stream frees
        cookies = Cookies(HostMemory())
        mine = []
        try:
            for _ in range(iters):
                r = rng.random()
                if not mine or (r < 0.5 and len(mine) < 100):
                    n = stress_size(rng)
                    p = alloc.malloc(n, stream)
                    ranges.add(p, n)
                    cookies.write(p, n)
                    mine.append(p)
                elif r < 0.8:
                    p = mine.pop(rng.randrange(len(mine)))
                    cookies.forget(p)
                    ranges.remove(p)
                    alloc.free(p)
                elif r < 0.85:
                    alloc.record_stream(rng.choice(mine), rng.randrange(4))
                else:  # exchange a block with the shared transfer array: its free crosses threads
                    i = rng.randrange(len(mine))
                    slot = rng.randrange(transfer_slots)
                    out = (mine[i], cookies.hand_over(mine[i]))
                    with transfer_lock:
                        incoming, transfer[slot] = transfer[slot], out
                    if incoming is None:
                        mine.pop(i)
                    else:
                        mine[i] = incoming[0]
                        cookies.adopt(*incoming)
                        cookies.verify(incoming[0])
            for p in mine:
                cookies.forget(p)
                ranges.remove(p)
                alloc.free(p)
        except BaseException as e:  # noqa: B036 (reported by the main thread)
            errors.append(e)

    stop = threading.Event()

    def checker():  # walks the invariants while the others run
        while not stop.is_set():
            try:
                alloc.check()
                alloc.stats()
            except BaseException as e:  # noqa: B036
                errors.append(e)
                return
            stop.wait(0.005)

    watcher = threading.Thread(target=checker, daemon=True)
    watcher.start()
    try:
        for rnd in range(rounds):
            threads = [
                threading.Thread(target=worker, args=(rnd * n_threads + t,), daemon=True)
                for t in range(n_threads)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not any(t.is_alive() for t in threads), "a worker hung (deadlock?)"
            assert not errors, errors[0]
    finally:
        stop.set()
    watcher.join()
    assert not errors, errors[0]

    cookies = Cookies(HostMemory())
    for entry in transfer:  # what is still in flight between threads
        if entry is not None:
            cookies.adopt(*entry)
            cookies.forget(entry[0])
            ranges.remove(entry[0])
            alloc.free(entry[0])


@pytest.mark.parametrize("expandable", [False, True], ids=["plain", "expandable"])
def test_threads_with_cross_thread_frees(expandable):
    device = SimulatedDevice(1024 * MiB)
    alloc = CachingAllocator(device, expandable_segments=expandable)
    run_stress(alloc, n_threads=4, rounds=3, iters=10_000)
    alloc.check()
    s = alloc.stats()
    assert s["allocated_bytes"] == 0 and s["live_blocks"] == 0
    assert s["num_allocs"] == s["num_frees"] > 0
    alloc.empty_cache()  # also completes frees still waiting on record_stream events
    s = alloc.stats()
    assert s["active_bytes"] == 0 and s["reserved_bytes"] == 0 and device.used_bytes == 0


@pytest.mark.parametrize("expandable", [False, True], ids=["plain", "expandable"])
def test_threads_under_a_tight_limit_with_a_pressure_handler(expandable):
    """Threads hit OOM together; the handler evicts cached "tensors" that other threads made."""
    device = SimulatedDevice(1024 * MiB)
    alloc = CachingAllocator(device, limit_bytes=48 * MiB, expandable_segments=expandable)
    evictable = []  # blocks any thread may free under pressure
    lock = threading.Lock()
    ooms = []

    def handler(need_bytes):
        freed = 0
        while freed < need_bytes:
            with lock:
                if not evictable:
                    break
                p, n = evictable.pop()
            alloc.free(p)
            freed += rounded(n)
        return freed

    alloc.add_pressure_handler(handler)

    def worker(seed):
        rng = random.Random(seed)
        for _ in range(6000):
            n = rng.choice((4096, 300_000, 3 * MiB, 7 * MiB))
            try:
                p = alloc.malloc(n, seed % 2)
            except OutOfMemoryError:
                ooms.append(n)
                continue
            with lock:
                evictable.append((p, n))
                if len(evictable) > 24:
                    victim = evictable.pop(rng.randrange(len(evictable)))
                else:
                    victim = None
            if victim:
                alloc.free(victim[0])

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a worker hung (deadlock?)"
    alloc.check()
    s = alloc.stats()
    assert s["num_pressure_calls"] > 0
    assert s["reserved_bytes_peak"] <= 48 * MiB
    assert s["num_ooms"] == len(ooms)
    for p, _ in evictable:
        alloc.free(p)
    assert alloc.stats()["allocated_bytes"] == 0


def run_isolated(code, timeout_s=30):
    """Runs `code` in a fresh interpreter: a deadlock that holds the GIL would hang this one too."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(f"deadlock: no exit after {timeout_s} s") from None
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_removing_a_pressure_handler_while_another_thread_reads_stats_does_not_deadlock():
    """Dropping the last reference to a Python handler takes the GIL; it must not happen under the
    allocator lock, which a thread holding the GIL may be waiting for (stats() and limit_bytes).
    Under ThreadSanitizer each GIL hand-off costs milliseconds (20 s per 1,000 rounds on 2 cores), and
    TSan reports a lock-order inversion itself, so its lane (SUPERMEM_TSAN=1) runs fewer rounds. On some
    2-core machines a round waits out CPython's switch interval twice (~10 ms: 20,000 rounds took minutes,
    the same code at c413511 too), so the rounds stop after 10 s: a deadlock never exits at all."""
    rounds = 300 if os.environ.get("SUPERMEM_TSAN") else 20000
    run_isolated(
        """
        import threading, time
        from supermem.allocator import CachingAllocator, SimulatedDevice
        alloc = CachingAllocator(SimulatedDevice(64 << 20))
        stop = False
        def reader():
            while not stop:
                alloc.limit_bytes
                alloc.stats()
        t = threading.Thread(target=reader)
        t.start()
        until = time.monotonic() + 10
        for _ in range(ROUNDS):
            alloc.remove_pressure_handler(alloc.add_pressure_handler(lambda need_bytes: 0))
            if time.monotonic() > until:
                break
        stop = True
        t.join()
        """.replace("ROUNDS", str(rounds))
    )


class_with_a_handler = """
    from supermem.allocator import CachingAllocator, SimulatedDevice
    from supermem.errors import OutOfMemoryError

    alloc = CachingAllocator(SimulatedDevice(64 << 20), limit_bytes=8 << 20)

    class Pool:
        \"\"\"Registers a bound method as its handler; when it goes, it frees its blocks.\"\"\"
        def __init__(self):
            self.blocks = [alloc.malloc(1 << 20)]
            self.handler_id = alloc.add_pressure_handler(self.evict)
        def evict(self, need_bytes):
            return 0
        def __del__(self):
            for p in self.blocks:
                alloc.free(p)
    """


def test_removing_the_last_reference_to_a_handler_may_reenter_the_allocator():
    """Only the registered bound method keeps the pool alive: removing it runs Pool.__del__, which
    frees through the allocator. That must not happen under the allocator's (non-recursive) lock."""
    run_isolated(
        class_with_a_handler
        + """
    handler_id = Pool().handler_id
    assert alloc.stats()["allocated_bytes"] == 1 << 20
    alloc.remove_pressure_handler(handler_id)
    assert alloc.stats()["allocated_bytes"] == 0
    """
    )


def test_handler_removing_itself_during_an_oom_may_reenter_the_allocator():
    run_isolated(
        class_with_a_handler
        + """
    class SelfRemovingPool(Pool):
        def evict(self, need_bytes):
            alloc.remove_pressure_handler(self.handler_id)
            return 0

    SelfRemovingPool()
    try:
        alloc.malloc(12 << 20)
        raise AssertionError("expected an OOM")
    except OutOfMemoryError:
        pass
    assert alloc.stats()["allocated_bytes"] == 0
    """
    )
