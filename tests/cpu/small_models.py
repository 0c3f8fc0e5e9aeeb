"""What the CPU pool suites share: torchvision's BasicBlock ResNet (BatchNorm, in-place ReLU), and the
training loop whose results must be bitwise the same with and without a pool."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from supermem.bench.models import loss_fn


class BasicBlock(nn.Module):
    """torchvision's: BatchNorm, and an in-place ReLU on the residual sum."""

    def __init__(self, c):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.relu(self.b1(self.c1(x)))
        y = self.b2(self.c2(y))
        y += x
        return self.relu(y)


class ResNet(nn.Module):
    def __init__(self, c=8, blocks=4):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True)
        )
        self.blocks = nn.Sequential(*[BasicBlock(c) for _ in range(blocks)])
        self.fc = nn.Linear(c, 10)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))


def train_steps(build, batch, pool=None, steps=3, autocast=False, during=None):
    """`steps` SGD steps of a fresh `build()` on `batch(generator)` = (x, y or None), under `pool` (or
    under identity saved-tensor hooks, so autograd's saving runs the same code path): every loss, and
    every gradient, parameter and buffer at the end. Forward runs under CPU bf16 autocast when asked;
    `during(pool)` runs between forward and backward, while the saved tensors are in the pool."""
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = batch(torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # dropout: the same draws in every run
    out = []
    for _ in range(steps):
        opt.zero_grad()
        ctx = pool if pool is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with ctx:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                o = model(x)
            loss = o.float().square().mean() if y is None else loss_fn(o.float(), y)
            if pool is not None:
                pool.check()  # mid-step too: tensors away, on their way, rebuilt
                if during is not None:
                    during(pool)
            loss.backward()
        if pool is not None:
            pool.check()
        out.append(loss.detach())
        opt.step()
    return out + [p.grad for p in model.parameters()] + list(model.state_dict().values())


def same(a, b):
    """Two train_steps results equal bit for bit."""
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def hide_entry_unpacks(pool, monkeypatch):
    """While a plan runs, backward unpacking one of the pool's entries no longer marks its step's
    backward (as when every call of it is unseen): what else marks it is then under test."""
    used = pool.plans.used

    def unnoticed(x):
        began = x.step.backward_s
        out = used(x)
        if pool.plans.plan_ok:
            x.step.backward_s = began
        return out

    monkeypatch.setattr(pool.plans, "used", unnoticed)


def restless(pool):
    """The pool runs its plan in every step, never resting (Rest.enter): a plan that keeps
    everything would step aside after its first step, and what it runs then is under test."""
    pool.rest.never = True
    return pool
