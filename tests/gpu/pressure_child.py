"""A tensor pool that offloads under supermem's allocator's pressure, then an OOM caught, then a step
that goes on: tests/gpu/test_pool_gpu.py's pressure test, and what tools/ci/exit_loop.py --mode gpu runs
200 times (an abort at exit was seen after it).

    python tests/gpu/pressure_child.py POLICY
"""

import sys

import torch

import supermem
from supermem.tensor_pool import Pool

supermem.install("limit:3GiB")
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()


def step(batch, pool):
    x = torch.randn(batch, 4096, device="cuda")
    with pool:
        loss = model(x).square().mean()
        loss.backward()
    model.zero_grad(set_to_none=True)


pool = Pool(budget=None, policy=sys.argv[1])  # act only under pressure
step(16384, pool)  # 8 saved activations of 256 MiB + params: over 3 GiB without the pool
print("pressure calls", pool.stats()["pressure_calls"], "offloads", pool.stats()["offloads"])
try:
    step(1 << 17, pool)  # 2 GiB per activation: cannot fit
    print("no OOM")
except torch.OutOfMemoryError as e:
    print("OOM", "CUDA out of memory." in str(e))
step(4096, pool)
pool.check()
print("continued", torch.cuda.memory_allocated() < (1 << 30))
