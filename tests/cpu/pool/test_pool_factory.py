"""supermem.pool(...): one pool however its options are spelled, a repr that says what it is, and a
close() that takes its hooks off and lets the factory forget it."""

import torch
import torch.nn as nn

import supermem
from supermem import tensor_pool


def test_one_pool_however_the_options_are_spelled():
    by_bytes = supermem.pool(budget=3 << 20)
    try:
        assert supermem.pool(budget="3MiB") is by_bytes
        assert supermem.pool(budget="3 MiB") is by_bytes
        assert supermem.pool(budget=3 << 20, policy="planned") is by_bytes  # planned: a budget's default
        assert supermem.pool(budget="3MiB", host_limit=None) is by_bytes  # None: the default 50%
        assert supermem.pool(budget="3MiB", device="cpu", min_bytes=0, graphs=True) is by_bytes
        assert supermem.pool(budget="3MiB", treatments="offload, recompute") is by_bytes
        assert supermem.pool(budget="3MiB", policy="lru") is not by_bytes
        assert supermem.pool(budget="4MiB") is not by_bytes
        assert supermem.pool(policy="cost_aware") is supermem.pool()  # cost_aware: no budget's default
    finally:
        for p in {*tensor_pool.factory._pools.values()}:
            if p.budget_bytes in (3 << 20, 4 << 20):
                p.close()


def test_repr_says_policy_budget_device_and_steps():
    p = supermem.pool(budget="5MiB", policy="lru")
    try:
        text = repr(p)
        assert "policy=lru" in text and "budget=5.00 MiB" in text and "device=cpu" in text, text
        assert "steps=0" in text, text
        assert "budget=none" in repr(tensor_pool.Pool())
    finally:
        p.close()


def test_close_takes_the_hooks_off_and_the_factory_forgets_it():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())

    def hooks():
        module = torch.nn.modules.module
        on_modules = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
        return on_modules + len(module._global_forward_pre_hooks) + len(module._global_forward_hooks)

    with supermem.pool(budget="6MiB") as p:
        assert isinstance(p, tensor_pool.Pool)
        model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    assert hooks() > 0  # the regions a planned pool chose from its first step
    p.close()
    assert hooks() == 0
    fresh = supermem.pool(budget="6MiB")
    assert fresh is not p and p not in tensor_pool.factory._pools.values()
    with fresh:  # profiling: the global hooks are on until the backward
        assert hooks() > 0
        fresh.close()
    assert hooks() == 0
