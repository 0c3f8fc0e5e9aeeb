"""A miss on one stream may take another stream's free block once that stream's work is past it: the
owner's fence, recorded after the block's free, completed (or the block was never used). The block stays
its owner's: its free waits for an event on the borrowing stream before the owner reuses it.
The simulated device's hold_events(True) stands in for a GPU that has not finished yet."""

import pytest
from alloc_spec import MiB

from supermem.allocator import CachingAllocator, SimulatedDevice

OWNER, BORROWER = 1, 2
SIZE = 12 * MiB  # a plain segment of its own: no rest to serve the next request
KINDS = pytest.mark.parametrize("expandable", [False, True], ids=["plain", "expandable"])


def make(expandable: bool) -> CachingAllocator:
    return CachingAllocator(SimulatedDevice(512 * MiB), expandable_segments=expandable)


@KINDS
def test_a_settled_free_block_of_another_stream_serves_a_miss(expandable):
    a = make(expandable)
    p = a.malloc(SIZE, OWNER)
    a.free(p)
    q = a.malloc(SIZE, BORROWER)  # p was freed after any fence: new memory, and a fence on OWNER
    assert q != p and a.stats()["num_borrows"] == 0
    reserved = a.stats()["reserved_bytes"]
    r = a.malloc(SIZE, BORROWER)  # the fence completed: p's block, no new memory
    s = a.stats()
    assert r == p and s["num_borrows"] == 1 and s["reserved_bytes"] == reserved

    a.device.hold_events(True)  # the borrower's work on it is still queued
    a.free(r)
    assert a.stats()["active_bytes"] == 2 * SIZE  # pending on the borrower's event
    x = a.malloc(SIZE, OWNER)
    assert x != p
    a.device.hold_events(False)
    y = a.malloc(SIZE, OWNER)  # back in its owner's free list
    assert y == p
    for b in (q, x, y):
        a.free(b)
    a.check()
    a.empty_cache()
    assert a.stats()["reserved_bytes"] == 0


@KINDS
def test_a_block_freed_while_its_stream_runs_is_never_lent(expandable):
    a = make(expandable)
    p = a.malloc(SIZE, OWNER)
    a.device.hold_events(True)  # the owner's work, and every fence after it, still queued
    a.free(p)
    got = [a.malloc(SIZE, BORROWER) for _ in range(3)]
    assert p not in got and a.stats()["num_borrows"] == 0
    a.device.hold_events(False)  # the owner ran past the fence the misses recorded
    r = a.malloc(SIZE, BORROWER)
    assert r == p and a.stats()["num_borrows"] == 1
    for b in got + [r]:
        a.free(b)
    a.check()


def test_never_used_memory_is_lent_at_once():
    """A fresh segment's rest was never used by its stream: no fence is needed before lending it."""
    a = make(False)
    p = a.malloc(3 * MiB, OWNER)  # a 20 MiB segment: 17 MiB never used
    q = a.malloc(8 * MiB, BORROWER)
    s = a.stats()
    assert s["num_borrows"] == 1 and s["segments"] == 1 and p < q < p + 20 * MiB
    a.free(q)
    a.free(p)
    a.check()


def test_the_best_fit_of_the_other_streams_is_lent():
    a = make(False)
    blocks = {n: a.malloc(n * MiB, stream) for n, stream in ((16, 1), (14, 3), (12, 4))}  # a segment each
    for p in blocks.values():
        a.free(p)
    own = a.malloc(13 * MiB, 2)  # a miss: all three too recent; fences on their streams
    q = a.malloc(13 * MiB, 2)
    assert q == blocks[14] and a.stats()["num_borrows"] == 1
    a.free(own)
    a.free(q)
    a.check()


def test_before_running_out_of_memory_a_stream_is_waited_for_and_lends():
    """At the limit, another stream's block that fits but was freed after its last completed fence: the
    miss waits for that stream once, then takes the block, rather than raising."""
    a = CachingAllocator(SimulatedDevice(512 * MiB), limit_bytes=20 * MiB)
    p = a.malloc(9 * MiB, OWNER)  # one 20 MiB segment: p, q and 2 MiB
    q = a.malloc(9 * MiB, OWNER)
    a.device.hold_events(True)  # the owner's work is still queued
    a.free(p)  # its segment keeps q: nothing to give back
    r = a.malloc(9 * MiB, BORROWER)
    s = a.stats()
    assert r == p and s["num_borrows"] == 1 and s["num_ooms"] == 0 and s["reserved_bytes"] == 20 * MiB
    assert a.device.waits[1] == 1  # one wait, for the owner
    a.device.hold_events(False)
    a.free(r)
    a.free(q)
    a.check()
