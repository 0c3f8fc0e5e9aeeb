"""Expandable segments on the simulated device: pages mapped on demand into one reserved range per
(pool, stream, size class), free pages unmapped when cached memory is released, stream-ordered reuse
kept, the walker checking the device's own page map, and less memory reserved when sizes vary.

Most tests run the same calls with the option off beside it: what the option changes is asserted,
so each fails without it. The conformance suite and the fuzz lanes run with it on and off too."""

import pytest
from alloc_spec import PAGE, MiB, rounded

from supermem import config
from supermem.activate import torch_segments
from supermem.allocator import CachingAllocator, SimulatedDevice
from supermem.bench import frag
from supermem.errors import ConfigError, InvariantError, OutOfMemoryError, UsageError

GiB = 1 << 30


def make(expandable: bool = True, capacity: int = 4 * GiB, **kw) -> CachingAllocator:
    return CachingAllocator(SimulatedDevice(capacity), expandable_segments=expandable, debug=2, **kw)


def test_pages_are_mapped_on_demand_and_count_as_reserved():
    a = make()
    assert a.stats()["reserved_bytes"] == 0 and a.device.used_bytes == 0
    p = a.malloc(3 * MiB)  # large pool: two pages, not a 20 MiB segment
    s = a.stats()
    assert s["reserved_bytes"] == 2 * PAGE == a.device.used_bytes
    assert a.device.mapped_bytes(p, 4 * MiB) == 4 * MiB
    assert s["segments"] == 1 and s["address_space_bytes"] >= 4 * GiB  # 1 1/8 of the device, reserved
    q = a.malloc(5 * MiB)  # the rest of the second page plus two more
    assert q == p + 3 * MiB and a.stats()["reserved_bytes"] == 4 * PAGE
    a.free(p)
    a.free(q)
    plain = make(expandable=False)
    plain.malloc(3 * MiB)
    assert plain.stats()["reserved_bytes"] == 20 * MiB  # what the option saves here


def test_a_larger_request_extends_the_free_end_of_the_segment():
    """The allocation that a plain allocator puts in a new segment, beside an unusable cached one."""
    for expandable, reserved in ((True, 14 * MiB), (False, 12 * MiB + 14 * MiB)):
        a = make(expandable)
        p = a.malloc(12 * MiB)
        a.free(p)
        q = a.malloc(14 * MiB)
        assert a.stats()["reserved_bytes"] == reserved
        assert (q == p) == expandable  # the same address, grown by one page
        a.free(q)


def test_empty_cache_unmaps_free_pages_anywhere_and_releases_empty_ranges():
    a = make()
    x, y, z = (a.malloc(10 * MiB) for _ in range(3))
    a.free(y)  # a hole in the middle
    a.empty_cache()
    s = a.stats()
    assert s["reserved_bytes"] == 20 * MiB == a.device.used_bytes
    assert a.device.mapped_bytes(y, 10 * MiB) == 0 and a.device.mapped_bytes(x, 10 * MiB) == 10 * MiB
    assert a.malloc(10 * MiB) == y  # the lowest place that fits: the hole, mapped again
    for p in (x, y, z):
        a.free(p)
    a.empty_cache()
    s = a.stats()
    assert s["reserved_bytes"] == 0 and s["segments"] == 0 and s["address_space_bytes"] == 0
    assert a.device.used_bytes == 0


def test_partial_pages_stay_mapped_under_live_blocks():
    a = make()
    p = a.malloc(3 * MiB)  # pages 0-1; page 1 half used
    q = a.malloc(2 * MiB)  # 3..5 MiB: pages 1-2
    a.free(p)
    a.empty_cache()  # page 0 is wholly free, page 1 shares q
    assert a.stats()["reserved_bytes"] == 2 * PAGE
    assert a.device.mapped_bytes(p, 2 * MiB) == 0 and a.device.mapped_bytes(p + 2 * MiB, 4 * MiB) == 4 * MiB
    a.free(q)


