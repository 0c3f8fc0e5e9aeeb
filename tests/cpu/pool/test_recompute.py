"""Recomputation in the tensor pool on CPU: training under every policy, at tiny and large budgets, is
bitwise plain PyTorch's on MLPs, a small GPT with dropout (RNG replay), a small ResNet (BatchNorm,
in-place ReLU), shared weights and autocast; regions really are dropped and replayed; misuse raises."""

import functools
import gc
import sys
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from small_models import ResNet, hide_entry_unpacks, restless, same, train_steps

from supermem.bench.models import GPT
from supermem.errors import ConfigError
from supermem.policies import POLICIES, live_names
from supermem.tensor_pool import Pool


class MLP(nn.Sequential):
    def __init__(self, d=64, layers=4):
        super().__init__(
            *[nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d), nn.Tanh()) for _ in range(layers)]
        )


class Shared(nn.Module):
    """One layer applied three times (a region module called more than once per step)."""

    def __init__(self, d=64):
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(d, d), nn.GELU())
        self.out = nn.Linear(d, d)

    def forward(self, x):
        for _ in range(3):
            x = self.layer(x) + x
        return self.out(x)


def small_gpt():
    return GPT(layers=3, d=32, heads=2, vocab=64, ctx=16, dropout=0.1)


CASES = {
    "mlp": (MLP, lambda g: (torch.randn(32, 64, generator=g), None)),
    "gpt": (small_gpt, lambda g: tuple(torch.randint(0, 64, (4, 16), generator=g) for _ in range(2))),
    "resnet": (
        ResNet,
        lambda g: (torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)),
    ),
    "shared": (Shared, lambda g: (torch.randn(32, 64, generator=g), None)),
}


def train(case, pool=None, steps=4, autocast=False):
    build, batch = CASES[case]
    return train_steps(build, batch, pool, steps, autocast)


def slow_link(pool, bytes_per_s=1e3):
    """Prices copies as over a slow link, so cost_aware recomputes whatever it can (the costs a CPU
    measures make offload and recompute about even; this takes chance out of which runs)."""
    pool.treatments["offload"].link_bytes_per_s = bytes_per_s
    return pool


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("policy", live_names())
@pytest.mark.parametrize("budget", [0, "64KiB", "1GiB"])
def test_training_is_bitwise_plain_pytorch(case, policy, budget):
    ref = train(case)
    pool = Pool(budget=budget, policy=policy, host_limit="256MiB")
    if budget == 0:
        slow_link(pool)  # both treatments run: recompute where the copy is dearer
    got = train(case, pool)
    assert same(ref, got)
    s = pool.stats()
    assert s["tracked_bytes"] == 0
    if budget == "1GiB":
        assert s["offloads"] == 0 and s["dropped"] == 0
    elif policy == "cost_aware" and budget == 0:
        assert s["regions"] > 0 and s["dropped"] > 0 and s["recomputes"] > 0, s
    elif policy == "lru" and budget == 0:
        assert s["dropped"] == 0 and s["offloads"] > 0
    if policy == "planned" and budget == 0:  # steps 3 and 4 ran a plan; copies priced dear: it recomputes
        assert s["plans"] == 1 and s["plan"]["recompute"] > 0, s
    if policy == "planned" and budget == "64KiB" and s["plan"]["feasible"]:
        assert s["plan"]["measured_peak_bytes"] <= 64 << 10, s


@pytest.mark.parametrize("policy", live_names())
def test_autocast_weight_copies_are_rebuilt_not_offloaded(policy):
    ref = train("mlp", autocast=True, steps=2)
    pool = Pool(budget=0, policy=policy, host_limit="256MiB")
    got = train("mlp", pool, autocast=True, steps=2)
    assert same(ref, got)
    # bf16 weight copies (64x64x2 bytes each) never cross to host: only activations (32x64, bf16) do.
    assert pool.stats()["offloaded_bytes"] % (32 * 64 * 2) == 0


def test_cost_aware_weighs_the_copy_against_the_replay():
    slow = slow_link(Pool(budget=0, policy="cost_aware", host_limit="256MiB"))
    train("mlp", slow, steps=3)
    s = slow.stats()
    assert s["dropped_bytes"] > 0 and s["recomputes"] > 0
    fast = slow_link(Pool(budget=0, policy="cost_aware", host_limit="256MiB"), 1e15)
    train("mlp", fast, steps=3)
    s = fast.stats()
    assert s["dropped_bytes"] == 0 and s["offloads"] > 0


def test_replay_restores_batchnorm_statistics_exactly():
    pool = slow_link(Pool(budget=0, policy="cost_aware", host_limit="256MiB"))
    ref = train("resnet", steps=3)
    got = train("resnet", pool, steps=3)
    assert pool.stats()["recomputes"] > 0
    assert same(ref, got)  # running_mean/var and num_batches_tracked included


def test_region_that_changes_its_input_in_place_is_not_replayed():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            h = x.exp()  # saves its result, not x
            x.mul_(0.5)  # its input, changed in place: a replay would start from the halved value
            return torch.sigmoid(self.lin(h))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = nn.Linear(64, 64)
            self.bad = nn.ModuleList(Bad() for _ in range(4))

        def forward(self, x):
            h = self.pre(x)
            for b in self.bad:
                h = b(h * 1)
            return h

    x = torch.randn(16, 64)

    def grads(pool):
        torch.manual_seed(0)
        net = Net()
        for _ in range(3):
            net.zero_grad()
            with (
                pool
                if pool is not None
                else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
            ):
                net(x).sum().backward()
        return [p.grad for p in net.parameters()]

    pool = slow_link(Pool(budget=0, policy="cost_aware", host_limit="64MiB"))
    assert same(grads(None), grads(pool))
    assert pool.stats()["recomputes"] == 0


