"""supermem.stream on CUDA: streamed training bitwise equal to unstreamed training whose optimizer also
steps on the host (the only place streaming is allowed to differ: a CPU optimizer step need not round
like a CUDA one); streaming + binomial checkpointing + pool the same; the device peak far below the
parameters' size; SUPERMEM_CONF=stream:weights streams an unchanged script; the device optimizer step
(optimizer_step="device") bitwise equal to unstreamed CUDA training, and its time beside the host step's."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import supermem
from supermem.checkpoint import binomial

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def deterministic():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


class Net(nn.Module):
    """Convolutions with BatchNorm, a Linear called twice, a tied weight, dropout, and (binomial=True) a
    chain of blocks through supermem.checkpoint.binomial."""

    def __init__(self, binomial_chain=False, c=16, width=64):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1)
        )
        self.inp = nn.Linear(c, width)
        self.blocks = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.GELU(), nn.Dropout(0.1))
                for _ in range(6)
            ]
        )
        self.twice = nn.Linear(width, width)
        self.out = nn.Linear(width, width, bias=False)
        self.out.weight = self.twice.weight
        self.binomial_chain = binomial_chain

    def forward(self, x):
        x = self.inp(self.conv(x).mean((2, 3)))
        x = binomial(self.blocks, x, checkpoints=2) if self.binomial_chain else self.blocks(x)
        x = torch.relu(self.twice(torch.relu(self.twice(x))))
        return self.out(x)


def reference(model, x, kind, steps):
    """Unstreamed training on CUDA whose optimizer steps on host copies of the parameters."""
    model = model.cuda()
    host = [p.detach().cpu().requires_grad_() for p in model.parameters()]
    opt = make_opt(kind, host)
    out = []
    torch.manual_seed(5)
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        for h, p in zip(host, model.parameters()):
            h.grad = p.grad.cpu()
        out.append((loss.item(), [h.grad.clone() for h in host]))
        opt.step()
        with torch.no_grad():
            for h, p in zip(host, model.parameters()):
                p.copy_(h)
                p.grad = None
    return out, [h.detach() for h in host] + [b.cpu() for b in model.buffers()]


def streamed(model, x, kind, steps, pool=False, unit_bytes=64 << 20, step="host"):
    s = supermem.stream(model, "cuda", unit_bytes=unit_bytes, optimizer_step=step)
    opt = make_opt(kind, model.parameters())
    out = []
    torch.manual_seed(5)
    for _ in range(steps):
        if pool:
            with supermem.pool(budget=1 << 20, device="cuda", min_bytes=0):
                loss = model(x).square().mean()
        else:
            loss = model(x).square().mean()
        loss.backward()
        s.sync()
        out.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert bool(s._state_views) == (step == "device")  # the device step kept the state in host blocks
    state = [p.detach().clone() for p in model.parameters()] + [b.cpu() for b in model.buffers()]
    s.close()
    return out, state


def make_opt(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05)


def assert_same(a, b):
    for (la, ga), (lb, gb) in zip(a[0], b[0], strict=True):
        assert la == lb
        for x, y in zip(ga, gb, strict=True):
            assert torch.equal(x, y)
    for x, y in zip(a[1], b[1], strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("unit_bytes", [0, 64 << 20], ids=["unit=module", "unit=model"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("chain", [False, True])
def test_streamed_training_bitwise_on_cuda(kind, chain, unit_bytes):
    torch.manual_seed(0)
    x = torch.randn(8, 3, 16, 16, device="cuda")
    torch.manual_seed(1)
    a = reference(Net(chain), x, kind, 3)
    torch.manual_seed(1)
    b = streamed(Net(chain), x, kind, 3, unit_bytes=unit_bytes)
    assert_same(a, b)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("chain", [False, True])
def test_overlapped_host_step_bitwise_on_cuda(kind, chain):
    """optimizer_step="overlap": the worker thread steps each unit on the host once its gradient copies
    have ended, while backward goes on; the result is the host step's."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, 16, 16, device="cuda")
    torch.manual_seed(1)
    a = reference(Net(chain), x, kind, 3)
    torch.manual_seed(1)
    b = streamed(Net(chain), x, kind, 3, unit_bytes=0, step="overlap")
    assert_same(a, b)


def test_streaming_binomial_and_pool_on_cuda():
    torch.manual_seed(0)
    x = torch.randn(8, 3, 16, 16, device="cuda")
    torch.manual_seed(1)
    a = reference(Net(True), x, "sgd", 3)
    torch.manual_seed(1)
    b = streamed(Net(True), x, "sgd", 3, pool=True, unit_bytes=0)
    assert_same(a, b)


def test_device_peak_far_below_the_parameters():
    layers, width = 48, 4096
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # 3 GiB
    s = supermem.stream(model, "cuda")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(16, width, device="cuda")
    for _ in range(2):  # the second step replays the first one's order with prefetch
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    st = s.stats()
    print(f"params {param_bytes / 2**30:.2f} GiB, streamed peak {peak / 2**20:.0f} MiB, {st}")
    assert peak < param_bytes / 4
    assert st["prefetch_hits"] > 0 and st["h2d_gbps"] > 1
    s.close()


