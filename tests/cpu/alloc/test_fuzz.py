"""Seeded random op streams over malloc / free / record_stream / held events / empty_cache / limit
changes / graph-pool captures, checked against the model in fuzz_model after every op (cookies,
disjointness, stats, device accounting, the invariant walker). The default run is 120k ops; the
slow one (--slow) 10^6. Each runs with expandable segments off and on."""

import pytest
from fuzz_model import run_random_ops


@pytest.mark.parametrize("expandable", [False, True], ids=["plain", "expandable"])
def test_random_ops_100k(expandable):
    m = run_random_ops(seed=1, n_ops=100_000, expandable=expandable)
    assert m.ops == 100_000
    assert m.ooms > 0 and m.syncs > 0 and m.pool_serial > 0  # the stream reached OOM, syncs and pools
    if expandable:  # segments grew (more page maps than segments) and gave pages back
        n = m.alloc.nested_stats()
        assert n["num_device_alloc"] > n["segment"]["all"]["allocated"] and n["num_device_free"] > 0


def test_random_ops_passthrough_20k():
    m = run_random_ops(seed=2, n_ops=20_000, passthrough=True)
    assert m.ops == 20_000


@pytest.mark.slow
@pytest.mark.parametrize("expandable", [False, True], ids=["plain", "expandable"])
def test_random_ops_1m(expandable):
    m = run_random_ops(seed=3, n_ops=1_000_000, expandable=expandable)
    assert m.ops == 1_000_000