def test_retain_graph_and_double_backward_under_recompute():
    pool = slow_link(Pool(budget=0, policy="cost_aware", host_limit="64MiB"))
    model = MLP(layers=3)
    x = torch.randn(16, 64, requires_grad=True)
    for _ in range(2):  # the first step profiles; the second drops and replays
        with pool:
            loss = model(x).square().sum()
            (g,) = torch.autograd.grad(loss, x, create_graph=True, retain_graph=True)
            (gg,) = torch.autograd.grad(g.square().sum(), x, retain_graph=True)
            (g_again,) = torch.autograd.grad(loss, x)
    xr = x.detach().requires_grad_()
    lr = model(xr).square().sum()
    (gr,) = torch.autograd.grad(lr, xr, create_graph=True, retain_graph=True)
    assert torch.equal(g, gr) and torch.equal(g_again, gr)
    assert torch.equal(gg, torch.autograd.grad(gr.square().sum(), xr)[0])
    assert pool.stats()["recomputes"] > 0


def test_exception_mid_step_leaves_nothing_behind():
    pool = slow_link(Pool(budget=0, policy="cost_aware", host_limit="64MiB"))
    train("mlp", pool, steps=2)
    model = MLP()
    with pytest.raises(RuntimeError, match="boom"), pool:
        model(torch.randn(8, 64)).sum()
        raise RuntimeError("boom")
    gc.collect()
    assert pool.stats()["tracked_bytes"] == 0
    assert pool.host.in_use_bytes == 0
    assert pool.regions.top() is None
    pool.check()
    assert same(train("mlp"), train("mlp", pool))


def test_two_models_interleaved_backwards():
    pool = slow_link(Pool(budget=0, policy="cost_aware", host_limit="64MiB"))
    torch.manual_seed(0)
    a, b = MLP(layers=2), MLP(layers=3)
    xs = [torch.randn(8, 64) for _ in range(2)]
    for _ in range(2):
        a.zero_grad(), b.zero_grad()
        with pool:
            la, lb = a(xs[0]).sum(), b(xs[1]).sum()
            lb.backward()
            la.backward()
    got = [p.grad.clone() for p in list(a.parameters()) + list(b.parameters())]
    a.zero_grad(), b.zero_grad()
    a(xs[0]).sum().backward()
    b(xs[1]).sum().backward()
    assert same(got, [p.grad for p in list(a.parameters()) + list(b.parameters())])
    assert pool.stats()["recomputes"] > 0


def test_bad_policy_names_the_known_ones():
    with pytest.raises(ConfigError) as info:
        Pool(policy="fifo")
    for name in live_names():
        assert name in str(info.value)
    assert "planned" in POLICIES and "planned" in live_names()  # live, and Belady in replay


def test_one_registry_for_pool_config_and_replay():
    from supermem import config
    from supermem.trace.replay import POLICIES as REPLAY

    assert set(REPLAY) == {"none", *POLICIES}
    for name in live_names():
        assert config.parse_conf(f"pool:{name}")["pool"] == name
    with pytest.raises(ConfigError) as info:
        config.parse_conf("pool:fifo")
    assert all(name in str(info.value) for name in live_names())


def test_checkpoint_inside_a_region_and_a_64kib_budget():
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x):
            h = checkpoint(lambda y: torch.tanh(self.a(y)), x, use_reentrant=False)
            return torch.sigmoid(self.b(F.gelu(h)))

    class Net(nn.Sequential):
        def __init__(self):
            super().__init__(*[Block() for _ in range(4)])

    CASES["ckpt"] = (Net, lambda g: (torch.randn(64, 64, generator=g), None))
    try:
        ref = train("ckpt")
        for budget in ("64KiB", 0):
            pool = slow_link(Pool(budget=budget, policy="cost_aware", host_limit="64MiB"))
            assert same(ref, train("ckpt", pool))
            assert pool.stats()["recomputes"] > 0
    finally:
        del CASES["ckpt"]


