"""`supermem bench frag`: memory reserved but never allocated, with and without expandable segments.

Two allocation patterns of a decoder's training step (12 layers, d1024, vocab 32k, bf16-sized):
`varlen`, sequence lengths drawn from 128..2048 each step; `ramp`, a batch that grows 1..16 over the
run. Rows: native, native `expandable_segments:True`, supermem, supermem `expandable_segments:true`,
each in a fresh process on a GPU. Reported: reserved / allocated at the peak, and the smallest limit,
as a multiple of the allocated peak, under which the run completes (1.00, 1.02, 1.05, 1.10, 1.25,
1.50; each its own process).

On a machine without CUDA the supermem rows run on the simulated device: the same mallocs and frees
on a CachingAllocator (no tensors, no kernels, no step time), in this process. Native rows need a GPU.
Skeleton: the GPT-24 / ResNet-152 / HF Llama model steps of issue 41 are not here yet.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from ..cli_args import positive_int
from . import runner, table

H = TypeVar("H")  # what alloc returns and free takes: an address, a tensor's key
LIMIT_FACTORS = (1.00, 1.02, 1.05, 1.10, 1.25, 1.50)
ROWS = (  # name, allocator, its option text
    ("native", "native", None),
    ("native expandable", "native", "expandable_segments:True"),
    ("supermem", "supermem", None),
    ("supermem expandable", "supermem", "expandable_segments:true"),
)


@dataclass(frozen=True)
class Decoder:
    """The tensors a decoder step allocates, in bytes, as functions of batch and sequence length."""

    layers: int = 12
    d_model: int = 1024
    heads: int = 16
    vocab: int = 32000
    elem: int = 2  # bf16

    def params_bytes(self) -> list[int]:
        return [12 * self.d_model * self.d_model * 4] * self.layers + [self.vocab * self.d_model * 4]


def lengths(pattern: str, steps: int, seed: int = 0) -> Iterator[tuple[int, int]]:
    """(batch, sequence length) of each step."""
    rng = random.Random(seed)
    for i in range(steps):
        if pattern == "varlen":
            yield 4, rng.randint(128, 2048)
        else:  # ramp
            yield 1 + (15 * i) // max(1, steps - 1), 1024


def step(alloc: Callable[[int], H], free: Callable[[H], None], m: Decoder, batch: int, seq: int) -> None:
    """One forward and backward: activations saved per layer, attention scores and the loss's logits
    as temporaries, gradients of each layer's size in backward."""
    act = batch * seq * m.d_model * m.elem
    saved: list[list[H]] = []
    for _ in range(m.layers):
        scores = alloc(batch * m.heads * seq * seq * m.elem)
        saved.append([alloc(3 * act), alloc(act), alloc(4 * act), alloc(4 * act)])
        free(scores)
    logits = alloc(batch * seq * m.vocab * 4)  # fp32 log_softmax
    grad = alloc(batch * seq * m.vocab * 4)
    free(logits)
    free(grad)
    for layer in reversed(saved):
        g = alloc(4 * act)
        for t in reversed(layer):
            free(t)
        free(g)


def run_pattern(alloc: Callable[[int], H], free: Callable[[H], None], pattern: str, steps: int) -> int:
    """The whole run; returns the steps completed (all of them, or an OOM propagates)."""
    m = Decoder()
    params = [alloc(n) for n in m.params_bytes()]
    done = 0
    for batch, seq in lengths(pattern, steps):
        step(alloc, free, m, batch, seq)
        done += 1
    for p in params:
        free(p)
    return done


def simulated(pattern: str, steps: int, expandable: bool, limit_bytes: int | None = None) -> dict:
    """The run on a simulated device (64 GiB, nothing touched): peaks, or oom=True."""
    from ..allocator import CachingAllocator, SimulatedDevice
    from ..errors import OutOfMemoryError

    a = CachingAllocator(SimulatedDevice(64 << 30), limit_bytes, expandable_segments=expandable)
    row: dict = {"oom": False}
    t = time.perf_counter()
    try:
        row["steps"] = run_pattern(a.malloc, a.free, pattern, steps)
    except OutOfMemoryError:
        row["oom"] = True
    row["wall_s"] = round(time.perf_counter() - t, 3)
    s = a.stats()
    row.update({k: s[k] for k in ("allocated_bytes_peak", "reserved_bytes_peak", "peak_reserved_ratio")})
    return row