def test_out_of_memory_moves_free_pages_to_where_the_request_fits():
    """Free memory scattered in holes serves a request none of them fits: stage 2 of the OOM protocol
    unmaps them and maps pages at the segment's end. Without the option the same calls raise."""
    for expandable in (True, False):
        a = make(expandable, capacity=GiB, limit_bytes=100 * MiB)
        blocks = [a.malloc(9 * MiB) for _ in range(9)]  # plain: two to a 20 MiB segment
        for p in blocks[::2]:
            a.free(p)  # 45 MiB free, in 9 MiB pieces
        if expandable:
            big = a.malloc(40 * MiB)
            assert a.stats()["reserved_bytes"] <= 100 * MiB
            a.free(big)
        else:
            with pytest.raises(OutOfMemoryError, match="expandable_segments:true"):  # the hint
                a.malloc(40 * MiB)
        for p in blocks[1::2]:
            a.free(p)


def test_growing_past_the_allocated_peak_moves_pages_out_of_holes_first():
    """A request no cached block fits, whose new pages would take reserved memory over the allocated
    peak (by more than 1/128 or 32 MiB): the pages of holes between live blocks (smallest first) are
    unmapped and mapped where the request goes, so reserved stays at the peak. Without that the same
    calls reserve 832 MiB."""
    a = make()
    blocks = [a.malloc(64 * MiB) for _ in range(10)]  # peak 640 MiB, one mapped run
    for p in blocks[0:8:2]:
        a.free(p)  # four 64 MiB holes, 384 MiB allocated
    big = a.malloc(192 * MiB)
    s = a.stats()
    assert s["reserved_bytes"] == 640 * MiB == a.device.used_bytes == s["allocated_bytes_peak"]
    assert s["num_reclaims"] == 3 and s["reclaimed_bytes"] == 192 * MiB  # three of the four holes
    assert sum(a.device.mapped_bytes(p, 64 * MiB) == 0 for p in blocks[0:8:2]) == 3
    a.free(big)
    for p in blocks[1::2]:
        a.free(p)


def test_a_move_maps_the_holes_memory_where_the_request_goes():
    """Moved pages keep their memory: mapped where the request goes, with no new memory and none freed
    (the device's own test shows them taken back in place where they were)."""
    a = make()
    blocks = [a.malloc(64 * MiB) for _ in range(10)]  # peak 640 MiB: 320 pages created
    for p in blocks[0:8:2]:
        a.free(p)
    created = a.device.page_calls["created"]
    big = a.malloc(192 * MiB)  # three holes' 96 pages move
    calls = a.device.page_calls
    assert calls["created"] == created == 320 and calls["aliased"] == 96
    assert a.stats()["reserved_bytes"] == a.device.used_bytes == 640 * MiB
    a.free(big)
    for p in blocks[1::2] + [blocks[8]]:
        a.free(p)
    a.empty_cache()
    assert a.device.used_bytes == 0 and a.stats()["reserved_bytes"] == 0


def test_moving_holes_waits_for_their_segments_stream_not_the_device():
    """A free block's last uses were queued on its segment's stream (another stream's keep it pending):
    moving its pages waits for that stream once, so copies on other streams (the pool's) run on.
    Releasing cached memory still waits for the device."""
    a = make()
    blocks = [a.malloc(64 * MiB) for _ in range(10)]
    for p in blocks[0:8:2]:
        a.free(p)
    big = a.malloc(192 * MiB)  # three holes move
    assert a.stats()["num_reclaims"] == 3
    assert a.device.waits == (0, 1) and a.device.live_events == 0  # one stream wait, its event given back
    a.free(big)
    a.empty_cache()
    assert a.device.waits[0] == 1


@pytest.mark.parametrize("caught_up", [True, False], ids=["stream-ran-past-the-fence", "stream-behind"])
def test_holes_freed_before_a_completed_fence_move_without_a_wait(caught_up):
    """A miss that grows within the slack records a fence on the holes' stream; once the stream ran past
    it, a later miss moves the holes freed before it with no wait. While the stream is still behind the
    fence, the move waits for it as before."""
    a = make()
    blocks = [a.malloc(64 * MiB) for _ in range(10)]  # peak 640 MiB
    for i in (0, 2, 9):
        a.free(blocks[i])  # two holes, and free space at the run's end
    a.device.hold_events(not caught_up)
    x = a.malloc(96 * MiB)  # the end's 64 MiB and 32 new: within 1/128 or 32 MiB of the peak, no move
    assert a.stats()["num_reclaims"] == 0 and a.device.live_events == 1  # the fence
    y = a.malloc(128 * MiB)  # the holes' pages move to it
    s = a.stats()
    assert s["num_reclaims"] == 2 and s["reserved_bytes"] == 672 * MiB
    assert s["num_reclaim_waits"] == a.device.waits[1] == (0 if caught_up else 1)
    a.device.hold_events(False)
    for p in [x, y] + [b for i, b in enumerate(blocks) if i not in (0, 2, 9)]:
        a.free(p)
    a.empty_cache()
    assert a.device.live_events == 0 and a.stats()["reserved_bytes"] == 0