def test_inplace_change_of_a_recomputed_tensor_raises_like_pytorch():
    """The region's output, saved by its own tanh, is changed after the call: plain autograd raises;
    so must the pool, even though a replay would rebuild the saved value."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4))

        def forward(self, x, change):
            for b in self.blocks:
                x = b(x)
            if change:
                x.add_(1)
            return x.sum()

    torch.manual_seed(0)
    net, x = Net(), torch.randn(16, 64)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as plain:
        net(x, True).backward()
    pool = slow_link(Pool(budget=0, policy="cost_aware", host_limit="64MiB"))
    for _ in range(2):
        with pool:
            net(x, False).backward()
    assert pool.stats()["recomputes"] > 0  # the regions are live
    with pool, pytest.raises(RuntimeError, match="modified by an inplace operation") as got:
        net(x, True).backward()
    assert "is at version 1; expected version 0" in str(got.value)
    assert "is at version 1; expected version 0" in str(plain.value)


def test_no_region_work_per_step_at_an_unneeded_budget(monkeypatch):
    """Regions are captured on the first two steps only while nothing needs to leave the device."""
    from supermem.tensor_pool import region

    made = []
    init = region.Region.__init__

    def counting(self, *args, **kwargs):
        made.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(region.Region, "__init__", counting)

    def regions_per_step(pool, steps=5):
        torch.manual_seed(0)
        model, x = MLP(), torch.randn(32, 64)
        counts = []
        for _ in range(steps):
            made.clear()
            with pool:
                model(x).sum().backward()
            counts.append(len(made))
        return counts

    # Step 1 profiles (no regions yet), step 2 captures the 4 layers, then nothing is needed.
    assert regions_per_step(Pool(budget="1GiB", policy="cost_aware", host_limit="64MiB")) == [0, 4, 0, 0, 0]
    # A pool that needs room keeps capturing.
    tight = slow_link(Pool(budget=0, policy="cost_aware", host_limit="64MiB"))
    assert regions_per_step(tight) == [0, 4, 4, 4, 4]


def test_check_walks_each_treatments_invariant():
    pool = slow_link(Pool(budget=0, policy="cost_aware", host_limit="64MiB"))
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(32, 64)
    for _ in range(2):
        with pool:
            model(x).sum().backward()
    with pool:
        loss = model(x).sum()
        away = [e for r in pool.ledger.entries.values() if (e := r()) is not None and e.state.value == "away"]
        by = {e.treatment.name: e for e in away}
        assert set(by) == {"offload", "recompute"}  # the layers' inputs offloaded, their insides dropped
        pool.check()
        block, by["offload"].payload = by["offload"].payload, None
        with pytest.raises(AssertionError, match="host copy"):
            pool.check()
        by["offload"].payload = block
        recipe, by["recompute"].recipe = by["recompute"].recipe, None
        with pytest.raises(AssertionError, match="recipe"):
            pool.check()
        by["recompute"].recipe = recipe
        pool.ledger.device_bytes += 1
        with pytest.raises(AssertionError, match="device bytes"):
            pool.check()
        pool.ledger.device_bytes -= 1
        pool.check()
        loss.backward()


@pytest.mark.parametrize("policy", ["cost_aware", "planned"])
def test_replay_runs_the_modules_own_hooks(policy):
    """A replay calls a region's module as its forward did: a user's pre-hook that changes the input
    runs again (a replay that skipped it would save other values), and one on a child module too."""
    calls = []

    def double(module, args):
        calls.append(module)
        return (args[0] * 2,)

    def build():
        model = MLP()
        for layer in model:
            layer.register_forward_pre_hook(double)
            layer[1].register_forward_pre_hook(double)
        return model

    batch = CASES["mlp"][1]
    ref = train_steps(build, batch, steps=3)
    forward_calls = len(calls)
    pool = slow_link(Pool(budget=0, policy=policy, host_limit="64MiB"))
    got = train_steps(build, batch, pool, steps=3)
    assert pool.stats()["recomputes"] > 0
    assert len(calls) > 2 * forward_calls  # the replays ran the hooks too
    assert same(ref, got)


class Mix(nn.Module):
    """Called with a nested tuple, a tensor keyword and plain keywords: a replay rebuilds them all."""

    def __init__(self, d=64):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, pair, *, gate, scale=1.0, act="tanh"):
        a, (b,) = pair
        h = getattr(torch, act)(self.lin1(a) * gate)
        return (self.lin2(h) + b) * scale


class MixNet(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.gate = nn.Linear(d, d)
        self.mix = nn.ModuleList(Mix(d) for _ in range(4))

    def forward(self, x):
        gate = torch.sigmoid(self.gate(x))
        y = x
        for i, m in enumerate(self.mix):
            y = m((y, (x,)), gate=gate, scale=0.5, act="tanh" if i % 2 else "sigmoid")
        return y


@pytest.mark.parametrize("policy", ["cost_aware", "planned"])
def test_replay_of_a_call_with_nested_and_keyword_arguments(policy, monkeypatch):
    from supermem.tensor_pool import region

    replays, rebuild = [], region.Region.rebuild
    monkeypatch.setattr(region.Region, "rebuild", lambda r, *a: replays.append(r) or rebuild(r, *a))
    batch = CASES["mlp"][1]
    ref = train_steps(MixNet, batch, steps=3)
    pool = slow_link(Pool(budget=0, policy=policy, host_limit="64MiB"))
    got = train_steps(MixNet, batch, pool, steps=3)
    assert {type(r.module) for r in replays} == {Mix}
    assert same(ref, got)


def test_a_weight_copy_rebuilt_in_a_create_graph_backward_holds_no_graph():
    """A backward with create_graph runs with grad on: an autocast weight copy is cast again detached."""
    from supermem.tensor_pool.cast import Cast

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    pool = Pool(budget="1GiB", policy="cost_aware", host_limit="64MiB")
    with pool, torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(4, 16))
    casts = [e for r in pool.ledger.entries.values() if (e := r()) is not None and isinstance(e.recipe, Cast)]
    assert casts
    for e in casts:
        assert pool.leave(e, pool.treatments["recompute"])
    with pool:
        torch.autograd.grad(out.float().square().sum(), list(model.parameters()), create_graph=True)
    assert pool.stats()["recomputes"] == len(casts)
    assert all(e.tensor is not None and not e.tensor.requires_grad for e in casts)


class SharedNorm(nn.Module):
    """One BatchNorm reached through two children: its statistics are put back once per replay."""

    def __init__(self, d=64):
        super().__init__()
        bn = nn.BatchNorm1d(d)
        self.a, self.b = nn.Sequential(nn.Linear(d, d), bn), nn.Sequential(nn.Linear(d, d), bn)

    def forward(self, x):
        return torch.tanh(self.b(torch.tanh(self.a(x))))


@pytest.mark.parametrize("policy", ["cost_aware", "planned"])
def test_replay_restores_a_shared_batchnorm_exactly(policy):
    build = lambda: nn.Sequential(*[SharedNorm() for _ in range(4)])  # noqa: E731
    batch = CASES["mlp"][1]
    ref = train_steps(build, batch, steps=3)
    pool = slow_link(Pool(budget=0, policy=policy, host_limit="64MiB"))
    got = train_steps(build, batch, pool, steps=3)
    assert pool.stats()["recomputes"] > 0
    assert same(ref, got)  # running statistics and num_batches_tracked included


class Fickle(nn.Module):
    """Saves other tensors once `change` is set (after a forward, before its backward replays it)."""

    def __init__(self, d=64):
        super().__init__()
        self.lin, self.change = nn.Linear(d, d), None

    def forward(self, x):
        h = self.lin(x)
        if self.change == "shape":
            h = h[:, : h.shape[1] // 2]
        if self.change == "fewer":
            return h  # saves none of its own
        return torch.tanh(h).exp()


@pytest.mark.parametrize("policy", ["cost_aware", "planned"])
@pytest.mark.parametrize(
    "change, message",
    [("shape", "saved a different tensor .*not deterministic"), ("fewer", "saved fewer tensors")],
)
def test_a_module_changed_before_its_replay_is_replayed_as_it_was(change, message, policy):
    """The replay runs the module as it was at the call (call_state.module_state): no error, and the
    user's change stands after (`message`: what a replay of the changed module would have raised)."""
    torch.manual_seed(0)
    model, x = nn.Sequential(*[Fickle() for _ in range(4)]), torch.randn(8, 64)
    pool = slow_link(Pool(budget=0, policy=policy, host_limit="64MiB"))
    for _ in range(3):  # the first step profiles; the next ones drop and replay (planned: by the plan)
        with pool:
            model(x).sum().backward()
    assert pool.stats()["recomputes"] > 0
    with pool:
        out = model(x).sum()
        for m in model:
            m.change = change
        out.backward()
    assert all(m.change == change for m in model)


