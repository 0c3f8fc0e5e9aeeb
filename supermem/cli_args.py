"""Every check the CLI makes of its arguments, in one place, so a user mistake is one line (exit 2), never a
traceback from deep inside a run nor a value silently ignored.

- argparse types (counts, durations, sizes, comma-separated lists, SUPERMEM_CONF strings): argparse
  prints "argument --x: ..." with the usage;
- checks that need the machine or another argument (a script to run, --device cuda, names a run knows
  only once it has its other arguments): they raise UsageError, which `supermem` prints as
  "supermem COMMAND: error: ...".

This module does not import torch at import time (`supermem run` sets the environment first)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Iterable
from typing import Any

from .errors import ConfigError, UsageError


def _number(kind: type, lo: float, inclusive: bool):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a{'n integer' if kind is int else ' number'}"
            ) from None
        if not math.isfinite(value) or value < lo or (value == lo and not inclusive):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {lo:g}, got {text}")
        return value

    return parse


positive_int = _number(int, 1, True)  # counts: steps, repeats, rounds, events
nonnegative_int = _number(int, 0, True)  # counts where 0 means "none": warm-up steps
positive_float = _number(float, 0, False)  # durations, rates and fractions: seconds, GB/s
nonnegative_float = _number(float, 0, True)  # where 0 means "none": a link speed not given


def size_bytes(text: str) -> int:
    """A size > 0 in bytes: 1048576, 64KiB, 12GiB, 512MB (a device capacity, a memory cap)."""
    from .units import parse_bytes

    try:
        value = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be > 0 bytes, got {text}")
    return value


def comma_list(item: Callable[[str], Any]) -> Callable[[str], list]:
    """A type for "a,b,c": each item parsed by `item` (an argparse type or str), at least one."""

    def parse(text: str) -> list:
        items = [part.strip() for part in text.split(",") if part.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"give one or more, comma-separated; got {text!r}")
        return [item(part) for part in items]  # each item's error names the item

    return parse


def conf(text: str) -> str:
    """A SUPERMEM_CONF string ("limit:12GiB,trace:100000"), checked here even where no row uses it."""
    from . import config

    try:
        config.parse_conf(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def check_names(
    flag: str, given: Iterable[str], known: Iterable[str], here: Iterable[str] | None = None
) -> None:
    """UsageError for a name in `given` that is not `known`, or (when `here` is given) known but not
    runnable here (e.g. a CUDA-only row on the CPU)."""
    known = list(dict.fromkeys(known))
    here = None if here is None else set(here)
    for name in given:
        if name not in known:
            raise UsageError(f"{flag}: unknown {name!r}; known: {', '.join(known)}")
        if here is not None and name not in here:
            raise UsageError(f"{flag}: {name!r} does not run on this device (it needs CUDA)")


def check_device(device: Any) -> None:
    """--device cuda (demo, bench) needs a PyTorch with CUDA and a GPU it can see."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        why = "this PyTorch is built without CUDA" if torch.version.cuda is None else "it sees no GPU"
        raise UsageError(f"--device cuda: {why}; use --device cpu")


def check_script(path: str) -> None:
    """A Python program to run as `python PATH` would: a file, or a directory or zip with __main__.py."""
    if not os.path.exists(path):
        raise UsageError(f"no such script: {path}")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "__main__.py")):
        raise UsageError(f"can't find '__main__' module in {path!r} (a directory runs its __main__.py)")
