"""Lifetimes, memory series, downsampling and attribution on small hand-made traces (values by hand)."""

import numpy as np

from supermem.trace import attribution
from supermem.trace.analysis import analyze
from supermem.trace.table import Trace, empty_columns
from supermem.trace.timeline import downsample, lifetimes, series


def make(events, segments=()):
    """events: (time, action, address, size); one device (0)."""
    t = Trace()
    cols = empty_columns(len(events))
    for i, (time_ns, action, addr, size) in enumerate(events):
        cols["time_ns"][i] = time_ns
        cols["action"][i] = t.action_id(action)
        cols["address"][i] = addr
        cols["size"][i] = size
    t.cols = cols
    t.device(0)["segments"] = list(segments)
    return t


def seg(addr, size, blocks):
    return {"address": addr, "total_size": size, "blocks": blocks}


def test_lifetimes_and_series_with_blocks_from_before_the_trace():
    segments = [
        seg(1000, 1000, [
            {"address": 1000, "size": 100, "state": "inactive"},  # A: freed in the trace
            {"address": 1100, "size": 50, "state": "active_allocated"},  # B: allocated in the trace
            {"address": 1150, "size": 30, "state": "inactive"},  # C: freed, allocated before the trace
            {"address": 1180, "size": 20, "state": "active_allocated", "category": "parameter"},  # D: none
            {"address": 1200, "size": 800, "state": "inactive"},
        ]),
    ]  # fmt: skip
    t = make(
        [
            (0, "alloc", 1000, 100),
            (5, "free_completed", 1150, 30),
            (10, "alloc", 1100, 50),
            (20, "free_requested", 1000, 100),
            (25, "offload", 1100, 50),
            (30, "free_completed", 1000, 100),
        ],
        segments,
    )
    lt = lifetimes(t, 0)
    rows = sorted(zip(lt.address.tolist(), lt.size.tolist(), lt.start.tolist(), lt.end.tolist(), strict=True))
    assert rows == [(1000, 100, 0, 5), (1100, 50, 2, -1), (1150, 30, -1, 1), (1180, 20, -1, -1)]
    s = series(t, 0, lt)
    assert s.initial_active == 50  # C and D
    assert s.active.tolist() == [150, 120, 170, 170, 170, 70]  # active until free_completed
    assert s.initial_reserved == 1000 and s.reserved.tolist() == [1000] * 6
    d = t.categories[lt.category[lt.address == 1180][0]]
    assert d == "parameter"  # from the snapshot block
    rep = analyze(t, width=10)
    assert rep.devices[0].peak_bytes == 170 and rep.devices[0].peak_num_blocks == 3
    assert rep.devices[0].peak_by_category == {"unknown": 150, "parameter": 20}


def test_reserved_is_rebuilt_backwards_from_the_final_segments():
    t = make(
        [(0, "segment_alloc", 0, 200), (1, "segment_free", 5000, 300), (2, "segment_alloc", 9000, 50)],
        [seg(0, 200, []), seg(9000, 50, []), seg(7000, 1000, [])],
    )
    s = series(t, 0, lifetimes(t, 0))
    assert s.initial_reserved == 1250 - 250 + 300  # final minus what the trace added, plus what it freed
    assert s.reserved.tolist() == [1500, 1200, 1250]


def test_downsample_keeps_peaks_and_carries_values_over_empty_bins():
    times = np.array([0, 1, 2, 100], np.int64)
    values = np.array([1, 5, 2, 3], np.int64)
    pos = downsample(times, values, 0, 100, 4)
    assert pos.tolist() == [1, 2, 2, 3]
    assert downsample(times, values, -50, 100, 3).tolist() == [-1, 1, 3]  # nothing before the first event
    assert downsample(np.zeros(0, np.int64), np.zeros(0, np.int64), 0, 1, 2).tolist() == [-1, -1]


def test_observations_attach_to_the_block_live_at_their_time():
    t = make(
        [
            (0, "alloc", 1000, 100),
            (10, "free_completed", 1000, 100),
            (20, "alloc", 1000, 64),  # the address reused by another block
            (30, "free_completed", 1000, 64),
            (40, "alloc", 2000, 8),
        ]
    )
    n = attribution.apply(
        t,
        [
            (5, 1000, "activation", -1),  # during the first block
            (25, 1000, "gradient", -1),  # during the second
            (35, 1000, "parameter", -1),  # after both: no block there then
            (45, 3000, "parameter", -1),  # an address no block ever had
            (50, 2000, "unknown", 0),  # a stack only
        ],
    )
    assert n == 3
    cats = [t.categories[c] for c in t.cols["category"]]
    assert cats == ["activation", "activation", "gradient", "gradient", "unknown"]
    assert t.cols["stack"].tolist() == [-1, -1, -1, -1, 0]
