"""`supermem replay TRACE --capacity 8GiB --policy planned` (also `tools/diag/replay`): would this run fit
on a device of that size? Prints predicted peak reserved, fragmentation and OOMs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cli_args import nonnegative_float
from ..errors import ConfigError, UsageError
from ..units import format_bytes, parse_bytes
from .loader import load_for_cli as load
from .replay import POLICIES, format_result, min_capacity, replay


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a .smtrace file or a PyTorch memory snapshot pickle")
    p.add_argument("--capacity", required=True, help="simulated device size: bytes, 8GiB, 512MB")
    p.add_argument("--policy", default="none", choices=sorted(POLICIES), help="what to do under pressure")
    p.add_argument("--device", type=int, help="device of the trace to replay (default: the busiest)")
    p.add_argument(
        "--offload",
        default="activation",
        help="categories the pool may offload, comma-separated (default: activation)",
    )
    p.add_argument(
        "--link-gbps", type=nonnegative_float, default=0.0, help="host link GB/s, to estimate copy time"
    )
    p.add_argument("--find-min", action="store_true", help="also search the smallest capacity that fits")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def main(args: argparse.Namespace) -> int:
    try:
        capacity = parse_bytes(args.capacity)
    except ValueError as e:
        raise ConfigError(f"--capacity: {e}") from None
    if capacity <= 0:
        raise ConfigError("--capacity must be > 0")
    cats = tuple(c.strip() for c in args.offload.split(",") if c.strip())
    src = Path(args.trace)
    trace = load(src)
    r = replay(trace, capacity, args.policy, args.device, cats)
    out = r.as_dict()
    if args.find_min:
        out["min_capacity_bytes"] = min_capacity(trace, args.policy, r.device, cats)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(format_result(r, src.name, args.link_gbps * 1e9))
        if args.find_min:
            print(
                f"  smallest capacity that fits  {format_bytes(out['min_capacity_bytes'])} "
                f"(policy {args.policy})"
            )
    return 0 if r.fits else 1


def run(argv: list[str] | None = None) -> int:
    """Entry point of tools/diag/replay: the same arguments as `supermem replay`."""
    p = argparse.ArgumentParser(prog="replay", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return main(args)
    except (ConfigError, UsageError, FileNotFoundError, ValueError) as e:
        print(f"replay: error: {e}", file=sys.stderr)
        return 2
