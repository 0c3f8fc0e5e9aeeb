"""`supermem export TRACE -o snapshot.pickle`: a .smtrace as PyTorch's memory snapshot pickle, for
`python -m torch.cuda._memory_viz trace_plot snapshot.pickle -o plot.html` and pytorch.org/memory_viz."""

from __future__ import annotations

import argparse
from pathlib import Path

from .loader import load_for_cli as load
from .output import check_output
from .torch_snapshot import write_torch_snapshot


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a .smtrace file")
    p.add_argument("-o", "--output", help="pickle to write (default: TRACE with .pickle)")
    p.add_argument("--no-pool-events", action="store_true", help="leave the pool's events (offload, ...) out")


def main(args: argparse.Namespace) -> int:
    src = Path(args.trace)
    out = check_output(args.output or src.with_suffix(".pickle"), inputs=[src])
    write_torch_snapshot(load(src), out, pool_events=not args.no_pool_events)
    print(f"wrote {out}: open it with `python -m torch.cuda._memory_viz trace_plot {out} -o plot.html`")
    return 0
