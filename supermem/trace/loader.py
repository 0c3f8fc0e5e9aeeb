"""Opens any trace supermem understands: its own .smtrace, or a PyTorch memory snapshot pickle."""

from __future__ import annotations

import os
from pathlib import Path

from . import format
from .format import TraceFormatError
from .table import Trace


def load(path: str | os.PathLike) -> Trace:
    """Reads `path` (.smtrace or PyTorch snapshot pickle, told apart by content, not by name).
    Raises FileNotFoundError, or TraceFormatError saying what is wrong with the file."""
    path = Path(path)
    if path.is_dir():
        raise TraceFormatError(f"{path} is a directory, not a trace file")
    kind = format.sniff(path)
    if kind == "smtrace":
        return format.read(path)
    if kind == "pickle":
        from .torch_snapshot import load_pickle

        return load_pickle(path)
    head = path.read_bytes()[:16]
    what = "empty" if not head else f"starts with {head!r}"
    raise TraceFormatError(
        f"{path}: not a supermem trace (.smtrace) or a PyTorch memory snapshot pickle ({what}); "
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
