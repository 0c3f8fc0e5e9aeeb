"""Where a supermem depth step's time goes on a GPU: the `bench depth` supermem trial's set-up, then
steps with phases (synchronised), the allocators' and the streamer's counters per step, one step without
the pool, and one step under torch.profiler (op table, CUDA runtime calls that block, with the Python
stacks that made them, and the GPU's busy time against the step's wall time).

    python tools/diag/depth_profile.py '{"n": 600}'     # keys as supermem.bench.depth's trial spec
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import supermem
from supermem.bench.depth import _model, layers


def main() -> None:
    spec = {
        "device": "cuda",
        "config": "supermem",
        "cap_bytes": 12 << 30,
        "batch": 16,
        "px": 224,
        "width": 64,
        "classes": 1000,
        "unit_bytes": 64 << 20,
        "checkpoints": 512,
        "n": 600,
        "profile": True,
        "no_pool_step": True,
    }
    spec.update(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})
    cap = spec["cap_bytes"]
    supermem.install({"limit": cap})
    device = torch.device("cuda")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = _model(spec)
    t1 = time.perf_counter()
    streamer = supermem.stream(
        model, device, unit_bytes=spec["unit_bytes"], optimizer_step=spec.get("optimizer_step", "host")
    )
    model.mode = ("binomial", spec["checkpoints"])
    pool = supermem.pool(budget=max(cap - (2 << 30), 1 << 30), device=device)
    t2 = time.perf_counter()
    print(f"build {t1 - t0:.1f} s, stream+pool {t2 - t1:.1f} s, units {len(streamer.units)}", flush=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)
    g = torch.Generator().manual_seed(0)
    b, px = spec["batch"], spec["px"]
    x = torch.randn(b, 3, px, px, generator=g).to(device)
    y = torch.randint(0, spec["classes"], (b,), generator=g).to(device)
    dev_alloc = supermem.device_allocator(0)
    host_alloc = streamer.host.allocator
    keys = (
        "num_alloc_retries",
        "num_sync_all_streams",
        "num_segment_allocs",
        "num_segment_frees",
        "num_allocs",
    )

    def counters() -> dict:
        d, h = dev_alloc.stats(), host_alloc.stats()
        s = streamer.stats()
        out = {f"dev_{k}": d.get(k) for k in keys}
        out.update({f"host_{k}": h.get(k) for k in keys})
        out.update({k: s[k] for k in ("fetches", "prefetch_hits", "grads_to_host", "h2d_bytes", "d2h_bytes")})
        out["wait_s"] = s["wait_s"]
        return out

    def step(use_pool: bool) -> dict:
        ph = {}
        torch.cuda.synchronize()
        ta = time.perf_counter()
        if use_pool:
            with pool:
                loss = torch.nn.functional.cross_entropy(model(x), y)
        else:
            loss = torch.nn.functional.cross_entropy(model(x), y)
        torch.cuda.synchronize()
        tb = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        tc = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        td = time.perf_counter()
        ph.update(forward=tb - ta, backward=tc - tb, optimizer=td - tc, step=td - ta)
        ph["ms_per_layer"] = ph["step"] / layers(spec["n"]) * 1e3
        ph["loss"] = float(loss)
        return {k: round(v, 4) for k, v in ph.items()}

    def delta(a: dict, b: dict) -> dict:
        return {k: round(b[k] - a[k], 3) if isinstance(b[k], (int, float)) else b[k] for k in b}

    for i, use_pool in enumerate([True, True, True] + ([False] if spec["no_pool_step"] else [])):
        c0 = counters()
        ph = step(use_pool)
        print(f"step {i + 1} pool={use_pool}: {ph}", flush=True)
        print(f"   counters: {delta(c0, counters())}", flush=True)
    print("pool stats:", {k: v for k, v in pool.stats().items() if k != "plan"}, flush=True)
    out = os.environ.get("OUT", "/tmp")
    if spec.get("cprofile"):
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        ph = step(True)
        prof.disable()
        print(f"cprofiled step: {ph}", flush=True)
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(70)
        stats.sort_stats("cumulative").print_stats(70)
        name = f"{out}/cprofile_n{spec['n']}.txt"
        with open(name, "w") as f:
            f.write(text.getvalue())
        print("wrote", name, flush=True)
    if not spec["profile"]:
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        t = time.perf_counter()
        ph = step(True)
    wall = time.perf_counter() - t
    print(f"profiled step: {ph}", flush=True)
    ka = prof.key_averages()
    print(ka.table(sort_by="self_cpu_time_total", row_limit=35, max_name_column_width=60), flush=True)
    busy_us = sum(e.self_device_time_total for e in ka if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"GPU kernel+copy time {busy_us / 1e6:.2f} s of the profiled step's {wall:.2f} s", flush=True)
    blocking = ("Synchronize", "cudaFree", "cudaMalloc", "cudaHostAlloc", "cudaHostRegister", "cudaMemcpy ")
    stacks = prof.key_averages(group_by_stack_n=8)
    rows = [e for e in stacks if any(k in e.key for k in blocking)]
    rows.sort(key=lambda e: -e.self_cpu_time_total)
    for e in rows[:12]:
        print(f"{e.key}: {e.count} calls, {e.self_cpu_time_total / 1e3:.1f} ms", flush=True)
        for frame in e.stack[:8]:
            print(f"      {frame}", flush=True)


if __name__ == "__main__":
    main()
