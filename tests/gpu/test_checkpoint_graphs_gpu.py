"""supermem.checkpoint.binomial(graphs=True) on CUDA: training whose repeated blocks replay CUDA graphs
equals plain training bitwise (losses, gradients, parameters, BatchNorm's running stats, over steps
whose weights change), with the model on the device and under supermem.stream; a block that draws
random numbers is refused with a warning and runs eagerly, still bitwise; and replays happen."""

import pytest
import torch
import torch.nn as nn

import supermem
from supermem import checkpoint_graphs
from supermem.checkpoint import binomial

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def deterministic():
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


class Bottleneck(nn.Module):
    def __init__(self, c_in, c, dropout=0.0):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c, 1, bias=False),
            nn.BatchNorm2d(c),
            nn.ReLU(inplace=True),
            nn.Conv2d(c, c, 3, padding=1, bias=False),
            nn.BatchNorm2d(c),
            nn.ReLU(inplace=True),
            nn.Conv2d(c, c_in, 1, bias=False),
            nn.BatchNorm2d(c_in),
        )
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x):
        return torch.relu(self.drop(self.body(x)) + x)


class Net(nn.Module):
    """A stem, a chain of 2 + n blocks (two of other shapes first, then n alike) and a head."""

    def __init__(self, n=9, graphs=False, dropout=0.0):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        blocks = [Bottleneck(32, 8), Bottleneck(32, 16)] + [Bottleneck(32, 8, dropout) for _ in range(n)]
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(32, 10)
        self.graphs = graphs

    def forward(self, x):
        x = binomial(self.blocks, self.stem(x), checkpoints=3, graphs=self.graphs)
        return self.head(x.mean((2, 3)))


def train(model, x, y, steps, host_step=False):
    """Losses, gradients after each step, then the parameters and buffers. host_step: the optimizer
    steps on host copies (what a streamed model's does), so streamed and unstreamed runs compare."""
    params = list(model.parameters())
    stepped = [p.detach().cpu().requires_grad_() for p in params] if host_step else params
    opt = torch.optim.SGD(stepped, lr=0.05, momentum=0.9)
    out = []
    torch.manual_seed(3)
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        streamer = getattr(model, "_supermem_streamer", None)
        if streamer is not None:
            streamer.sync()
        if host_step and stepped is not params:
            for h, p in zip(stepped, params):
                h.grad = p.grad.cpu()
        out.append(loss.detach().cpu())
        out += [p.grad.detach().cpu().clone() for p in stepped]
        opt.step()
        opt.zero_grad()
        if host_step and stepped is not params:
            with torch.no_grad():
                for h, p in zip(stepped, params):
                    p.copy_(h)
                    p.grad = None
    return out + [p.detach().cpu() for p in params] + [b.cpu() for b in model.buffers()]


def data():
    torch.manual_seed(0)
    return torch.randn(4, 3, 12, 12, device="cuda"), torch.randint(0, 10, (4,), device="cuda")


def replays(model):
    g = checkpoint_graphs._graphs.get(model.blocks[0])
    return g.replays if g is not None else 0


