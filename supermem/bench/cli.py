"""`supermem bench alloc|train|depth|trace|relu|frag`: benchmarks with their native baseline, each
configuration in a fresh process (relu runs in this one; frag on CPU, on the simulated device). Prints
tables (and "target ..." verdict lines) on stdout; --json PATH writes the rows."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..cli_args import conf, positive_float, positive_int
from . import alloc, depth, frag, relu, trace, train

BENCHES = {
    "alloc": (alloc, "cost of torch.empty + del per pair, native vs supermem"),
    "train": (train, "GPT-24 / ResNet-152 / HF Llama training steps: allocator and memory-saver rows"),
    "depth": (
        depth,
        "the deepest ResNet [3, 8, n, 3] one SGD step trains under a cap, and its time per layer",
    ),
    "trace": (trace, "what recording a trace costs a training step; writes the trace (and report)"),
    "relu": (relu, "ReLU compression kernels: pack/unpack throughput against a copy, packed size"),
    "frag": (
        frag,
        "reserved / allocated at the peak with and without expandable segments: synthetic varlen, ramp; "
        "GPT-24, ResNet-152, HF Llama varlen / ramp on CUDA",
    ),
}


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"  # does not create a CUDA context


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (module, help_text) in BENCHES.items():
        b = sub.add_parser(name, help=help_text, description=help_text)
        b.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
        b.add_argument("--quick", action="store_true", help="tiny sizes and few steps (a smoke test)")
        b.add_argument(
            "--repeats",
            type=positive_int,
            default=None,
            help="processes per compared config (default 2; train --sweep: 3 for every row, interleaved)",
        )
        b.add_argument(
            "--conf",
            type=conf,
            default=None,
            help="SUPERMEM_CONF-style options for the supermem rows (pool:...: a pool for every backward)",
        )
        b.add_argument(
            "--timeout", type=positive_float, default=300, help="seconds per process (default 300)"
        )
        b.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the rows as JSON")
        module.add_arguments(b)


def main(args: argparse.Namespace) -> int:
    args.device = args.device or _default_device()
    if args.repeats is None:
        args.repeats = 3 if getattr(args, "sweep", False) else 2
    module, _ = BENCHES[args.bench]
    result = module.run(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))
        print(f"\nrows written to {args.json}")
    return 0