def test_conf_stream_weights_streams_an_unchanged_script():
    script = textwrap.dedent(
        """
        import torch, torch.nn as nn
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(4, 64, device="cuda")
        for _ in range(3):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert model._supermem_streamer is not None
        assert all(p.device.type == "cpu" for p in model.parameters())
        assert torch.isfinite(loss)
        print("streamed ok", model._supermem_streamer.stats()["fetches"])
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERMEM")}
    env.update(SUPERMEM="1", SUPERMEM_CONF="stream:weights")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "streamed ok" in r.stdout, r.stdout + r.stderr


def test_stream_close_cycles_keep_no_host_memory():
    """A GPU soak kept ~2x the model in pinned memory per stream/close cycle: now close() gives the
    blocks back to the device's host pool, whose reserved bytes stay flat after the first cycle."""
    import psutil

    model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(3)])  # 48 MiB
    x = torch.randn(16, 2048, device="cuda")
    reserved, rss = [], []
    for _ in range(5):
        s = supermem.stream(model, "cuda")
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        model(x).square().mean().backward()
        opt.step()
        s.close()
        del opt
        torch.cuda.synchronize()
        assert s.host.in_use_bytes == 0
        assert s.host.pool.pinned
        reserved.append(s.host.reserved_bytes)
        rss.append(psutil.Process().memory_info().rss)
    print(f"host pool reserved per cycle (MiB): {[r >> 20 for r in reserved]}, rss: {[r >> 20 for r in rss]}")
    assert reserved[-1] == reserved[0]
    assert rss[-1] - rss[1] < 48 << 20


def test_pool_and_streamer_share_the_host_pool_and_the_copy_streams():
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    s = supermem.stream(model, "cuda")
    pool = supermem.tensor_pool.Pool(budget=0, device="cuda", min_bytes=0)
    assert pool.host.pool is s.host.pool and s.host.pool.pinned
    assert pool.copies.stream_ids == s.copies.stream_ids
    x = torch.randn(64, 256, device="cuda")
    with pool:
        model(x).square().mean().backward()
    s.sync()
    assert pool.stats()["offloads"] > 0 and all(p.grad is not None for p in model.parameters())
    s.close()
    assert s.host.in_use_bytes == 0


def plain_cuda(model, x, kind, steps):
    """Unstreamed training with the optimizer on CUDA: what the device step must equal."""
    model = model.cuda()
    opt = make_opt(kind, model.parameters())
    out = []
    torch.manual_seed(5)
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        out.append((loss.item(), [p.grad.cpu() for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
    return out, [p.detach().cpu() for p in model.parameters()] + [b.cpu() for b in model.buffers()]


@pytest.mark.parametrize("unit_bytes", [0, 64 << 20], ids=["unit=module", "unit=model"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_device_optimizer_step_bitwise_plain_cuda_training(kind, unit_bytes):
    torch.manual_seed(0)
    x = torch.randn(8, 3, 16, 16, device="cuda")
    torch.manual_seed(1)
    a = plain_cuda(Net(), x, kind, 3)
    torch.manual_seed(1)
    b = streamed(Net(), x, kind, 3, unit_bytes=unit_bytes, step="device")
    assert_same(a, b)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_optimizer_step_times_host_and_device(kind):
    """Prints the optimizer step's time both ways for a 768 MiB model (which is faster decides the
    default) and checks both step the same parameters to within CPU-vs-CUDA rounding. Both get the same
    gradients each step (set by hand): gradients from each run's own forward differ by an ulp from the
    second step on, and AdamW's normalised update turns a sign flip of a near-zero one into a whole lr,
    which says nothing of the step. (That the device step is exactly CUDA's own step is
    test_device_optimizer_step_bitwise_plain_cuda_training.)"""
    import time

    layers, width, steps = 12, 4096, 3
    x = torch.randn(16, width, device="cuda")
    gen = torch.Generator().manual_seed(1)
    shapes = [(width, width), (width,)] * layers
    grads = [[torch.randn(shape, generator=gen) * 1e-3 for shape in shapes] for _ in range(steps)]
    times, params = {}, {}
    for where in ("host", "device"):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        s = supermem.stream(model, "cuda", optimizer_step=where)
        opt = make_opt(kind, model.parameters())
        model(x).square().mean().backward()  # the gradients where the streamer keeps them
        s.sync()
        for step_grads in grads:  # the first step makes the state
            for p, g in zip(model.parameters(), step_grads, strict=True):
                p.grad.copy_(g)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            torch.cuda.synchronize()
            times[where] = time.perf_counter() - t0
        params[where] = [p.detach().clone() for p in model.parameters()]
        assert bool(s._state_views) == (where == "device")
        s.close()
    print(
        f"{kind} optimizer step, 768 MiB of parameters: host {times['host'] * 1e3:.1f} ms, "
        f"device {times['device'] * 1e3:.1f} ms"
    )
    lr = make_opt(kind, [torch.zeros(1, requires_grad=True)]).defaults["lr"]
    for a, b in zip(params["host"], params["device"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=lr * 1e-4)
