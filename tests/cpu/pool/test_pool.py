"""The tensor pool on CPU tensors: results are bitwise those of plain autograd, accounting is exact,
memory is returned, misuse is rejected. (GPU offload is covered in tests/gpu.)"""

import gc

import psutil
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from pool_policies import policy  # noqa: F401  (autouse: every test under every live policy)
from torch.utils.checkpoint import checkpoint

import supermem
from supermem.errors import ConfigError
from supermem.tensor_pool import Pool


class Net(nn.Module):
    """Views, in-place ops, a weight used twice, dropout: what the pool must get right."""

    def __init__(self, d=64):
        super().__init__()
        self.a = nn.Linear(d, 2 * d)
        self.b = nn.Linear(d, d)
        self.shared = nn.Linear(d, d)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        h = self.a(x)
        u, v = h.chunk(2, dim=-1)  # views
        h = F.gelu(u) * v.sigmoid()
        h = self.drop(h)
        h = h.t().contiguous().t()  # a transposed view, made contiguous again
        h = self.shared(h).relu_()  # in-place on a saved output's input
        h = self.shared(h) + self.b(h)  # the same weight saved twice
        return h.pow(2).sum(dim=-1)


def run(model, x, pool=None, steps=3):
    """Trains a copy of `model` for `steps` SGD steps; returns losses and final gradients."""
    torch.manual_seed(1234)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        if pool is None:
            loss = model(x).mean()
            loss.backward()
        else:
            with pool:
                loss = model(x).mean()
                loss.backward()
            pool.check()
        losses.append(loss.detach().clone())
        opt.step()
    return losses, [p.grad.clone() for p in model.parameters()]


def fresh(cls=Net, **kw):
    torch.manual_seed(0)
    return cls(**kw)


@pytest.mark.parametrize("budget", [0, "16KiB", "1MiB", None])
def test_bitwise_equal_to_plain_autograd(budget):
    x = torch.randn(32, 64)
    ref_losses, ref_grads = run(fresh(), x)
    pool = Pool(budget=budget, host_limit="64MiB")
    losses, grads = run(fresh(), x, pool)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    assert all(torch.equal(a, b) for a, b in zip(ref_grads, grads))
    s = pool.stats()
    if budget == 0:
        assert s["offloads"] > 0 and s["prefetches"] + s["sync_restores"] > 0
    if budget is None:
        assert s["offloads"] == 0
    assert s["tracked_bytes"] == 0  # every entry was freed with its graph


def test_budget_bounds_resident_bytes():
    x = torch.randn(64, 64)
    entry_bytes = 64 * 64 * 4
    pool = Pool(budget=4 * entry_bytes, host_limit="64MiB")
    run(fresh(), x, pool, steps=1)
    s = pool.stats()
    assert s["offloads"] > 0
    # A just-saved tensor is resident before its older neighbours move out: at most one entry over
    # (the largest saved here is the first layer's output, 2 entry_bytes).
    assert s["peak_resident_bytes"] <= 4 * entry_bytes + 2 * entry_bytes


def test_accounting_during_a_step():
    x = torch.randn(16, 64)
    pool = Pool(budget="8KiB", host_limit="64MiB")
    model = fresh()
    with pool:
        loss = model(x).mean()
        pool.check()
        s = pool.stats()
        # Counted independently: the distinct storage spans a plain run of the same step saves.
        assert s["tracked_bytes"] == saved_span_bytes(fresh(), x)
        # Every byte off the device sits in a host block the host allocator counts.
        off_device = s["away_bytes"] + s["leaving_bytes"]
        assert off_device > 0 and pool.host.in_use_bytes >= off_device
        loss.backward()
    pool.check()
    assert pool.stats()["tracked_bytes"] == 0


def saved_span_bytes(model, x):
    """Bytes of the distinct storage spans autograd saves in one forward of `model`, leaving out
    parameters and leaf inputs (which the pool does not track), counted with a plain hook."""
    spans = {}

    def pack(t):
        base = t._base if t._base is not None else t
        if not (base.is_leaf and base.requires_grad) and t.numel():
            last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
            spans[key] = (last + 1) * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).mean()
    return sum(spans.values())


def test_saved_twice_is_one_entry():
    pool = Pool(budget=0, host_limit="16MiB")
    x = torch.randn(256, 256, requires_grad=True)
    with pool:
        y = x * 2
        z = (y * y).sum()  # mul saves y twice
        assert pool.stats()["entries_by_state"] == {
            "resident": 0,
            "leaving": 0,
            "away": 1,
            "returning": 0,
        }
        z.backward()
    assert torch.equal(x.grad, 8 * x.detach())


def test_retain_graph_and_double_backward():
    pool = Pool(budget=0, host_limit="16MiB")
    x = torch.randn(128, 128, requires_grad=True)
    with pool:
        y = torch.tanh(x @ x)
        loss = y.pow(3).sum()
        (g,) = torch.autograd.grad(loss, x, create_graph=True, retain_graph=True)
        g2 = torch.autograd.grad(g.sum(), x, retain_graph=True)[0]
        (g_again,) = torch.autograd.grad(loss, x)  # the first graph was retained
    xr = x.detach().requires_grad_()
    yr = torch.tanh(xr @ xr)
    lr = yr.pow(3).sum()
    (gr,) = torch.autograd.grad(lr, xr, create_graph=True, retain_graph=True)
    assert torch.equal(g, gr)
    assert torch.equal(g2, torch.autograd.grad(gr.sum(), xr, retain_graph=True)[0])
    assert torch.equal(g_again, gr)