class NormBlock(nn.Module):
    """LayerNorm, then an MLP: its LayerNorm and GELU outputs have op replays, fc1's output is the
    block's (only a replay of the block rebuilds it)."""

    def __init__(self, d=32):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def test_a_region_replay_brings_back_what_op_replays_would_rebuild(monkeypatch):
    """Everything dropped: backward's first need in a block is GELU's output, whose op replay reads fc1's,
    which replays the block. That replay computes the LayerNorm output too: it comes back with it, and
    its own op replay never runs (on an H100 host each rebuild costs ~0.1-0.2 ms)."""
    from supermem.tensor_pool import op_replay, region
    from supermem.tensor_pool.treatments import Recompute

    def run(pool):
        torch.manual_seed(0)
        model = nn.Sequential(*[NormBlock() for _ in range(6)])  # each under a quarter: the regions
        x = torch.randn(8, 32)
        for step in range(3):
            if step == 1:  # the first step has no regions yet (it profiles which modules they are)
                calls.update(op=0, region=0)
            with pool:
                model(x).square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    calls = {"op": 0, "region": 0}
    for name, cls in (("op", op_replay.OpReplay), ("region", region.Region)):
        real = cls.rebuild

        def counted(self, pool, e, _real=real, _name=name):
            calls[_name] += 1
            return _real(self, pool, e)

        monkeypatch.setattr(cls, "rebuild", counted)
    identity = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    ref = run(identity)
    pool = Pool(budget=0, policy="cost_aware", min_bytes=0, treatments=(Recompute(),))
    assert all(torch.equal(a, b) for a, b in zip(ref, run(pool)))
    # per block and step: one region replay and the GELU's op replay that asked for it
    assert calls["region"] > 0 and calls["op"] == calls["region"], calls


class _Block(nn.Module):
    """x + f(x): a block the plan replays whole (its input is the only tensor it reads from outside)."""

    def __init__(self, kind, d=64):
        super().__init__()
        if kind == "dropout":  # RNG: the rebuild must draw the same mask
            self.f = nn.Sequential(nn.Linear(d, 4 * d), nn.Dropout(0.2), nn.GELU(), nn.Linear(4 * d, d))
        elif kind == "batchnorm":  # buffers: checkpoint's rebuild updates the statistics a second time
            self.f = nn.Sequential(nn.Linear(d, 4 * d), nn.BatchNorm1d(4 * d), nn.Tanh(), nn.Linear(4 * d, d))
        else:
            self.f = nn.Sequential(nn.Linear(d, 4 * d), nn.Tanh(), nn.Linear(4 * d, d))
        # the input read by three layers, as attention's q, k and v read theirs: under autocast each
        # use casts it and their float gradients add after the casts
        self.qkv = nn.ModuleList(nn.Linear(d, d) for _ in range(3)) if kind == "shared" else None

    def forward(self, x):
        if self.qkv is not None:
            q, k, v = (f(x) for f in self.qkv)
            return x + self.f(q * k.tanh() + v)
        return x + self.f(x)


@pytest.mark.parametrize("kind", ["plain", "dropout", "batchnorm", "shared"])
@pytest.mark.parametrize("autocast", [False, True])
def test_a_plan_runs_the_blocks_it_replays_under_checkpoint_bitwise(kind, autocast):
    """Plan.light: a block call the plan replays whole runs with grad off (autograd saves nothing in
    it, the pool makes no entry), its node calling it again in backward. Dropout's RNG, autocast and
    BatchNorm's statistics (put back after the rebuild) stay bitwise plain PyTorch's, and the step
    stays under budget. An input three layers read under bf16 autocast gets its gradient as plain
    does: autocast caches no cast of it in the rebuild (a float leaf that needs grad, it would)."""
    from supermem.tensor_pool.treatments import Recompute

    build = lambda: nn.Sequential(*[_Block(kind) for _ in range(6)])  # noqa: E731
    batch = lambda g: (torch.randn(32, 64, generator=g), None)  # noqa: E731
    full = Pool(budget="1GiB", policy="planned")
    train_steps(build, batch, full, 3, autocast)
    # a quarter: bf16 blocks also offer op replays and weight casts, which a plan takes first
    budget = full.stats()["plan"]["measured_peak_bytes"] // (4 if autocast else 2)
    pool = Pool(budget=budget, policy="planned", treatments=(Recompute(),))
    ref = train_steps(build, batch, None, 6, autocast)
    assert same(ref, train_steps(build, batch, pool, 6, autocast))
    s = pool.stats()
    assert s["light_calls"] > 0 and s["plan"]["feasible"], s
    assert s["plan"]["measured_peak_bytes"] <= budget, s


class _TupleBlock(nn.Module):
    """A block with keyword arguments and a tuple out: an integer tensor and None beside its output."""

    def __init__(self, d=64):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(d, 4 * d), nn.Dropout(0.2), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask=None, scale=1.0):
        return x + scale * self.f(x) * mask, (mask > 0).sum(), None


class _TupleChain(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_TupleBlock() for _ in range(6))

    def forward(self, x):
        mask = (torch.arange(x.shape[0]) % 3 != 0).float()[:, None]
        for b in self.blocks:
            x, n, _ = b(x, mask=mask, scale=0.5)
        return x * (n > 0)


