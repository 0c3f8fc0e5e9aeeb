"""`supermem trace -o run.smtrace -- python train.py args`: runs a Python program with a recording on
and writes the trace when it ends (also when it fails: an OOM's trace is the useful one).

The program runs in a child Python (`python -m supermem.trace.run_script`), which installs supermem's
allocator when the installed supermem offers `supermem.install`, starts the recording, and runs the
script as __main__ (runpy), so its sys.argv, exit code and exceptions are its own."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from ..errors import UsageError
from .format import TraceFormatError
from .output import check_output
from .recorder import DEFAULT_CAPACITY_EVENTS

_PYTHON = re.compile(r"^python[0-9.]*$")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o", "--output", default="supermem.smtrace", help="trace to write (default supermem.smtrace)"
    )
    p.add_argument(
        "--capacity",
        type=int,
        default=DEFAULT_CAPACITY_EVENTS,
        help=f"events kept per device, newest win (default {DEFAULT_CAPACITY_EVENTS})",
    )
    p.add_argument("--stacks", action="store_true", help="record the Python stack of each tensor (slower)")
    p.add_argument(
        "--report", action="store_true", help="also write the HTML report and PNG beside the trace"
    )
    # dest "program": the subcommand's name is args.command (supermem's CLI prints it in errors)
    p.add_argument(
        "program",
        metavar="command",
        nargs=argparse.REMAINDER,
        help="-- python train.py args (or -- train.py args)",
    )


def child_argv(command: list[str], output: str, capacity: int, stacks: bool) -> list[str]:
    """The child's command line for `command` (python [-m mod | -c code | script.py] args...)."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("nothing to run: give the program after --, e.g. supermem trace -- python train.py")
    if _PYTHON.match(os.path.basename(command[0])):
        python, rest = command[0], command[1:]
    elif command[0].endswith(".py"):
        python, rest = sys.executable, command
    else:
        raise UsageError(
            "supermem trace runs Python programs (`-- python train.py` or `-- train.py`), "
            f"not {command[0]!r}; "
            "for other launchers wrap the training code in `with supermem.trace('run.smtrace'):`"
        )
    if not rest:
        raise UsageError("no script given to python: supermem trace -- python train.py args")
    out = [python, "-m", "supermem.trace.run_script", "--output", output, "--capacity", str(capacity)]
    if stacks:
        out.append("--stacks")
    return [*out, "--", *rest]


def main(args: argparse.Namespace) -> int:
    if args.capacity <= 0:
        raise UsageError(f"--capacity must be a number of events > 0, got {args.capacity}")
    argv = child_argv(args.program, str(Path(args.output).resolve()), args.capacity, args.stacks)
    # Every output is checked before the program runs: a run of hours must not end in a lost trace.
    script = argv[argv.index("--") + 1]
    inputs = [script] if os.path.isfile(script) else []
    out = check_output(args.output, inputs=inputs)
    if args.report:
        html = check_output(out.with_suffix(".html"), inputs=[*inputs, out])
        check_output(html.with_suffix(".png"), inputs=[*inputs, out])
    before = _identity(out)
    rc = subprocess.call(argv)
    if _identity(out) in (None, before):  # absent, or the previous run's file
        print(f"supermem trace: the program ended (exit {rc}) without writing {out}", file=sys.stderr)
        return rc or 1
    if args.report:
        from .report_html import write_report_files

        try:
            files = write_report_files(out)
        except TraceFormatError as e:
            raise UsageError(str(e)) from None
        print(f"supermem trace: report {files['html']}", file=sys.stderr)
    return rc


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns
