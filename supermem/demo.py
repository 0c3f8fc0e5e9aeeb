"""`supermem demo`: the main job on an embedded default.

Until the tensor pool lands, the demo replays a training-like allocation pattern (a forward pass that
keeps activations, a backward pass that frees them in reverse, temporaries in between) on a simulated
device, through supermem's caching allocator and through an uncached passthrough, and prints device
calls, peak memory and time."""

from __future__ import annotations

import argparse
import random
import time

from .allocator import CachingAllocator, SimulatedDevice
from .units import format_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=20, help="training steps to replay (default 20)")
    p.add_argument("--layers", type=int, default=48, help="layers per step (default 48)")


def replay(alloc: CachingAllocator, steps: int, layers: int, seed: int = 0) -> float:
    rng = random.Random(seed)
    sizes = [rng.choice([256 << 10, 3 << 20, 12 << 20]) for _ in range(layers)]
    t0 = time.perf_counter()
    for _ in range(steps):
        saved = []
        for s in sizes:  # forward: keep the activation, drop a temporary
            saved.append(alloc.malloc(s))
            alloc.free(alloc.malloc(s // 2 + 512))
        for a in reversed(saved):  # backward: a gradient temporary per layer, activations released
            g = alloc.malloc(rng.choice(sizes))
            alloc.free(a)
            alloc.free(g)
    return time.perf_counter() - t0


def main(args: argparse.Namespace) -> int:
    print(f"supermem demo: {args.steps} steps x {args.layers} layers on a simulated 16 GiB device\n")
    print(f"{'allocator':<22}{'device calls':>14}{'peak reserved':>16}{'peak allocated':>16}{'time':>10}")
    for name, passthrough in (("passthrough (no cache)", True), ("supermem caching", False)):
        alloc = CachingAllocator(SimulatedDevice("16GiB"), passthrough=passthrough)
        seconds = replay(alloc, args.steps, args.layers)
        s = alloc.stats()
        calls = s["num_segment_allocs"] + s["num_segment_frees"]
        print(
            f"{name:<22}{calls:>14}{format_bytes(s['reserved_bytes_peak']):>16}"
            f"{format_bytes(s['allocated_bytes_peak']):>16}{seconds * 1e3:>8.1f}ms"
        )
    return 0