def test_frees_record_fences_too_so_a_first_move_need_not_wait():
    """Every 16 frees of a stream's expandable blocks record a fence on it: holes freed before one that
    completed move without a wait even where no miss came between."""
    a = make()
    blocks = [a.malloc(64 * MiB) for _ in range(10)]
    a.free(blocks[0])
    a.free(blocks[2])
    for _ in range(16):  # frees of small blocks, the same stream: a fence at the 16th free
        a.free(a.malloc(4096))
    big = a.malloc(128 * MiB)  # moves both holes' pages (and the small blocks' free page first)
    s = a.stats()
    assert s["num_reclaims"] == 3 and s["num_reclaim_waits"] == a.device.waits[1] == 0
    a.free(big)


def test_holes_below_the_allocators_all_time_peak_stay_cached_after_a_peak_reset():
    """torch.cuda.reset_peak_memory_stats between steps changes no allocation: growth within the
    highest allocated bytes ever leaves the holes mapped (they serve the next step)."""
    a = make()
    for p in [a.malloc(64 * MiB) for _ in range(10)]:
        a.free(p)
    a.empty_cache()  # peak 640 MiB, nothing reserved
    hole, live = a.malloc(64 * MiB), a.malloc(64 * MiB)
    a.free(hole)
    a.reset_peak_stats()  # the peak now reads 128 MiB
    big = a.malloc(128 * MiB)  # 256 MiB reserved: over the peak since the reset, under the all-time one
    assert a.stats()["num_reclaims"] == 0 and a.device.mapped_bytes(hole, 64 * MiB) == 64 * MiB
    a.free(big)
    a.free(live)


def test_a_private_pools_holes_are_never_reclaimed():
    """A captured graph's kernels address its pool's free blocks too: only the default pool's pages move."""
    a = make()
    a.begin_allocate_to_pool((1, 0), [7])
    g = [a.malloc(64 * MiB, 7) for _ in range(3)]
    a.end_allocate_to_pool((1, 0))
    a.free(g[0])  # a 64 MiB hole in the graph's pool
    big = a.malloc(192 * MiB)  # over the peak: the default pool has no hole, and the graph's stays
    assert a.stats()["num_reclaims"] == 0 and a.device.mapped_bytes(g[0], 64 * MiB) == 64 * MiB
    a.free(big)
    for p in g[1:]:
        a.free(p)
    a.release_pool((1, 0))


def test_cached_bytes_no_move_can_reach_do_not_make_every_miss_move_holes():
    """Small free blocks that share their pages with live ones (64 MiB, more than the slack) stay
    reserved whatever moves: once steps of varying sizes have settled, holes move in a rare step only
    (counting those bytes as movable had each miss unmap every hole, and the next map them back)."""
    import random

    a = CachingAllocator(SimulatedDevice(16 * GiB), expandable_segments=True, debug=1)
    small = [a.malloc(512 << 10) for _ in range(256)]
    for p in small[::2]:
        a.free(p)  # every 2 MiB page keeps a live block
    rng = random.Random(0)
    moved = []
    for _ in range(30):
        before = a.stats()["num_reclaims"]
        acts = [a.malloc(rng.randint(1, 24) * MiB) for _ in range(30)]
        for p in acts[::2]:
            a.free(p)
        more = [a.malloc(rng.randint(1, 24) * MiB) for _ in range(15)]
        for p in acts[1::2] + more:
            a.free(p)
        moved.append(a.stats()["num_reclaims"] - before)
    assert sum(moved[10:]) <= 6 and moved[10:].count(0) >= 15, moved
    a.check()


def test_the_oom_message_says_what_is_mapped():
    a = make(capacity=64 * MiB)
    p = a.malloc(40 * MiB)
    with pytest.raises(OutOfMemoryError) as info:
        a.malloc(30 * MiB)
    message = str(info.value)
    assert message.startswith("CUDA out of memory. Tried to allocate 30.00 MiB.")
    assert "Expandable segments map 40.00 MiB in" in message and "of reserved address space" in message
    a.free(p)


