"""The OOM protocol: (1) a new segment, (2) release cached segments and retry, (3) call the pressure
handlers with the allocator lock released and retry, (4) raise torch.OutOfMemoryError."""

import sys
import threading

import pytest
import torch
from alloc_spec import MiB, rounded
from live_blocks import HostMemory, LiveBlocks

from supermem.allocator import CachingAllocator, SimulatedDevice
from supermem.errors import OutOfMemoryError

LIMIT = 8 * MiB
BIG = 6 * MiB  # one fits under LIMIT, two do not


@pytest.fixture
def alloc():
    a = CachingAllocator(SimulatedDevice(64 * MiB), limit_bytes=LIMIT)
    yield a
    a.check()


@pytest.fixture
def unraisable(monkeypatch):
    """Exceptions Python reported as unraisable (a pressure handler's error is one)."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))
    return seen


def run_with_deadline(fn, seconds=20.0):
    """Runs fn in a thread; a deadlock fails the test instead of hanging it."""
    result = {}

    def body():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: B036 (re-raised in the caller)
            result["error"] = e

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"deadlock: still running after {seconds} s"
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_limit_gives_oom_on_demand_and_free_then_retry_succeeds(alloc):
    """PyTorch's test_out_of_memory_retry."""
    blocks = LiveBlocks(HostMemory())
    p = alloc.malloc(BIG)
    blocks.add(p, BIG, rounded(BIG))
    with pytest.raises(OutOfMemoryError) as info:
        alloc.malloc(BIG)
    assert isinstance(info.value, torch.OutOfMemoryError)
    s = alloc.stats()
    assert s["num_ooms"] == 1
    assert s["reserved_bytes"] <= LIMIT
    blocks.cookies.verify_all()  # earlier blocks are intact
    blocks.remove(p)
    alloc.free(p)
    q = alloc.malloc(BIG)
    alloc.free(q)
    assert alloc.stats()["num_ooms"] == 1


def test_oom_message_reads_like_pytorchs_and_carries_the_numbers(alloc):
    p = alloc.malloc(BIG)
    with pytest.raises(OutOfMemoryError) as info:
        alloc.malloc(BIG + 1)
    message = str(info.value)
    s = alloc.stats()
    assert message.startswith("CUDA out of memory. Tried to allocate 6.00 MiB.")
    assert "The supermem limit is 8.00 MiB." in message
    assert (
        f"requested {BIG + 1} bytes, allocated {s['allocated_bytes']} bytes, "
        f"reserved {s['reserved_bytes']} bytes, evicted 0 bytes" in message
    )
    assert s["allocated_bytes"] == rounded(BIG)
    alloc.free(p)


def test_cached_segments_are_released_before_giving_up(alloc):
    p = alloc.malloc(3 * MiB)
    alloc.free(p)  # cached: 3 MiB reserved, nothing allocated
    q = alloc.malloc(BIG)  # 3 + 6 MiB > LIMIT: only fits once the cache is released
    s = alloc.stats()
    assert s["num_alloc_retries"] == 1 and s["num_ooms"] == 0
    assert s["reserved_bytes"] == BIG and s["segments"] == 1
    alloc.free(q)


def test_pressure_handler_runs_with_the_lock_released_and_its_free_lets_malloc_succeed(alloc):
    victim = alloc.malloc(BIG)
    calls = []

    def handler(need_bytes):
        calls.append((need_bytes, alloc.stats()["allocated_bytes"]))  # would deadlock under the lock
        alloc.free(victim)
        return rounded(BIG)

    alloc.add_pressure_handler(handler)
    p = run_with_deadline(lambda: alloc.malloc(BIG))
    assert calls == [(rounded(BIG), rounded(BIG))]
    s = alloc.stats()
    assert s["num_ooms"] == 0 and s["num_pressure_calls"] == 1 and s["pressure_freed_bytes"] == rounded(BIG)
    assert s["allocated_bytes"] == rounded(BIG)
    alloc.free(p)


