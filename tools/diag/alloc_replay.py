"""A recorded trace's allocations, replayed on supermem's allocator over a simulated device: the same
mallocs (size, stream) and frees in the same order, with or without expandable segments, so that the
allocator's policies (where a request goes, which holes move) can be compared on CPU against a real
workload's sequence. A block is freed at its free_completed event (a block another stream still used
stays taken until then), else at its free_requested. Blocks the trace never saw allocated (before the
ring's oldest event) are left out. Prints, per configuration: the allocated and reserved peaks, their
ratio, and the moves (blocks, GiB, host waits).

    supermem trace -o pool.smtrace -- python train.py          # on the GPU
    python3 tools/diag/alloc_replay.py pool.smtrace [--device 0]
"""

from __future__ import annotations

import argparse
import sys

from supermem.allocator import CachingAllocator, SimulatedDevice
from supermem.trace.loader import load


def ops(path: str, device: int | None) -> tuple[list[tuple[int, int, int, int]], int]:
    """(kind, address, size, stream) in order: kind 1 malloc, 0 free; and the device's capacity."""
    tr = load(path)
    cols, actions = tr.cols, tr.actions
    devs = cols["device"]
    if device is None:  # the busiest
        values, counts = (list(x) for x in _unique(devs))
        device = values[counts.index(max(counts))] if values else 0
    alloc, requested, completed = (actions.index(a) for a in ("alloc", "free_requested", "free_completed"))
    rows = [i for i in range(len(devs)) if devs[i] == device]
    completes = {int(cols["address"][i]) for i in rows if cols["action"][i] == completed}
    out, live = [], set()
    for i in rows:
        action, address = int(cols["action"][i]), int(cols["address"][i])
        if action == alloc:
            live.add(address)
            out.append((1, address, int(cols["size"][i]), int(cols["stream"][i])))
        elif address in live and (action == completed or (action == requested and address not in completes)):
            live.discard(address)
            out.append((0, address, 0, 0))
    total = next((d.get("total_bytes") for d in tr.devices if d.get("index") == device), None)
    return out, int(total or 80 << 30)


def _unique(values):
    import numpy as np

    return np.unique(values, return_counts=True)


def replay(seq: list[tuple[int, int, int, int]], capacity: int, expandable: bool) -> dict:
    a = CachingAllocator(SimulatedDevice(capacity * 2), expandable_segments=expandable)
    mine: dict[int, int] = {}
    for kind, address, size, stream in seq:
        if kind:
            mine[address] = a.malloc(size, stream)
        else:
            a.free(mine.pop(address))
    return dict(a.stats())


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument(
        "--device", type=int, default=None, help="device index in the trace (default: the busiest)"
    )
    args = p.parse_args(argv)
    seq, capacity = ops(args.trace, args.device)
    print(f"{sum(k for k, *_ in seq)} mallocs, {sum(1 - k for k, *_ in seq)} frees")
    for expandable in (False, True):
        s = replay(seq, capacity, expandable)
        peaks = f"allocated peak {s['allocated_bytes_peak'] / 2**30:.2f} GiB, reserved peak"
        peaks += f" {s['reserved_bytes_peak'] / 2**30:.2f} GiB ({s['peak_reserved_ratio']:.3f})"
        moves = (
            f"{s['num_reclaims']} ({s['reclaimed_bytes'] / 2**30:.1f} GiB, {s['num_reclaim_waits']} waits)"
        )
        print(f"expandable {expandable!s:5}: {peaks}, moves {moves}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
