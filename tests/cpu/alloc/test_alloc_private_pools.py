"""Private pools, as CUDA graph capture uses them: allocations on routed streams come from the pool,
its blocks are reused only within it, and its memory goes back only once the pool is released."""

import pytest
from alloc_spec import MiB, rounded, segment_bytes

from supermem.allocator import CachingAllocator, SimulatedDevice
from supermem.errors import OutOfMemoryError

POOL = (1, 7)
CAPTURE_STREAM, OTHER_STREAM = 5, 6


@pytest.fixture
def device():
    return SimulatedDevice(256 * MiB)


@pytest.fixture
def alloc(device):
    a = CachingAllocator(device)
    yield a
    a.check()


def pool_of(alloc, address):
    for seg in alloc.snapshot():
        if seg["address"] <= address < seg["address"] + seg["total_size"]:
            return tuple(seg["segment_pool_id"])
    raise AssertionError(f"{address:#x} is in no segment")


def test_routed_streams_allocate_from_the_private_pool(alloc):
    alloc.begin_allocate_to_pool(POOL, [CAPTURE_STREAM])
    p = alloc.malloc(4096, CAPTURE_STREAM)
    q = alloc.malloc(4096, 0)
    alloc.end_allocate_to_pool(POOL)
    assert pool_of(alloc, p) == POOL
    assert pool_of(alloc, q) == (0, 0)
    for x in (p, q):
        alloc.free(x)
    alloc.release_pool(POOL)


def test_pool_blocks_stay_cached_for_the_pool_until_it_is_released(device, alloc):
    alloc.begin_allocate_to_pool(POOL, [CAPTURE_STREAM])
    small = alloc.malloc(4096, CAPTURE_STREAM)
    large = alloc.malloc(3 * MiB, CAPTURE_STREAM)
    alloc.end_allocate_to_pool(POOL)
    alloc.free(small)
    alloc.free(large)
    pool_reserved = segment_bytes(4096) + segment_bytes(3 * MiB)
    assert alloc.stats()["reserved_bytes"] == pool_reserved

    # The default pool never gets the graph's memory, on any stream.
    for stream in (0, CAPTURE_STREAM):
        for nbytes in (4096, 3 * MiB):
            p = alloc.malloc(nbytes, stream)
            assert p not in (small, large) and pool_of(alloc, p) == (0, 0)
            alloc.free(p)
    alloc.empty_cache()  # the graph may replay: its pool keeps its segments
    assert alloc.stats()["reserved_bytes"] == pool_reserved

    # A new capture into the same pool reuses them.
    alloc.begin_allocate_to_pool(POOL, [CAPTURE_STREAM])
    assert alloc.malloc(4096, CAPTURE_STREAM) == small
    alloc.free(small)
    alloc.end_allocate_to_pool(POOL)
    alloc.release_pool(POOL)  # one user left (the first capture)
    assert alloc.stats()["reserved_bytes"] == pool_reserved
    alloc.release_pool(POOL)  # the last graph is gone: the memory goes back
    assert alloc.stats()["reserved_bytes"] == 0
    assert device.used_bytes == 0


def test_blocks_still_live_at_release_go_back_when_freed(device, alloc):
    alloc.begin_allocate_to_pool(POOL, [CAPTURE_STREAM])
    p = alloc.malloc(3 * MiB, CAPTURE_STREAM)
    alloc.end_allocate_to_pool(POOL)
    alloc.release_pool(POOL)
    assert alloc.stats()["reserved_bytes"] == segment_bytes(3 * MiB)
    alloc.free(p)
    assert alloc.stats()["reserved_bytes"] == 0 and device.used_bytes == 0


def test_two_captures_route_their_own_streams(alloc):
    other_pool = (2, 0)
    alloc.begin_allocate_to_pool(POOL, [CAPTURE_STREAM])
    alloc.begin_allocate_to_pool(other_pool, [OTHER_STREAM])
    p = alloc.malloc(4096, CAPTURE_STREAM)
    q = alloc.malloc(4096, OTHER_STREAM)
    alloc.end_allocate_to_pool(POOL)
    alloc.end_allocate_to_pool(other_pool)
    assert pool_of(alloc, p) == POOL and pool_of(alloc, q) == other_pool
    alloc.free(p)
    alloc.free(q)
    alloc.release_pool(POOL)
    assert alloc.stats()["reserved_bytes"] == segment_bytes(4096)  # other_pool's
    alloc.release_pool(other_pool)
    assert alloc.stats()["reserved_bytes"] == 0


def test_no_memory_goes_back_to_the_device_during_a_capture(alloc):
    """cudaFree is illegal while a graph is being captured."""
    p = alloc.malloc(3 * MiB)
    alloc.free(p)
    alloc.begin_allocate_to_pool(POOL, [CAPTURE_STREAM])
    alloc.empty_cache()
    assert alloc.stats()["reserved_bytes"] == segment_bytes(3 * MiB)
    alloc.end_allocate_to_pool(POOL)
    alloc.empty_cache()
    assert alloc.stats()["reserved_bytes"] == 0
    alloc.release_pool(POOL)


def test_oom_during_capture_does_not_release_the_cache(device):
    alloc = CachingAllocator(device, limit_bytes=24 * MiB)
    alloc.free(alloc.malloc(12 * MiB))  # cached
    alloc.begin_allocate_to_pool(POOL, [CAPTURE_STREAM])
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(14 * MiB, CAPTURE_STREAM)
    assert alloc.stats()["reserved_bytes"] == 12 * MiB
    alloc.end_allocate_to_pool(POOL)
    alloc.release_pool(POOL)
    alloc.free(alloc.malloc(14 * MiB))  # after the capture the cache can be released
    alloc.check()


def test_passthrough_frees_during_a_capture_wait_for_its_end(device):
    alloc = CachingAllocator(device, passthrough=True)
    p = alloc.malloc(4096)
    alloc.begin_allocate_to_pool(POOL, [CAPTURE_STREAM])
    alloc.free(p)
    assert device.used_bytes == rounded(4096)
    alloc.end_allocate_to_pool(POOL)
    alloc.empty_cache()
    assert device.used_bytes == 0
    alloc.release_pool(POOL)
    alloc.check()


def test_block_freed_during_a_capture_after_record_stream_is_reusable_after_it(device, alloc):
    """Events cannot be recorded while capturing, so the free waits for the capture's end; then the
    next malloc must record and process them (PyTorch: insert_events_deferred_until_no_capture)."""
    p = alloc.malloc(4096)
    alloc.record_stream(p, OTHER_STREAM)
    alloc.begin_allocate_to_pool(POOL, [CAPTURE_STREAM])
    alloc.free(p)
    assert device.live_events == 0  # nothing recorded during the capture
    assert alloc.stats()["active_bytes"] == rounded(4096)
    alloc.end_allocate_to_pool(POOL)
    q = alloc.malloc(4096)
    assert q == p  # the simulated device's events complete at once
    assert alloc.stats()["active_bytes"] == rounded(4096)
    alloc.free(q)
    alloc.release_pool(POOL)
