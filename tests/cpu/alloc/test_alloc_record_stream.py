"""record_stream: a block used on another stream is reused only once that stream's work is done.
The simulated device's hold_events(True) stands in for a GPU that has not finished yet."""

import pytest
from alloc_spec import MiB, rounded, segment_bytes

from supermem.allocator import CachingAllocator, SimulatedDevice
from supermem.errors import OutOfMemoryError, UsageError

ALLOC_STREAM, OTHER_STREAM = 1, 2


@pytest.fixture
def device():
    return SimulatedDevice(64 * MiB)


@pytest.fixture
def alloc(device):
    a = CachingAllocator(device)
    yield a
    a.check()


@pytest.mark.parametrize("nbytes", [4096, 3 * MiB], ids=["small", "large"])
def test_block_is_not_reused_until_the_other_streams_events_complete(device, alloc, nbytes):
    p = alloc.malloc(nbytes, ALLOC_STREAM)
    alloc.record_stream(p, OTHER_STREAM)
    device.hold_events(True)
    alloc.free(p)
    s = alloc.stats()
    assert s["allocated_bytes"] == 0
    assert s["active_bytes"] == rounded(nbytes)  # still in use by the other stream
    assert device.live_events == 1
    for _ in range(3):  # nor on later mallocs while the event is outstanding
        q = alloc.malloc(nbytes, ALLOC_STREAM)
        assert q != p
        alloc.free(q)
    assert alloc.stats()["active_bytes"] == rounded(nbytes)
    alloc.check()

    device.hold_events(False)
    q = alloc.malloc(nbytes, ALLOC_STREAM)  # processes the completed event first
    assert q == p
    assert alloc.stats()["active_bytes"] == rounded(nbytes)
    assert device.live_events == 0
    alloc.free(q)
    assert alloc.stats()["active_bytes"] == 0


def test_every_recorded_stream_must_finish(device, alloc):
    p = alloc.malloc(4096, ALLOC_STREAM)
    alloc.record_stream(p, 2)
    alloc.record_stream(p, 3)
    alloc.record_stream(p, 3)  # recorded once per stream
    device.hold_events(True)
    alloc.free(p)
    assert device.live_events == 2
    device.hold_events(False)
    q = alloc.malloc(4096, ALLOC_STREAM)
    assert q == p and device.live_events == 0
    alloc.free(q)


def test_recording_the_allocation_stream_defers_nothing(device, alloc):
    p = alloc.malloc(4096, ALLOC_STREAM)
    alloc.record_stream(p, ALLOC_STREAM)
    device.hold_events(True)
    alloc.free(p)
    assert device.live_events == 0
    assert alloc.stats()["active_bytes"] == 0
    assert alloc.malloc(4096, ALLOC_STREAM) == p
    alloc.free(p)


def test_pending_block_cannot_be_freed_or_recorded_again(device, alloc):
    p = alloc.malloc(4096, ALLOC_STREAM)
    alloc.record_stream(p, OTHER_STREAM)
    device.hold_events(True)
    alloc.free(p)
    with pytest.raises(UsageError, match="pending block"):
        alloc.free(p)
    with pytest.raises(UsageError, match="pending block"):
        alloc.record_stream(p, 3)
    device.hold_events(False)


def test_empty_cache_waits_for_outstanding_events(device, alloc):
    p = alloc.malloc(3 * MiB, ALLOC_STREAM)
    alloc.record_stream(p, OTHER_STREAM)
    device.hold_events(True)
    alloc.free(p)
    alloc.empty_cache()
    s = alloc.stats()
    assert s["active_bytes"] == 0 and s["reserved_bytes"] == 0
    assert s["num_sync_all_streams"] == 1
    assert device.used_bytes == 0 and device.live_events == 0
    device.hold_events(False)


def test_oom_recovery_reclaims_blocks_whose_free_waits_on_events(device, alloc):
    """PyTorch's test_caching_allocator_record_stream_oom: the retry syncs outstanding events."""
    big = 40 * MiB  # two of these do not fit on the 64 MiB device
    p = alloc.malloc(big, ALLOC_STREAM)
    alloc.record_stream(p, OTHER_STREAM)
    device.hold_events(True)
    alloc.free(p)
    assert alloc.stats()["active_bytes"] == big
    q = alloc.malloc(big, OTHER_STREAM)  # another stream: p's cached block cannot serve it
    s = alloc.stats()
    assert s["num_sync_all_streams"] == 1 and s["num_alloc_retries"] == 1 and s["num_ooms"] == 0
    assert s["active_bytes"] == big and s["reserved_bytes"] == segment_bytes(big)
    assert device.live_events == 0
    alloc.free(q)
    device.hold_events(False)


def test_oom_when_even_synced_blocks_are_not_enough(device, alloc):
    p = alloc.malloc(40 * MiB, ALLOC_STREAM)
    q = alloc.malloc(10 * MiB, ALLOC_STREAM)
    alloc.record_stream(q, OTHER_STREAM)
    device.hold_events(True)
    alloc.free(q)
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(40 * MiB, OTHER_STREAM)
    s = alloc.stats()
    assert s["num_ooms"] == 1 and s["active_bytes"] == 40 * MiB  # q was reclaimed on the way
    alloc.free(p)
    device.hold_events(False)


def test_cached_blocks_of_a_stream_no_longer_used_are_released_under_pressure(device, alloc):
    """A stream that is gone (destroyed, never used again) must not pin its cached segments."""
    for stream in (7, 8):
        alloc.free(alloc.malloc(24 * MiB, stream))
    assert alloc.stats()["reserved_bytes"] == 48 * MiB
    p = alloc.malloc(40 * MiB, ALLOC_STREAM)  # fits only once both streams' caches are released
    assert alloc.stats()["reserved_bytes"] == 40 * MiB
    alloc.free(p)


@pytest.mark.parametrize("expandable", [False, True], ids=["segments", "expandable"])
def test_the_reserved_peak_names_the_bytes_in_flight_when_it_was_set(expandable):
    device = SimulatedDevice(64 * MiB)
    alloc = CachingAllocator(device, expandable_segments=expandable)
    p = alloc.malloc(12 * MiB, ALLOC_STREAM)
    alloc.record_stream(p, OTHER_STREAM)
    device.hold_events(True)
    alloc.free(p)  # pending: the other stream's copy of it has not finished
    q = alloc.malloc(12 * MiB, ALLOC_STREAM)  # cannot take p's block: reserved grows to its peak
    s = alloc.stats()
    assert s["reserved_bytes_peak"] == s["reserved_bytes"] > s["allocated_bytes_peak"]
    assert s["pending_at_reserved_peak"] == rounded(12 * MiB)
    device.hold_events(False)
    alloc.free(q)
    alloc.reset_peak_stats()  # the peak restarts at the current: nothing in flight now
    alloc.malloc(MiB, ALLOC_STREAM)
    assert alloc.stats()["pending_at_reserved_peak"] == 0
    alloc.check()
