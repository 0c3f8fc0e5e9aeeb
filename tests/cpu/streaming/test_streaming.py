"""supermem.stream on CPU (a host tier and a compute tier both on the CPU): streamed training is bitwise
plain training, with SGD momentum and AdamW, shared weights, BatchNorm, binomial checkpointing and a pool."""

import copy

import pytest
import torch
import torch.nn as nn

import supermem
from supermem.checkpoint import binomial
from supermem.errors import UsageError


class Tied(nn.Module):
    """Shared weights two ways: one module called twice, and one Parameter registered in two modules."""

    def __init__(self, width=12):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.twice = nn.Linear(width, width)
        self.out = nn.Linear(width, width, bias=False)
        self.out.weight = self.inp.weight
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        x = self.drop(torch.relu(self.twice(x)))
        x = torch.relu(self.twice(x))
        return self.out(x)


class ConvNorm(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1),
            nn.BatchNorm2d(c),
            nn.ReLU(),
            nn.Conv2d(c, c, 3, padding=1, bias=False),
            nn.BatchNorm2d(c),
            nn.ReLU(),
        )
        self.head = nn.Linear(c, 5)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


class Chain(nn.Module):
    """Blocks with BatchNorm and dropout, run through binomial checkpointing."""

    def __init__(self, n=7, width=10, checkpoints=2):
        super().__init__()
        self.stem = nn.Linear(6, width)
        self.blocks = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.GELU(), nn.Dropout(0.1))
                for _ in range(n)
            ]
        )
        self.head = nn.Linear(width, 3)
        self.checkpoints = checkpoints

    def forward(self, x):
        return self.head(binomial(self.blocks, self.stem(x), checkpoints=self.checkpoints))


def optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05)


def train(
    model, x, kind, steps, *, streamed, pool=False, zero_to_none=True, unit_bytes=64 << 20, step="host"
):
    """Losses, gradients after each step, and the final parameters and buffers."""
    streamer = supermem.stream(model, "cpu", unit_bytes=unit_bytes, optimizer_step=step) if streamed else None
    opt = optimizer(kind, model.parameters())
    torch.manual_seed(7)
    out = []
    for _ in range(steps):
        if pool:
            with supermem.pool(budget=1 << 10, device="cpu"):
                loss = model(x).square().mean()
                loss.backward()
        else:
            loss = model(x).square().mean()
            loss.backward()
        if streamer is not None:
            streamer.sync()  # the test reads .grad before the optimizer does
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        out.append((loss.detach().clone(), grads))
        opt.step()
        opt.zero_grad(set_to_none=zero_to_none)
    state = [p.detach().clone() for p in model.parameters()] + [b.clone() for b in model.buffers()]
    if streamer is not None:
        assert bool(streamer._state_views) == (step == "device")  # the optimizer's state in host blocks
        streamer.close()
    return out, state


def assert_bitwise(a, b):
    (steps_a, state_a), (steps_b, state_b) = a, b
    for (la, ga), (lb, gb) in zip(steps_a, steps_b, strict=True):
        assert torch.equal(la, lb)
        assert len(ga) == len(gb)
        for x, y in zip(ga, gb):
            assert (x is None and y is None) or torch.equal(x, y)
    for x, y in zip(state_a, state_b, strict=True):
        assert torch.equal(x, y)


def assert_streamed_training_is_plain(kind, make, shape, unit_bytes, step):
    """Four steps of `make()` on one batch, streamed with `step` as the optimizer step, end bitwise
    where plain training does."""
    torch.manual_seed(0)
    model = make()
    x = torch.randn(shape)
    plain = train(copy.deepcopy(model), x, kind, 4, streamed=False)
    streamed = train(copy.deepcopy(model), x, kind, 4, streamed=True, unit_bytes=unit_bytes, step=step)
    assert_bitwise(plain, streamed)


