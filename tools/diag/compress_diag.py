"""Why the pool does or does not compress: ResNet-152 (b64, fp32) under cost_aware at a budget, one
variant per process. Per step: time, what left the device and how; at the end the learned prices
(region forward seconds, compress seconds per byte, the link rate) and the host seconds the pool spent
deciding. GPU only (supermem's allocator, so the budget is its soft limit and pressure calls happen).

    python3 tools/diag/compress_diag.py offload+recompute+compress [budget_gib] [steps]
    python3 tools/diag/compress_diag.py offload+recompute+compress+guess   # Compress(room="guess"): no sync
"""

import sys
import time
import types

import torch

import supermem
from supermem.bench.models import PRESETS, loss_fn

GiB = 2**30
KEYS = ("offloads", "dropped", "recomputes", "pressure_calls", "sync_restores", "compressions", "repacks")


def main() -> None:
    variant = sys.argv[1].split("+")
    budget_gib = float(sys.argv[2]) if len(sys.argv) > 2 else 4.5
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    supermem.install()
    from supermem.tensor_pool import Pool
    from supermem.tensor_pool import treatments as tm
    from supermem.tensor_pool.treatments import make_treatments

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    preset = PRESETS["resnet"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = preset.build()
    x, y = preset.batch(torch.device("cuda"), torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    names = [n for n in variant if n in tm.TREATMENTS]
    ways = [tm.Compress(room="guess") if n == "compress" and "guess" in variant else n for n in names]
    pool = Pool(budget=int(budget_gib * GiB), policy="cost_aware", treatments=make_treatments(ways))
    host_s: dict[str, float] = {}
    # bound methods (the allocator holds weak ones): the budget's choosing and fitting, the pressure handler
    for owner, name in ((pool.budget, "choices"), (pool.budget, "fit"), (pool, "on_pressure")):
        real = getattr(owner, name)

        def timed(self, *a, _real=real, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _real(*a, **k)
            finally:
                host_s[_name] = host_s.get(_name, 0.0) + time.perf_counter() - t0

        setattr(owner, name, types.MethodType(timed, owner))
    for i in range(steps):
        if i == 3:
            host_s.clear()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with pool:
            loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        torch.cuda.synchronize()
        s = pool.stats()
        moved = {k: s.get(k) for k in KEYS if s.get(k) is not None}
        print(
            f"step {i}: {start.elapsed_time(end):.1f} ms {moved} offloaded {s['offloaded_bytes'] / GiB:.2f}"
            f" dropped {s['dropped_bytes'] / GiB:.2f} compressed {s.get('compressed_bytes', 0) / GiB:.2f}",
            flush=True,
        )
        pool.reset_stats()
    print(f"peak {torch.cuda.max_memory_allocated() / GiB:.2f} GiB; host s in the last {steps - 3} steps:",
          {k: round(v, 3) for k, v in host_s.items()})  # fmt: skip
    costs = [pool.regions.cost_s(m) for m in pool.regions.modules]
    known = [c for c in costs if c]
    print(f"regions {len(costs)}: forward ms sum {1e3 * sum(known):.2f}, per block (every 5th)",
          [round(1e3 * (pool.regions.cost_s(b) or 0), 3) for b in model.blocks][::5])  # fmt: skip
    c = pool.treatments.get("compress")
    if c is not None:
        print(f"compress s/byte: pack {c._timing['pack'].s_per_byte} unpack {c._timing['unpack'].s_per_byte},"
              f" packed/tensor {c._packed_bytes / max(1, c._tensor_bytes):.3f}")  # fmt: skip
    off = pool.treatments.get("offload")
    if off is not None:
        print(f"link {off.rate(pool) / 1e9:.1f} GB/s, last forward {pool.clock.last_forward_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
