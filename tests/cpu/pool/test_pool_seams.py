"""The pool's seams. Treatments: one added in its own file (stash_treatment.py) and registered is made
by name, chosen by the policies whose kinds include its kind, and carried out by the plan, with
training bitwise plain PyTorch's; nothing else in the pool names it. Solvers: a planning policy
brings its own (Policy.solve), and the pool plans with it."""

import pytest
import torch
import torch.nn as nn
from stash_treatment import Stash

from supermem.tensor_pool import Pool
from supermem.tensor_pool.treatments import Treatment, make_treatments, register
from supermem.units import format_bytes


def _train(pool, steps=5):
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)) for _ in range(4)]
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with pool if pool is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = model(x).square().mean()
            loss.backward()
        out += [loss.detach()] + [p.grad.clone() for p in model.parameters()]
        opt.step()
    return out


def _half_peak():
    probe = Pool(policy="lru", min_bytes=0)
    _train(probe, steps=2)
    return probe.stats()["peak_resident_bytes"] // 2


def test_a_registered_treatment_is_made_by_name_and_listed_when_a_name_is_wrong():
    (t,) = make_treatments(["stash"])
    assert type(t) is Stash
    with pytest.raises(ValueError, match="stash"):
        make_treatments(["stach"])


def test_a_second_class_under_a_registered_name_is_refused():
    class Other(Treatment):
        name = "stash"

    with pytest.raises(ValueError, match="registered already"):
        register(Other)


@pytest.mark.parametrize("policy", ["lru", "cost_aware", "planned"])
def test_the_pool_uses_a_new_treatment_of_the_offload_kind_and_training_is_unchanged(policy):
    ref = _train(None)
    pool = Pool(budget=_half_peak(), policy=policy, min_bytes=0, treatments=("stash",))
    (stash,) = pool.treatments.values()
    got = _train(pool)
    assert all(torch.equal(a, b) for a, b in zip(got, ref)) and len(got) == len(ref)
    assert stash.left > 0 and stash.back > 0, (stash.left, stash.back)
    assert pool.stats()["offloads"] == 0  # (Offload's own counter: it never ran)
    pool.check()


def test_the_plan_carries_out_its_offloads_by_the_treatment_of_that_kind():
    pool = Pool(budget=_half_peak(), policy="planned", min_bytes=0, treatments=("stash",))
    stash = pool.treatments["stash"]
    _train(pool, steps=3)  # (the first step profiles; the plan runs from the second)
    planned = pool.stats()["plan"]["offload"]
    before = stash.left
    _train(pool, steps=1)
    assert planned > 0 and stash.left - before >= planned, (planned, stash.left - before)