def test_blocks_run_with_grad_off_take_keywords_give_tuples_and_send_gradients_through_autograd():
    """A block the plan runs with grad off (Plan.light) may take keyword arguments and return a tuple
    with an integer tensor and None in it; the first one's input needs no grad. Training stays bitwise,
    and each parameter's gradient reaches it through autograd: its post-accumulate hook runs once a
    backward, as in plain PyTorch (a distributed wrapper's hooks depend on it)."""
    from supermem.tensor_pool.treatments import Recompute

    batch = lambda g: (torch.randn(32, 64, generator=g), None)  # noqa: E731
    full = Pool(budget="1GiB", policy="planned")
    ref = train_steps(_TupleChain, batch, None, 6)
    assert same(ref, train_steps(_TupleChain, batch, full, 6))
    budget = full.stats()["plan"]["measured_peak_bytes"] // 2
    runs = []

    def counted():
        model = _TupleChain()
        for w in model.parameters():
            w.register_post_accumulate_grad_hook(lambda w: runs.append(w))
        return model

    pool = Pool(budget=budget, policy="planned", treatments=(Recompute(),))
    assert same(ref, train_steps(counted, batch, pool, 6))
    s = pool.stats()
    assert s["light_calls"] > 0 and s["plan_misses"] == 0, s
    assert len(runs) == 6 * len(list(_TupleChain().parameters()))


class _ReluBlock(nn.Module):
    """relu(x + f(x)), as a ResNet bottleneck ends: the ReLU saves its output, which the next block's
    first layer saves again (one entry, no ordinal of its own in the recorded step)."""

    def __init__(self, d=64):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(d, 4 * d), nn.Tanh(), nn.Linear(4 * d, d))

    def forward(self, x):
        return F.relu(x + self.f(x))


def test_a_block_whose_output_is_saved_again_after_it_runs_unseen_and_the_plan_holds():
    """A block the plan runs under checkpoint or with its hooks off saves its ReLU's output unseen; the
    next block's first layer saves it again, a save the recorded step made no ordinal for. The pool is
    given the call's outputs at its end under their recorded ordinals (Plan.outputs): that save finds
    its own, and every later save still matches the plan (before, ResNet-152's plans broke after their
    first checkpointed block)."""
    from supermem.tensor_pool.treatments import Recompute

    build = lambda: nn.Sequential(*[_ReluBlock() for _ in range(6)])  # noqa: E731
    batch = lambda g: (torch.randn(32, 64, generator=g), None)  # noqa: E731
    full = Pool(budget="1GiB", policy="planned")
    ref = train_steps(build, batch, None, 6)
    assert same(ref, train_steps(build, batch, full, 6))
    assert full.stats()["bypassed_calls"] > 0 and full.stats()["plan_misses"] == 0, full.stats()
    budget = full.stats()["plan"]["measured_peak_bytes"] // 2
    pool = Pool(budget=budget, policy="planned", treatments=(Recompute(),))
    assert same(ref, train_steps(build, batch, pool, 6))
    s = pool.stats()
    assert s["plan_misses"] == 0 and s["light_calls"] > 0 and s["plan"]["feasible"], s
    assert s["plan"]["measured_peak_bytes"] <= budget, s


@pytest.mark.parametrize("how", ["light_calls", "bypassed_calls", "lean_drops", "rest_steps"])
def test_calls_the_pool_does_not_see_survive_retain_graph_a_forward_alone_and_an_exception(how):
    """Blocks run under checkpoint (Plan.light, at half the budget), with the pool's hooks off
    (Plan.bypass, everything kept), with hooks of their own that drop GELU's output (Plan.drops, at
    three quarters), or whole steps without the pool (resting: everything kept) in the orders a user
    may take: two grads of one forward
    (retain_graph), a forward with no backward (the step ends when its tensors die), a block that
    raises mid-forward (no hook is left pushed, the pool's hooks are back), then training again."""
    from supermem.tensor_pool.treatments import Recompute

    torch.manual_seed(0)
    model = nn.Sequential(*[_Block("dropout") for _ in range(6)])
    x = torch.randn(32, 64)
    loss = lambda: model(x).square().mean()  # noqa: E731
    full = Pool(budget="1GiB", policy="planned")
    for _ in range(3):
        with full:
            loss().backward()
    if how in ("bypassed_calls", "rest_steps"):
        pool = restless(full) if how == "bypassed_calls" else full
    else:
        share = 0.5 if how == "light_calls" else 0.75
        budget = int(full.stats()["plan"]["measured_peak_bytes"] * share)
        pool = Pool(budget=budget, policy="planned", treatments=(Recompute(),))
    for _ in range(4):
        with pool:
            loss().backward()
    ran = pool.stats()[how]
    assert ran > 0
    with pool:
        out = loss()
        params = list(model.parameters())
        first = torch.autograd.grad(out, params, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(first, torch.autograd.grad(out, params)))
    with pool:
        loss()  # no backward
    gc.collect()
    assert pool.ledger.unseen_live == 0

    def boom(_):
        raise ValueError("boom")

    model[3].forward = boom
    with pytest.raises(ValueError, match="boom"), pool:
        loss().backward()
    del model[3].forward
    gc.collect()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    before = pool.stats()[how]
    for _ in range(2):  # the step after a broken one may record again (it left the plan's shape)
        with pool:
            loss().backward()
    assert pool.stats()[how] > before and pool.ledger.unseen_live == 0


def test_a_plan_that_keeps_a_block_whole_runs_it_with_the_pools_hooks_off():
    """Plan.bypass: the pool's hooks come off around a block call whose saves the plan keeps
    (autograd keeps them, as without a pool: on an H100 host a kept save through the pool costs
    ~12 us), training stays bitwise, and what autograd checks itself still raises: a saved tensor
    changed in place. The user's own hooks inside the pool's keep their saves (no bypass there)."""
    build = lambda: nn.Sequential(*[_Block("dropout") for _ in range(6)])  # noqa: E731
    batch = lambda g: (torch.randn(32, 64, generator=g), None)  # noqa: E731
    pool = restless(Pool(budget="1GiB", policy="planned"))
    ref = train_steps(build, batch, None, 6)
    assert same(ref, train_steps(build, batch, pool, 6))
    s = pool.stats()
    assert s["bypassed_calls"] >= 5 * 3 and s["plan_misses"] == 0, s  # blocks 2-6 of the planned steps
    torch.manual_seed(0)
    model = build()
    x = torch.randn(32, 64)
    pool = restless(Pool(budget="1GiB", policy="planned"))
    packs = []
    pack = pool.pack
    pool.pack = lambda t: packs.append(1) or pack(t)  # what the pool's hook sees
    for _ in range(4):
        packs.clear()
        with pool:
            model(x).square().mean().backward()
    assert 0 < len(packs) < pool.stats()["plan"]["keep"] / 2, (len(packs), pool.stats()["plan"])
    with pool:
        h = model[0](x)
        out = model[1:](h)
        h.add_(1)  # model[1] saved h (its Linear's input) with autograd's own hooks off
        with pytest.raises(RuntimeError, match="inplace"):
            out.sum().backward()
    mine = []
    with pool, torch.autograd.graph.saved_tensors_hooks(lambda t: mine.append(1) or t, lambda t: t):
        model(x).sum().backward()
    assert mine


