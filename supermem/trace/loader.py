"""Opens any trace supermem understands: its own .smtrace, or a PyTorch memory snapshot pickle."""

from __future__ import annotations

import os

from . import format
from .format import TraceFormatError
from .table import Trace


def load(path: str | os.PathLike) -> Trace:
    """Reads `path` (.smtrace or PyTorch snapshot pickle, told apart by content, not by name).
    Raises FileNotFoundError, or TraceFormatError saying what is wrong with the file."""
    return parse(format.read_input(path), str(path))


def parse(data: bytes, name: str = "trace") -> Trace:
    """load() of a file's bytes; `name` starts every error message."""
    kind = format.kind_of(data)
    if kind == "smtrace":
        return format.parse(data, name)
    if kind == "pickle":
        from .torch_snapshot import parse_pickle

        return parse_pickle(data, name)
    what = "empty" if not data else f"starts with {data[:16]!r}"
    raise TraceFormatError(
        f"{name}: not a supermem trace (.smtrace) or a PyTorch memory snapshot pickle ({what}); "
        "record one with `supermem trace -o run.smtrace -- python train.py` or "
        "torch.cuda.memory._dump_snapshot()"
    )


def load_for_cli(path: str | os.PathLike) -> Trace:
    """load() for the command line: a bad file is the user's mistake, so it becomes a UsageError, which
    supermem's CLI prints as one line (no traceback)."""
    from ..errors import UsageError

    try:
        return load(path)
    except TraceFormatError as e:
        raise UsageError(str(e)) from None
