"""Where a pool step's peak falls: per step and phase (forward, loss, backward) the peak allocated bytes,
with the pool's own view (target, margin, resident bytes, what left). GPU only.

    SUPERMEM=1 python3 tools/diag/pool_diag.py gpt cost_aware 0.75 [steps]
"""

import contextlib
import sys
import time

import torch

import supermem
from supermem.bench.models import PRESETS, loss_fn

GiB = 2**30


def main() -> None:
    model_name, policy, frac = sys.argv[1], sys.argv[2], float(sys.argv[3])
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 6
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    preset = PRESETS[model_name]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = preset.build()
    x, y = preset.batch(torch.device("cuda"), torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)

    def step(ctx) -> dict:
        marks = {}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda.reset_peak_memory_stats()
        with ctx:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=preset.bf16):
                out = model(x)
                torch.cuda.synchronize()
                marks["fwd"] = torch.cuda.max_memory_allocated()
                marks["fwd_end"] = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                loss = loss_fn(out, y)
            del out
            torch.cuda.synchronize()
            marks["loss"] = torch.cuda.max_memory_allocated()
            marks["loss_end"] = torch.cuda.memory_allocated()
            if hasattr(ctx, "ledger"):
                marks["pool_resident"] = ctx.ledger.device_bytes
            torch.cuda.reset_peak_memory_stats()
            loss.backward()
        torch.cuda.synchronize()
        marks["bwd"] = torch.cuda.max_memory_allocated()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        marks["ms"] = (time.perf_counter() - t0) * 1e3
        return marks

    def show(label: str, m: dict, pool=None) -> None:
        peak = max(m["fwd"], m["loss"], m["bwd"])
        where = max(("fwd", "loss", "bwd"), key=lambda k: m[k])
        s = (
            f"{label:<14} {m['ms']:7.1f} ms peak {peak / GiB:6.2f} ({where}) fwd {m['fwd'] / GiB:6.2f} "
            f"fwd_end {m['fwd_end'] / GiB:6.2f} loss {m['loss'] / GiB:6.2f} "
            f"loss_end {m['loss_end'] / GiB:6.2f} "
            f"bwd {m['bwd'] / GiB:6.2f}"
        )
        if pool is not None:
            st = pool.stats()
            s += (
                f" | target {pool.budget.target() / GiB:5.2f} margin {pool.budget.margin / GiB:5.2f} "
                f"resident@loss {m.get('pool_resident', 0) / GiB:5.2f} "
                f"dropped {st.get('dropped_bytes', 0) / GiB:6.2f} "
                f"off {st.get('offloaded_bytes', 0) / GiB:6.2f} "
                f"sync_restores {st.get('sync_restores')} prefetches {st.get('prefetches')} "
                f"pressure {st.get('pressure_calls')} regions {len(pool.regions.modules)}"
            )
            pool.reset_stats()
        print(s, flush=True)

    native = [step(contextlib.nullcontext()) for _ in range(3)]
    for m in native:
        show("native", m)
    peak = max(max(m["fwd"], m["loss"], m["bwd"]) for m in native[1:])
    budget = int(frac * peak)
    print(f"{model_name} {policy} budget {budget / GiB:.2f} GiB ({frac:.0%} of {peak / GiB:.2f})", flush=True)
    pool = supermem.pool(budget=budget, policy=policy)
    for i in range(steps):
        show(f"{policy} {i}", step(pool), pool)
    st = pool.stats()
    if st.get("plan"):
        print("plan:", st["plan"])


if __name__ == "__main__":
    main()
