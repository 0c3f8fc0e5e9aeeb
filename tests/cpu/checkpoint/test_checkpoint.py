"""supermem.checkpoint.binomial: Griewank's schedule (fewest rebuilds for the memory), bitwise-equal
gradients, RNG and buffers as in plain training, O(checkpoints) boundaries alive, composition with hooks."""

import functools
import weakref

import pytest
import torch
import torch.nn as nn

import supermem
from supermem.checkpoint import binomial
from supermem.errors import UsageError


@functools.cache
def rebuild_cost(n: int, free: int, precomputed: bool) -> int:
    """Brute force over every split: the fewest blocks advanced to reverse a chain of n blocks that holds
    its input and `free` more boundaries. precomputed: the forward sweep already held the right-most
    descent's boundaries (so reaching the split costs nothing on that path)."""
    if n == 1:
        return 0
    if free == 0:
        return n * (n - 1) // 2
    return min(
        (0 if precomputed else m) + rebuild_cost(n - m, free - 1, precomputed) + rebuild_cost(m, free, False)
        for m in range(1, n)
    )


class Block(nn.Module):
    def __init__(self, width: int, calls: list | None = None):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.3)
        self.calls = calls

    def forward(self, x):
        if self.calls is not None:
            self.calls.append(weakref.ref(x))
        return x + self.drop(torch.nn.functional.gelu(self.norm(self.lin(x))))


def make(n, width=16, seed=0, calls=None):
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(width, calls) for _ in range(n)])


def step(model, x, run):
    torch.manual_seed(123)
    y = run(model, x)
    loss = (y * y).mean()
    loss.backward()
    after = torch.rand(4)  # the RNG stream after the step
    return loss.detach(), x.grad, [p.grad for p in model.parameters()], list(model.buffers()), after


def assert_same_step(n, checkpoints, width=16):
    x0 = torch.randn(8, width)
    plain = step(make(n, width), x0.clone().requires_grad_(), lambda m, x: m(x))
    ours = step(make(n, width), x0.clone().requires_grad_(), lambda m, x: binomial(m, x, checkpoints))
    assert torch.equal(plain[0], ours[0]) and torch.equal(plain[1], ours[1])
    for a, b in zip(plain[2] + plain[3], ours[2] + ours[3]):
        assert torch.equal(a, b)
    assert torch.equal(plain[4], ours[4])


@pytest.mark.parametrize("n", range(2, 41))
@pytest.mark.parametrize("free", [0, 1, 2, 3, 4])
def test_schedule_rebuilds_the_fewest_blocks(n, free):
    from supermem import checkpoint as ck

    chain = [lambda x: x + 1] * n
    sched = ck._Schedule(chain, free, [])
    x = torch.zeros(1, requires_grad=True)
    with torch.no_grad():
        sched.sweep(x)
    sched.reverse(x, torch.ones(1))
    assert sched.advances == rebuild_cost(n, free, precomputed=True)


@pytest.mark.parametrize("n, checkpoints", [(1, 2), (2, 1), (7, 0), (13, 1), (13, 3), (30, "log"), (9, 20)])
def test_gradients_buffers_and_rng_bitwise_equal(n, checkpoints):
    assert_same_step(n, checkpoints)


def test_graphs_off_cuda_run_eagerly():
    """graphs=True is a CUDA feature; on the CPU the chain runs as without it (bitwise, RNG included)."""
    x0 = torch.randn(8, 16)
    plain = step(make(9), x0.clone().requires_grad_(), lambda m, x: m(x))
    ours = step(make(9), x0.clone().requires_grad_(), lambda m, x: binomial(m, x, 2, graphs=True))
    for a, b in zip(
        [plain[0], plain[1], *plain[2], *plain[3], plain[4]], [ours[0], ours[1], *ours[2], *ours[3], ours[4]]
    ):
        assert torch.equal(a, b)


def test_graphs_find_a_block_again_once_its_streamer_is_closed(monkeypatch):
    """A block graphed while streamed, its streamer closed since: the chain's graphs must not keep its
    streamed unit (whose host block is gone: a replay read None's tensor), but see it unstreamed."""
    from supermem.checkpoint_graphs import ChainGraphs

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)  # (no CUDA: _block needs none)
    block = nn.Linear(8, 8)
    streamer = supermem.stream(block, "cpu")
    graphs = ChainGraphs(torch.device("cpu"))
    assert graphs._block(block).unit is not None
    streamer.close()
    again = graphs._block(block)
    assert again is not None and again.unit is None and again.streamer is None


