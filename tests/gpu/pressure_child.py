"""A tensor pool that offloads under supermem's allocator's pressure, then an OOM caught, then a step
that goes on: tests/gpu/test_pool_gpu.py's pressure test, and what tools/ci/exit_loop.py --mode gpu runs
200 times (an abort at exit was seen after it).

    python tests/gpu/pressure_child.py POLICY
    python tests/gpu/pressure_child.py native     # the same steps on PyTorch's allocator, no pool: does
                                                  # the abort at exit need supermem at all?
"""

import contextlib
import sys

import torch

NATIVE = sys.argv[1] == "native"
if NATIVE:  # the same 3 GiB, PyTorch's way, supermem not even imported
    torch.cuda.set_per_process_memory_fraction(3 * 2**30 / torch.cuda.get_device_properties(0).total_memory)
else:
    import supermem
    from supermem.tensor_pool import Pool

    supermem.install("limit:3GiB")
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()


def step(batch, pool):
    x = torch.randn(batch, 4096, device="cuda")
    with pool if pool is not None else contextlib.nullcontext():
        loss = model(x).square().mean()
        loss.backward()
    model.zero_grad(set_to_none=True)


pool = None if NATIVE else Pool(budget=None, policy=sys.argv[1])  # act only under pressure
step(4096 if NATIVE else 16384, pool)  # 8 saved activations of 256 MiB + params: over 3 GiB unpooled
if pool is not None:
    print("pressure calls", pool.stats()["pressure_calls"], "offloads", pool.stats()["offloads"])
try:
    step(1 << 17, pool)  # 2 GiB per activation: cannot fit
    print("no OOM")
except torch.OutOfMemoryError as e:
    print("OOM", "CUDA out of memory." in str(e))
step(4096, pool)
if pool is not None:
    pool.check()
print("continued", torch.cuda.memory_allocated() < (1 << 30))
