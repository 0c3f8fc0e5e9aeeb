"""`report --budget` plans as the live pool does: the trace's step becomes the planner's profile with the
module calls the pool would replay as its recompute units (trace/step_profile.py), so a budget the
pool meets by replaying whole blocks is predicted at the plan's simulated peak, below the budget, not at
it. Checked on a model of residual blocks against the recording's own bytes and against a live pool
planning the same step."""

import collections
import copy

import pytest
import torch
import torch.nn as nn
from owners_workload import train_traced

from supermem import costs
from supermem.tensor_pool import Pool
from supermem.tensor_pool.planner import make_plan
from supermem.tensor_pool.treatments import Recompute
from supermem.trace import format as fmt
from supermem.trace.context import CALLS_EVERY
from supermem.trace.cpu_source import ProfiledCPU
from supermem.trace.loader import load
from supermem.trace.phases import CALL_ACTION, OUTPUT_ACTION, RETURN_ACTION
from supermem.trace.step_profile import _step_starts, last_step, module_calls, step_period_s, step_profile
from supermem.trace.whatif import summary, what_if

D, ROWS, BLOCKS = 64, 2048, 6
HIDDEN_BYTES = ROWS * 4 * D * 4  # fc1's output, and SiLU's: each block saves both
RESIDUAL_BYTES = ROWS * D * 4  # a block's input and output


