"""Seeded random op streams over malloc / free / record_stream / held events / empty_cache / limit
changes / graph-pool captures, checked against the model in fuzz_model after every op (cookies,
disjointness, stats, device accounting, the invariant walker). The default run is 120k ops; the
slow one (--slow) 10^6."""

import pytest
from fuzz_model import run_random_ops


def test_random_ops_100k():
    m = run_random_ops(seed=1, n_ops=100_000)
    assert m.ops == 100_000
    assert m.ooms > 0 and m.syncs > 0 and m.pool_serial > 0  # the stream reached OOM, syncs and pools


def test_random_ops_passthrough_20k():
    m = run_random_ops(seed=2, n_ops=20_000, passthrough=True)
    assert m.ops == 20_000


@pytest.mark.slow
def test_random_ops_1m():
    m = run_random_ops(seed=3, n_ops=1_000_000)
    assert m.ops == 1_000_000