def test_a_block_is_priced_by_a_timed_replay_when_its_recorded_call_ran_slow():
    """The step the pool records runs at its host's pace (on an H100 its CUDA events timed GPT-24's
    blocks at 7.2 ms, kernels ~0.8): a block's price is the least of its calls' and of a timed replay
    of it, and blocks of one kind (type, input shapes) share it. Here each block's first call is slow
    and its replays are not (a replay priced as slow as half the call failed: on a loaded 2-core
    machine a replay of this block once took a 24 ms scheduler slice)."""
    import time

    class Slow(_Block):
        pool = None

        def forward(self, x):
            if not getattr(self.pool.regions._local, "replaying", False):
                time.sleep(0.1)
            return super().forward(x)

    pool = Pool(budget="1GiB", policy="planned")
    Slow.pool = pool
    model = nn.Sequential(*[Slow("plain") for _ in range(4)])
    x = torch.randn(32, 64)
    for _ in range(2):
        with pool:
            model(x).square().mean().backward()
    prices = [pool.regions.cost_s(m) for m in model]
    assert all(p is not None and p < 0.05 for p in prices), prices


@pytest.mark.parametrize("through", [True, False])
def test_backward_through_a_bypassed_call_ends_its_step(monkeypatch, through):
    """A bypassed call's saves never reach the pool: the hook on its input, which runs once backward is
    through the call, marks the step's backward. Here that is all that marks it (the entries' and left
    alone tensors' unpacks are hidden) and each step's graph is kept (retain_graph): the next step's
    first save starts a new step, no plan miss. Without the hook's mark (`through` False) it does not."""
    from supermem.tensor_pool.light import _Alive

    pool = Pool(budget="1GiB", policy="planned")
    began = pool.clock.backward_began

    def only_through():
        if sys._getframe(1).f_code.co_name == "through":
            began()

    hide_entry_unpacks(pool, monkeypatch)
    monkeypatch.setattr(pool.clock, "backward_began", only_through)
    if not through:
        monkeypatch.setattr(_Alive, "through", lambda self, grad: self.release())
    torch.manual_seed(0)
    model = nn.Sequential(*[_ReluBlock() for _ in range(6)])
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(6):
        with pool:
            loss = model(torch.randn(32, 64, generator=g)).square().mean()
            loss.backward(retain_graph=True)
        losses.append(loss)  # its graph and saves live on
    s = pool.stats()
    assert s["bypassed_calls"] > 0 or not through, s
    assert (s["plan_misses"] == 0) == through, s


def test_a_gradient_penalty_trains_bitwise_under_the_planned_pool():
    """A second-order step (the gradients' norm as a penalty: autograd.grad with create_graph, then
    backward through it) under a planned pool at half the peak: bitwise plain PyTorch's. (Its steps
    save in backward too, so they keep leaving the plan's shape: the reactive pool runs them.)"""
    from supermem.tensor_pool.treatments import Recompute

    def train(pool, steps=6):
        torch.manual_seed(0)
        model = nn.Sequential(*[_Block("dropout") for _ in range(6)])
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
        out = []
        for _ in range(steps):
            model.zero_grad()
            with (
                pool
                if pool is not None
                else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
            ):
                loss = model(x).square().mean()
                grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
                (loss + sum(g.square().sum() for g in grads)).backward()
            out.append(loss.detach())
        return out + [p.grad for p in model.parameters()]

    ref = train(None)
    full = Pool(budget="1GiB", policy="planned")
    train(full, 3)
    budget = full.stats()["plan"]["measured_peak_bytes"] // 2
    assert same(ref, train(Pool(budget=budget, policy="planned", treatments=(Recompute(),))))


def test_a_call_run_with_grad_off_gives_first_and_second_order_gradients_of_the_plain_call():
    """_LightFn, the node of a call run with grad off: the gradients of its inputs and parameters
    (autograd.grad, with create_graph) are bitwise the plain call's, dropout drawing the same mask in
    the replay; a gradient penalty's, through the graph that backward built, equal them to rounding
    (that graph sums in another order). Before, the replay's detached inputs cut the graph: the
    input's second-order gradient was 3e-3 off."""
    from supermem.tensor_pool.call_state import CallState
    from supermem.tensor_pool.light import _Light

    class Tracker:  # (let go at once: the replay calls the module itself)
        pass

    torch.manual_seed(0)
    block = _Block("dropout")
    x = torch.randn(16, 64, requires_grad=True)

    def run(light):
        torch.manual_seed(3)
        if light:
            state = CallState(torch.device("cpu"))
            with torch.no_grad():
                out = block(x * 1)
            y = _Light(state).attach(Tracker(), block, (x * 1,), {}, out, None)
        else:
            y = block(x * 1)
        loss = y.square().mean()
        params = list(block.parameters())
        first = torch.autograd.grad(loss, [x, *params], create_graph=True)
        penalty = sum(g.square().sum() for g in first)
        second = torch.autograd.grad(penalty, [x, *params])
        return [loss, *first, *second]

    plain, light = run(False), run(True)
    assert len(plain) == len(light) == 11
    assert all(torch.equal(a, b) for a, b in zip(plain[:6], light[:6]))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(plain[6:], light[6:]))


