"""The simulated device itself: capacity, accounting and held events, as the other tests rely on."""

import ctypes

import pytest
from alloc_spec import MiB

from supermem.allocator import CachingAllocator, SimulatedDevice
from supermem.errors import OutOfMemoryError


def test_capacity_and_accounting():
    device = SimulatedDevice("64MiB")
    assert device.total_bytes == 64 * MiB and device.free_bytes == 64 * MiB and device.used_bytes == 0
    assert device.name == "sim" and device.index == 0
    alloc = CachingAllocator(device)
    p = alloc.malloc(30 * MiB)
    assert device.used_bytes == 30 * MiB and device.free_bytes == 34 * MiB
    with pytest.raises(OutOfMemoryError, match="Simulated device has a total capacity of 64.00 MiB"):
        alloc.malloc(40 * MiB)
    alloc.free(p)
    alloc.empty_cache()
    assert device.used_bytes == 0


def test_bad_capacity():
    with pytest.raises(ValueError, match=">= 0"):
        SimulatedDevice(-1)
    with pytest.raises(ValueError, match="needs a known device capacity"):
        SimulatedDevice("50%")


def test_memory_is_real_and_writable_to_the_last_byte():
    alloc = CachingAllocator(SimulatedDevice(64 * MiB))
    p = alloc.malloc(20 * MiB)
    ctypes.memset(p + 20 * MiB - 1, 0xAB, 1)
    assert ctypes.string_at(p + 20 * MiB - 1, 1) == b"\xab"
    alloc.free(p)


def test_held_events_stay_pending_until_released_or_waited_for():
    device = SimulatedDevice(64 * MiB)
    alloc = CachingAllocator(device)
    p = alloc.malloc(4096)
    alloc.record_stream(p, 9)
    device.hold_events(True)
    alloc.free(p)
    assert device.live_events == 1
    device.hold_events(False)
    device.hold_events(True)  # holding again does not hold events recorded before
    alloc.free(alloc.malloc(4096))
    assert device.live_events == 0 and alloc.stats()["active_bytes"] == 0
