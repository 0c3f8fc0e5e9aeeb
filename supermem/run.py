"""`supermem run [--conf K:V,...] script.py args` / `supermem run -m module args`: runs a Python
program with supermem installed (the explicit form of SUPERMEM=1; works with autoload disabled).
The program's exceptions are its own: they print their traceback and exit 1, as under `python`."""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import sys

from . import activate, config
from .cli_args import check_script, conf
from .errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--conf", type=conf, default="", help="options as in SUPERMEM_CONF, e.g. limit:12GiB,trace:100000"
    )
    p.add_argument(
        "-m", dest="module", action="store_true", help="run the target as a module (like python -m)"
    )
    p.add_argument("target", help="script path (or module name with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the program")


def main(args: argparse.Namespace) -> int:
    # --conf wins over SUPERMEM_CONF key by key; children (workers, torchrun) inherit the merge
    merged = config.merge_conf(os.environ.get("SUPERMEM_CONF", ""), args.conf)
    if not args.module:
        check_script(args.target)
    if merged:
        os.environ["SUPERMEM_CONF"] = merged
    os.environ["SUPERMEM"] = "1"
    if args.module:
        sys.path.insert(0, os.getcwd())  # as `python -m` does
        if not _module_exists(args.target):
            raise UsageError(f"no module named {args.target!r}")
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(args.target)))
    activate.install(args.conf or None)
    sys.argv = [args.target, *args.args]
    try:
        if args.module:
            runpy.run_module(args.target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(args.target, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as e:  # the program's own error: its traceback, without supermem's frames
        tb = e.__traceback__
        while tb is not None and _ours(tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next
        sys.excepthook(type(e), e.with_traceback(tb), tb)  # the hook prints e's own traceback
        return 130 if isinstance(e, KeyboardInterrupt) else 1
    return 0


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a missing parent package, or an empty/relative name
        return False


def _ours(filename: str) -> bool:
    return filename in (__file__, runpy.__file__) or filename.startswith("<frozen runpy")
