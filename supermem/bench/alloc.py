"""`supermem bench alloc`: the cost of a cached malloc+free pair as a training loop sees it
(torch.empty + del), native allocator beside supermem's, each in its own process.

Two patterns (as in shared/bench/anchors_gpu.py): pairs of mixed sizes (512 B .. 16 MiB, one live at a
time) and bursts of 500 live tensors freed together. Target: supermem <= 1.0x native.
"""

from __future__ import annotations

import argparse
import random
import time

from ..cli_args import positive_int
from . import runner, table

SIZES = (512, 4096, 65536, 1 << 20, 3 * (1 << 20) + 17, 1 << 24)
TARGET_RATIO = 1.0
REFERENCE = "reference (docs/design.md#baselines, H200, not this run): native 1.75 us per pair"


def measure(spec: dict) -> dict:
    """Worker side: microseconds per pair, best of `inner` repetitions."""
    import torch

    device = torch.device(spec["device"])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rng = random.Random(0)
    sizes = [rng.choice(SIZES) for _ in range(2000)]
    burst = sizes[:500]
    for s in sizes:  # warm the cache: every size class has a block
        torch.empty(s, dtype=torch.uint8, device=device)
    sync()
    pair_us, burst_us = [], []
    for _ in range(spec["inner"]):
        t = time.perf_counter()
        for _ in range(spec["rounds"]):
            for s in sizes:
                x = torch.empty(s, dtype=torch.uint8, device=device)
                del x
        sync()
        pair_us.append((time.perf_counter() - t) / (spec["rounds"] * len(sizes)) * 1e6)
        t = time.perf_counter()
        for _ in range(spec["rounds"]):
            live = [torch.empty(s, dtype=torch.uint8, device=device) for s in burst]
            del live
        sync()
        burst_us.append((time.perf_counter() - t) / (spec["rounds"] * len(burst)) * 1e6)
    return {
        "pair_us": round(min(pair_us), 3),
        "burst500_us": round(min(burst_us), 3),
        "pair_us_all": [round(v, 3) for v in pair_us],
        "burst500_us_all": [round(v, 3) for v in burst_us],
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rounds", type=positive_int, default=20, help="passes over the 2000 sizes per timing (default 20)"
    )
    p.add_argument(
        "--inner", type=positive_int, default=5, help="timings per process; the best counts (default 5)"
    )


def run(args: argparse.Namespace) -> dict:
    """Parent side: native and supermem interleaved `repeats` times; each keeps its best process."""
    if args.quick:
        args.rounds, args.inner = 2, 2
    configs = [("native", None)] + ([("supermem", args.conf)] if args.device == "cuda" else [])
    runs: dict[str, list[dict]] = {name: [] for name, _ in configs}
    for _ in range(args.repeats):
        for name, conf in configs:
            spec = {"bench": "alloc", "allocator": name, "conf": conf, "device": args.device}
            spec.update(rounds=args.rounds, inner=args.inner)
            runs[name].append(runner.run(spec, args.timeout, f"alloc {name}"))
    rows = [_best(name, rs) for name, rs in runs.items()]
    native = rows[0]
    for row in rows:
        row["pair_x"] = table.ratio(row.get("pair_us"), native.get("pair_us"))
        row["burst_x"] = table.ratio(row.get("burst500_us"), native.get("burst500_us"))
    print(f"\nalloc: torch.empty + del per pair, device {args.device} (baseline: native, this run)")
    columns = [
        ("allocator", lambda r: r["config"], ""),
        ("pair us", lambda r: r["pair_us"], ".3f"),
        ("x native", lambda r: r["pair_x"], ".3f"),
        ("burst500 us", lambda r: r["burst500_us"], ".3f"),
        ("x native", lambda r: r["burst_x"], ".3f"),
        ("note", lambda r: r.get("error"), ""),
    ]
    print(table.render(columns, rows))
    if args.device == "cuda" and not args.quick:
        print(REFERENCE)
    for row in rows[1:]:
        for key, what in (("pair_x", "pair"), ("burst_x", "burst500")):
            x, verdict = cell_x(row.get(key)), _verdict(row.get(key), TARGET_RATIO)
            print(f"target alloc {what}: {row['config']} {x} native (<= {TARGET_RATIO}x): {verdict}")
    return {"bench": "alloc", "device": args.device, "rows": rows, "env": native.get("env")}


def _best(name: str, rs: list[dict]) -> dict:
    ok = [r for r in rs if "pair_us" in r]
    best = dict(min(ok, key=lambda r: r["pair_us"]) if ok else rs[-1])
    best["config"] = name
    best["pair_us_runs"] = [r.get("pair_us") for r in rs]
    return best


def cell_x(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}x"


def _verdict(x: float | None, target: float) -> str:
    if x is None:
        return "NO DATA"
    return "met" if x <= target else "MISSED"
