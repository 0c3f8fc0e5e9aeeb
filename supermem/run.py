"""`supermem run [--conf K:V,...] script.py args` / `supermem run -m module args`: runs a Python
program with supermem installed (the explicit form of SUPERMEM=1; works with autoload disabled)."""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from . import activate, config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conf", default="", help="options as in SUPERMEM_CONF, e.g. limit:12GiB,trace:100000")
    p.add_argument(
        "-m", dest="module", action="store_true", help="run the target as a module (like python -m)"
    )
    p.add_argument("target", help="script path (or module name with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the program")


def main(args: argparse.Namespace) -> int:
    if args.conf:
        config.parse_conf(args.conf)  # fail early, with the key named
        os.environ["SUPERMEM_CONF"] = ",".join(filter(None, [os.environ.get("SUPERMEM_CONF", ""), args.conf]))
    os.environ["SUPERMEM"] = "1"  # child processes inherit it
    activate.install(args.conf or None)
    if not args.module and not os.path.exists(args.target):
        raise FileNotFoundError(f"no such script: {args.target}")
    sys.argv = [args.target, *args.args]
    if args.module:
        runpy.run_module(args.target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(args.target)))
        runpy.run_path(args.target, run_name="__main__")
    return 0
