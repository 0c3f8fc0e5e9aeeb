"""`supermem trace -o run.smtrace -- python train.py args`: runs a Python program with a recording on
and writes the trace when it ends (also when it fails: an OOM's trace is the useful one).

The program runs in a child Python (`python -m supermem.trace.run_script`), which installs supermem's
allocator when the installed supermem offers `supermem.install`, starts the recording, and runs the
script as __main__ (runpy), so its sys.argv, exit code and exceptions are its own.

Under a launcher (`-- torchrun ... train.py`, `-- python -m torch.distributed.run ...`) the command runs
unchanged: the launcher starts the ranks, not us. The recording's settings travel in the environment
(TRACE_ENV) and each rank's `import torch` starts its recording there (supermem's torch.backends entry
point, see start_from_env in run_script.py); each rank fills in the output template ({rank}, {pid}) itself
and writes its trace when it exits. The launcher's own process has no RANK and records nothing."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from ..cli_args import check_script
from ..distributed import expand_path, is_template
from ..errors import UsageError
from .format import TraceFormatError
from .output import check_output
from .recorder import DEFAULT_CAPACITY_EVENTS

_PYTHON = re.compile(r"^python[0-9.]*$")
# Bare names that mean "Python": run as supermem's own interpreter, the one that imports supermem (PATH's
# first python may be another environment's: "No module named 'supermem'"). A path or a versioned name
# (python3.12) is the user's choice and runs as given.
_BARE_PYTHONS = ("python", "python3")
_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")
TRACE_ENV = "SUPERMEM_TRACE_CHILD"  # JSON {"output", "capacity", "stacks"} for each rank


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
        "--exact-activations",
        action="store_true",
        help="name activations by what autograd saves for the whole run (a saved-tensor hook: ~+20%% of a "
        "host-bound step), not from the phases once two backwards checked them; not under a launcher",
    )
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


def is_launcher(command: list[str]) -> bool:
    """True for torchrun and `python -m torch.distributed.run/launch`: they start the ranks."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        return False
    if os.path.basename(command[0]) == "torchrun":
        return True
    return (
        bool(_PYTHON.match(os.path.basename(command[0])))
        and len(command) > 2
        and command[1] == "-m"
        and command[2] in _LAUNCHER_MODULES
    )


def _interpreter(word: str) -> str:
    return sys.executable if word in _BARE_PYTHONS and sys.executable else word


def child_argv(
    command: list[str], output: str, capacity: int, stacks: bool, exact_activations: bool = False
) -> list[str]:
    """The child's command line for `command` (python [-m mod | -c code | script.py] args...)."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("nothing to run: give the program after --, e.g. supermem trace -- python train.py")
    if _PYTHON.match(os.path.basename(command[0])):
        python, rest = _interpreter(command[0]), command[1:]
    elif command[0].endswith(".py"):
        python, rest = sys.executable, command
    else:
        raise UsageError(
            "supermem trace runs Python programs (`-- python train.py`, `-- train.py`, or under "
            "`-- torchrun ... train.py`), "
            f"not {command[0]!r}; "
            "for other launchers wrap the training code in `with supermem.trace('run.smtrace'):`"
        )
    if not rest:
        raise UsageError("no script given to python: supermem trace -- python train.py args")
    out = [python, "-m", "supermem.trace.run_script", "--output", output, "--capacity", str(capacity)]
    if stacks:
        out.append("--stacks")
    if exact_activations:
        out.append("--exact-activations")
    return [*out, "--", *rest]


def main(args: argparse.Namespace) -> int:
    if args.capacity <= 0:
        raise UsageError(f"--capacity must be a number of events > 0, got {args.capacity}")
    exact = getattr(args, "exact_activations", False)
    if is_launcher(args.program):
        if exact:
            raise UsageError(
                "--exact-activations is not for a launcher's ranks: gloo keeps copies of process-wide "
                "saved-tensor hooks that deadlock its teardown; their activations are named from the phases"
            )
        return _main_launcher(args)
    if is_template(args.output):
        # One process, but {rank}/{pid} still name its file: the child fills them in.
        argv = child_argv(args.program, _abs(args.output), args.capacity, args.stacks, exact)
        return _main_template(args, argv)
    argv = child_argv(args.program, str(Path(args.output).resolve()), args.capacity, args.stacks, exact)
    # The program and every output are checked before it runs: a run of hours must not end in a lost
    # trace, and a script that is not there must not leave an empty one
    script = argv[argv.index("--") + 1]
    if script not in ("-m", "-c"):
        check_script(script)
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


def _abs(template: str) -> str:
    """The template made absolute without resolving it (its braces are not a path yet)."""
    return template if os.path.isabs(template) else os.path.join(os.getcwd(), template)


def _main_launcher(args: argparse.Namespace) -> int:
    if not is_template(args.output):
        raise UsageError(
            f"under {args.program[args.program[0] == '--']} every rank writes its own trace: put {{rank}} in "
            "the output, e.g. supermem trace -o run-{rank}.smtrace -- torchrun ..."
        )
    command = args.program[1:] if args.program[0] == "--" else args.program
    command = [_interpreter(command[0]), *command[1:]]
    env = dict(os.environ)
    env[TRACE_ENV] = json.dumps(
        {"output": _abs(args.output), "capacity": args.capacity, "stacks": args.stacks}
    )
    return _main_template(args, command, env)


def _main_template(args: argparse.Namespace, argv: list[str], env: dict[str, str] | None = None) -> int:
    """Runs `argv`; its processes write the files `args.output` names ({rank}, {pid} filled in)."""
    template = _abs(args.output)
    check_output(expand_path(template, rank=0, pid=0))  # the directory exists and is writable
    started_ns = time.time_ns()
    rc = subprocess.call(argv, env=env)
    written = [p for p in _matching(template) if p.stat().st_mtime_ns >= started_ns - 2_000_000_000]
    if not written:
        print(f"supermem trace: the program ended (exit {rc}) without writing {args.output}", file=sys.stderr)
        return rc or 1
    for out in written:
        if args.report:
            from .report_html import write_report_files

            try:
                files = write_report_files(out)
            except TraceFormatError as e:
                raise UsageError(str(e)) from None
            print(f"supermem trace: report {files['html']}", file=sys.stderr)
    print(f"supermem trace: {len(written)} trace(s): {' '.join(map(str, written))}", file=sys.stderr)
    return rc


def _matching(template: str) -> list[Path]:
    """Existing files the template can name (each field any run of digits), sorted by name."""
    parts = re.split(r"\{(?:rank|world_size|local_rank|pid)\}", template)
    pattern = re.compile("[0-9]+".join(map(re.escape, parts)) + "$")
    directory = Path(template).parent
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if pattern.fullmatch(str(p)) and p.is_file())


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns
