"""What supermem must answer exactly as PyTorch's CUDA caching allocator does (issue 14), checked on the
simulated device: the OOM message's size format (c10's format_size), the counters of memory_stats()
(num_sync_all_streams, num_device_alloc/free, inactive_split*), its key set, and
set_per_process_memory_fraction's semantics (0 is a real limit). Expected values are derived by hand
from PyTorch's c10/cuda/CUDACachingAllocator.cpp and torch/csrc/cuda/Module.cpp, cited per test."""

import math

import pytest
from alloc_spec import MiB

from supermem import _C
from supermem.allocator import CachingAllocator, SimulatedDevice
from supermem.errors import OutOfMemoryError

GiB = 1 << 30

# c10's format_size: "<= 1024" bytes, "<= 1 MiB" KiB, "<= 1 GiB" MiB, else GiB; 2 decimals, fixed.
FORMAT_CASES = [
    (0, "0 bytes"),
    (1, "1 bytes"),
    (1024, "1024 bytes"),
    (1025, "1.00 KiB"),
    (1536, "1.50 KiB"),
    (MiB, "1024.00 KiB"),
    (MiB + 1, "1.00 MiB"),
    (20 * MiB, "20.00 MiB"),
    (GiB, "1024.00 MiB"),
    (GiB + 1, "1.00 GiB"),
    (80 * GiB, "80.00 GiB"),
    (800_000_000 * GiB, "800000000.00 GiB"),
    (1 << 60, "1073741824.00 GiB"),
]


@pytest.mark.parametrize(("nbytes", "text"), FORMAT_CASES)
def test_sizes_are_formatted_as_pytorch_formats_them(nbytes, text):
    assert _C.format_size(nbytes) == text


def test_oom_message_says_what_pytorch_says_for_a_huge_request():
    a = CachingAllocator(SimulatedDevice(GiB))
    with pytest.raises(OutOfMemoryError) as info:
        a.malloc(800_000_000 * GiB)
    msg = str(info.value)
    assert "Tried to allocate 800000000.00 GiB." in msg, msg
    assert "total capacity of 1024.00 MiB" in msg, msg


# torch/csrc/cuda/Module.cpp (_cuda_memoryStats) and torch/csrc/DeviceAccelerator.cpp build the same dict.
NATIVE_ARRAYS = [
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
]
NATIVE_STATS = ["oversize_allocations", "oversize_segments"]
NATIVE_COUNTERS = [
    "num_alloc_retries",
    "num_ooms",
    "max_split_size",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
]


def test_nested_stats_has_natives_whole_key_set():
    n = CachingAllocator(SimulatedDevice(64 * MiB)).nested_stats()
    own = n.pop("supermem")
    assert isinstance(own, dict)
    assert set(n) == set(NATIVE_ARRAYS + NATIVE_STATS + NATIVE_COUNTERS)
    for key in NATIVE_ARRAYS:
        assert set(n[key]) == {"all", "small_pool", "large_pool"}, key
        for pool in n[key].values():
            assert set(pool) == {"current", "peak", "allocated", "freed"}, key
    for key in NATIVE_STATS:
        assert set(n[key]) == {"current", "peak", "allocated", "freed"}, key


def test_every_empty_cache_counts_one_sync_of_all_streams():
    # Native: emptyCache -> release_cached_blocks -> synchronize_and_free_events, which counts every call.
    a = CachingAllocator(SimulatedDevice(64 * MiB))
    for expected in (1, 2, 3):
        a.empty_cache()
        assert a.nested_stats()["num_sync_all_streams"] == expected


def test_device_alloc_and_free_count_each_segment():
    a = CachingAllocator(SimulatedDevice(64 * MiB))
    p = a.malloc(1000)  # a 2 MiB small segment
    r = a.malloc(12 * MiB)  # its own 12 MiB segment (>= 10 MiB), nothing left over
    q = a.malloc(3 * MiB)  # a 20 MiB large segment
    n = a.nested_stats()
    assert (n["num_device_alloc"], n["num_device_free"]) == (3, 0)
    for x in (p, q, r):
        a.free(x)
    assert a.nested_stats()["num_device_free"] == 0  # cached, not returned
    a.empty_cache()
    n = a.nested_stats()
    assert (n["num_device_alloc"], n["num_device_free"]) == (3, 3)
    a.free(a.malloc(1000))
    assert a.nested_stats()["num_device_alloc"] == 4


def _split(a):
    s = a.nested_stats()
    return (
        s["inactive_split"]["all"]["current"],
        s["inactive_split_bytes"]["all"]["current"],
        s["inactive_split"]["small_pool"]["current"],
        s["inactive_split"]["large_pool"]["current"],
    )


def test_inactive_split_follows_natives_rules():
    # Native: splitting an unsplit block creates one inactive split block (the remainder); shrinking an
    # already split one takes the allocated size off its bytes; a freed block that stays split is one
    # more; each neighbour it absorbs is one fewer.
    seg = 2 * MiB
    a = CachingAllocator(SimulatedDevice(64 * MiB))
    p1 = a.malloc(1000)  # 1024 of a fresh 2 MiB segment: the remainder is split and inactive
    assert _split(a) == (1, seg - 1024, 1, 0)
    p2 = a.malloc(1000)  # from the remainder: still one inactive block, 1024 bytes smaller
    assert _split(a) == (1, seg - 2048, 1, 0)
    a.free(p1)  # stays split (its neighbour p2 is allocated): a second inactive split block
    assert _split(a) == (2, seg - 1024, 2, 0)
    a.free(p2)  # absorbs both neighbours: the segment is whole again, nothing inactive-split
    assert _split(a) == (0, 0, 0, 0)
    s = a.nested_stats()["inactive_split"]["all"]
    assert (s["peak"], s["allocated"], s["freed"]) == (2, 2, 2)
    a.check()


