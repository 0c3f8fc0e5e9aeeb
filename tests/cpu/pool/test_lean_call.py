"""Lean calls (tensor_pool/lean_call.py): a block the plan keeps but for a few cheap rebuilds (a GELU
output, BatchNorm + ReLU, a weight's autocast copy) runs under hooks of its own, which make no entry.
Training stays bitwise plain PyTorch's, the step stays under its budget, the pool's hook sees none of
the block's saves, and what autograd would raise still raises."""

import gc

import pytest
import torch
import torch.nn as nn
from small_models import same, train_steps

from supermem.tensor_pool import Pool
from supermem.tensor_pool.treatments import Recompute


class GeluBlock(nn.Module):
    """x + fc2(gelu(dropout(fc1(x)))): GELU's output is rebuilt from dropout's, which GELU keeps."""

    def __init__(self, d=64):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(d, 4 * d), nn.Dropout(0.2), nn.Linear(4 * d, d)
        self.h = None  # GELU's input, held when asked (a replay would hold its own, with its graph)
        self.hold = False

    def forward(self, x):
        h = self.drop(self.fc1(x))
        if self.hold:
            self.h = h
        return x + self.fc2(nn.functional.gelu(h))


class BnReluBlock(nn.Module):
    """x + fc2(relu(bn(fc1(x)))): ReLU saves its output, and fc2 saves it again (one tensor, dropped
    once, rebuilt once by BatchNorm + ReLU from fc1's output)."""

    def __init__(self, d=64):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(d, 4 * d), nn.BatchNorm1d(4 * d), nn.ReLU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.f(x)


BLOCKS = {"gelu": GeluBlock, "bn_relu": BnReluBlock}


def build(kind):
    return lambda: nn.Sequential(*[BLOCKS[kind]() for _ in range(6)])


def batch(g):
    return torch.randn(32, 64, generator=g), None


def planned_at(kind, fraction, autocast=False):
    """A Recompute-only planned pool at `fraction` of the block model's peak, and that budget."""
    full = Pool(budget="1GiB", policy="planned")
    train_steps(build(kind), batch, full, 3, autocast)
    budget = int(full.stats()["plan"]["measured_peak_bytes"] * fraction)
    return Pool(budget=budget, policy="planned", treatments=(Recompute(),)), budget


@pytest.mark.parametrize(("kind", "autocast"), [("gelu", False), ("gelu", True), ("bn_relu", False)])
def test_a_block_run_lean_drops_what_its_plan_rebuilds_bitwise_under_budget(kind, autocast):
    ref = train_steps(build(kind), batch, None, 6, autocast)
    pool, budget = planned_at(kind, 0.75, autocast)
    assert same(ref, train_steps(build(kind), batch, pool, 6, autocast))
    s = pool.stats()
    assert s["lean_calls"] > 0 and s["lean_drops"] >= s["lean_calls"], s
    assert s["plan_misses"] == 0 and s["plan"]["feasible"], s
    assert s["plan"]["measured_peak_bytes"] <= budget, s


def test_the_pools_hook_sees_none_of_a_lean_blocks_saves():
    """What a lean call saves goes to its own hooks (the pool's ~25 us a save on this CPU, its own a
    counter and a Kept); the pool's hook sees the first block's (its input comes from outside the
    graph, so it is never run unseen) and the loss's."""
    pool, _ = planned_at("gelu", 0.75)
    packs = []
    pack = pool.pack
    pool.pack = lambda t: packs.append(1) or pack(t)
    torch.manual_seed(0)
    model = build("gelu")()
    x, _ = batch(torch.Generator().manual_seed(1))
    for _ in range(4):
        packs.clear()
        with pool:
            model(x).square().mean().backward()
    s = pool.stats()
    assert s["lean_calls"] > 0, s
    assert 0 < len(packs) < (s["plan"]["keep"] + s["plan"]["recompute"]) / 3, (len(packs), s["plan"])


def test_a_lean_blocks_dropped_tensor_whose_input_changed_in_place_raises_like_pytorch():
    """GELU's output is dropped and rebuilt from dropout's output (which GELU keeps). Changed in place
    before backward, plain PyTorch raises at GELU's backward; the rebuild raises the same error first
    (it would otherwise rebuild from the changed value)."""
    pool, _ = planned_at("gelu", 0.75)
    torch.manual_seed(0)
    model = build("gelu")()
    x, _ = batch(torch.Generator().manual_seed(1))
    for _ in range(4):
        with pool:
            model(x).square().mean().backward()
    assert pool.stats()["lean_drops"] > 0
    model[3].hold = True
    with pool:
        out = model(x).square().mean()
        with torch.no_grad():
            model[3].h.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward()
    del out
    gc.collect()
    with pool:  # and the pool trains on
        model(x).square().mean().backward()


def test_a_plan_whose_calls_cannot_run_lean_is_priced_as_run_through_the_pool(monkeypatch):
    """Where a call the greedy priced lean cannot run lean (here none can), the units it priced so
    would run through the pool at full price: the plan is made again without them, and it is the plan
    of a profile with no lean prices at all."""
    import copy

    from supermem.policies import Planned
    from supermem.tensor_pool import planner

    profiles = []
    real = Planned.solve
    monkeypatch.setattr(
        Planned, "solve", lambda self, p, budget: profiles.append(copy.deepcopy(p)) or real(self, p, budget)
    )
    pool, budget = planned_at("gelu", 0.6)
    train_steps(build("gelu"), batch, pool, 3)
    p = profiles[-1]
    assert p.unit_lean_s and planner.make_plan(p, budget).drops  # lean calls where they can run
    monkeypatch.setattr(planner.greedy, "bypass", lambda *a: {})
    plan = planner.make_plan(p, budget)
    unlean = copy.deepcopy(p)
    unlean.unit_lean_s = {}
    expected = planner.make_plan(unlean, budget)
    assert plan.treatment == expected.treatment and plan.added_s == expected.added_s
