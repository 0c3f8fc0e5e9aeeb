"""The trace ring: which events the allocator records, in what order, and the ring's bound."""

import pytest
from alloc_spec import MiB, rounded, segment_bytes

from supermem.allocator import TRACE_ACTIONS, CachingAllocator, SimulatedDevice
from supermem.errors import OutOfMemoryError, UsageError


def make(capacity=64 * MiB, **options):
    return CachingAllocator(SimulatedDevice(capacity), **options)


def actions(alloc):
    return [(e.action, e.address, e.size, e.stream) for e in alloc.drain_trace()]


def test_tracing_is_off_by_default():
    alloc = make()
    alloc.free(alloc.malloc(100))
    assert alloc.trace_capacity == 0
    assert alloc.drain_trace() == []


def test_alloc_free_and_segment_events_in_order():
    alloc = make(trace_capacity=64)
    p = alloc.malloc(100, 3)
    q = alloc.malloc(200, 3)  # from the same cached segment: no segment event
    alloc.free(p)
    alloc.free(q)
    alloc.empty_cache()
    seg = segment_bytes(100)
    assert actions(alloc) == [
        ("segment_alloc", p, seg, 3),
        ("alloc", p, rounded(100), 3),
        ("alloc", q, rounded(200), 3),
        ("free_completed", p, rounded(100), 3),
        ("free_completed", q, rounded(200), 3),
        ("segment_free", p, seg, 3),
    ]


def test_deferred_free_records_requested_then_completed():
    device = SimulatedDevice(64 * MiB)
    alloc = CachingAllocator(device, trace_capacity=64)
    p = alloc.malloc(4096, 1)
    alloc.record_stream(p, 2)
    device.hold_events(True)
    alloc.free(p)
    assert [e[0] for e in actions(alloc)] == ["segment_alloc", "alloc", "free_requested"]
    device.hold_events(False)
    alloc.free(alloc.malloc(4096, 1))
    assert [e[0] for e in actions(alloc)] == ["free_completed", "alloc", "free_completed"]


def test_oom_is_recorded():
    alloc = make(trace_capacity=64, limit_bytes=4 * MiB)
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(5 * MiB)
    assert [(a, size) for a, _, size, _ in actions(alloc)] == [("oom", rounded(5 * MiB))]


def test_timestamps_do_not_go_backwards():
    alloc = make(trace_capacity=1000)
    for _ in range(100):
        alloc.free(alloc.malloc(1000))
    times = [e.time_ns for e in alloc.drain_trace()]
    assert len(times) == 201 and times == sorted(times)


def test_full_ring_keeps_the_newest_and_counts_the_dropped():
    alloc = make(trace_capacity=8)
    for i in range(20):
        alloc.push_trace("annotate", tag=i)
    events = alloc.drain_trace()
    assert [e.tag for e in events] == list(range(12, 20))
    assert alloc.trace_dropped == 12
    assert alloc.drain_trace() == []  # drain empties it
    alloc.push_trace("offload", address=0x1000, size=512, stream=4, tag=99)
    (e,) = alloc.drain_trace()
    assert (e.action, e.address, e.size, e.stream, e.tag) == ("offload", 0x1000, 512, 4, 99)
    assert alloc.trace_dropped == 12


def test_capacity_can_be_changed():
    alloc = make()
    alloc.trace_capacity = 3
    for i in range(5):
        alloc.push_trace("annotate", tag=i)
    assert [e.tag for e in alloc.drain_trace()] == [2, 3, 4]
    alloc.trace_capacity = 0
    alloc.push_trace("annotate")
    assert alloc.drain_trace() == []


def test_a_resize_counts_the_events_it_empties_as_dropped():
    alloc = make(trace_capacity=8)
    for i in range(5):
        alloc.push_trace("annotate", tag=i)
    alloc.trace_capacity = 16
    assert alloc.drain_trace() == [] and alloc.trace_dropped == 5
    alloc.push_trace("annotate")
    alloc.trace_capacity = 0
    assert alloc.trace_dropped == 6


def test_every_action_round_trips_and_unknown_ones_are_refused():
    alloc = make(trace_capacity=len(TRACE_ACTIONS))
    for action in TRACE_ACTIONS:
        alloc.push_trace(action)
    assert [e.action for e in alloc.drain_trace()] == list(TRACE_ACTIONS)
    with pytest.raises(UsageError, match="unknown trace event kind 'explode'"):
        alloc.push_trace("explode")
    assert alloc.drain_trace() == []