def test_handler_that_cannot_free_enough_ends_in_oom_with_evicted_bytes(alloc):
    big = alloc.malloc(BIG)
    small = alloc.malloc(MiB)
    freed = []

    def handler(need_bytes):
        if freed:
            return None
        alloc.free(small)
        freed.append(small)
        return MiB

    alloc.add_pressure_handler(handler)
    with pytest.raises(OutOfMemoryError, match=f"evicted {MiB} bytes under pressure"):
        alloc.malloc(BIG)
    with pytest.raises(OutOfMemoryError, match="evicted 0 bytes under pressure"):
        alloc.malloc(BIG)
    s = alloc.stats()
    assert s["num_ooms"] == 2 and s["num_pressure_calls"] == 2 and s["pressure_freed_bytes"] == MiB
    alloc.free(big)


def test_raising_handler_is_reported_and_the_next_handler_still_runs(alloc, unraisable):
    victim = alloc.malloc(BIG)

    def broken(need_bytes):
        raise RuntimeError("handler bug")

    def good(need_bytes):
        alloc.free(victim)
        return rounded(BIG)

    alloc.add_pressure_handler(broken)
    alloc.add_pressure_handler(good)
    p = alloc.malloc(BIG)
    assert [str(e) for e in unraisable] == ["handler bug"]
    alloc.free(p)


@pytest.mark.parametrize("bad_return", [-1, "lots", 2.5], ids=["negative", "str", "float"])
def test_handler_returning_a_bad_value_counts_as_raising(alloc, unraisable, bad_return):
    p = alloc.malloc(BIG)
    alloc.add_pressure_handler(lambda need_bytes: bad_return)
    with pytest.raises(OutOfMemoryError, match="evicted 0 bytes"):
        alloc.malloc(BIG)
    assert len(unraisable) == 1
    alloc.free(p)
    alloc.free(alloc.malloc(BIG))  # still usable


def test_raising_handler_leaves_the_allocator_usable(alloc, unraisable):
    p = alloc.malloc(BIG)
    alloc.add_pressure_handler(lambda need_bytes: 1 // 0)
    for _ in range(3):
        with pytest.raises(OutOfMemoryError):
            alloc.malloc(BIG)
    assert len(unraisable) == 3
    alloc.check()
    alloc.free(p)
    alloc.free(alloc.malloc(BIG))


def test_removed_handler_is_not_called(alloc):
    p = alloc.malloc(BIG)
    calls = []
    handler_id = alloc.add_pressure_handler(calls.append)
    other_id = alloc.add_pressure_handler(lambda need_bytes: 0)
    assert handler_id != other_id
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(BIG)
    assert len(calls) == 1
    alloc.remove_pressure_handler(handler_id)
    alloc.remove_pressure_handler(handler_id)  # unknown ids are ignored
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(BIG)
    assert len(calls) == 1
    assert alloc.stats()["num_pressure_calls"] == 2
    alloc.free(p)


def test_handlers_are_not_called_when_releasing_the_cache_suffices(alloc):
    calls = []
    alloc.add_pressure_handler(calls.append)
    alloc.free(alloc.malloc(3 * MiB))
    alloc.free(alloc.malloc(BIG))
    assert calls == []


def test_handlers_are_not_called_for_impossible_requests(alloc):
    calls = []
    alloc.add_pressure_handler(calls.append)
    with pytest.raises(OutOfMemoryError, match="more than 1EB"):
        alloc.malloc(1 << 61)
    assert calls == []


def test_lowering_the_limit_releases_the_cache_and_raising_it_allows_more(alloc):
    p = alloc.malloc(MiB)
    alloc.free(alloc.malloc(3 * MiB))
    assert alloc.stats()["reserved_bytes"] == 2 * MiB + 3 * MiB
    alloc.limit_bytes = 4 * MiB
    assert alloc.stats()["reserved_bytes"] == 2 * MiB  # the wholly free segment went back
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(3 * MiB)
    alloc.limit_bytes = "32MiB"
    q = alloc.malloc(12 * MiB)
    alloc.limit_bytes = None
    assert alloc.limit_bytes == 0
    r = alloc.malloc(40 * MiB)
    for x in (p, q, r):
        alloc.free(x)


def test_limit_as_a_fraction_of_the_device():
    a = CachingAllocator(SimulatedDevice(64 * MiB), limit_bytes="25%")
    assert a.limit_bytes == 16 * MiB
    with pytest.raises(OutOfMemoryError):
        a.malloc(16 * MiB + 1)
    a.free(a.malloc(16 * MiB))
