"""The child of `supermem trace`: `python -m supermem.trace.run_script --output F [--capacity N]
[--stacks] [--exact-activations] -- (script.py | -m module | -c code) args...`. Records while the
program runs as __main__."""

from __future__ import annotations

import argparse
import runpy
import sys
import traceback

import supermem

from . import recorder


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m supermem.trace.run_script --output F -- script.py args", file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="supermem.trace.run_script")
    p.add_argument("--output", required=True)
    p.add_argument("--capacity", type=int, default=recorder.DEFAULT_CAPACITY_EVENTS)
    p.add_argument("--stacks", action="store_true")
    p.add_argument("--exact-activations", action="store_true")
    opts = p.parse_args(argv[:cut])
    program = argv[cut + 1 :]
    install = getattr(supermem, "install", None)  # the allocator swap, where this supermem has it
    if install is not None:
        install()
    try:
        hook = None if opts.exact_activations else recorder.ACTIVATION_HOOK_BACKWARDS
        rec = recorder.Recorder(
            capacity_events=opts.capacity, stacks=opts.stacks, activation_hook_backwards=hook
        ).start()
    except (ValueError, MemoryError, OSError) as e:  # e.g. a ring of that capacity does not fit
        print(f"supermem trace: error: cannot start the recording: {e}", file=sys.stderr)
        return 2
    rc = 0
    try:
        if program[0] == "-m":
            sys.argv = program[1:]
            runpy.run_module(program[1], run_name="__main__", alter_sys=True)
        elif program[0] == "-c":
            sys.argv = ["-c", *program[2:]]
            exec(compile(program[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = program
            runpy.run_path(program[0], run_name="__main__")
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        rc = 1
    finally:
        try:
            path = rec.stop(opts.output)
        except (ValueError, OSError) as e:  # OutputError (disk full, ...) names the file
            print(f"supermem trace: error: the trace was not written: {e}", file=sys.stderr)
            rc = rc or 1
        else:
            n = sum(s.count for s in rec.sources) + len(rec.pool_events)
            print(
                f"supermem trace: wrote {path} ({n} events, {len(rec.sources)} allocator(s))",
                file=sys.stderr,
            )
    return rc


def start_from_env(install: bool = True) -> bool:
    """In a rank started by a launcher under `supermem trace` (the TRACE_ENV variable set, and RANK):
    installs the allocator where it can, starts the recording, and writes the trace (the output template
    with this rank filled in) when the process exits, also after an uncaught exception. Called by
    supermem's torch.backends entry point, at the end of `import torch`. Returns True if it recorded."""
    import atexit
    import json
    import os

    from .. import distributed
    from .cli_trace import TRACE_ENV

    spec = os.environ.get(TRACE_ENV)
    if not spec or not distributed.is_distributed():  # the launcher itself records nothing
        return False
    try:
        opts = json.loads(spec)
        output, capacity, stacks = str(opts["output"]), int(opts["capacity"]), bool(opts["stacks"])
    except (ValueError, KeyError, TypeError):
        print(f"supermem trace: error: bad {TRACE_ENV}={spec!r}; not recording", file=sys.stderr)
        return False
    if install and getattr(supermem, "install", None) is not None:  # False: SUPERMEM=1 installs anyway
        supermem.install()
    try:
        # No saved-tensor hook of its own in a launcher's rank: gloo keeps copies of process-wide hooks
        # that deadlock its teardown unless drained (process_hooks.py does so for the pool's only).
        # Activations are named from the phases alone (owners.py), unchecked.
        rec = recorder.Recorder(capacity_events=capacity, stacks=stacks, activation_hook_backwards=0).start()
    except (ValueError, MemoryError, OSError) as e:
        print(f"supermem trace: error: cannot start the recording: {e}", file=sys.stderr)
        return False

    def write() -> None:
        try:
            path = rec.stop(output)
        except (ValueError, OSError) as e:
            print(f"supermem trace: error: the trace was not written: {e}", file=sys.stderr)
        else:
            r = distributed.rank()
            print(f"supermem trace: rank {r} wrote {path}", file=sys.stderr)

    atexit.register(write)
    return True


if __name__ == "__main__":
    sys.exit(main())
