"""One model's training step with and without the tensor pool, in one process: native step time, the
pool's step times at a budget (a fraction of native's peak on a GPU, of the bytes saved for backward on
CPU) and the pool's counters. Small and self-contained, so tools/diag/ab_commits.sh can run it against
several commits on one card.

    python3 tools/diag/pool_step.py gpt 0.75 [policy]        # GPU: supermem's allocator installed here
    python3 tools/diag/pool_step.py gpt 1 hooks              # identity saved-tensor hooks: the floor of any
                                                        # pool that runs Python per saved tensor
    STEPS=12 python3 tools/diag/pool_step.py ...             # more timed steps (default 4): the host-bound
                                                        # step varies by 20-30% from one to the next
"""

import contextlib
import os
import statistics
import sys
import time

import torch

import supermem
from supermem.bench.models import PRESETS, loss_fn
from supermem.tensor_pool import Pool


def main() -> None:
    name, fraction = sys.argv[1], float(sys.argv[2])
    policy = sys.argv[3] if len(sys.argv) > 3 else "cost_aware"
    cuda = torch.cuda.is_available()
    if cuda:
        supermem.install()  # the pool's budget is the allocator's soft limit
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    device = torch.device("cuda" if cuda else "cpu")
    preset = PRESETS[name]
    torch.manual_seed(0)
    with device:
        model = preset.build()
    x, y = preset.batch(device, torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step(ctx) -> float:
        sync()
        t0 = time.perf_counter()
        with ctx:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=preset.bf16):
                out = model(x)
            loss_fn(out, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0

    for _ in range(2):
        step(contextlib.nullcontext())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    native_s = min(step(contextlib.nullcontext()) for _ in range(3))
    if cuda:
        budget = int(torch.cuda.max_memory_allocated() * fraction)
    else:
        probe = Pool(budget=None)
        step(probe)
        budget = int(probe.stats()["peak_resident_bytes"] * fraction)
        del probe  # (its region hooks would run in every later step)
    if policy == "hooks":
        pool = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    else:
        pool = supermem.pool(budget=budget, policy=policy)
    for _ in range(3):
        step(pool)
    if policy != "hooks":
        pool.reset_stats()
    times = [step(pool) for _ in range(int(os.environ.get("STEPS", 4)))]
    print(
        f"{preset.label} {policy} {fraction:g}: native {native_s * 1e3:.1f} ms, "
        f"pool {min(times) * 1e3:.1f} ms ({min(times) / native_s:.2f}x), "
        f"median {statistics.median(times) * 1e3:.1f} ms, steps {[round(t * 1e3, 1) for t in times]} ms"
    )
    if policy != "hooks":
        print({k: v for k, v in pool.stats().items() if v and not isinstance(v, (list, dict))})


if __name__ == "__main__":
    main()