def test_streams_have_their_own_segments_and_pending_blocks_wait_for_their_events():
    a = make()
    p = a.malloc(4 * MiB, 1)
    q = a.malloc(4 * MiB, 2)
    segments = {seg["stream"]: seg for seg in a.snapshot()}
    assert set(segments) == {1, 2} and all(seg["is_expandable"] for seg in segments.values())
    assert segments[1]["address"] <= p < segments[1]["address"] + segments[1]["total_size"]
    a.device.hold_events(True)
    a.record_stream(p, 3)  # stream 3 still works on p after its free
    a.free(p)
    r = a.malloc(4 * MiB, 1)
    assert r != p  # pending, not free: neither reused nor merged with the pages after it
    a.empty_cache()  # waits for the events, then unmaps p's pages (a live r keeps its own)
    assert a.device.mapped_bytes(p, 4 * MiB) == 0 and a.stats()["active_bytes"] == 8 * MiB
    for x in (q, r):
        a.free(x)
    a.device.hold_events(False)


def test_private_pools_get_their_own_segments_and_give_them_back_when_released():
    a = make()
    keep = a.malloc(4 * MiB)
    a.begin_allocate_to_pool((1, 0), [7])
    g = a.malloc(6 * MiB, 7)
    a.end_allocate_to_pool((1, 0))
    pools = {tuple(seg["segment_pool_id"]) for seg in a.snapshot()}
    assert pools == {(0, 0), (1, 0)}
    a.free(g)
    a.empty_cache()  # the pool's graph is alive: its pages stay
    assert a.stats()["reserved_bytes"] == 4 * MiB + 6 * MiB
    a.release_pool((1, 0))
    assert a.stats()["reserved_bytes"] == 4 * MiB and a.stats()["segments"] == 1
    a.free(keep)


def test_a_lower_limit_unmaps_free_pages():
    a = make()
    p = a.malloc(64 * MiB)
    a.free(p)
    a.limit_bytes = 32 * MiB
    assert a.stats()["reserved_bytes"] == 0


def test_the_walker_checks_the_devices_page_map():
    a = make()
    p = a.malloc(3 * MiB)
    a.check()
    a.device._vm_unmap(p, PAGE)  # memory gone from under an allocated block
    with pytest.raises(InvariantError, match="does not map every page"):
        a.check()
    a.device._vm_map(p, PAGE)
    a.check()
    hole = p + 2 * PAGE  # the first unmapped page after the mapped run
    a.device._vm_map(hole, PAGE)
    with pytest.raises(InvariantError, match="maps pages under an unmapped block"):
        a.check()
    a.device._vm_unmap(hole, PAGE)
    a.free(p)


def test_pages_set_aside_are_taken_back_in_place_mapped_elsewhere_or_freed():
    d = SimulatedDevice(64 * MiB)
    a, b = d._vm_reserve(8 * PAGE), d._vm_reserve(8 * PAGE)
    d._vm_map(a, 2 * PAGE)
    d._vm_set_aside(a, 2 * PAGE)
    assert d.mapped_bytes(a, 2 * PAGE) == 0 and d.used_bytes == 2 * PAGE  # unmapped, memory kept
    d._vm_map(a, 2 * PAGE)  # taken back where they still were
    assert d.page_calls == {"created": 2, "aliased": 0, "in_place": 2, "unmapped": 0}
    d._vm_set_aside(a, 2 * PAGE)
    d._vm_map(b, 2 * PAGE)  # the same memory, now at b
    assert d.page_calls == {"created": 2, "aliased": 2, "in_place": 2, "unmapped": 0}
    assert d.used_bytes == 2 * PAGE
    d._vm_map(a, PAGE)  # a's page still names memory in use at b: new memory, a's stale view dropped
    assert d.page_calls == {"created": 3, "aliased": 2, "in_place": 2, "unmapped": 1}
    d._vm_unmap(b, 2 * PAGE)  # freed, with a's other stale view
    assert d.used_bytes == PAGE and d.page_calls["unmapped"] == 4
    d._vm_set_aside(a, PAGE)
    d._vm_trim()  # what no mapping took is freed
    assert d.used_bytes == 0
    d._vm_release(a, 8 * PAGE)
    d._vm_release(b, 8 * PAGE)