def test_checkpoint_inside_and_autocast():
    class Ckpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

        def forward(self, x):
            for i, b in enumerate(self.blocks):
                x = checkpoint(b, x, use_reentrant=False) if i % 2 else torch.relu(b(x))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                x = self.blocks[0](x)
            return x.float().sum(-1)

    x = torch.randn(16, 64)
    ref = run(fresh(Ckpt), x)
    got = run(fresh(Ckpt), x, Pool(budget=0, host_limit="16MiB"))
    assert all(torch.equal(a, b) for a, b in zip(ref[0] + ref[1], got[0] + got[1]))


def test_interleaved_backwards():
    pool = Pool(budget=0, host_limit="16MiB")
    w = torch.randn(64, 64, requires_grad=True)
    xs = [torch.randn(32, 64) for _ in range(3)]
    with pool:
        losses = [torch.sin(x @ w).pow(2).sum() for x in xs]
        for loss in reversed(losses):  # three graphs alive at once, backwards in another order
            loss.backward()
    ref = torch.zeros_like(w)
    for x in xs:
        wr = w.detach().requires_grad_()
        torch.sin(x @ wr).pow(2).sum().backward()
        ref += wr.grad
    assert torch.allclose(w.grad, ref, rtol=0, atol=1e-5)
    assert pool.stats()["tracked_bytes"] == 0


def test_exception_mid_step_leaks_nothing():
    pool = Pool(budget=0, host_limit="16MiB")
    model = fresh()
    with pytest.raises(RuntimeError, match="boom"), pool:
        model(torch.randn(16, 64)).mean()
        raise RuntimeError("boom")
    gc.collect()
    s = pool.stats()
    assert s["tracked_bytes"] == 0
    assert pool.host.in_use_bytes == 0
    pool.check()


def test_no_host_memory_growth_over_1000_steps():
    pool = Pool(budget=0, host_limit="64MiB")
    model = fresh(d=32)
    x = torch.randn(8, 32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def steps(n):
        for _ in range(n):
            opt.zero_grad()
            with pool:
                model(x).mean().backward()
            opt.step()

    steps(100)  # warm up caches
    gc.collect()
    rss = psutil.Process().memory_info().rss
    host_reserved = pool.host.reserved_bytes
    steps(1000)
    gc.collect()
    assert pool.host.reserved_bytes == host_reserved
    assert psutil.Process().memory_info().rss - rss < 8 << 20
    assert pool.stats()["offloads"] >= 1000
    pool.check()


def test_pool_factory_reuses_and_rejects_bad_options():
    assert supermem.pool(budget="1MiB") is supermem.pool(budget="1MiB")
    with pytest.raises(ConfigError, match="budget"):
        Pool(budget="lots")
    with pytest.raises(ConfigError, match="budget"):
        Pool(budget=-5)
    with pytest.raises(ConfigError, match="policy"):
        Pool(policy="fifo")
    with pytest.raises(ConfigError, match="host_limit"):
        Pool(host_limit="12 apples")
    with pytest.raises(ConfigError, match="graphs"):
        Pool(graphs="yes")
    for budget in (float("nan"), float("inf"), 1.5):  # not a fraction: no talk of a device total
        with pytest.raises(ConfigError, match=r"budget=.*a float size must be a fraction in \(0, 1\]"):
            Pool(budget=budget, device="cpu")
    for min_bytes in (-5, 1.5, True):
        with pytest.raises(ConfigError, match="min_bytes"):
            Pool(min_bytes=min_bytes)
    for device in ("meta", *(() if torch.cuda.is_available() else ("cuda", "cuda:0"))):
        with pytest.raises(ConfigError, match="device="):
            Pool(device=device)


def test_host_full_keeps_tensors_resident():
    pool = Pool(budget=0, host_limit="64KiB")  # smaller than one saved tensor
    x = torch.randn(512, 64)
    ref = run(fresh(), x)
    got = run(fresh(), x, pool)
    assert all(torch.equal(a, b) for a, b in zip(ref[0] + ref[1], got[0] + got[1]))
    assert pool.stats()["host_full"] > 0


def test_a_pressure_call_prices_a_window_of_entries_and_all_only_when_that_is_not_enough(monkeypatch):
    """The pressure handler runs inside an allocation (30 times a step on ResNet-152 at 75% with op
    replays): pricing every resident entry each time (about 1000) cost more than the drops saved. The
    stalest CANDIDATES entries are priced first; all of them only if those free too little."""
    import importlib

    from supermem.tensor_pool.treatments import Offload

    pool_module = importlib.import_module("supermem.tensor_pool.pool")

    priced = []
    choices = Offload.choices

    def spy(self, pool, resident):
        resident = list(resident)
        priced.append(len(resident))
        return choices(self, pool, resident)

    monkeypatch.setattr(Offload, "choices", spy)
    window = pool_module.CANDIDATES
    layers = 3 * window
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)])
    x = torch.randn(16, 64, requires_grad=True)
    p = Pool(budget=None, policy="cost_aware", min_bytes=0, treatments=(Offload(),))
    with p:
        y = model(x)
    resident = p.stats()["resident_bytes"]
    assert len(p.ledger.resident_entries()) > 2 * window

    priced.clear()
    assert p.on_pressure(1) > 0
    assert priced == [window]  # the window freed enough
    priced.clear()
    assert p.on_pressure(resident) > 0  # more than the window holds: everything left is priced
    assert priced[0] == window and priced[-1] > window
    y.sum().backward()
