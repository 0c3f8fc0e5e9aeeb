"""The soft limit: the tensor pool's budget kept by the allocator. An allocation that would take
allocated bytes over it asks the pressure handlers for the excess first (with the lock released), then
goes ahead whatever they freed; a handler that had too little is not asked again until re-armed."""

import types
import warnings

import pytest
import torch
from alloc_spec import MiB, rounded
from test_oom import run_with_deadline

from supermem.allocator import CachingAllocator, SimulatedDevice
from supermem.errors import OutOfMemoryError

SOFT = 8 * MiB


@pytest.fixture
def alloc():
    a = CachingAllocator(SimulatedDevice(64 * MiB))
    a.soft_limit_bytes = SOFT
    yield a
    a.check()


def test_an_allocation_over_the_soft_limit_asks_for_the_excess_first(alloc):
    victim = alloc.malloc(6 * MiB)
    asked = []

    def handler(need_bytes):
        asked.append((need_bytes, alloc.stats()["allocated_bytes"]))  # runs unlocked
        alloc.free(victim)
        return rounded(6 * MiB)

    alloc.add_pressure_handler(handler)
    alloc.free(alloc.malloc(MiB))  # under the limit: nobody asked
    assert asked == []
    p = run_with_deadline(lambda: alloc.malloc(4 * MiB))
    assert asked == [(rounded(6 * MiB) + rounded(4 * MiB) - SOFT, rounded(6 * MiB))]
    s = alloc.stats()
    assert s["allocated_bytes"] == rounded(4 * MiB) and s["allocated_bytes_peak"] <= SOFT
    alloc.free(p)


def test_it_goes_ahead_when_the_handlers_free_too_little_and_then_stops_asking(alloc):
    calls = []
    alloc.add_pressure_handler(lambda need_bytes: calls.append(need_bytes) or 0)
    a = alloc.malloc(6 * MiB)
    b = alloc.malloc(6 * MiB)  # over the soft limit: asked once, nothing freed, allocated anyway
    c = alloc.malloc(MiB)  # not asked again: the handlers said they had nothing
    assert len(calls) == 1 and alloc.stats()["allocated_bytes"] == 13 * MiB
    alloc.arm_soft_limit()  # the pool holds something again
    d = alloc.malloc(MiB)
    assert len(calls) == 2
    for p in (a, b, c, d):
        alloc.free(p)


def test_an_allocation_made_by_a_handler_does_not_call_it_again(alloc):
    depth = []

    def handler(need_bytes):
        depth.append(need_bytes)
        alloc.free(alloc.malloc(MiB))  # a handler's own allocation goes ahead
        return 0

    alloc.add_pressure_handler(handler)
    p = alloc.malloc(10 * MiB)
    assert len(depth) == 1
    alloc.free(p)


def test_off_by_default_and_when_zero(alloc):
    calls = []
    alloc.add_pressure_handler(lambda need_bytes: calls.append(need_bytes) or 0)
    alloc.soft_limit_bytes = 0
    alloc.free(alloc.malloc(20 * MiB))
    assert calls == [] and alloc.soft_limit_bytes == 0
    assert CachingAllocator(SimulatedDevice(MiB)).soft_limit_bytes == 0


@pytest.mark.parametrize("bad", [-1, 2**64, "8MiB", 1.5])
def test_bad_soft_limits_are_refused(alloc, bad):
    with pytest.raises((ValueError, TypeError), match="soft_limit_bytes"):
        alloc.soft_limit_bytes = bad
    assert alloc.soft_limit_bytes == SOFT


def test_an_arm_while_the_handlers_run_keeps_the_limit_armed(alloc):
    """The handlers run unlocked: a save on another thread (or a second pool) may re-arm the limit
    before the allocator sees that they freed too little. That arm stands: the pool holds more."""
    calls = []

    def handler(need_bytes):
        calls.append(need_bytes)
        alloc.arm_soft_limit()  # what a save elsewhere does meanwhile
        return 0

    alloc.add_pressure_handler(handler)
    a = alloc.malloc(6 * MiB)
    b = alloc.malloc(6 * MiB)  # over the limit, nothing freed, but armed during the call
    c = alloc.malloc(MiB)
    assert len(calls) == 2
    for p in (a, b, c):
        alloc.free(p)


