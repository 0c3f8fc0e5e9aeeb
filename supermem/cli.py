"""The `supermem` command (also `python -m supermem`). Each subcommand lives in its own module,
which provides `add_arguments(parser)` and `main(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import re
import sys
from pathlib import Path

from .cli_args import check_device
from .errors import ConfigError, UsageError

# name -> (module, one-line help)
COMMANDS = {
    "demo": ("supermem.demo", "train a small model with and without supermem; print memory and time"),
    "run": ("supermem.run", "run a Python program with supermem's allocator installed"),
    "bench": ("supermem.bench.cli", "benchmarks with a native baseline: alloc, train, depth, trace, relu"),
    "trace": ("supermem.trace.cli_trace", "run a Python program and record its memory events to a .smtrace"),
    "report": ("supermem.trace.cli_report", "write a self-contained HTML report (and PNG) of a trace"),
    "export": ("supermem.trace.cli_export", "convert a .smtrace to PyTorch's memory snapshot pickle"),
    "replay": ("supermem.trace.cli_replay", "replay a trace on a simulated device: predicted peak and OOMs"),
    "top": ("supermem.top", "live view of a running supermem process (its control socket)"),
}


def version() -> str:
    """The installed distribution's version; in a source tree that was never installed, pyproject's."""
    try:
        return importlib.metadata.version("supermem")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        text = pyproject.read_text() if pyproject.is_file() else ""
        found = re.search(r'^version = "([^"]+)"', text, re.M)
        return found.group(1) if found else "unknown"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `command`, only that subcommand's module is imported (others import torch,
    and `supermem run` must set the environment before torch's import runs supermem's hook); with
    "", none (`supermem --version` and `--help` need none)."""
    parser = argparse.ArgumentParser(prog="supermem", description="A GPU memory manager for PyTorch.")
    parser.add_argument("--version", action="version", version=f"supermem {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if command in (None, name):
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_main=mod.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    # no known command: argparse answers (--version, --help, a usage error) before any module is needed
    args = build_parser(command if command in COMMANDS else "").parse_args(argv)
    try:
        check_device(getattr(args, "device", None))  # demo's and bench's --device cuda
        return int(args._main(args) or 0)
    except (ConfigError, UsageError, FileNotFoundError) as e:  # user mistakes: a message, no traceback
        print(f"supermem {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
