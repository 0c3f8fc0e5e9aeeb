"""The pool's work is named in torch.profiler's traces: a user profiling a step sees where its time
went (supermem::pack, supermem::unpack, supermem::<treatment>, supermem::<treatment>.restore,
supermem::plan)."""

import pytest
import torch
import torch.nn as nn

from supermem.tensor_pool import Pool


def _names(pool, steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)) for _ in "abcd"])
    x = torch.randn(32, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with pool:
                model(x).square().mean().backward()
    return {e.key for e in prof.key_averages()}


@pytest.mark.parametrize(
    "policy, treatments, expected",
    [
        ("lru", ("offload",), {"supermem::offload", "supermem::offload.restore"}),
        ("cost_aware", ("recompute",), {"supermem::recompute", "supermem::recompute.restore"}),
        ("planned", ("offload",), {"supermem::plan", "supermem::offload", "supermem::offload.restore"}),
    ],
)
def test_the_pools_work_is_named_in_a_profiler_trace(policy, treatments, expected):
    pool = Pool(budget=16 << 10, policy=policy, min_bytes=0, treatments=treatments)
    names = _names(pool)
    assert {"supermem::pack", "supermem::unpack"} | expected <= names, sorted(
        n for n in names if "supermem" in n
    )


def test_no_range_is_made_without_a_profiler(monkeypatch):
    made = []
    monkeypatch.setattr(torch.profiler, "record_function", lambda *a: made.append(a))
    from supermem.tensor_pool import labels

    monkeypatch.setattr(labels, "record_function", lambda *a: made.append(a))
    pool = Pool(budget=16 << 10, policy="lru", min_bytes=0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    with pool:
        model(torch.randn(32, 64)).square().mean().backward()
    assert pool.stats()["offloads"] > 0 and made == []