def test_the_handlers_know_a_soft_limit_call_from_an_out_of_memory_one(alloc):
    seen = []
    alloc.add_pressure_handler(lambda need_bytes: seen.append(alloc.in_soft_limit_call) or 0)
    a = alloc.malloc(6 * MiB)
    b = alloc.malloc(6 * MiB)  # the soft limit's call
    assert seen == [True] and not alloc.in_soft_limit_call
    with pytest.raises(OutOfMemoryError):
        alloc.malloc(60 * MiB)  # more than the device: an out-of-memory call
    assert seen[1:] and not any(seen[1:])
    for p in (a, b):
        alloc.free(p)


def test_two_pools_used_in_turn_each_step_under_its_own_budget(alloc):
    """The soft limit is the budget of the pool entered last: two pools on one device used in turn
    (a benchmark's arms, a model and its evaluation) each keep theirs while entered."""
    from supermem.tensor_pool import Pool

    pools = [Pool(budget=budget) for budget in (40 * MiB, 20 * MiB)]
    for pool in pools:  # (a CPU pool has no allocator: this one's is simulated)
        pool.budget.alloc, pool.budget.pressure_registered = alloc, True
    for pool in pools + pools[::-1]:
        with pool:
            assert alloc.soft_limit_bytes == pool.budget_bytes
    del pools, pool
    import gc

    gc.collect()
    assert alloc.soft_limit_bytes == 0  # the last pool's end leaves no limit behind


class _CudaPoolStub:
    """What Budget reads of a CUDA pool with a budget, on a machine without one."""

    cuda, device, budget_bytes = True, torch.device("cuda", 0), 100 << 20

    def __init__(self, said_infeasible=()):
        self.plans = types.SimpleNamespace(said_infeasible=set(said_infeasible))
        self.clock = types.SimpleNamespace(steps=0)  # steps opened
        self.compiled = types.SimpleNamespace(take_unsettled=lambda: False, warned_unfit=False)  # (none)


@pytest.mark.parametrize("allocator", ["pytorch", "supermem"])
def test_a_step_over_the_budget_is_said_once_unless_the_planner_named_the_floor(monkeypatch, allocator):
    """On a GPU the pool holds the budget where it can act (every save; with supermem's allocator,
    every allocation); a step that still went over it, the planner not having said no plan fits, is
    said once, with why. PyTorch's allocator: its peak counts from the pool's first step."""
    from supermem.tensor_pool.budget import Budget

    high = [0]
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: high[0])
    watermark = types.SimpleNamespace(take_watermark=lambda: high[0])
    monkeypatch.setattr(Budget, "allocator", lambda self: watermark if allocator == "supermem" else None)

    def steps(pool, peaks, before=0):
        """learn_margin at each step's start, after a step that peaked at `peaks[k]`: PyTorch's
        allocator's peak is the most since `before` (the user's own, before the pool's first step)."""
        budget, high[0] = Budget(pool), before
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for peak in peaks:
                high[0] = max(high[0], peak) if allocator == "pytorch" else peak
                budget.learn_margin()
                pool.clock.steps += 1
        return [str(w.message) for w in said]

    MiB = 1 << 20
    assert steps(_CudaPoolStub(), [90 * MiB, 102 * MiB, 100 * MiB]) == []  # within the budget x1.03
    # the user's peak before the pool's first step is not the pool's (supermem's watermark then: the first)
    if allocator == "pytorch":
        assert steps(_CudaPoolStub(), [90 * MiB, 150 * MiB, 102 * MiB], before=150 * MiB) == []
    else:
        assert steps(_CudaPoolStub(), [150 * MiB, 90 * MiB, 102 * MiB]) == []
    said = steps(_CudaPoolStub(), [90 * MiB, 95 * MiB, 180 * MiB, 200 * MiB])
    assert len(said) == 1 and "180.00 MiB" in said[0] and "budget of 100.00 MiB" in said[0], said
    assert ("SUPERMEM=1" in said[0]) == (allocator == "pytorch"), said
    assert steps(_CudaPoolStub(said_infeasible=[(1,)]), [90 * MiB, 180 * MiB]) == []