class Block(nn.Module):
    """fc1, SiLU, fc2 and the residual: no op the pool replays alone (op_replay.py), so a block's saves
    come back by replaying the block."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.fc2(nn.functional.silu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(D))
        self.blocks = nn.Sequential(*[Block() for _ in range(BLOCKS)])

    def forward(self, x):
        return self.blocks(x + self.shift)


def _build():
    return Net(), lambda g: torch.randn(ROWS, D, generator=g), lambda m, x: m(x).square().mean()


def _sgd(params):
    return torch.optim.SGD(params, lr=1e-3)


@pytest.fixture(scope="module")
def trace():
    return train_traced(_build, "cpu", [ProfiledCPU()], steps=3, optimizer=_sgd)[0]


def test_a_recording_holds_each_forward_call_with_its_input_and_outputs(trace, tmp_path):
    path = tmp_path / "blocks.smtrace"
    fmt.write(trace, path)
    (root,) = module_calls(load(path), *last_step(trace))
    assert root.module == "Net"
    (seq,) = root.children
    blocks = seq.children
    assert [b.module for b in blocks] == [f"blocks.{k}" for k in range(BLOCKS)]
    for k, b in enumerate(blocks):
        assert [c.module for c in b.children] == [f"blocks.{k}.fc1", f"blocks.{k}.fc2"]
        assert root.start_ns <= b.start_ns < b.end_ns <= root.end_ns
        assert len(b.output_ptrs) == 1 and b.held is None
        if k:  # each block reads what the one before it returned
            assert b.input_ptr == blocks[k - 1].output_ptrs[0]
    assert seq.output_ptrs == blocks[-1].output_ptrs


def test_module_calls_are_recorded_on_sampled_steps_and_the_profile_takes_the_last_of_them():
    """A recording keeps the forward's module calls on its first 3 steps and every CALLS_EVERY-th after
    (steps 10, 18, ...): of 12 steps, 0-2 and 10. The profile is step 10's, its units the blocks; its
    period is from step 9's forward to step 10's."""
    assert CALLS_EVERY == 8
    trace = train_traced(_build, "cpu", [ProfiledCPU()], steps=12, optimizer=_sgd)[0]
    windows = _step_starts(trace)
    assert len(windows) == 12
    with_calls = [k for k, w in enumerate(windows) if module_calls(trace, *w)]
    assert with_calls == [0, 1, 2, 10]
    assert last_step(trace) == windows[10]
    assert step_period_s(trace) == (windows[10][0] - windows[9][0]) / 1e9
    made = step_profile(trace, 0)
    assert [made.unit_calls[u].module for u in sorted(made.profile.unit_cost_s)] == [
        f"blocks.{k}" for k in range(BLOCKS)
    ]


def test_the_profiles_units_are_the_blocks(trace):
    """Each block is a unit, as the live pool chooses its regions (MAX_SHARE of the step's saves: the
    blocks, not the model): its members fc1's and SiLU's outputs, its input the block before's
    output, which is no member of that block (the replay of the next one reads it)."""
    made = step_profile(trace, 0)
    p = made.profile
    paths = [made.unit_calls[u].module for u in sorted(p.unit_cost_s)]
    assert paths == [f"blocks.{k}" for k in range(BLOCKS)]
    by = {s.ordinal: s for s in p.saved}
    for u in p.unit_cost_s:
        assert sorted(s.nbytes for s in p.saved if s.unit == u) == [HIDDEN_BYTES, HIDDEN_BYTES]
        (read,) = p.unit_inputs[u]
        assert by[read].nbytes == RESIDUAL_BYTES and by[read].unit is None
        assert by[read].save < p.unit_ready[u] <= min(s.use for s in p.saved if s.unit == u)
        assert 0 < p.unit_cost_s[u] < p.step_s


def test_the_what_if_replays_whole_blocks_and_lands_below_the_budget(trace, monkeypatch):
    """Copies made dear (0.2 GB/s, both ways blocking: ~40 ms a block's saves), the plan at half the
    step's peak replays whole blocks, and its peak is the recording's bytes less the replayed blocks'
    members from each block's end to its replay: below the budget (a block frees 4 MiB at once), where
    a plan of copies alone had landed at it."""
    monkeypatch.setattr(costs, "CPU_COPY_BYTES_PER_S", 0.2e9)
    made = step_profile(trace, 0)
    p = made.profile
    budget = made.step_peak // 2
    w = what_if(trace, budget)
    assert w.fits, summary(w)
    assert w.recomputed_calls and set(w.recomputed_calls) <= {f"blocks.{k}" for k in range(BLOCKS)}
    assert not any(r["offload_bytes"] for r in w.by_module)
    rebuilt = sum(r["recompute_bytes"] for r in w.by_module)
    assert rebuilt == 2 * HIDDEN_BYTES * len(w.recomputed_calls)
    assert f"{len(w.recomputed_calls)} module calls replayed" in summary(w)
    # the curve, by hand: each replayed block's members off from its end to the first use of one
    units = [u for u, x in made.unit_calls.items() if x.module in w.recomputed_calls]
    away = [0] * len(p.base_bytes)
    for u in units:
        members = [s for s in p.saved if s.unit == u]
        for i in range(p.unit_ready[u], min(s.use for s in members)):
            away[i] += sum(s.nbytes for s in members)
    curve = [b + t - a for b, t, a in zip(p.base_bytes, p.transient_bytes, away)]
    assert w.predicted_peak_bytes == max(max(curve), w.floor_bytes)
    assert w.predicted_peak_bytes < budget
    assert w.predicted_step_s > w.measured_step_s


def test_a_trace_without_module_calls_plans_copies_alone(trace):
    bare = copy.copy(trace)
    keep = ~trace.action_mask(CALL_ACTION, RETURN_ACTION, OUTPUT_ACTION)
    bare.cols = {k: v[keep] for k, v in trace.cols.items()}
    w = what_if(bare, step_profile(bare, 0).step_peak // 2)
    assert not w.recomputed_calls and not any(r["recompute_bytes"] for r in w.by_module)
    assert any("no module calls" in n for n in w.notes)


def _saves_only(p):
    """The profile as a pool on CPU counts a step: its saved tensors' bytes alone (no parameters,
    gradients or temporaries), none of them copied (the pool below has no offload)."""
    p = copy.deepcopy(p)
    diff = [0] * (len(p.base_bytes) + 1)
    for s in p.saved:
        diff[s.save] += s.nbytes
        diff[s.end] -= s.nbytes
        s.offloadable = False
    running, base = 0, []
    for d in diff[:-1]:
        running += d
        base.append(running)
    p.base_bytes, p.transient_bytes = base, [0] * len(base)
    return p


def _trained_under_a_pool(build, budget):
    """A planned pool at `budget` that may only recompute (whatever this machine's copy timings), after
    six SGD steps of `build()` under it."""
    torch.manual_seed(0)
    model, batch, loss_of = build()
    x = batch(torch.Generator().manual_seed(1))
    opt = _sgd(model.parameters())
    pool = Pool(budget=budget, policy="planned", treatments=(Recompute(),))
    for _ in range(6):
        opt.zero_grad()
        with pool:
            loss_of(model, x).backward()
        opt.step()
    return pool


def test_the_what_if_plans_the_step_as_a_live_pool_at_that_budget(trace):
    """A pool on CPU counts its own saved tensors, so the two are compared on that count: the trace's
    step with its saves alone, against a live pool (recompute only: both plans free bytes by replaying
    blocks, whatever this machine's timings) at half of it. The same units, members and inputs, the
    same number of blocks replayed and the same predicted peak. The pool's own count of its planned
    step is lower still: it leaves out the inputs its light calls hold (a block's 0.5 MiB)."""
    traced = _saves_only(step_profile(trace, 0).profile)
    budget = max(traced.base_bytes) // 2
    pool = _trained_under_a_pool(_build, budget)
    (live,) = pool.plans.profiles.values()
    assert max(live.base_bytes) == max(traced.base_bytes)  # the same saves, the batch's shift included

    def units(p):
        by = {s.ordinal: s for s in p.saved}
        return sorted(
            (sum(s.nbytes for s in p.saved if s.unit == u), tuple(by[o].nbytes for o in p.unit_inputs[u]))
            for u in p.unit_cost_s
        )

    assert units(traced) == units(live)
    plan, ran = make_plan(traced, budget), pool.plans.plan
    assert plan.feasible and ran.feasible
    assert plan.counts()["recompute"] == ran.counts()["recompute"] > 0
    assert abs(plan.predicted_peak_bytes - ran.predicted_peak_bytes) <= 0.05 * ran.predicted_peak_bytes
    measured = pool.stats()["plan"]["measured_peak_bytes"]
    assert measured <= plan.predicted_peak_bytes <= budget


def _small_resnet(size):
    from small_models import ResNet

    def batch(g):
        return torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)

    return ResNet(8, 4), batch, lambda m, x: nn.functional.cross_entropy(m(x[0]), x[1])


# The trace weighs a call by the activation blocks allocated in it, the pool by the bytes saved in
# it: a tiny Llama layer's grouped-query attention saves views and expanded keys the trace counts once,
# so its layers hold 26.6% of the trace's bytes (split: over MAX_SHARE, 25%) and 24.8% of the pool's
# (chosen).
LLAMA_SHARES = pytest.mark.xfail(strict=True, reason="the trace counts a Llama layer's bytes otherwise")


@pytest.mark.parametrize("name", ["gpt2", pytest.param("llama", marks=LLAMA_SHARES), "resnet"])
def test_the_calls_a_trace_replays_are_the_live_pools_regions(name):
    """The live pool's regions on these models: a Hugging Face decoder layer, replayed on a copy of the
    KV cache its training forward builds (tensor_pool/held.py); an embedding's output is saved by the
    first layer, no save of the embedding's call. The trace's units are the same calls."""
    from corpus import CASES

    build = _small_resnet if name == "resnet" else CASES[name]
    made = step_profile(train_traced(lambda: build("tiny"), "cpu", [ProfiledCPU()], steps=3)[0], 0)
    traced = {x.module for x in made.unit_calls.values()}
    torch.manual_seed(0)
    model, batch, loss_of = build("tiny")
    x = batch(torch.Generator().manual_seed(1))
    pool = Pool(budget=1 << 20, policy="planned")
    with pool:
        loss_of(model, x).backward()
    paths = {id(m): path or type(m).__name__ for path, m in model.named_modules()}
    live = {paths[id(m)] for m in pool.regions.modules}
    assert traced == live and len(live) > 3


def _deep_resnet():
    """Sixteen blocks: one BatchNorm's output is 2% of the step's saves, so plans that differ by a unit
    (this machine's timings, which move under load) land within 5% of each other."""
    from small_models import ResNet

    def batch(g):
        return torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)

    return ResNet(16, 16), batch, lambda m, x: nn.functional.cross_entropy(m(x[0]), x[1])


def _unit_kinds(p):
    """A profile's recompute units in the order of their first save: an op replay (one member) by the
    bytes it reads, a call by its name."""
    first: dict[int, int] = {}
    for s in p.saved:
        if s.unit in p.unit_cost_s:
            first[s.unit] = min(first.get(s.unit, s.save), s.save)
    by = {s.ordinal: s for s in p.saved}
    ones = collections.Counter(s.unit for s in p.saved)
    order = sorted(first, key=first.get)
    return [tuple(by[o].nbytes for o in p.unit_inputs[u]) if ones[u] == 1 else "call" for u in order]


def test_a_batchnorm_call_is_a_unit_of_its_own_as_the_live_pools_op_replays():
    """A BatchNorm's call rebuilds the tensor it returned (its in-place ReLU's output) from its input,
    conv's output; a block's last one also reads the block's input (the residual summed into it in
    place), which the block before's last one rebuilds, as the live pool's op replays read it. The
    trace's units are the live pool's, one for one; at 75% of the step's saves, recompute only, the
    what-if then predicts the live pool's planned peak within 5%, replaying BatchNorms. Without module
    types (a trace by an older supermem) it has whole blocks alone."""
    trace = train_traced(_deep_resnet, "cpu", [ProfiledCPU()], steps=3)[0]
    made = step_profile(trace, 0)
    p = made.profile
    types = trace.meta["module_types"]
    ops = {made.op_calls[u].module: u for u in made.op_calls}
    assert {types[m] for m in ops} == {"BatchNorm2d"}
    assert {f"blocks.{k}.b{i}" for k in range(16) for i in (1, 2)} <= set(ops)
    by = {s.ordinal: s for s in p.saved}
    for m, u in ops.items():
        (member,) = [s for s in p.saved if s.unit == u]
        reads = p.unit_inputs[u]
        assert [by[o].nbytes for o in reads] == [member.nbytes] * (2 if m.endswith(".b2") else 1)
        assert all(by[o].save < member.save for o in reads)

    traced = _saves_only(p)
    budget = int(0.75 * max(traced.base_bytes))
    pool = _trained_under_a_pool(_deep_resnet, budget)
    (live,) = pool.plans.profiles.values()
    assert _unit_kinds(traced) == _unit_kinds(live)
    ran = pool.plans.plan
    plan = make_plan(traced, budget)
    assert plan.feasible and ran.feasible
    assert any(plan.treatment.get(s.ordinal) == "recompute" for s in p.saved if s.unit in made.op_calls)
    assert abs(plan.predicted_peak_bytes - ran.predicted_peak_bytes) <= 0.05 * ran.predicted_peak_bytes

    older = copy.copy(trace)
    older.meta = {k: v for k, v in trace.meta.items() if k != "module_types"}
    coarse = step_profile(older, 0)
    assert not coarse.op_calls
    assert set(_unit_kinds(_saves_only(coarse.profile))) == {"call"}