@pytest.mark.parametrize("unit_bytes", [0, 1 << 20], ids=["unit=module", "unit=model"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("make,shape", [(Tied, (9, 12)), (ConvNorm, (4, 3, 8, 8)), (Chain, (8, 6))])
def test_streamed_training_is_bitwise_plain(kind, make, shape, unit_bytes):
    assert_streamed_training_is_plain(kind, make, shape, unit_bytes, "host")


def test_streams_where_pytorch_cannot_read_the_saved_tensor_hooks(monkeypatch):
    """A PyTorch without the hooks' getter (torch_private.top_saved_hooks None): streamed training is
    still bitwise plain (it raised 'NoneType' not callable at the first call under grad)."""
    from supermem import torch_private as tp

    monkeypatch.setattr(tp, "top_saved_hooks", None)
    assert_streamed_training_is_plain("sgd", Tied, (9, 12), 0, "host")


def test_streaming_binomial_and_pool_together_equal_plain():
    torch.manual_seed(1)
    model = Chain(n=9, checkpoints=2)
    x = torch.randn(8, 6)
    plain_model = copy.deepcopy(model)
    plain_model.forward = lambda x: plain_model.head(plain_model.blocks(plain_model.stem(x)))
    plain = train(plain_model, x, "sgd", 3, streamed=False)
    together = train(copy.deepcopy(model), x, "sgd", 3, streamed=True, pool=True, unit_bytes=400)
    assert_bitwise(plain, together)


def test_gradient_accumulation_and_zeroed_grads():
    torch.manual_seed(2)
    model = Tied()
    x = torch.randn(9, 12)
    a = train(copy.deepcopy(model), x, "sgd", 3, streamed=False, zero_to_none=False)
    b = train(copy.deepcopy(model), x, "sgd", 3, streamed=True, zero_to_none=False)
    assert_bitwise(a, b)


def test_weights_live_on_the_host_tier_and_come_back_per_module():
    model = ConvNorm()
    s = supermem.stream(model, "cpu", unit_bytes=0)  # a unit per module
    host = {id(p): p.data.data_ptr() for p in model.parameters()}
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    st = s.stats()
    assert all(p.data.data_ptr() == host[id(p)] for p in model.parameters())  # the module got its own back
    # each unit once per forward, and again in backward for those whose weights the backward needs
    assert 2 * st["units"] < st["fetches"] <= 2 * 2 * st["units"]
    assert st["prefetch_hits"] > 0  # the second step replays the first one's order
    assert st["grads_to_host"] == 2 * sum(1 for _ in model.parameters())
    assert all(u.copy is None for u in s.units)  # all released
    s.close()


def test_bad_input_is_a_usage_error():
    with pytest.raises(UsageError):
        supermem.stream("not a model")
    with pytest.raises(UsageError):
        supermem.stream(nn.Linear(2, 2), "cpu", prefetch=-1)
    m = nn.Linear(2, 2)
    supermem.stream(m, "cpu")
    with pytest.raises(UsageError):
        supermem.stream(m, "cpu")


def test_optimizer_step_between_forward_and_backward_is_an_error():
    model = nn.Linear(4, 4)
    supermem.stream(model, "cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(2, 4, requires_grad=True)).sum()  # its backward needs the weight
    model.weight.grad = torch.ones_like(model.weight)
    model.bias.grad = torch.ones_like(model.bias)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace"):
        loss.backward()


def test_a_whole_model_unit_is_prefetched_at_step_start():
    model = Tied()  # small: the whole model is one unit, fetched by the root's own pre-hook
    s = supermem.stream(model, "cpu")
    for _ in range(2):
        model(torch.randn(3, 12)).sum().backward()
    st = s.stats()
    assert st["units"] == 1
    assert st["prefetch_hits"] >= 1  # step 2 found its first fetch already made at step start
    s.close()


def test_steps_are_seen_without_calling_the_root():
    """Calling submodules directly (stem, binomial over blocks, head): the optimizer step marks the step."""
    model = Chain(n=5)
    s = supermem.stream(model, "cpu", unit_bytes=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        h = binomial(model.blocks, model.stem(torch.randn(4, 6)), checkpoints=1)
        model.head(h).sum().backward()
        opt.step()
        opt.zero_grad()
    assert s.stats()["prefetch_hits"] > 0
    s.close()


def test_conf_stream_weights_streams_the_outermost_module(tmp_path):
    """SUPERMEM_CONF=stream:weights's global hooks (in a fresh process: they stay for the process), with
    the compute tier on the CPU: the outermost module is streamed at its first call and trains as plain."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import copy, torch, torch.nn as nn
        from supermem import config, streaming
        streaming._target_device = lambda module, args: torch.device("cpu")  # no CUDA here
        torch.manual_seed(0)
        inner = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        plain = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), inner, nn.Linear(6, 2))
        model = copy.deepcopy(plain)
        x = torch.randn(5, 6)
        def train(m):
            opt = torch.optim.AdamW(m.parameters(), lr=0.01)
            for _ in range(3):
                m(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            return [p.detach().clone() for p in m.parameters()]
        want = train(plain)
        streaming.activate_from_config(config.current())
        got = train(model)
        s = model._supermem_streamer
        assert s is not None and plain.__dict__.get("_supermem_streamer") is None
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert s.stats()["fetches"] > 0 and s.stats()["prefetch_hits"] > 0
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


def test_frozen_parameters_get_no_gradient():
    torch.manual_seed(3)
    model = ConvNorm()
    model.body[0].weight.requires_grad_(False)  # frozen, in a unit with trainable parameters
    model.body[1].requires_grad_(False)
    x = torch.randn(2, 3, 8, 8)
    plain = train(copy.deepcopy(model), x, "sgd", 2, streamed=False)
    streamed = train(copy.deepcopy(model), x, "sgd", 2, streamed=True)
    assert_bitwise(plain, streamed)


def test_close_gives_every_host_block_back():
    """close() returns the parameters' and the gradients' host blocks to the host pool: repeated
    stream/close cycles of one model keep nothing (a GPU soak kept 2x the model per cycle)."""
    torch.manual_seed(4)
    model = ConvNorm()
    x = torch.randn(2, 3, 8, 8)
    want = copy.deepcopy(model)
    want(x).sum().backward()
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        s = supermem.stream(model, "cpu", unit_bytes=0)
        model(x).sum().backward()
        s.sync()
        host = s.host
        assert host.in_use_bytes > 0
        s.close()
        assert host.in_use_bytes == 0
        # what close() handed over is intact: ordinary memory, not the blocks given back
        for p, q in zip(model.parameters(), want.parameters(), strict=True):
            assert torch.equal(p, q) and torch.equal(p.grad, q.grad)


def test_the_streamer_and_the_tensor_pool_share_one_host_pool(monkeypatch):
    """One host budget per device: the pool's offloads and the streamer's weights come from one host
    pool, whose limit is the larger host_limit (not one pool each, pinning the sum)."""
    from supermem.transfer import host

    monkeypatch.setattr(host, "_shared", {})  # no host pool made yet in this process
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    x = torch.randn(32, 64)
    want = copy.deepcopy(model)
    want(x).square().mean().backward()
    s = supermem.stream(model, "cpu", host_limit="1MiB")
    pool = supermem.tensor_pool.Pool(budget=0, host_limit="2MiB", device="cpu", min_bytes=0)
    with pool:
        model(x).square().mean().backward()
    s.sync()
    assert pool.stats()["offloads"] > 0
    assert pool.host.pool is s.host.pool and s.host.pool.limit_bytes == 2 << 20
    assert s.host.reserved_bytes <= 2 << 20
    assert s.host.in_use_bytes > 0 and pool.host.in_use_bytes == 0  # the weights and grads stay, nothing else
    for p, q in zip(model.parameters(), want.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    s.close()
    assert s.host.in_use_bytes == 0


def test_conf_stream_weights_streams_the_model_then_costs_nothing_per_call():
    """SUPERMEM_CONF=stream:weights's global module hooks run on every module call of the process: once
    the model (the first outermost module with parameters) is streamed they are gone, so later calls
    take PyTorch's hook-free path, and another module with parameters called afterwards stays as it is."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import torch, torch.nn as nn
        from torch.nn.modules import module as M
        from supermem import config, streaming
        # no CUDA here: a module with parameters goes to the CPU compute tier
        has_params = lambda m: next(m.parameters(), None) is not None
        streaming._target_device = lambda m, a: torch.device("cpu") if has_params(m) else None
        before = (len(M._global_forward_pre_hooks), len(M._global_forward_hooks))
        streaming.activate_from_config(config.current())
        assert (len(M._global_forward_pre_hooks), len(M._global_forward_hooks)) != before
        nn.ReLU()(torch.randn(3))  # no parameters: not the model
        model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
        model(torch.randn(5, 6)).sum().backward()
        assert model.__dict__.get("_supermem_streamer") is not None
        assert (len(M._global_forward_pre_hooks), len(M._global_forward_hooks)) == before
        other = nn.Linear(6, 6)
        other(torch.randn(5, 6))
        assert other.__dict__.get("_supermem_streamer") is None
        model(torch.randn(5, 6)).sum().backward()  # still streamed
        assert model._supermem_streamer.stats()["prefetch_hits"] > 0
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("unit_bytes", [0, 1 << 20], ids=["unit=module", "unit=model"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("make,shape", [(Tied, (9, 12)), (ConvNorm, (4, 3, 8, 8))])
def test_the_device_optimizer_step_is_bitwise_plain(kind, make, shape, unit_bytes):
    """optimizer_step="device": each unit's parameters, gradients and state come to the device ("cpu"
    here: the same code path), step there and go back; training is bitwise plain training."""
    assert_streamed_training_is_plain(kind, make, shape, unit_bytes, "device")


def test_the_device_step_keeps_state_in_host_blocks_and_steps_the_rest_as_usual():
    """The optimizer's state lives in the streamer's host blocks (handed back as ordinary memory at
    close); a parameter of the same optimizer that is not streamed steps in the optimizer's own call."""
    torch.manual_seed(6)
    model, extra = ConvNorm(), nn.Parameter(torch.randn(5))
    x = torch.randn(2, 3, 8, 8)
    twin, twin_extra = copy.deepcopy(model), extra.detach().clone().requires_grad_()
    s = supermem.stream(model, "cpu", unit_bytes=0, optimizer_step="device")
    opts = [torch.optim.AdamW([*m.parameters(), e], lr=1e-2) for m, e in ((model, extra), (twin, twin_extra))]
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for i in range(3):
        for m, e, opt in zip((model, twin), (extra, twin_extra), opts):
            (m(x).square().mean() + e.square().sum()).backward()
            held = s.host.in_use_bytes
            opt.step()
            if m is model:  # AdamW's two moments of every streamed parameter went to host blocks
                assert s.host.in_use_bytes - held == (2 * param_bytes if i == 0 else 0)
            opt.zero_grad()
    s.close()
    assert s.host.in_use_bytes == 0
    for a, b in zip([*model.parameters(), extra], [*twin.parameters(), twin_extra], strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opts[0].state[a]["exp_avg_sq"], opts[1].state[b]["exp_avg_sq"])


def test_the_device_step_between_forward_and_backward_is_an_error():
    model = nn.Linear(4, 4)
    supermem.stream(model, "cpu", optimizer_step="device")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(2, 4, requires_grad=True)).sum()
    model.weight.grad = torch.ones_like(model.weight)
    model.bias.grad = torch.ones_like(model.bias)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace"):
        loss.backward()


def test_bad_optimizer_step_is_a_usage_error():
    with pytest.raises(UsageError, match="optimizer_step"):
        supermem.stream(nn.Linear(2, 2), "cpu", optimizer_step="gpu")


def test_a_device_step_that_raises_leaves_the_parameters_on_the_host():
    class Flaky(torch.optim.SGD):
        calls = 0

        def step(self, closure=None):
            Flaky.calls += 1
            if Flaky.calls == 2:  # the second unit
                raise RuntimeError("boom")
            return super().step(closure)

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    s = supermem.stream(model, "cpu", unit_bytes=0, optimizer_step="device")
    opt = Flaky(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    s.sync()
    host = [(p.data.data_ptr(), p.grad.clone()) for p in model.parameters()]
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    for p, (ptr, grad) in zip(model.parameters(), host, strict=True):
        assert p.data.data_ptr() == ptr and torch.equal(p.grad, grad)
    assert all(g is None or g.device.type == "cpu" for g in (p.grad for p in model.parameters()))
    opt.step()  # steps again, on the device
    model(torch.randn(2, 4)).sum().backward()
    s.close()


def test_gradients_hidden_from_a_users_step_that_raised_come_back_at_the_next_backward():
    class RaisesAfterTheDeviceStep(torch.optim.SGD):
        def step(self, closure=None):
            if not supermem_streamer._stepping:  # the user's own call, after the device step
                raise RuntimeError("boom")
            return super().step(closure)

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    supermem_streamer = s = supermem.stream(model, "cpu", unit_bytes=0, optimizer_step="device")
    opt = RaisesAfterTheDeviceStep(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    model(x).sum().backward()
    s.sync()
    first = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    assert all(p.grad is None for p in model.parameters())  # hidden: the post-hook did not run
    model(x).sum().backward()  # accumulates onto them, as after a host step that raised
    s.sync()
    second = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    s.sync()
    for a, b, p in zip(first, second, model.parameters(), strict=True):
        assert torch.equal(b, a + p.grad)
    s.close()


def test_a_host_limit_too_small_is_a_clear_error_that_leaves_the_model_as_it_was():
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    model(torch.randn(2, 64)).sum().backward()
    before = [(p.data_ptr(), p.grad) for p in model.parameters()]
    with pytest.raises(torch.OutOfMemoryError, match="host_limit"):
        supermem.stream(model, "cpu", host_limit=20000, unit_bytes=0)  # room for the first Linear only
    for p, (ptr, grad) in zip(model.parameters(), before, strict=True):
        assert p.data_ptr() == ptr and p.grad is grad
    s = supermem.stream(model, "cpu")  # not "already streamed"
    s.close()


def test_a_units_inner_hooks_are_muted_during_its_call_and_back_after():
    # Inside a unit's call its modules find their weights swapped in: their hooks would cost PyTorch's
    # slow call path for nothing. They must be back afterwards (a module called alone fetches its
    # unit) and after a call that raised.
    torch.manual_seed(0)
    model = ConvNorm()
    ref = copy.deepcopy(model)
    s = supermem.stream(model, "cpu", unit_bytes=1 << 20)  # the whole model is one unit
    conv = model.body[0]
    seen = []
    conv.register_forward_pre_hook(lambda m, a: seen.append(len(m._forward_pre_hooks)))
    hooks_before = (len(conv._forward_pre_hooks), len(conv._forward_hooks))
    x = torch.randn(2, 3, 6, 6)
    model(x).sum().backward()
    assert seen == [hooks_before[0] - 1]  # the streamer's own pre-hook was out during the call
    assert (len(conv._forward_pre_hooks), len(conv._forward_hooks)) == hooks_before
    with torch.no_grad():
        assert torch.equal(conv(x), ref.body[0](x))  # called alone: it fetches its unit
    model.head.register_forward_pre_hook(lambda m, a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model(x)
    assert (len(conv._forward_pre_hooks), len(conv._forward_hooks)) == hooks_before
    s.close()


def test_a_unit_calls_gradients_go_to_the_host_in_one_batch(monkeypatch):
    from supermem.transfer.copy import CopyEngine

    batches = []
    monkeypatch.setattr(CopyEngine, "to_host", lambda *a: pytest.fail("one copy per gradient"))
    real = CopyEngine.to_host_many
    monkeypatch.setattr(
        CopyEngine, "to_host_many", lambda self, pairs: batches.append(len(pairs)) or real(self, pairs)
    )
    torch.manual_seed(0)
    model = ConvNorm()
    supermem.stream(model, "cpu", unit_bytes=1 << 20)
    model(torch.randn(2, 3, 6, 6)).sum().backward()
    assert batches == [len(list(model.parameters()))]


@pytest.mark.parametrize("unit_bytes", [0, 1 << 20], ids=["unit=module", "unit=model"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("make,shape", [(Tied, (9, 12)), (ConvNorm, (4, 3, 8, 8)), (Chain, (8, 6))])
def test_the_overlapped_optimizer_step_is_bitwise_plain(kind, make, shape, unit_bytes):
    """optimizer_step="overlap": units step on the host in a worker thread while backward goes on
    (shared weights, with several contributions, in the user's step); training is bitwise plain."""
    assert_streamed_training_is_plain(kind, make, shape, unit_bytes, "overlap")


def test_the_overlapped_step_runs_during_backward():
    torch.manual_seed(0)
    model = Chain(n=6, checkpoints=2)
    s = supermem.stream(model, "cpu", unit_bytes=0, optimizer_step="overlap")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 6)
    for _ in range(2):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    calls = []
    real = type(opt).step.__wrapped__
    monkey = pytest.MonkeyPatch()
    monkey.setattr(
        type(opt).step,
        "__wrapped__",
        lambda o, *a: calls.append(len(o.param_groups[0]["params"])) or real(o, *a),
    )
    try:
        model(x).sum().backward()  # the worker stepped the streamed units before backward returned
        stepped = sum(calls)
        assert stepped == len(list(model.parameters()))
        opt.step()  # hides them: nothing is stepped twice
        assert sum(calls) == stepped
    finally:
        monkey.undo()
    s.close()


def test_two_backwards_per_overlapped_step_is_an_error():
    torch.manual_seed(0)
    model = ConvNorm()
    supermem.stream(model, "cpu", unit_bytes=0, optimizer_step="overlap")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 3, 6, 6)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="already has one"):
        model(x).sum().backward()


def test_streamed_unit_names_a_module_fetched_alone_with_all_its_parameters():
    """What binomial's graphs ask before copying a block's host block themselves: a module that is a
    unit of its own (not one inside a larger unit, not one sharing a parameter with another unit)."""
    from supermem.streaming import streamed_unit

    torch.manual_seed(0)
    blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
    blocks[2][0].weight = blocks[1][0].weight  # block 2 shares a weight with block 1
    model = nn.Sequential(nn.Linear(4, 8), *blocks)
    unit_bytes = 8 * 8 * 4 + 8 * 4  # one block's parameters: each block a unit, the model not
    with supermem.stream(model, "cpu", unit_bytes=unit_bytes) as s:
        found = streamed_unit(blocks[0])
        assert found is not None and found[0] is s and found[1].module is blocks[0]
        assert streamed_unit(blocks[0][0]) is None  # inside block 0's unit
        assert streamed_unit(blocks[2]) is None  # its weight belongs to block 1's unit
    assert streamed_unit(blocks[0]) is None  # streaming stopped
