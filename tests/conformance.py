"""One conformance suite for the caching allocator, run against every source and configuration.

A test module supplies a `target` fixture returning a `Target` and subclasses `AllocatorConformance`:

    @pytest.fixture(params=[...])
    def target(request): return Target(...)

    class TestMySource(AllocatorConformance):
        pass

Every test gets a fresh allocator from `target.make()`; the suite frees what it allocates and checks
the invariant walker when the test ends. Expected sizes come from alloc_spec (the spec), never from
the allocator itself.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from alloc_spec import BOUNDARY_SIZES, SMALL_SEGMENT, EiB, GiB, MiB, PiB, rounded, segment_bytes
from live_blocks import DeviceMemory, LiveBlocks

from supermem.allocator import CachingAllocator
from supermem.errors import OutOfMemoryError, UsageError


@dataclass
class Target:
    name: str
    make: Callable[[], CachingAllocator]  # a fresh allocator over the source
    memory: DeviceMemory  # reads/writes what the allocator hands out
    streams: tuple[int, int]  # two distinct non-default stream handles valid on the source
    passthrough: bool = False
    expandable: bool = False  # expandable segments: reserved sizes are whole pages (alloc_spec)
    limit_bytes: int | None = None
    big_bytes: int = GiB  # the largest boundary size tried (0 to skip)
    device_used_bytes: Callable[[CachingAllocator], int] | None = None  # the source's own count, if known
    keep: list = field(default_factory=list)  # objects that must outlive the target (streams, ...)


class AllocatorConformance:
    @pytest.fixture
    def alloc(self, target: Target):
        a = target.make()
        yield a
        a.check()

    @pytest.fixture
    def blocks(self, target: Target) -> LiveBlocks:
        return LiveBlocks(target.memory)

    # ------------------------------------------------------------ sizes

    def test_zero_bytes_is_null_and_free_null_is_a_no_op(self, alloc):
        before = alloc.stats()
        assert alloc.malloc(0) == 0
        alloc.free(0)
        assert alloc.stats() == before

    @pytest.mark.parametrize("nbytes", BOUNDARY_SIZES + ("big",))
    def test_boundary_size(self, target, alloc, blocks, nbytes):
        if nbytes == "big":
            if not target.big_bytes:
                pytest.skip("the source has no room for the big boundary size")
            nbytes = target.big_bytes
        p = alloc.malloc(nbytes)
        blocks.add(p, nbytes, rounded(nbytes))
        assert alloc.allocation_size(p) == rounded(nbytes)
        s = alloc.stats()
        assert s["allocated_bytes"] == rounded(nbytes)
        assert s["requested_bytes"] == nbytes
        assert s["reserved_bytes"] == segment_bytes(nbytes, target.passthrough, target.expandable)
        assert s["segments"] == 1
        blocks.remove(p)
        alloc.free(p)
        s = alloc.stats()
        assert s["allocated_bytes"] == 0 and s["requested_bytes"] == 0
        assert s["reserved_bytes"] == (
            0 if target.passthrough else segment_bytes(nbytes, False, target.expandable)
        )

    def test_many_live_blocks_never_alias_and_keep_their_contents(self, alloc, blocks, target):
        rng = random.Random(1)
        sizes = [int(2 ** rng.uniform(0, 23)) for _ in range(600)] + list(BOUNDARY_SIZES)
        rng.shuffle(sizes)
        live = []
        for i, n in enumerate(sizes):
            stream = (0, *target.streams)[i % 3]
            p = alloc.malloc(n, stream)
            blocks.add(p, n, rounded(n))
            live.append(p)
            if rng.random() < 0.3:  # churn: free a random earlier block
                q = live.pop(rng.randrange(len(live)))
                blocks.remove(q)
                alloc.free(q)
        alloc.check()
        blocks.cookies.verify_all()
        assert alloc.stats()["live_blocks"] == len(live)
        rng.shuffle(live)
        for p in live:
            blocks.remove(p)
            alloc.free(p)
        assert alloc.stats()["allocated_bytes"] == 0

    def test_reuses_a_freed_block_of_the_same_stream(self, alloc, target):
        if target.passthrough:
            pytest.skip("passthrough caches nothing")
        p = alloc.malloc(3000)
        alloc.free(p)
        assert alloc.malloc(3000) == p
        alloc.free(p)

    def test_does_not_hand_a_cached_block_to_another_stream(self, alloc, target):
        if target.passthrough:
            pytest.skip("passthrough caches nothing (the source may hand the address out again)")
        a, b = target.streams
        p = alloc.malloc(3000, a)
        alloc.free(p)
        q = alloc.malloc(3000, b)
        assert q != p  # a stream's cached blocks may still be in use by its queued work
        alloc.free(q)

    def test_split_carves_from_the_front_and_free_coalesces(self, alloc, target):
        if target.passthrough:
            pytest.skip("passthrough neither splits nor caches")
        a, b, c = (alloc.malloc(512) for _ in range(3))
        assert (b, c) == (a + 512, a + 1024)
        alloc.free(b)  # a hole: two free blocks, the hole and the rest of the segment
        s = alloc.stats()
        tail = SMALL_SEGMENT - 3 * 512
        assert s["cached_free_bytes"] == 512 + tail and s["largest_free_block_bytes"] == tail
        assert s["fragmentation"] == pytest.approx(1 - tail / (512 + tail))
        assert alloc.malloc(512) == b  # best fit: the hole, not the big rest
        alloc.free(b)
        alloc.free(a)
        alloc.free(c)  # all three merge with the rest: one free block spans the segment again
        s = alloc.stats()
        assert s["cached_free_bytes"] == s["largest_free_block_bytes"] == SMALL_SEGMENT
        assert s["fragmentation"] == 0
        assert alloc.malloc(SMALL_SEGMENT // 2) == a  # the whole segment is one block again
        alloc.free(a)

    def test_snapshot_describes_segments_and_blocks(self, alloc, target):
        p = alloc.malloc(1000)
        q = alloc.malloc(3 * MiB, target.streams[0])
        segments = alloc.snapshot()
        assert sorted(seg["segment_type"] for seg in segments) == ["large", "small"]
        states = {}
        for seg in segments:
            assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
            assert seg["blocks"][0]["address"] == seg["address"]
            assert tuple(seg["segment_pool_id"]) == (0, 0)
            for b in seg["blocks"]:
                states[b["address"]] = (b["state"], b["requested_size"], seg["stream"])
        assert states[p] == ("active_allocated", 1000, 0)
        assert states[q] == ("active_allocated", 3 * MiB, target.streams[0])
        alloc.free(p)
        alloc.free(q)
        assert all(b["state"] == "inactive" for seg in alloc.snapshot() for b in seg["blocks"])

    # ------------------------------------------------------------ out of memory

    @pytest.mark.parametrize(
        "nbytes", [PiB, 1 << 61, EiB + 1, 1 << 64], ids=["1PiB", "2^61", "1EiB+1", "2^64"]
    )
    def test_impossible_request_raises_oom_and_leaves_the_allocator_usable(self, alloc, blocks, nbytes):
        keep = alloc.malloc(4096)
        blocks.add(keep, 4096, rounded(4096))
        before = alloc.stats()
        with pytest.raises(OutOfMemoryError) as info:
            alloc.malloc(nbytes)
        assert isinstance(info.value, torch.OutOfMemoryError)
        message = str(info.value)
        assert message.startswith("CUDA out of memory.")
        if nbytes > EiB:
            assert "more than 1EB" in message
        else:
            assert f"requested {nbytes} bytes" in message
        after = alloc.stats()
        assert after["num_ooms"] == before["num_ooms"] + 1
        assert after["allocated_bytes"] == before["allocated_bytes"]
        assert after["live_blocks"] == 1
        alloc.check()
        blocks.cookies.verify_all()
        p = alloc.malloc(5000)  # still usable
        blocks.add(p, 5000, rounded(5000))
        for q in (p, keep):
            blocks.remove(q)
            alloc.free(q)

    def test_limit_is_honoured(self, alloc, target):
        if target.limit_bytes is None:
            pytest.skip("no limit configured")
        with pytest.raises(OutOfMemoryError):
            alloc.malloc(target.limit_bytes + 1)
        p = alloc.malloc(target.limit_bytes // 2)
        assert alloc.stats()["reserved_bytes"] <= target.limit_bytes
        alloc.free(p)

    # ------------------------------------------------------------ misuse

    def test_negative_size_is_a_usage_error(self, alloc):
        before = alloc.stats()
        with pytest.raises(UsageError, match="nbytes must be >= 0"):
            alloc.malloc(-1)
        assert alloc.stats() == before

    @pytest.mark.parametrize("misuse", ["double_free", "interior", "foreign", "other_allocator"])
    def test_bad_free_is_a_usage_error_and_corrupts_nothing(self, target, alloc, blocks, misuse):
        live = [alloc.malloc(n) for n in (700, 3000, 3 * MiB)]
        for p, n in zip(live, (700, 3000, 3 * MiB), strict=True):
            blocks.add(p, n, rounded(n))
        victim = alloc.malloc(2048)
        other = target.make()
        expected = {
            "double_free": "double free",  # also when the freed block's segment went back already
            "interior": "points inside the block",
            "foreign": "not allocated by this allocator",
            "other_allocator": "not allocated by this allocator",
        }[misuse]
        if misuse == "double_free":
            alloc.free(victim)
            bad = victim
        elif misuse == "interior":
            bad = live[1] + 512
        elif misuse == "foreign":
            bad = 0x1000  # the first page is never mapped
        else:
            bad = other.malloc(2048)
        before = alloc.stats()
        for call in (alloc.free, alloc.allocation_size, lambda p: alloc.record_stream(p, target.streams[0])):
            with pytest.raises(UsageError, match=expected):
                call(bad)
        assert alloc.stats() == before
        alloc.check()
        blocks.cookies.verify_all()
        if misuse == "other_allocator":
            other.free(bad)
        if misuse != "double_free":
            alloc.free(victim)
        for p in live:
            blocks.remove(p)
            alloc.free(p)
        other.empty_cache()

    # ------------------------------------------------------------ stats

    def test_stats_are_exact(self, alloc, target):
        a = alloc.malloc(1)  # 512 bytes, small pool
        b = alloc.malloc(MiB + 1)  # large pool
        s = alloc.stats()
        assert s["requested_bytes"] == 1 + MiB + 1
        assert s["allocated_bytes"] == rounded(1) + rounded(MiB + 1)
        assert s["active_bytes"] == s["allocated_bytes"]
        assert s["live_blocks"] == 2 and s["num_allocs"] == 2 and s["num_frees"] == 0
        expected_reserved = sum(segment_bytes(n, target.passthrough, target.expandable) for n in (1, MiB + 1))
        assert s["reserved_bytes"] == expected_reserved
        nested = alloc.nested_stats()
        assert nested["allocated_bytes"]["small_pool"]["current"] == rounded(1)
        assert nested["allocated_bytes"]["large_pool"]["current"] == rounded(MiB + 1)
        alloc.free(b)
        s = alloc.stats()
        assert s["allocated_bytes"] == rounded(1)
        assert s["allocated_bytes_peak"] == rounded(1) + rounded(MiB + 1)
        assert s["requested_bytes_peak"] == 1 + MiB + 1
        assert s["num_frees"] == 1
        alloc.reset_peak_stats()
        s = alloc.stats()
        assert s["allocated_bytes_peak"] == rounded(1)
        assert s["reserved_bytes_peak"] == s["reserved_bytes"]
        alloc.reset_accumulated_stats()
        s = alloc.stats()
        assert s["num_allocs"] == 0 and s["num_frees"] == 0 and s["live_blocks"] == 1
        alloc.free(a)
        s = alloc.stats()
        assert s["allocated_bytes"] == 0 and s["requested_bytes"] == 0 and s["active_bytes"] == 0
        assert s["num_frees"] == 1 and s["live_blocks"] == 0

    def test_empty_cache_returns_everything_to_the_source(self, alloc, target):
        ps = [alloc.malloc(n) for n in (1, 5000, 3 * MiB, 12 * MiB)]
        alloc.record_stream(ps[2], target.streams[1])
        for p in ps:
            alloc.free(p)
        alloc.empty_cache()
        s = alloc.stats()
        assert s["reserved_bytes"] == 0 and s["active_bytes"] == 0 and s["segments"] == 0
        if target.device_used_bytes:
            assert target.device_used_bytes(alloc) == 0

    def test_record_stream_then_free_is_eventually_reusable(self, alloc, target):
        a, b = target.streams
        p = alloc.malloc(8192, a)
        alloc.record_stream(p, b)
        alloc.record_stream(p, a)  # the allocation stream itself: nothing to wait for
        alloc.free(p)
        alloc.empty_cache()  # waits for the other stream's work, then frees the segment
        s = alloc.stats()
        assert s["active_bytes"] == 0 and s["reserved_bytes"] == 0
