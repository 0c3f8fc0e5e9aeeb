"""OOM snapshots: when an OOM is raised, write a trace (and a report beside it) of what filled memory.

The allocator's activation code calls `on_oom(device, requested_bytes, message)` when it raises an OOM.
That records the OOM for `supermem top` and, if the `oom_snapshot` option names a path, writes:
  - the trace of the recording in progress (a `supermem trace` run keeps recording), or else
  - what the allocators' always-on rings hold (option `trace:N`) plus their segments and blocks;
    with the ring off, the snapshot still lists every live block, its size and category.
The path may contain {rank} (torch.distributed's, else RANK, else 0), {pid} and {n} (the OOM's number in
this process); an existing file is replaced, so
the last OOM wins. Writing never raises: the user's OOM error must reach the user unchanged.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from pathlib import Path
from typing import Any

from ..log import logger

_recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=16)
_count = 0
_lock = threading.Lock()


OOM_RING_EVENTS = 65536  # ~3 MB of ring per device: the last few steps of a typical training loop


def ring_events_for_config() -> int:
    """Ring size the allocator should get at install: the `trace` option, or with only `oom_snapshot`
    set, OOM_RING_EVENTS, so that an OOM snapshot shows the events that led to it (the always-on mode:
    one ~40 ns push per allocator event, nothing else)."""
    from .. import config

    cfg = config.current()
    return cfg.trace or (OOM_RING_EVENTS if cfg.oom_snapshot else 0)


def oom_snapshot_path(n: int | None = None) -> str | None:
    """The `oom_snapshot` option with {rank}, {pid} and {n} filled in, or None when unset."""
    from .. import config, distributed

    path = config.current().oom_snapshot
    if not path:
        return None
    return distributed.expand_path(path, n=_count if n is None else n)


def note_oom(device: int, requested_bytes: int, message: str = "") -> int:
    """Records an OOM for `supermem top` (the "ooms" provider). Returns its number in this process."""
    global _count
    with _lock:
        _count += 1
        _recent.append(
            {
                "n": _count,
                "time_unix_s": time.time(),
                "device": device,
                "rank": _rank(),
                "requested_bytes": int(requested_bytes),
                "message": message[:300],
            }
        )
        n = _count
    try:
        from .. import control

        control.register_provider("ooms", recent_ooms)
    except ImportError:
        pass
    return n


def _rank() -> int:
    from .. import distributed

    return distributed.rank()


def recent_ooms() -> dict[str, Any]:
    return {"count": _count, "recent": list(_recent)}


def on_oom(device: int = -1, requested_bytes: int = 0, message: str = "") -> Path | None:
    """What the allocator's activation code calls when it raises an OOM. Returns the trace written
    (None when the oom_snapshot option is unset or writing failed)."""
    n = note_oom(device, requested_bytes, message)
    path = oom_snapshot_path(n)
    if path is None:
        return None
    from .. import distributed

    note = {
        "device": device,
        "rank": distributed.rank(),
        "world_size": distributed.world_size(),
        "requested_bytes": requested_bytes,
        "message": message,
    }
    return write_oom_snapshot(path, note=note)


def write_oom_snapshot(
    path: str | os.PathLike | None = None, *, report: bool = True, note: dict[str, Any] | None = None
) -> Path | None:
    """Writes a trace of the current state to `path` (default: the oom_snapshot option) and, with
    `report`, path.html and path.png beside it. Returns the trace's path, or None on failure (a
    message goes to stderr). Takes ~1 s per 10^6 recorded events."""
    try:
        from . import recorder

        path = Path(path or oom_snapshot_path() or "")
        if not str(path):
            return None
        rec = recorder.active()
        if rec is not None:
            trace = rec.build()
        else:
            trace = recorder.one_shot_trace()
        trace.meta["oom"] = note or {}
        from . import format

        path.parent.mkdir(parents=True, exist_ok=True)
        format.write(trace, path)
        if report:
            from .report_html import write_report_files

            write_report_files(path)
        logger.warning("supermem: OOM snapshot written to %s", path)
        return path
    except Exception as e:  # never mask the OOM being raised
        logger.error("supermem: could not write the OOM snapshot to %s: %s: %s", path, type(e).__name__, e)
        return None
