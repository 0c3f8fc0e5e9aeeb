#!/usr/bin/env python3
"""A 1,000-step soak on the GPU: a small model trained with supermem's allocator and the tensor pool on
(under a budget that makes it offload), printing host RSS and device reserved/allocated at steps 10, 100,
500 and 1000. Fails (exit 1) if, after warm-up (step 100), host RSS or device memory grows by more than a
small margin: a leak of pinned buffers, pool entries, events or segments shows here and nowhere else.

    python tools/ci/soak.py [--steps 1000] [--rss-margin-mib 64] [--device-margin-mib 8]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

import supermem

supermem.install()  # before the first CUDA tensor

CHECKPOINTS = (10, 100, 500, 1000)
WARMUP_STEP = 100


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def model_and_batch(width: int, depth: int, batch: int):
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)]
    model = nn.Sequential(*layers, nn.Linear(width, 10)).cuda()
    x = torch.randn(batch, width, device="cuda")
    y = torch.randint(0, 10, (batch,), device="cuda")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), x, y


def step(model, opt, x, y) -> float:
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()  # a sync: every step ends with the device idle, so memory is comparable


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--rss-margin-mib", type=float, default=64, help="host RSS growth allowed after warm-up")
    p.add_argument("--device-margin-mib", type=float, default=8, help="device growth allowed after warm-up")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("soak: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.steps < WARMUP_STEP:
        p.error(f"--steps must be >= {WARMUP_STEP} (the warm-up)")

    model, opt, x, y = model_and_batch(args.width, args.depth, args.batch)
    step(model, opt, x, y)  # optimizer state exists from here on
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(model, opt, x, y)
    activations = torch.cuda.max_memory_allocated() - base
    budget = base + activations // 2  # half the saved activations must leave the device each step
    pool = supermem.pool(budget=budget)
    print(
        f"soak: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"params+state {base / 2**20:.0f} MiB, "
        f"step peak +{activations / 2**20:.0f} MiB, pool budget {budget / 2**20:.0f} MiB"
    )

    rows = {}
    for i in range(1, args.steps + 1):
        with pool:
            loss = step(model, opt, x, y)
        if i in CHECKPOINTS or i == args.steps:
            rows[i] = (rss_bytes(), torch.cuda.memory_reserved(), torch.cuda.memory_allocated())
            rss, reserved, allocated = rows[i]
            print(
                f"step {i:5d}  loss {loss:.4f}  host_rss {rss / 2**20:9.1f} MiB  "
                f"device_reserved {reserved / 2**20:9.1f} MiB  device_allocated {allocated / 2**20:9.1f} MiB",
                flush=True,
            )
    stats = pool.stats()
    print(
        "pool:",
        {
            k: stats[k]
            for k in sorted(stats)
            if k in ("offloaded_bytes", "prefetched_bytes", "host_reserved_bytes")
        },
    )
    if not stats.get("offloaded_bytes"):
        print("soak: FAIL: the pool offloaded nothing (the budget did not bind): nothing was soaked")
        return 1

    failures = []
    warm = rows[WARMUP_STEP]
    margins = (args.rss_margin_mib * 2**20, args.device_margin_mib * 2**20, args.device_margin_mib * 2**20)
    names = ("host_rss", "device_reserved", "device_allocated")
    for i, row in rows.items():
        if i <= WARMUP_STEP:
            continue
        for name, value, ref, margin in zip(names, row, warm, margins):
            if value > ref + margin:
                failures.append(
                    f"{name} grew {(value - ref) / 2**20:.1f} MiB from step {WARMUP_STEP} to "
                    f"{i} (allowed {margin / 2**20:.0f} MiB)"
                )
    for f in failures:
        print("soak: FAIL:", f)
    if not failures:
        print(f"soak: OK: flat after step {WARMUP_STEP}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
