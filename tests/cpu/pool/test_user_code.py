"""Ordinary user code around a pooled step, against plain PyTorch, bitwise: a forward pre-hook that
returns a new input, a LayerNorm eps changed between steps, the model changed between forward and
backward, two threads training their own models through one pool."""

import threading

import pytest
import torch
import torch.nn as nn

from supermem.policies import live_names
from supermem.tensor_pool import Pool
from supermem.tensor_pool.treatments import Recompute

_BUILD = threading.Lock()


class Block(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.ln, self.fc1, self.act, self.fc2 = (
            nn.LayerNorm(d),
            nn.Linear(d, 4 * d),
            nn.GELU(),
            nn.Linear(4 * d, d),
        )

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


def _train(pool, steps=6, at_step=None, between=None, seed=0):
    """Plain steps (pool None) or pooled ones; `at_step(model, k)` before step k's forward,
    `between(model)` between its forward and backward. Every loss and gradient."""
    with _BUILD:  # (the global RNG: two threads building at once would draw each other's weights)
        torch.manual_seed(seed)
        model = nn.Sequential(*[Block() for _ in range(6)])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed + 1))
    out = []
    for k in range(steps):
        if at_step is not None:
            at_step(model, k)
        opt.zero_grad(set_to_none=True)
        with pool if pool is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = model(x).square().mean()
            if between is not None:
                between(model)
            loss.backward()
        out += [loss.detach()] + [p.grad for p in model.parameters()]
        opt.step()
    return out


def _same(a, b):
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b)
    )


def _budget():
    probe = Pool(policy="lru", min_bytes=0)
    _train(probe, steps=2)
    return probe.stats()["peak_resident_bytes"] // 2


def _pool(policy, recompute_only=False):
    """Half the saved bytes; recompute only, at a quarter: the planned pool runs blocks light there
    (reentrant, with grad off: 19 light calls in 6 steps on this CPU)."""
    if not recompute_only:
        return Pool(budget=_budget(), policy=policy, min_bytes=0)
    return Pool(budget=_budget() // 2, policy=policy, min_bytes=0, treatments=[Recompute()])


WAYS = [p for policy in live_names() for p in ((policy, False), (policy, True))]


@pytest.mark.parametrize("policy, recompute_only", WAYS)
def test_a_forward_pre_hook_that_returns_a_new_input_keeps_every_gradient(policy, recompute_only):
    def hook(model, k):
        if k == 0:
            model[2].register_forward_pre_hook(lambda mod, args: (args[0] * 0.5,))

    ref = _train(None, at_step=hook)
    pool = _pool(policy, recompute_only)
    assert _same(_train(pool, at_step=hook), ref)
    assert pool.stats()["light_split_misses"] == 0


@pytest.mark.parametrize("policy, recompute_only", WAYS)
def test_a_layernorm_eps_changed_between_steps_is_replayed_with_the_new_eps(policy, recompute_only):
    def eps(model, k):
        if k == 3:
            for block in model:
                block.ln.eps = 1e-2

    ref = _train(None, at_step=eps)
    assert _same(_train(_pool(policy, recompute_only), at_step=eps), ref)


@pytest.mark.parametrize("change", ["eval", "gelu", "eps", "swap"])
@pytest.mark.parametrize("policy, recompute_only", WAYS)
def test_a_model_changed_between_forward_and_backward_gets_plain_pytorchs_gradients(
    policy, recompute_only, change
):
    """Plain autograd's backward uses what the forward saved; a replay runs the module as it was."""

    def between(model):
        for block in model:
            if change == "eval":
                block.eval()
            elif change == "gelu":
                block.act.approximate = "tanh"
            elif change == "eps":
                block.ln.eps = 1e-2
            else:
                block.act = nn.ReLU()

    ref = _train(None, between=between)
    assert _same(_train(_pool(policy, recompute_only), between=between), ref)


@pytest.mark.parametrize("policy", live_names())
def test_two_threads_train_their_own_models_through_one_pool(policy):
    refs = [_train(None, seed=s) for s in (0, 10)]
    budget = _budget()
    for _ in range(3):
        pool = Pool(budget=budget, policy=policy, min_bytes=0)
        got, errors = [None, None], []

        def run(i, pool=pool, got=got, errors=errors):
            try:
                got[i] = _train(pool, seed=(0, 10)[i])
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert not errors, errors
        assert _same(got[0], refs[0]) and _same(got[1], refs[1])