def test_inactive_split_in_the_large_pool_and_through_pending_frees():
    a = CachingAllocator(SimulatedDevice(128 * MiB))
    a.device.hold_events(True)
    p = a.malloc(3 * MiB)  # 3 MiB of a 20 MiB segment: the 17 MiB remainder is split
    assert _split(a) == (1, 17 * MiB, 0, 1)
    a.record_stream(p, 5)
    a.free(p)  # pending: not free yet, nothing changes
    assert _split(a) == (1, 17 * MiB, 0, 1)
    a.check()
    a.device.hold_events(False)
    a.empty_cache()  # the event completes, the block merges back, the segment goes
    assert _split(a) == (0, 0, 0, 0)
    a.check()


# ---------------------------------------------------------------- set_per_process_memory_fraction


def test_memory_fraction_is_one_until_set_and_then_what_was_set():
    a = CachingAllocator(SimulatedDevice(64 * MiB))
    assert a.memory_fraction() == 1.0
    a.set_memory_fraction(0.5)
    assert a.memory_fraction() == 0.5 and a.limit_bytes == 32 * MiB
    with pytest.raises(OutOfMemoryError):
        a.malloc(40 * MiB)
    a.free(a.malloc(20 * MiB))


def test_memory_fraction_zero_allows_nothing_new():
    a = CachingAllocator(SimulatedDevice(64 * MiB))
    cached = a.malloc(1000)
    a.free(cached)  # a cached 2 MiB segment: native reuses cached blocks under any fraction
    a.set_memory_fraction(0.0)
    assert a.memory_fraction() == 0.0
    a.free(a.malloc(1000))
    for nbytes in (4 * MiB, 1 * MiB + 1, 64 * MiB):
        with pytest.raises(OutOfMemoryError):
            a.malloc(nbytes)
    a.empty_cache()
    with pytest.raises(OutOfMemoryError):
        a.malloc(1)
    a.limit_bytes = None  # an explicit "no limit" lifts it
    assert a.memory_fraction() == 1.0
    a.free(a.malloc(1))


@pytest.mark.parametrize("fraction", [-0.1, 1.5, math.nan, math.inf])
def test_bad_memory_fractions_are_refused(fraction):
    a = CachingAllocator(SimulatedDevice(64 * MiB), limit_bytes=8 * MiB)
    with pytest.raises(ValueError, match="fraction"):
        a.set_memory_fraction(fraction)
    assert a.limit_bytes == 8 * MiB


# torch/csrc/cuda/Module.cpp, segmentInfoToDict (PyTorch 2.1 to 2.13): what each dict of
# torch.cuda.memory_snapshot() holds. PyTorch's test_memory_stats reads segment["is_expandable"].
NATIVE_SEGMENT_KEYS = {
    "device",
    "address",
    "total_size",
    "allocated_size",
    "active_size",
    "requested_size",
    "stream",
    "segment_type",
    "segment_pool_id",
    "is_expandable",
    "frames",
    "blocks",
}
NATIVE_BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames"}


def test_memory_snapshot_has_natives_keys_and_sums(monkeypatch):
    from torch.cuda import _memory_viz

    from supermem import activate

    device = SimulatedDevice(GiB)
    a = CachingAllocator(device)
    live = [a.malloc(n) for n in (100, 3 * MiB + 5, 512, 30 * MiB)]
    a.free(live.pop(1))  # inactive
    device.hold_events(True)
    a.record_stream(live[1], 7)
    a.free(live.pop(1))  # active_pending_free: a stream's work on it is not done
    monkeypatch.setattr(_C, "plugin_devices", lambda: [0], raising=False)
    monkeypatch.setattr(_C, "plugin_allocator", lambda index, strict: a._impl, raising=False)
    snap = activate._memory_snapshot()
    segments = snap["segments"]
    states = {b["state"] for s in segments for b in s["blocks"]}
    assert states == {"active_allocated", "active_pending_free", "inactive"}
    for s in segments:
        assert set(s) == NATIVE_SEGMENT_KEYS, sorted(set(s) ^ NATIVE_SEGMENT_KEYS)
        assert s["is_expandable"] is False and s["frames"] == [] and s["device"] == 0
        for b in s["blocks"]:
            assert set(b) == NATIVE_BLOCK_KEYS, sorted(set(b) ^ NATIVE_BLOCK_KEYS)
        active = [b for b in s["blocks"] if b["state"] != "inactive"]  # c10: allocated or events pending
        assert s["active_size"] == sum(b["size"] for b in active)
        assert s["requested_size"] == sum(b["requested_size"] for b in active)
        assert s["allocated_size"] == sum(b["size"] for b in s["blocks"] if b["state"] == "active_allocated")
    _memory_viz.segsum(snap)  # PyTorch's own reader of the shape
    device.hold_events(False)