def test_one_block_applied_n_times():
    torch.manual_seed(0)
    cell = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    x0 = torch.randn(4, 8)

    def run(fn):
        cell.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        fn(x).sum().backward()
        return x.grad, [p.grad.clone() for p in cell.parameters()]

    def plain(x):
        for _ in range(20):
            x = cell(x)
        return x

    a, b = run(plain), run(lambda x: binomial(cell, x, 3, steps=20))
    assert torch.equal(a[0], b[0])
    for p, q in zip(a[1], b[1]):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)  # 20 contributions summed: order may differ


def test_autocast_state_of_the_forward_is_replayed():
    x0 = torch.randn(8, 16)

    def run(m, x, use):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = use(m, x)
        return y.float()

    plain = step(make(10), x0.clone().requires_grad_(), lambda m, x: run(m, x, lambda m, x: m(x)))
    ours = step(make(10), x0.clone().requires_grad_(), lambda m, x: run(m, x, lambda m, x: binomial(m, x, 2)))
    assert torch.equal(plain[1], ours[1])
    for a, b in zip(plain[2], ours[2]):
        assert torch.equal(a, b)


def test_boundaries_alive_stay_bounded_by_checkpoints():
    calls: list = []
    model = make(64, calls=calls)
    x = torch.randn(4, 16, requires_grad=True)
    alive_max = 0
    y = binomial(model, x, 3)

    def watch(grad):
        nonlocal alive_max
        alive = {r().untyped_storage().data_ptr() for r in calls if r() is not None}
        alive_max = max(alive_max, len(alive))
        return grad

    for blk in model:
        blk.lin.weight.register_hook(watch)
    calls.clear()
    y.sum().backward()
    # block inputs rebuilt in backward and alive while a block's gradient is computed: one boundary per
    # level of the recursion (3), the one rebuilt at the last level, the block being differentiated
    assert alive_max <= 3 + 2, alive_max
    plain_calls: list = []
    plain = make(64, calls=plain_calls)
    out = plain(torch.randn(4, 16, requires_grad=True))
    assert sum(r() is not None for r in plain_calls) == 64  # what binomial avoids
    del out


def test_held_boundaries_go_through_saved_tensor_hooks():
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t.clone()

    model = make(20)
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = binomial(model, x, 4)
    assert len(packed) == 1 + 4  # the input and the four boundaries
    y.sum().backward()
    assert x.grad is not None


def test_runs_where_pytorch_cannot_read_the_saved_tensor_hooks(monkeypatch):
    """A PyTorch without the hooks' getter (torch_private.top_saved_hooks None): the boundaries are held
    as they are, the step still bitwise that of plain training (it raised 'NoneType' not callable)."""
    from supermem import torch_private as tp

    monkeypatch.setattr(tp, "top_saved_hooks", None)
    assert_same_step(9, 2)


def test_composes_with_the_pool():
    x0 = torch.randn(8, 16)
    plain = step(make(12), x0.clone().requires_grad_(), lambda m, x: m(x))

    def pooled(m, x):
        with supermem.pool(budget=1 << 10, device="cpu"):
            return binomial(m, x, 3)

    ours = step(make(12), x0.clone().requires_grad_(), pooled)
    assert torch.equal(plain[1], ours[1])
    for a, b in zip(plain[2], ours[2]):
        assert torch.equal(a, b)


def test_retain_graph_backward_twice():
    model = make(9)
    x = torch.randn(4, 16, requires_grad=True)
    y = binomial(model, x, 2)
    y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    x.grad = None
    y.sum().backward()
    assert torch.equal(first, x.grad)


def test_no_grad_and_eval_run_plainly():
    model = make(5).eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.equal(binomial(model, x, 1), model(x))


