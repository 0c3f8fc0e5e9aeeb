"""The pool's work is named in torch.profiler's traces: a user profiling a step sees where its time
went (supermem::pack, supermem::unpack, supermem::<treatment>, supermem::<treatment>.restore,
supermem::plan); with SUPERMEM_NVTX=1 a CUDA pool names the same work in NVTX ranges (Nsight Systems)."""

import pytest
import torch
import torch.nn as nn

from supermem.tensor_pool import Pool


def _steps(pool, steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)) for _ in "abcd"])
    x = torch.randn(32, 64)
    for _ in range(steps):
        with pool:
            model(x).square().mean().backward()


def _names(pool, steps=3):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _steps(pool, steps)
    return {e.key for e in prof.key_averages()}


@pytest.fixture
def nvtx_calls(monkeypatch):
    """torch.cuda.nvtx's push and pop, recorded instead of sent (this build may have no CUDA): the
    depth after each call, so that a pop without its push shows as a depth below 0."""
    calls = []

    def push(name):
        calls.append((name, sum(1 if n else -1 for n, _ in calls) + 1))

    def pop():
        calls.append((None, sum(1 if n else -1 for n, _ in calls) - 1))

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", push)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", pop)
    return calls


def _nvtx_pool(monkeypatch, policy, treatments):
    """A CPU pool that takes itself for a CUDA pool made with SUPERMEM_NVTX=1."""
    from supermem.tensor_pool import labels

    monkeypatch.setenv(labels.NVTX_ENV, "1")
    pool = Pool(budget=16 << 10, policy=policy, min_bytes=0, treatments=treatments)
    assert pool.nvtx is False  # NVTX is for CUDA pools
    pool.nvtx = labels.nvtx_wanted(cuda=True)
    return pool


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


def test_no_range_is_made_without_a_profiler(monkeypatch, nvtx_calls):
    made = []
    monkeypatch.setattr(torch.profiler, "record_function", lambda *a: made.append(a))
    from supermem.tensor_pool import labels

    monkeypatch.setattr(labels, "record_function", lambda *a: made.append(a))
    pool = Pool(budget=16 << 10, policy="lru", min_bytes=0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    with pool:
        model(torch.randn(32, 64)).square().mean().backward()
    assert pool.stats()["offloads"] > 0 and made == [] and nvtx_calls == []


@pytest.mark.parametrize(
    "policy, treatments, expected",
    [
        ("lru", ("offload",), {"supermem::offload", "supermem::offload.restore"}),
        ("cost_aware", ("recompute",), {"supermem::recompute", "supermem::recompute.restore"}),
        ("planned", ("offload",), {"supermem::plan", "supermem::offload", "supermem::offload.restore"}),
    ],
)
def test_supermem_nvtx_names_the_same_work_in_nvtx_ranges(
    monkeypatch, nvtx_calls, policy, treatments, expected
):
    pool = _nvtx_pool(monkeypatch, policy, treatments)
    _steps(pool)
    names = {n for n, _ in nvtx_calls if n}
    assert {"supermem::pack", "supermem::unpack"} | expected <= names, sorted(names)
    depths = [d for _, d in nvtx_calls]
    assert min(depths) >= 0 and depths[-1] == 0  # every push popped, never a pop too many
    assert sum(1 for n, _ in nvtx_calls if n) == sum(1 for n, _ in nvtx_calls if n is None)


def test_while_a_profiler_records_its_ranges_are_made_not_nvtx_ones(monkeypatch, nvtx_calls):
    pool = _nvtx_pool(monkeypatch, "lru", ("offload",))
    names = _names(pool)
    assert {"supermem::pack", "supermem::offload"} <= names and nvtx_calls == []


def test_nvtx_is_wanted_for_a_cuda_pool_with_supermem_nvtx_set_only(monkeypatch):
    from supermem.tensor_pool.labels import NVTX_ENV, nvtx_wanted

    monkeypatch.delenv(NVTX_ENV, raising=False)
    assert not nvtx_wanted(cuda=True)
    for value, wanted in (("1", True), ("on", True), ("0", False), ("", False)):
        monkeypatch.setenv(NVTX_ENV, value)
        assert nvtx_wanted(cuda=True) is wanted and not nvtx_wanted(cuda=False)
