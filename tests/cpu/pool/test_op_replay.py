"""Op-level replay in the tensor pool on CPU: a saved tensor made by a cheap op (GELU, LayerNorm and its
autocast cast, BatchNorm + ReLU, add + ReLU) from tensors the step keeps anyway is dropped and rebuilt
by running that op again. Training under every policy is bitwise plain PyTorch's; the replays really
happen (stats()["replays"]); each supported node type rebuilds its tensor exactly; what cannot be
replayed exactly (dropout, changed inputs, unknown eps, cascades) is kept."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from small_models import ResNet as BasicResNet
from small_models import same, train_steps

from supermem.bench.models import GPT, ResNet
from supermem.policies import live_names
from supermem.tensor_pool import Pool
from supermem.tensor_pool.op_replay import OpReplay

CASES = {
    # bf16 autocast on CPU, as the GPU bench runs it: LayerNorm -> cast and GELU chains
    "gpt": (
        lambda: GPT(layers=2, d=32, heads=2, vocab=64, ctx=16),
        lambda g: tuple(torch.randint(0, 64, (4, 16), generator=g) for _ in range(2)),
        True,
    ),
    # the bench's Bottleneck: relu(bn(conv)) and relu(bn(conv) + x), a downsample branch
    "resnet": (
        lambda: ResNet((1, 1, 1, 1), width=8, classes=10),
        lambda g: (torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 10, (2,), generator=g)),
        False,
    ),
    # torchvision's BasicBlock: in-place ReLU, in-place residual add
    "basic": (
        BasicResNet,
        lambda g: (torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)),
        False,
    ),
}


def train(case, pool=None, steps=4):
    build, batch, autocast = CASES[case]
    return train_steps(build, batch, pool, steps, autocast)


def slow_link(pool):
    """Copies priced as over a slow link: the policy recomputes what it can (chance out of the choice)."""
    pool.treatments["offload"].link_bytes_per_s = 1e3
    return pool


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("policy", live_names())
def test_training_under_a_tight_budget_is_bitwise_plain_pytorch(case, policy):
    ref = train(case)
    pool = slow_link(Pool(budget=0, policy=policy, host_limit="256MiB"))
    got = train(case, pool)
    assert same(ref, got)
    s = pool.stats()
    assert s["tracked_bytes"] == 0
    if policy == "lru":  # offloads only
        assert s["replays"] == 0 and s["offloads"] > 0, s
    else:
        assert s["replays"] > 0, s


def saved_recipes(model, x, autocast=False):
    """Runs one forward under a roomy pool: the op chains of the entries that got an op recipe."""
    pool = Pool(budget="1GiB", policy="cost_aware", host_limit="64MiB")
    with pool, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    entries = [e for r in pool.ledger.entries.values() if (e := r()) is not None]
    return pool, out, {e.recipe.ops: e for e in entries if isinstance(e.recipe, OpReplay)}


def drop_and_backward(pool, out, entries):
    """Drops the entries by their recipes, runs backward (which rebuilds them)."""
    for e in entries:
        assert pool.leave(e, pool.treatments["recompute"])
    with pool:
        out.float().square().sum().backward()
    pool.check()


def grads_plain_and_replayed(make, x, ops, autocast=False):
    torch.manual_seed(0)
    model = make()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    out.float().square().sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch.manual_seed(0)
    model = make()
    pool, out, by_ops = saved_recipes(model, x, autocast)
    assert ops in by_ops, list(by_ops)
    drop_and_backward(pool, out, [by_ops[ops]])
    assert pool.stats()["replays"] == 1
    return ref, [p.grad for p in model.parameters()]


class Gelu(nn.Module):
    def __init__(self, approximate="none"):
        super().__init__()
        self.a, self.b, self.approximate = nn.Linear(16, 64), nn.Linear(64, 16), approximate

    def forward(self, x):
        return self.b(F.gelu(self.a(x), approximate=self.approximate))


class Norm(nn.Module):
    def __init__(self, eps=1e-5):
        super().__init__()
        self.pre, self.ln, self.lin = nn.Linear(16, 16), nn.LayerNorm(16, eps=eps), nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(self.ln(self.pre(x).float() * 2))  # fp32 into the norm: autocast casts its output


class ConvBN(nn.Module):
    def __init__(self, residual=False, inplace=False):
        super().__init__()
        self.c1, self.bn = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.residual, self.inplace = residual, inplace

    def forward(self, x):
        x = self.c1(x)
        y = self.bn(self.c2(x))
        if self.residual:
            y = y + x
        y = F.relu(y, inplace=self.inplace)
        return self.c2(y)


class Heads(nn.Module):
    """Attention's heads merged back before the output projection, a.transpose(1, 2).reshape(b, t, d):
    a copy the projection saves, rebuilt from `a` (which its op keeps: here exp, as flash attention
    keeps its output)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        a = x.view(2, 4, 4, 4).exp()  # (b, heads, t, head dim)
        return self.proj(a.transpose(1, 2).reshape(2, 4, 16))