def test_a_calls_tensors_are_pytrees_in_its_order_also_where_pytree_is_skipped():
    """region._tensors skips pytree for a tensor, a tuple of tensors and (tensors, no keywords): the
    same tensors in the same order as tree_flatten gives, for those and for every other shape."""
    from torch.utils._pytree import tree_flatten

    from supermem.tensor_pool.region import _tensors

    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    trees = [a, (a, b), ((a, b), {}), ((a,), {"m": c}), ((a, 3), {}), ([a, b],), ((a, (b, c)), {}), ()]
    trees += [((), {}), {"x": a}, (a, None, b), ((a, b), {"k": None}), ((b, a), {}, c)]
    for tree in trees:
        ref = [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]
        got = _tensors(tree)
        assert len(got) == len(ref) and all(x is y for x, y in zip(got, ref)), tree


def test_a_call_run_with_grad_off_given_one_tensor_twice_gives_its_gradient_once():
    """f(x, x) run with grad off: x's gradient through the node is plain PyTorch's, with and without
    create_graph (where the node runs on x itself: one tensor at two places, counted once)."""
    from supermem.tensor_pool.call_state import CallState
    from supermem.tensor_pool.light import _Light

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.f = nn.Linear(8, 8)

        def forward(self, a, b):
            return self.f(a) * b

    class Tracker:
        pass

    torch.manual_seed(0)
    m, x = Twice(), torch.randn(4, 8, requires_grad=True)
    for create in (False, True):
        h = x * 1
        plain = torch.autograd.grad(m(h, h).square().sum(), [x, *m.parameters()], create_graph=create)
        h = x * 1
        with torch.no_grad():
            out = m(h, h)
        y = _Light(CallState(torch.device("cpu"))).attach(Tracker(), m, (h, h), {}, out, None)
        light = torch.autograd.grad(y.square().sum(), [x, *m.parameters()], create_graph=create)
        assert all(torch.equal(a, b) for a, b in zip(plain, light)), create


def test_a_block_on_the_batch_itself_is_never_planned_to_run_with_the_pools_hooks_off(monkeypatch):
    """The first block's input is the batch, made outside the graph: run with the pool's hooks off,
    nothing would tell when backward is through it (light._pool_hooks), so it runs through the pool.
    The recording marks it (Profile.no_bypass) and the plan leaves it out of Plan.bypass. Its capture
    made the batch an entry of the step (the block saves only casts of it: Profile.capture_made), so
    each planned step captures it too (Plan.captures) and keeps the plan's ordinals. Before, a
    planned step that bypassed it ran it through the pool all the same, or one that kept it made no
    such entry, and the step left the plan (test_lean_call's gelu-True, under load)."""
    from supermem.policies import Planned

    made, solve = [], Planned.solve
    monkeypatch.setattr(
        Planned, "solve", lambda self, p, b: made.append((p, solve(self, p, b))) or made[-1][1]
    )
    build = lambda: nn.Sequential(*[_Block("dropout") for _ in range(6)])  # noqa: E731
    batch = lambda g: (torch.randn(32, 64, generator=g), None)  # noqa: E731
    pool = Pool(budget="1GiB", policy="planned")
    assert same(train_steps(build, batch, None, 6, True), train_steps(build, batch, pool, 6, True))  # bf16
    profile, plan = made[0]
    assert 0 in profile.no_bypass and 0 not in plan.bypass and plan.bypass, (profile.no_bypass, plan.bypass)
    assert 0 in plan.captures and profile.capture_made, (plan.captures, profile.capture_made)
    s = pool.stats()
    assert s["plan_misses"] == 0 and s["bypassed_calls"] > 0, s


def test_blocks_called_one_by_one_by_the_step_are_the_regions_not_their_layers():
    """A step that calls its blocks itself, with no module call around them (GPT.hidden's loop under
    supermem.linear_cross_entropy): each block is a top call and a region, as inside a model's forward.
    Split into its layers, a GPT-24 step ran 96 regions that the plan could not run hook-free."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh()) for _ in range(6)
    )
    whole = nn.Sequential(*blocks)
    x = torch.randn(32, 64)
    for run in (lambda: whole(x), lambda: functools.reduce(lambda h, b: b(h), blocks, x)):
        pool = Pool(budget=0, policy="cost_aware", host_limit="64MiB")
        for _ in range(2):
            with pool:
                run().sum().backward()
        assert sorted(map(id, pool.regions.modules)) == sorted(map(id, blocks))


class _Node:
    """A C++ autograd node as torch 2.11's Python sees it: its Python object lives only while held; one
    asked for after that is a new object (maybe at another address)."""

    _alive: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def __init__(self, real):
        self.real = real

    @classmethod
    def of(cls, real):
        if real is None:
            return None
        node = cls._alive.get(id(real))
        if node is None:
            node = cls._alive[id(real)] = cls(real)
        return node

    @property
    def next_functions(self):
        return tuple((_Node.of(fn), nr) for fn, nr in self.real.next_functions)

    @property
    def variable(self):
        return self.real.variable


class _Weak:
    """A tensor whose grad_fn is a _Node."""

    def __init__(self, t):
        self.t, self.output_nr = t, t.output_nr

    @property
    def grad_fn(self):
        return _Node.of(self.t.grad_fn)


def test_a_calls_uses_are_counted_where_autograd_lets_its_node_objects_go():
    """A light call's node takes an input once per use in the call (consumers), so autograd adds each
    use's gradient as in plain PyTorch. Under torch 2.11 an input's node read 0 uses when its Python
    object was let go between reading its id and meeting it again in the walk: a Llama's RMSNorms ran
    light with their gradients summed, and trained 1 ulp off plain from the first light step (H200)."""
    from supermem.tensor_pool.region import consumers

    a = torch.randn(8, requires_grad=True)
    x, h = a.exp(), a.sin()  # two inputs made in the graph, as a norm's residual stream is
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) + h * 2
    assert [len(u) for u in consumers([x, h], [y])] == [2, 1]
    got = consumers([_Weak(x), _Weak(h)], [_Weak(y)])
    assert got is not None and [len(u) for u in got] == [2, 1]


def _light_slots(monkeypatch):
    """Each light call's (module type, uses, extra slots), as its node is made."""
    from supermem.tensor_pool.light import _Light

    seen, attach = [], _Light.attach

    def counted(self, tracker, module, *rest):
        out = attach(self, tracker, module, *rest)
        seen.append((type(module).__name__, self.uses, len(self.extra)))
        return out

    monkeypatch.setattr(_Light, "attach", counted)
    return seen