def assert_equal(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"tensor {i}: max difference {(u.double() - v.double()).abs().max()}"


def test_graphed_training_bitwise_on_device():
    x, y = data()
    torch.manual_seed(1)
    plain = train(Net().cuda(), x, y, 3)
    torch.manual_seed(1)
    model = Net(graphs=True).cuda()
    ours = train(model, x, y, 3)
    # 9 blocks alike, 3 steps: each forward (sweep and rebuilds) and each backward replays
    assert replays(model) >= 3 * 2 * 9
    assert_equal(plain, ours)


def test_graphed_training_bitwise_streamed():
    x, y = data()
    torch.manual_seed(1)
    plain = train(Net().cuda(), x, y, 3, host_step=True)
    torch.manual_seed(1)
    model = Net(graphs=True)
    with supermem.stream(model, "cuda", unit_bytes=16 << 10):  # a unit a block
        ours = train(model, x, y, 3)
        assert replays(model) >= 3 * 2 * 9
    assert_equal(plain, ours)


def test_graphed_training_bitwise_in_a_pool():
    """The held boundaries go through a pool that offloads everything it can (budget 1 MiB); the
    captures happen inside the pooled step."""
    x, y = data()
    torch.manual_seed(1)
    plain = train(Net().cuda(), x, y, 3)
    torch.manual_seed(1)
    model = Net(graphs=True).cuda()
    pool = supermem.pool(budget=1 << 20, device="cuda", min_bytes=0)

    def pooled(t):
        with pool:
            return Net.forward(model, t)

    model.forward = pooled
    ours = train(model, x, y, 3)
    assert replays(model) >= 3 * 2 * 9
    assert pool.stats()["packed"] > 0
    assert_equal(plain, ours)


def test_random_blocks_run_eagerly_and_say_so():
    x, y = data()
    torch.manual_seed(1)
    plain = train(Net(dropout=0.2).cuda(), x, y, 2)
    torch.manual_seed(1)
    model = Net(graphs=True, dropout=0.2).cuda()
    with pytest.warns(UserWarning, match="draw random numbers"):
        ours = train(model, x, y, 2)
    assert replays(model) == 0
    assert_equal(plain, ours)


class Chain(nn.Module):
    """Net's blocks called one by one, for the pool (its regions: the blocks)."""

    def __init__(self, n=9, dropout=0.0):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        blocks = [Bottleneck(32, 8), Bottleneck(32, 16)] + [Bottleneck(32, 8, dropout) for _ in range(n)]
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean((2, 3)))


def pooled_training(dropout=0.0, graphs=True, steps=4):
    """Plain training, then the same under planned pools that recompute at shares of the peak (which
    blocks a plan runs light depends on the profiled step's timings: op replays of BatchNorm + ReLU
    may come first): bitwise each time; the light calls and graph replays of them all."""
    from supermem.tensor_pool import Pool
    from supermem.tensor_pool.treatments import Recompute

    torch.manual_seed(0)
    x, y = torch.randn(16, 3, 64, 64, device="cuda"), torch.randint(0, 10, (16,), device="cuda")
    torch.manual_seed(1)
    plain = train(Chain(dropout=dropout).cuda(), x, y, steps)
    full = Pool(budget="1GiB", policy="planned", min_bytes=0)
    train_pooled(Chain(dropout=dropout).cuda(), full, x, y, 3)
    light = replayed = 0
    seen = []
    for share in (0.7, 0.6, 0.5, 0.4):
        budget = int(full.stats()["plan"]["measured_peak_bytes"] * share)
        torch.manual_seed(1)
        model = Chain(dropout=dropout).cuda()
        pool = Pool(budget=budget, policy="planned", min_bytes=0, treatments=(Recompute(),), graphs=graphs)
        assert_equal(plain, train_pooled(model, pool, x, y, steps))
        s = pool.stats()
        light, replayed = light + s["light_calls"], replayed + s["graph_replays"]
        plan = s["plan"]
        seen.append((share, s["light_calls"], s["graph_replays"], plan["feasible"], plan["recompute"]))
    return light, replayed, seen


def train_pooled(model, pool, x, y, steps):
    def forward(t):
        with pool:
            return Chain.forward(model, t)

    model.forward = forward
    return train(model, x, y, steps)


@pytest.fixture
def uncapped(monkeypatch):
    """Graphs whatever structure repeats: this net's tensors are large against its budgets, and it
    has 9 alike blocks (the pool graphs from 16)."""
    from supermem import costs

    monkeypatch.setattr(costs, "LIGHT_GRAPHS_MAX_SHARE", 1.0)
    monkeypatch.setattr(costs, "LIGHT_GRAPHS_MIN_CALLS", 4)


def test_a_pools_light_calls_replay_their_backward_bitwise(uncapped):
    """The plan runs blocks light (grad off, rebuilt in backward); the 9 alike replay a CUDA graph
    for the rebuild and its backward. Training stays bitwise plain training's."""
    light, replayed, seen = pooled_training()
    assert light >= 4 and replayed > 0, seen
    light, replayed, seen = pooled_training(graphs=False)
    assert light >= 4 and replayed == 0, seen


def test_a_pools_random_light_calls_stay_eager(uncapped):
    """The 9 alike blocks' Dropouts run light and are refused (they draw random numbers); their
    bodies, regions of their own, may replay graphs. Training stays bitwise."""
    with pytest.warns(UserWarning, match="draw random numbers"):
        light, _, seen = pooled_training(dropout=0.2)
    assert light >= 4, seen