def test_a_planning_policy_brings_its_own_solver(monkeypatch):
    from supermem.policies import POLICIES, Planned

    asked = []

    class Cautious(Planned):
        """The greedy, aiming at half the budget it is given."""

        name = "cautious"

        def solve(self, profile, budget):
            asked.append(budget)
            return super().solve(profile, budget // 2)

    monkeypatch.setitem(POLICIES, "cautious", Cautious)
    budget = _half_peak()
    pool = Pool(budget=budget, policy="cautious", min_bytes=0)
    ref = _train(None)
    got = _train(pool)
    assert all(torch.equal(a, b) for a, b in zip(got, ref)) and len(got) == len(ref)
    assert asked and asked[0] == budget, asked
    plan = pool.stats()["plan"]
    assert plan["budget_bytes"] == budget // 2 and plan["measured_peak_bytes"] <= budget // 2, plan


class Watermark:
    """supermem's allocator as the budget reads it: the most allocated since the last take."""

    def __init__(self, high):
        self.high = self.allocated_bytes = high
        self.soft_limit_bytes = None

    def take_watermark(self):
        high, self.high = self.high, self.allocated_bytes
        return high

    def arm_soft_limit(self):
        pass


def test_the_watermark_from_before_the_pools_first_step_is_not_the_steps(monkeypatch):
    """On an H200, three native steps of a ResNet-50 (5.52 GiB) and then a pool at 40% of that: the pool
    read the allocator's watermark since the native steps as its first step's peak, learned a margin
    of the whole budget and warned that the device reached 5.52 GiB under it. The first step's opening
    lets go of the watermark from before it (every pool: SUPERMEM_CONF's is never entered). An exit in
    the middle of a step (a backward after the `with`) and the next entry keep the step's."""
    pool = Pool(budget=1 << 20, policy="lru")
    alloc = Watermark(high=5 << 30)
    pool.budget.alloc = alloc
    alloc.allocated_bytes = 1 << 10  # the native step's tensors are gone; its peak is in the watermark
    pool.budget.watch(+1)
    pool.budget.learn_margin()  # the first step opens
    assert pool.budget.margin == 0 and pool.budget.last_peak_bytes == 0 and not pool.budget.said_over
    pool.clock.steps = 1
    monkeypatch.setattr(pool.clock, "between", lambda: False)  # its backward runs outside the `with`
    pool.budget.watch(-1)
    alloc.high = 3 << 20
    pool.budget.watch(+1)
    pool.budget.learn_margin()  # the next step opens: the last one peaked at 3 MiB
    assert pool.budget.last_peak_bytes == 3 << 20


def test_the_one_over_budget_warning_waits_while_compiled_graphs_compile_toward_the_budget(monkeypatch):
    """GPT-24 compiled whole under a pool at 5.29 GiB: its steps peaked at 11.31 GiB until the pool's
    recompiles (its blocks checkpointed) brought them to 4.89, and the pool's one warning that the device
    went over the budget was spent there, on steps it was acting on. It waits for a step whose graphs
    were not still compiling toward the budget (CompiledGraphs.take_unsettled): a step over the budget
    after that is said. Where the pool said the graphs cannot fit, that warning is the one."""
    import warnings

    def pool_at_its_second_step():
        pool = Pool(budget=1 << 20, policy="lru")
        alloc = Watermark(high=0)
        pool.budget.alloc = alloc
        monkeypatch.setattr(pool, "cuda", True)
        pool.budget.learn_margin()  # the first step opens
        pool.clock.steps = 1
        return pool, alloc

    def over(pool, alloc, high, unsettled=False):
        alloc.high = high
        pool.compiled.unsettled = unsettled  # (what the step's compiled backward's end left)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            pool.budget.learn_margin()  # the next step opens
        return [str(w.message) for w in said if "over its budget" in str(w.message)]

    pool, alloc = pool_at_its_second_step()
    assert over(pool, alloc, 3 << 20, unsettled=True) == []
    (said,) = over(pool, alloc, 2 << 20)
    assert "reached 2.00 MiB" in said and over(pool, alloc, 4 << 20) == []  # (once)
    pool, alloc = pool_at_its_second_step()
    pool.compiled.warned_unfit = True
    assert over(pool, alloc, 3 << 20) == []


def test_a_recorded_steps_own_restores_under_pressure_do_not_raise_the_floor(monkeypatch):
    """On a GPU a recorded step's restore (its reactive fallback bringing an entry back) may cross the
    soft limit and call the pressure handler from inside the pool's own work. That demand is not the
    step's, and the entry's bytes are still counted away: recorded as a point of the curve, it made a
    100 KiB budget infeasible (a floor of 128 KiB) for an MLP whose plan reaches 64 KiB. Here every
    restore calls the handler as supermem's allocator would."""
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)])
    x = torch.randn(64, 256)
    pool = Pool(budget=100 << 10, policy="planned", min_bytes=0, treatments=("offload",))
    come_back = pool.come_back

    def pressed_come_back(entry):
        if pool.plans.rec is not None and pool.plans.rec.full:
            pool.on_pressure(entry.nbytes)  # room for the restore's own bytes, asked of the handler
        return come_back(entry)

    monkeypatch.setattr(pool, "come_back", pressed_come_back)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            with pool:
                model(x).sum().backward()
    plan = pool.plans.plan
    assert plan.feasible and plan.predicted_peak_bytes <= 100 << 10, plan.predicted_peak_bytes


@pytest.mark.parametrize(
    "policy, treatments, stuck", [("cost_aware", ["compress"], True), ("lru", None, False)]
)
def test_where_nothing_more_could_leave_is_named_as_the_policys_floor(policy, treatments, stuck):
    """A GELU MLP gives compression nothing to take: the step runs over its budget, every choice taken,
    and the over-budget warning says at how many bytes nothing more could leave. lru copies whatever it
    must and never gets stuck: no floor to name."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)])
    x = torch.randn(32, 64)
    pool = Pool(budget="4KiB", policy=policy, treatments=treatments, min_bytes=0)
    for _ in range(2):
        with pool:
            model(x).square().mean().backward()
    said = pool.budget.floor_said()
    if stuck:
        peak = pool.stats()["peak_resident_bytes"]
        assert 4096 < pool.budget.stuck_bytes <= peak
        assert f"at {format_bytes(pool.budget.stuck_bytes)}:" in said and "cannot go below" in said
    else:
        assert pool.budget.stuck_bytes == 0 and said == ""