X16 = torch.randn(8, 16)
IMG = torch.randn(2, 4, 8, 8)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate):
    ref, got = grads_plain_and_replayed(lambda: Gelu(approximate), X16, ("GeluBackward0",))
    assert same(ref, got)


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_layer_norm_fp32(eps):
    ref, got = grads_plain_and_replayed(lambda: Norm(eps), X16, ("NativeLayerNormBackward0",))
    assert same(ref, got)


def test_layer_norm_then_autocast_cast():
    ops = ("NativeLayerNormBackward0", "ToCopyBackward0")
    ref, got = grads_plain_and_replayed(Norm, X16, ops, autocast=True)
    assert same(ref, got)


def test_heads_merged_by_a_reshape_that_copies():
    ops = ("TransposeBackward0", "CloneBackward0", "UnsafeViewBackward0")
    x = torch.randn(8, 16, requires_grad=True)
    ref, got = grads_plain_and_replayed(Heads, x, ops)
    assert same(ref, got)


def test_batch_norm_then_relu():
    ops = ("NativeBatchNormBackward0", "ReluBackward0")
    ref, got = grads_plain_and_replayed(ConvBN, IMG, ops)
    assert same(ref, got)


def test_batch_norm_add_then_inplace_relu():
    ops = ("NativeBatchNormBackward0", "AddBackward0", "ReluBackward0")
    ref, got = grads_plain_and_replayed(lambda: ConvBN(residual=True, inplace=True), IMG, ops)
    assert same(ref, got)


def test_batch_norm_replay_leaves_running_statistics_alone():
    torch.manual_seed(0)
    model = ConvBN()
    pool, out, by_ops = saved_recipes(model, IMG)
    stats = [b.clone() for b in model.bn.buffers()]
    drop_and_backward(pool, out, list(by_ops.values()))
    assert pool.stats()["replays"] > 0
    assert same(stats, list(model.bn.buffers()))


def test_a_layer_norms_eps_is_its_modules_and_without_one_there_is_no_recipe():
    """LayerNorm's node does not keep eps: the replay reads the module's (any value), and a layer
    norm whose weight no module with an eps owns is not guessed."""
    ref, got = grads_plain_and_replayed(lambda: Norm(eps=0.37), X16, ("NativeLayerNormBackward0",))
    assert same(ref, got)

    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre, self.lin = nn.Linear(16, 16), nn.Linear(16, 16)
            self.w, self.b = nn.Parameter(torch.ones(16)), nn.Parameter(torch.zeros(16))

        def forward(self, x):
            return self.lin(F.layer_norm(self.pre(x), (16,), self.w, self.b, 0.37))

    torch.manual_seed(0)
    model = Functional()
    _, _, by_ops = saved_recipes(model, X16)
    assert ("NativeLayerNormBackward0",) not in by_ops


def test_dropout_is_never_replayed():
    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            return self.b(torch.relu(F.dropout(self.a(x), 0.5)))

    _, _, by_ops = saved_recipes(Drop(), X16)
    assert not by_ops


def test_layer_norm_without_bias_is_kept():
    """A missing bias and a frozen one look alike in the node (no edge): neither is guessed."""

    class NoBias(Norm):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(16, bias=False)

    _, _, by_ops = saved_recipes(NoBias(), X16)
    assert not by_ops