def test_double_backward_is_refused():
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    x = torch.randn(2, 4, requires_grad=True)
    (g,) = torch.autograd.grad(binomial(model, x, 1).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m, x: binomial(m, x, -1), "checkpoints must be"),
        (lambda m, x: binomial(m, x, "many"), "checkpoints must be"),
        (lambda m, x: binomial([m[0], 3], x, 1), "block 1 is not callable"),
        (lambda m, x: binomial(m[0], x, 1), "needs steps="),
        (lambda m, x: binomial(m[0], x, 1, steps=-2), "steps must be"),
        (lambda m, x: binomial([lambda t: (t, t)] * 3, x, 1), "returned tuple"),
        (lambda m, x: binomial(m, [x], 1), "x must be a tensor"),
        (lambda m, x: binomial(m, x, 1, graphs="yes"), "graphs must be True or False"),
        (lambda m, x: binomial(None, x), "blocks must be a sequence of callables"),
    ],
)
def test_bad_input_gives_clear_errors(call, message):
    with pytest.raises(UsageError, match=message):
        call(make(3), torch.randn(2, 16, requires_grad=True))


def test_parameter_replaced_between_forward_and_backward_is_an_error_not_a_lost_gradient():
    # The rebuild differentiates the block's parameters as they are at backward time; one that was not
    # there in the forward has no gradient slot, and its gradient must not vanish silently.
    model = make(4)
    x = torch.randn(8, 16, requires_grad=True)
    y = binomial(model, x, 1)
    model[2].lin.weight = nn.Parameter(model[2].lin.weight.detach().clone())
    with pytest.raises(UsageError, match="block 2"):
        y.sum().backward()


def test_submodule_replaced_between_forward_and_backward_is_an_error_not_a_lost_gradient():
    # A block's modules are listed once per call (its rebuilds read parameters and buffers from that
    # list); a submodule swapped in after the forward would run in the rebuild with no gradient slot.
    model = make(4)
    x = torch.randn(8, 16, requires_grad=True)
    y = binomial(model, x, 1)
    model[2].lin = nn.Linear(16, 16)
    with pytest.raises(UsageError, match="block 2"):
        y.sum().backward()


def test_more_checkpoints_than_the_interpreter_has_frames():
    # The backward's splits nest one level per held boundary: as Python recursion, a chain holding
    # about 1,000 of them raised RecursionError (supermem bench depth holds hundreds, on chains of
    # thousands of blocks).
    n = 1300
    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Linear(2, 2) for _ in range(n)])
    x0 = torch.randn(3, 2)
    plain = step(blocks, x0.clone().requires_grad_(), lambda m, x: m(x))
    grads = [g.clone() for g in plain[2]]
    blocks.zero_grad(set_to_none=True)
    ours = step(blocks, x0.clone().requires_grad_(), lambda m, x: binomial(m, x, checkpoints=n - 10))
    assert torch.equal(plain[0], ours[0]) and torch.equal(plain[1], ours[1])
    assert all(torch.equal(a, b) for a, b in zip(grads, ours[2]))


def _frozen_weight(model):
    model[1].lin.weight.requires_grad_(False)
    return model[1].lin.weight


@pytest.mark.parametrize(
    "changed",
    [
        lambda m: m[2].lin.weight,  # a parameter
        _frozen_weight,  # a parameter without grad: still read by the input's gradient
        lambda m: m.eval()[3].norm.running_var,  # a buffer an eval-mode BatchNorm saves
    ],
    ids=["parameter", "frozen parameter", "eval buffer"],
)
def test_changed_in_place_between_forward_and_backward_raises_as_autograd_does(changed):
    # The rebuilds read the blocks' parameters and buffers as they are at backward time; plain autograd
    # refuses a backward whose saved tensors were changed since, and so must binomial (else: gradients
    # of values the forward never saw, silently).
    x0 = torch.randn(8, 16)
    for run in (lambda m, x: m(x), lambda m, x: binomial(m, x, 1)):
        model = make(5)
        t = changed(model)
        y = run(model, x0.clone().requires_grad_())
        with torch.no_grad():
            t.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


@pytest.mark.parametrize("train", [True, False])
def test_two_calls_over_one_model_before_one_backward(train):
    # The second forward moves BatchNorm's running stats in training, and the first call's backward
    # rebuilds (and restores) buffers the second call watches: neither is a change in place that
    # plain autograd would refuse.
    x0 = torch.randn(8, 16)

    def twice(m, x):
        return binomial(m, x, 1) + binomial(m, x * 2, 2)

    plain = step(make(6).train(train), x0.clone().requires_grad_(), lambda m, x: m(x) + m(x * 2))
    ours = step(make(6).train(train), x0.clone().requires_grad_(), twice)
    for a, b in zip([plain[1], *plain[2], *plain[3]], [ours[1], *ours[2], *ours[3]]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # two contributions summed: order may differ
