"""`supermem bench relu`: the ReLU compression kernels (supermem.compress) beside a device-to-device
copy of the same tensor, in this process and the same run.

For each dtype (fp32, bf16), size (16 MiB .. 1 GiB) and density (0.5, 0.3) of nonzeros:
- copy      y.copy_(x): the baseline (reads and writes the dense tensor once);
- pack      relu_pack(x, exact=False): one kernel (one read of x), no host sync;
- pack+sync relu_pack(x): the kernel for bitmap and offsets, the nonzero count read back, the kernel
            again for the values into a buffer of their exact size (two reads of x);
- pack room relu_pack(x, capacity=...): one kernel into a values buffer sized by a guess (the count
            plus the tensor pool's margin), no host sync: what the pool does after a tensor's first pack;
- unpack    relu_unpack(packed).
Throughput is dense-tensor bytes per second for every row, so "x copy" compares like with like
(target: pack and unpack >= 0.70x the copy). The GPU times come from CUDA events around `--iters`
calls queued behind a sleep kernel, so they time the GPU, not Python's launch loop (except
pack+sync, whose host round trip is part of its cost). Packed size is compared with its ideal,
n/8 + nnz x itemsize (the rest is word padding of the bitmap and 8 bytes per 2048-element block).
"""

from __future__ import annotations

import argparse
import time

from ..cli_args import comma_list, positive_int
from . import table

MiB = 1 << 20
SIZES_MIB = (16, 64, 256, 1024)
QUICK_SIZES_MIB = (1, 4)
DENSITIES = (0.5, 0.3)
DTYPES = ("float32", "bfloat16")
TARGET_X_COPY = 0.70
SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU sleep: the host queues the timed calls behind it


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--iters", type=positive_int, default=20, help="timed calls per row (default 20)")
    p.add_argument(
        "--sizes",
        type=comma_list(positive_int),
        default=None,
        help="MiB, comma-separated (default: 16 .. 1024)",
    )


def run(args: argparse.Namespace) -> dict:
    import torch

    device = torch.device(args.device)
    sizes = _sizes(args)
    iters = 2 if args.quick else args.iters
    rows: list[dict] = []
    print(f"\nrelu: pack/unpack against a copy of the same tensor, device {_device_name(device)}", flush=True)
    for dtype_name in DTYPES:
        for size_mib in sizes:
            for density in DENSITIES:
                rows += measure(device, getattr(torch, dtype_name), size_mib * MiB, density, iters)
    columns = [
        ("dtype", lambda r: r["dtype"], ""),
        ("MiB", lambda r: r["size_mib"], ""),
        ("density", lambda r: r["density"], ".2f"),
        ("op", lambda r: r["op"], ""),
        ("us", lambda r: r["us"], ".1f"),
        ("GB/s", lambda r: r["gbps"], ".0f"),
        ("x copy", lambda r: r["x_copy"], ".2f"),
        ("bound", lambda r: r["bound_x_copy"], ".2f"),
        ("moved GB/s", lambda r: r["moved_gbps"], ".0f"),
        ("packed MiB", lambda r: r["packed_mib"], ".2f"),
        ("ideal MiB", lambda r: r["ideal_mib"], ".2f"),
        ("x ideal", lambda r: r["x_ideal"], ".4f"),
        ("x dense", lambda r: r["x_dense"], ".3f"),
    ]
    print(table.render(columns, rows))
    print("GB/s: dense tensor bytes per second; x copy: copy time / op time (baseline: the copy, this run)")
    print("moved GB/s: the bytes the op must read and write / time (pack+sync reads the input twice);")
    print("bound: the x copy it would reach moving them as fast as the copy moves its own")
    if device.type != "cuda":
        print("(cpu runs the torch reference: the targets below apply to the CUDA kernels)")
    for op in ("pack", "pack room", "unpack"):
        xs = [(r["x_copy"], r) for r in rows if r["op"] == op]
        worst, where = min(xs, key=lambda t: t[0])
        verdict = "met" if worst >= TARGET_X_COPY else "MISSED"
        at = f"{where['dtype']} {where['size_mib']} MiB density {where['density']}"
        print(f"target relu {op} >= {TARGET_X_COPY}x copy: worst {worst:.2f}x ({at}): {verdict}")
    bad = [r for r in rows if r.get("lossless") is False]
    print("round trip bitwise equal: " + ("all" if not bad else f"FAILED in {len(bad)} rows"))
    return {"bench": "relu", "device": args.device, "gpu": _device_name(device), "rows": rows}


def measure(device, dtype, size_bytes: int, density: float, iters: int) -> list[dict]:
    """The five rows (copy, pack, pack+sync, pack room, unpack) of one tensor."""
    import torch

    from ..compress import relu_pack, relu_unpack
    from ..tensor_pool.treatments.compress import ROOM_MARGIN, ROOM_SLACK

    n = size_bytes // (torch.finfo(dtype).bits // 8)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.rand(n, generator=g, device=device)
    x = torch.where(x < density, x + 0.5, 0.0).to(dtype)  # density of nonzeros, values >= 0.5
    y = torch.empty_like(x)
    times = {
        "copy": _time(lambda: y.copy_(x), device, iters),
        "pack": _time(lambda: relu_pack(x, exact=False), device, iters),
        "pack+sync": _time(lambda: relu_pack(x), device, iters),
    }
    packed = relu_pack(x)
    room = int(packed.nnz * ROOM_MARGIN + n * ROOM_SLACK)
    times["pack room"] = _time(lambda: relu_pack(x, capacity=room), device, iters)
    times["unpack"] = _time(lambda: relu_unpack(packed), device, iters)
    int_view = torch.int32 if dtype == torch.float32 else torch.int16
    lossless = torch.equal(relu_unpack(packed).view(int_view), x.view(int_view))
    ideal = n / 8 + packed.nnz * x.element_size()
    base = {"dtype": str(dtype).removeprefix("torch."), "size_mib": size_bytes // MiB, "density": density}
    # Bytes each op must move: pack reads the input once and writes the packed buffers (pack+sync
    # reads it twice); unpack reads them and writes the dense tensor.
    moved = {
        "copy": 2 * size_bytes,
        "pack": size_bytes + packed.nbytes,
        "pack+sync": 2 * size_bytes + packed.nbytes,
        "pack room": size_bytes + packed.nbytes,
        "unpack": size_bytes + packed.nbytes,
    }
    rows = []
    for op, seconds in times.items():
        row = dict(base, op=op, us=seconds * 1e6, gbps=size_bytes / seconds / 1e9)
        row["x_copy"] = times["copy"] / seconds
        row["moved_gbps"] = moved[op] / seconds / 1e9
        row["bound_x_copy"] = moved["copy"] / moved[op]
        if op != "copy":
            row.update(lossless=lossless, packed_mib=packed.nbytes / MiB, ideal_mib=ideal / MiB)
            row.update(x_ideal=packed.nbytes / ideal, x_dense=packed.nbytes / size_bytes)
        rows.append(row)
    return rows


def _time(fn, device, iters: int) -> float:
    """Seconds per call: GPU time from CUDA events on CUDA, wall time on CPU."""
    import torch

    from .. import torch_private as tp

    fn()  # warm up: kernels loaded, allocator cache filled
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    tp.cuda_sleep(SLEEP_CYCLES)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def _sizes(args: argparse.Namespace) -> tuple[int, ...]:
    return tuple(args.sizes or (QUICK_SIZES_MIB if args.quick else SIZES_MIB))


def _device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (torch reference)"