def test_the_device_refuses_what_the_allocator_must_never_do():
    d = SimulatedDevice(64 * MiB)
    with pytest.raises(Exception, match="not whole pages"):
        d._vm_map(4096, PAGE)  # nothing reserved there


def test_variable_sizes_reserve_less_with_the_option():
    """Sequence lengths drawn from 128..2048 each step (frag's varlen pattern): reserved / allocated
    at the peak, and the smallest limit (x allocated peak) the run completes under."""
    off = frag.simulated("varlen", 40, expandable=False)
    on = frag.simulated("varlen", 40, expandable=True)
    assert on["peak_reserved_ratio"] <= 1.02 < 1.5 < off["peak_reserved_ratio"]  # frag's target
    for run, expandable in ((on, True), (off, False)):  # the target: 5% above the allocated peak
        limit = int(run["allocated_bytes_peak"] * 1.05)
        assert frag.simulated("varlen", 40, expandable, limit_bytes=limit)["oom"] == (not expandable)


def test_stats_report_fragmentation_at_the_peak():
    a = make(expandable=False)
    p = a.malloc(3 * MiB)  # a 20 MiB segment
    s = a.stats()
    assert s["peak_unallocated_bytes"] == 20 * MiB - rounded(3 * MiB)
    assert s["peak_reserved_ratio"] == pytest.approx(20 * MiB / rounded(3 * MiB))
    assert s["expandable_segments"] is False and s["address_space_bytes"] == 0
    a.free(p)
    assert make().stats()["peak_reserved_ratio"] == 1.0  # nothing allocated yet


def test_snapshot_reports_one_segment_per_mapped_run_with_native_keys():
    a = make()
    x, y, z = (a.malloc(10 * MiB) for _ in range(3))
    a.free(y)
    a.empty_cache()  # y's pages unmapped: two runs
    segs = a.snapshot()
    assert [(seg["address"], seg["total_size"]) for seg in segs] == [(x, 10 * MiB), (z, 10 * MiB)]
    torch_segs = torch_segments(segs, device=0)
    assert all(seg["is_expandable"] is True and seg["allocated_size"] == 10 * MiB for seg in torch_segs)
    assert torch_segments(make(expandable=False).snapshot(), 0) == []
    a.free(x)
    a.free(z)


def test_option_parsing_and_refusals():
    assert config.parse_conf("expandable_segments:True") == {"expandable_segments": True}
    assert config.parse_conf("expandable_segments:false") == {"expandable_segments": False}
    assert config.Config().expandable_segments is False  # off by default
    with pytest.raises(ConfigError, match="'expandable_segments'.*'maybe' is not a boolean"):
        config.parse_conf("expandable_segments:maybe")
    with pytest.raises(UsageError, match="passthrough caches none"):
        CachingAllocator(SimulatedDevice(64 * MiB), passthrough=True, expandable_segments=True)
    with pytest.raises(UsageError, match="need virtual memory"):
        CachingAllocator(SimulatedDevice(64 * MiB, page_bytes=0), expandable_segments=True)
    with pytest.raises(UsageError, match="multiple of the host's page size"):
        SimulatedDevice(64 * MiB, page_bytes=1000)


def test_the_trace_records_each_mapped_and_unmapped_range_as_a_segment_event():
    a = CachingAllocator(SimulatedDevice(GiB), expandable_segments=True, trace_capacity=64)
    p = a.malloc(3 * MiB, 5)
    q = a.malloc(2 * MiB, 5)  # 1 MiB left on the second page, one page more
    a.free(p)
    a.empty_cache()  # page 0 is free; page 1 is shared with q
    events = [(e.action, e.address, e.size, e.stream) for e in a.drain_trace()]
    assert events == [
        ("segment_alloc", p, 2 * PAGE, 5),
        ("alloc", p, 3 * MiB, 5),
        ("segment_alloc", p + 2 * PAGE, PAGE, 5),
        ("alloc", q, 2 * MiB, 5),
        ("free_completed", p, 3 * MiB, 5),
        ("segment_free", p, PAGE, 5),
    ]
    a.free(q)


def test_a_pointer_into_unmapped_address_space_is_foreign():
    a = make()
    p = a.malloc(MiB + 1)
    with pytest.raises(UsageError, match="not allocated by this allocator"):
        a.free(p + 64 * MiB)  # inside the segment's reserved range, where nothing is mapped
    a.free(p)