def measure(spec: dict) -> dict:
    """Worker side (a GPU): the pattern with torch.empty tensors; peaks and seconds per step."""
    import torch

    live: dict[int, torch.Tensor] = {}

    def alloc(n: int) -> int:
        x = torch.empty(n, dtype=torch.uint8, device="cuda")
        live[id(x)] = x
        return id(x)

    def free(h: int) -> None:
        del live[h]

    if spec.get("limit_bytes"):
        torch.cuda.set_per_process_memory_fraction(
            spec["limit_bytes"] / torch.cuda.get_device_properties(0).total_memory
        )
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    steps = run_pattern(alloc, free, spec["pattern"], spec["steps"])
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    return {
        "steps": steps,
        "step_ms": elapsed / max(1, steps) * 1e3,
        "allocated_bytes_peak": allocated,
        "reserved_bytes_peak": reserved,
        "peak_reserved_ratio": reserved / allocated if allocated else 1.0,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pattern", choices=("varlen", "ramp"), action="append", help="default: both")
    p.add_argument("--steps", type=positive_int, default=200, help="steps per run (default 200)")


def run(args: argparse.Namespace) -> dict:
    steps = 20 if args.quick else args.steps
    rows = []
    for pattern in args.pattern or ["varlen", "ramp"]:
        for name, allocator, option in ROWS:
            if args.device == "cuda":
                row = _gpu_row(args, pattern, steps, allocator, option)
            elif allocator == "supermem":
                row = _sim_row(pattern, steps, option is not None)
            else:
                continue
            rows.append(dict(row, pattern=pattern, config=name + ("" if args.device == "cuda" else " (sim)")))
    print(f"\nfrag: reserved / allocated at the peak, device {args.device} ({steps} steps a run)")
    columns = [
        ("pattern", lambda r: r["pattern"], ""),
        ("allocator", lambda r: r["config"], ""),
        ("alloc peak GiB", lambda r: r["allocated_bytes_peak"] / 2**30, ".2f"),
        ("res. peak GiB", lambda r: r["reserved_bytes_peak"] / 2**30, ".2f"),
        ("res./alloc", lambda r: r["peak_reserved_ratio"], ".3f"),
        ("min limit x", lambda r: r.get("min_limit_x"), ".2f"),
        ("step ms", lambda r: r.get("step_ms"), ".1f"),
        ("note", lambda r: r.get("error"), ""),
    ]
    print(table.render(columns, rows))
    return {"bench": "frag", "device": args.device, "rows": rows}


def _sim_row(pattern: str, steps: int, expandable: bool) -> dict:
    row = simulated(pattern, steps, expandable)
    for factor in LIMIT_FACTORS:
        if not simulated(pattern, steps, expandable, int(row["allocated_bytes_peak"] * factor))["oom"]:
            row["min_limit_x"] = factor
            break
    return row


def _gpu_row(args: argparse.Namespace, pattern: str, steps: int, allocator: str, option: str | None) -> dict:
    spec = {"bench": "frag", "allocator": allocator, "device": "cuda", "pattern": pattern, "steps": steps}
    if allocator == "supermem":
        spec["conf"] = ",".join(filter(None, [args.conf, option])) or None
    else:
        spec["pytorch_alloc_conf"] = option
    row = runner.run(spec, args.timeout, f"frag {pattern} {allocator} {option or ''}")
    if "allocated_bytes_peak" not in row:
        return row
    for factor in LIMIT_FACTORS:
        trial = runner.run(dict(spec, limit_bytes=int(row["allocated_bytes_peak"] * factor)), args.timeout)
        if not trial.get("oom") and "error" not in trial:
            row["min_limit_x"] = factor
            break
    return row