def test_input_changed_in_place_is_kept_and_raises_like_pytorch():
    class Change(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 16)

        def forward(self, x):
            h = self.a(x)
            g = F.gelu(h)
            out = self.b(g)
            with torch.no_grad():
                h.mul_(2)  # gelu's input, after gelu saved it: a replay would read the new value
            return out

    torch.manual_seed(0)
    pool, out, by_ops = saved_recipes(Change(), X16)
    (e,) = by_ops.values()
    assert not pool.treatments["recompute"].applies(e)
    assert not pool.leave(e, pool.treatments["recompute"])
    with pool, pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_no_cascades_of_op_replays():
    """ResNet: each block's output is read by the next block's output recipe. Dropping both would
    rebuild a chain back through the model at backward: one of them stays."""
    torch.manual_seed(0)
    model = ResNet((3,), width=4, classes=10)
    pool, out, by_ops = saved_recipes(model, torch.randn(2, 3, 16, 16))
    entries = [e for r in pool.ledger.entries.values() if (e := r()) is not None]
    adds = [e for e in entries if isinstance(e.recipe, OpReplay) and "AddBackward0" in e.recipe.ops]
    outs = sorted(adds, key=lambda e: e.seq)
    assert len(outs) == 3  # the first block's reads its downsample branch's BatchNorm
    rc = pool.treatments["recompute"]
    assert pool.leave(outs[1], rc)
    assert not rc.applies(outs[0]) and not rc.applies(outs[2])  # read by it / reads it
    assert not pool.leave(outs[2], rc)
    with pool:
        out.sum().backward()
    assert pool.stats()["replays"] == 1


def test_pressure_during_a_replay_leaves_its_inputs(monkeypatch):
    """The allocator may call the pool's pressure handler while a replay runs: the inputs it just
    brought back must stay (taking them frees nothing while the replay holds them, and costs another
    rebuild later)."""
    from supermem.tensor_pool import op_replay

    torch.manual_seed(0)
    pool, out, by_ops = saved_recipes(ConvBN(), IMG)
    e = by_ops[("NativeBatchNormBackward0", "ReluBackward0")]
    (leaf,) = [x for x in e.recipe.leaves if not isinstance(x, torch.Tensor)]
    states = []
    bn = op_replay.OPS["NativeBatchNormBackward0"]

    def under_pressure(a, v, *inputs):
        pool.on_pressure(1 << 40)  # everything the handler may take
        states.append(leaf.state.value)
        return bn.run(a, v, *inputs)

    monkeypatch.setitem(op_replay.OPS, "NativeBatchNormBackward0", op_replay.Op(3, bn.read, under_pressure))
    e.recipe.prog[0] = (e.recipe.prog[0][0], op_replay.OPS["NativeBatchNormBackward0"], *e.recipe.prog[0][2:])
    drop_and_backward(pool, out, [e])
    assert states == ["resident"]


def test_inputs_held_by_another_pool_are_not_used():
    """Two pools over one graph: an entry of the other pool is not this pool's to bring back."""
    torch.manual_seed(0)
    model = Gelu()
    a = Pool(budget="1GiB", policy="cost_aware", host_limit="64MiB")
    b = Pool(budget="1GiB", policy="cost_aware", host_limit="64MiB")
    with a:
        g = F.gelu(model.a(X16))  # gelu saves its input in pool a
    with b:
        out = model.b(g)  # the linear saves gelu's output in pool b
    entries = [e for r in b.ledger.entries.values() if (e := r()) is not None]
    assert entries and not any(isinstance(e.recipe, OpReplay) for e in entries)
    out.sum().backward()


def test_a_rebuild_in_a_create_graph_backward_records_no_graph():
    """A backward with create_graph runs with grad on: the chain still runs under no_grad, so the rebuilt
    tensor holds no graph of its own (one would keep its inputs' tensors alive with it)."""
    torch.manual_seed(0)
    model = Gelu()
    pool, out, by_ops = saved_recipes(model, torch.randn(8, 16))
    e = by_ops[("GeluBackward0",)]
    assert pool.leave(e, pool.treatments["recompute"])
    with pool:
        torch.autograd.grad(out.square().sum(), list(model.parameters()), create_graph=True)
    assert pool.stats()["replays"] == 1
    assert e.tensor is not None and e.tensor.grad_fn is None and not e.tensor.requires_grad