def test_a_block_reading_its_input_twice_inside_and_nowhere_else_runs_light_without_slots(monkeypatch):
    """x + f(x), as a ResNet bottleneck: both uses of x are in the call, so its rebuilt backward sums
    them in plain order into a buffer nothing else adds to. Once its verifying step's backward showed
    no use outside, a light call takes x once (no per-use slot: light_graphs may replay it), and
    training stays bitwise. Before, each such block took x twice, and its CUDA graphs were off."""
    from supermem.tensor_pool.treatments import Recompute

    build = lambda: nn.Sequential(*[_Block("plain") for _ in range(6)])  # noqa: E731
    batch = lambda g: (torch.randn(32, 64, generator=g), None)  # noqa: E731
    full = Pool(budget="1GiB", policy="planned")
    train_steps(build, batch, full, 3)
    pool = Pool(
        budget=full.stats()["plan"]["measured_peak_bytes"] // 2, policy="planned", treatments=(Recompute(),)
    )
    seen = _light_slots(monkeypatch)
    assert same(train_steps(build, batch, None, 6), train_steps(build, batch, pool, 6))
    twice = [s for s in seen if s[1] == (2,)]  # (the first block's input needs no grad: no use)
    assert twice and all(extra == 0 for _, _, extra in twice), seen
    assert pool.stats()["light_split_misses"] == 0


class _RMSNorm(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class _PreNorm(nn.Module):
    """h + f(norm(h)), the adds in the model's own call: each norm's input is read by the add too."""

    def __init__(self, d=64, n=6):
        super().__init__()
        self.norms = nn.ModuleList(_RMSNorm(d) for _ in range(n))
        self.fs = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 4 * d), nn.Tanh(), nn.Linear(4 * d, d)) for _ in range(n)
        )

    def forward(self, h):
        for norm, f in zip(self.norms, self.fs):
            h = h + f(norm(h))
        return h


@pytest.mark.parametrize("loss_in_pool", [True, False])
def test_a_norm_whose_input_the_residual_add_reads_keeps_its_slots(monkeypatch, loss_in_pool):
    """A Llama's RMSNorm: its input is read twice in the call and once by the residual add outside, so
    its light calls keep a slot per use (autograd adds (r + a) + b, as plain). Also where the loss is
    taken outside the pool, a sum that saves nothing: backward begins under the last add, which the
    walk from there cannot see; the norm's whole gradient, unlike the sum of its uses', tells (the
    last norm's, which the walk alone took for one without a use outside)."""
    from supermem.tensor_pool.treatments import Recompute

    models = []

    def run(pool, steps=6):
        torch.manual_seed(0)
        model = _PreNorm()
        models.append(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
        out = []
        for _ in range(steps):
            opt.zero_grad()
            ctx = (
                pool
                if pool is not None
                else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
            )
            with ctx:
                o = model(x)
                if loss_in_pool:
                    loss = o.square().mean()
                    loss.backward()
            if not loss_in_pool:
                loss = o.sum() / 1e3
                loss.backward()
            out += [loss.detach()] + [p.grad for p in model.parameters()]
            opt.step()
        return out

    full = Pool(budget="1GiB", policy="planned")
    run(full, 3)
    pool = Pool(
        budget=full.stats()["plan"]["measured_peak_bytes"] // 2, policy="planned", treatments=(Recompute(),)
    )
    # Each replay priced at 0.16 ms, about what this CPU measures for both kinds when idle: timed on a
    # loaded one, the plan ran only the MLPs light in one full run of the suite, no norm's slots seen.
    from supermem.tensor_pool.regions import Regions

    monkeypatch.setattr(Regions, "cost_s", lambda self, m: 1.6e-4)
    seen = _light_slots(monkeypatch)
    assert same(run(None), run(pool))
    norms = [s for s in seen if s[0] == "_RMSNorm"]
    assert norms and all(uses == (2,) and extra == 1 for _, uses, extra in norms), seen
    for norm in models[-1].norms[1:]:  # (the first one's input, the batch, needs no grad)
        assert pool.regions.uses[norm] == (2,) and pool.regions.outside_uses.of(norm, 1) == (True,)
    assert pool.stats()["light_split_misses"] == 0


def test_a_replay_makes_room_before_it_brings_its_saves_back():
    """On CPU (and under PyTorch's allocator) nothing asks the pool for room as a replay's saves come
    back: the replay first lets entries backward has not touched yet leave. Here the last half of the
    blocks is dropped and the budget set to what stays: each replay in backward would take the pool
    over it by a block's saves."""
    from supermem.tensor_pool.region import Region
    from supermem.tensor_pool.treatments import Recompute

    class Block(nn.Module):
        def __init__(self, d=16):
            super().__init__()
            self.a, self.b = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.b(torch.tanh(self.a(x)))

    def build():
        return nn.Sequential(*[Block() for _ in range(6)])  # each under a quarter of the saves: regions

    def batch(g):
        return torch.randn(64, 16, generator=g), None

    ref = train_steps(build, batch, steps=3)
    probe = Pool(policy="lru", min_bytes=0)
    train_steps(build, batch, probe, steps=1)
    pool = Pool(
        budget=probe.stats()["peak_resident_bytes"] // 2,
        policy="cost_aware",
        min_bytes=0,
        treatments=(Recompute(),),
    )
    steps = [0]

    def drop_the_last_blocks(p):
        steps[0] += 1
        if steps[0] < 3:  # (the first step profiles the regions)
            return
        regions = sorted(
            (e for e in p.ledger.resident_entries(None, lambda e: True) if isinstance(e.recipe, Region)),
            key=lambda e: e.seq,
        )
        assert regions, "no region's save is resident: nothing to test"
        for e in regions[len(regions) // 2 :]:
            assert p.leave(e, p.treatments["recompute"])
        p.budget_bytes = p.ledger.peak_resident_bytes = p.ledger.device_bytes

    got = train_steps(build, batch, pool, steps=3, during=drop_the_last_blocks)
    assert same(ref, got)
    assert pool.stats()["peak_resident_bytes"] <= pool.budget_bytes
