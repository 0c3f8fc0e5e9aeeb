"""The pool tells a trace what it holds off the device and how: offloaded, dropped to be recomputed,
packed by compression (supermem.events), and the report counts each way at the peak."""

import numpy as np
import torch
import torch.nn as nn

from supermem import events
from supermem.tensor_pool import Pool
from supermem.tensor_pool.treatments import Compress, Recompute
from supermem.trace.breakdown import off_device
from supermem.trace.table import Trace, empty_columns


def _events_of(pool, steps=2):
    seen = []
    events.subscribe(seen.append)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(
            *[nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)) for _ in "abcd"]
        )
        x = torch.randn(32, 64)
        for _ in range(steps):
            with pool:
                model(x).square().mean().backward()
    finally:
        events.unsubscribe(seen.append)
    return seen


def _paired(seen, away, back):
    """Every entry that left by `away` came back by `back`, once, after it left."""
    left = {e.tag: i for i, e in enumerate(seen) if e.action == away}
    came = {e.tag: i for i, e in enumerate(seen) if e.action == back}
    return left and left.keys() == came.keys() and all(left[t] < came[t] for t in left)


def test_recomputed_entries_are_dropped_and_rebuilt_in_the_trace():
    pool = Pool(budget=0, policy="cost_aware", min_bytes=0, treatments=(Recompute(),))
    seen = _events_of(pool)
    drops = [e for e in seen if e.action == "drop"]
    assert len(drops) == pool.stats()["dropped"] > 0
    assert sum(e.nbytes for e in drops) == pool.stats()["dropped_bytes"]
    assert _paired(seen, "drop", "recompute")


def test_compressed_entries_are_packed_and_unpacked_in_the_trace():
    pool = Pool(budget=0, policy="cost_aware", min_bytes=0, treatments=(Compress(),))
    seen = _events_of(pool)
    assert len([e for e in seen if e.action == "compress"]) == pool.stats()["compressions"] > 0
    assert _paired(seen, "compress", "decompress")


def test_off_device_counts_each_way_until_the_entry_is_back():
    trace = Trace()
    rows = [
        ("offload", 1, 100),
        ("drop", 2, 50),
        ("compress", 3, 30),
        ("recompute", 2, 50),
        ("prefetch", 1, 100),
    ]
    cols = empty_columns(len(rows))
    cols["time_ns"] = np.arange(len(rows), dtype=np.int64)
    cols["action"] = np.array([trace.action_id(a) for a, _, _ in rows], cols["action"].dtype)
    cols["tag"] = np.array([t for _, t, _ in rows], cols["tag"].dtype)
    cols["size"] = np.array([s for _, _, s in rows], cols["size"].dtype)
    cols["device"][:] = 0
    trace.cols = cols
    assert off_device(trace, 2, 0) == {"offloaded": 100, "recomputed": 50, "compressed": 30}
    assert off_device(trace, 3, 0) == {"offloaded": 100, "compressed": 30}
    assert off_device(trace, 4, 0) == {"compressed": 30}
    assert off_device(trace, 4, 1) == {}


def test_a_report_with_more_pool_actions_than_series_keeps_its_peak_counts(tmp_path):
    """More kinds of pool action than the plot has series (the pool names offload, prefetch, drop,
    recompute, compress, decompress...): they are summed into one series, and the peak's unlisted
    blocks are still the peak's (the summing once reused the names holding them)."""
    from trace_workload import Workload, make_allocator

    import supermem
    from supermem.trace.analysis import MAX_SERIES, OTHER_ACTIONS, analyze
    from supermem.trace.loader import load

    alloc = make_allocator()
    w = Workload(alloc, layers=6, seed=1)
    with supermem.trace(tmp_path / "run.smtrace", allocators=[alloc], model=w.model, optimizer=w.opt):
        w.run(1)
        for k in range(MAX_SERIES + 3):
            events.emit(f"pool_action_{k}", 4096, 0, 0, k + 1, "activation")
    trace = load(tmp_path / "run.smtrace")
    (d,) = analyze(trace, max_blocks=2).devices
    assert len(d.pool_bytes) == MAX_SERIES and OTHER_ACTIONS in d.pool_bytes
    assert d.peak_other_blocks == d.peak_num_blocks - len(d.peak_blocks) > 0
    assert d.peak_other_bytes == d.peak_bytes - sum(b["size"] for b in d.peak_blocks)
