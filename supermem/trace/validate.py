"""What a trace read from a file must satisfy before any code uses it.

Both readers (.smtrace and PyTorch snapshot pickles) end in check_trace, so analysis, export and replay
can index with the file's numbers without further checks: every index in range, every size an int64
that is not negative, every name a string, times in order, device indices small. A file that breaks
any of these gives one TraceFormatError saying what is wrong, never a traceback deeper in.

Device indices are bounded because code allocates per device index (a PyTorch snapshot has one trace
list per device): CUDA device indices are c10::DeviceIndex, an int8, so 0..127.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .table import COLUMNS, Frame, Trace

MAX_DEVICES = 128
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_NAMES = 255  # actions and categories are uint8 columns
# No block or device is larger (the biggest GPUs hold ~2**38): sums of many sizes then stay in int64.
MAX_BYTES = 1 << 50


class TraceFormatError(ValueError):
    """A file that is not a readable trace (foreign, truncated, corrupt, crafted or too new)."""


def need(cond: bool, msg: str) -> None:
    if not cond:
        raise TraceFormatError(msg)


def is_int(v: Any, lo: int = INT64_MIN, hi: int = INT64_MAX) -> bool:
    return type(v) is int and lo <= v <= hi  # not bool, not float


def int_field(d: dict, key: str, what: str, lo: int = INT64_MIN, hi: int = INT64_MAX, default: Any = None):
    v = d.get(key, default)
    if type(v) is not int or not lo <= v <= hi:  # the message is built only for a bad value
        raise TraceFormatError(f"{what}: {key!r} must be an integer in [{lo}, {hi}], got {_show(v)}")
    return v


def str_field(d: dict, key: str, what: str, default: Any = None) -> str:
    v = d.get(key, default)
    if type(v) is not str:
        raise TraceFormatError(f"{what}: {key!r} must be a string, got {_show(v)}")
    return v


def _show(v: Any) -> str:
    """A short description of a value from a file (never a deep or huge repr)."""
    if v is None or type(v) in (bool, float) or (type(v) is int and abs(v) < 10**30):
        return repr(v)
    if type(v) is str:
        return repr(v[:40]) + ("..." if len(v) > 40 else "")
    return f"a {type(v).__name__}"


def names(v: Any, what: str) -> list[str]:
    need(type(v) is list, f"{what} must be a list, got {_show(v)}")
    need(len(v) <= MAX_NAMES, f"{what}: {len(v)} names, at most {MAX_NAMES}")
    need(all(type(x) is str for x in v), f"{what} must all be strings")
    need(len(set(v)) == len(v), f"{what} has duplicates")
    return list(v)


def strings(v: Any) -> list[str]:
    need(type(v) is list and all(type(x) is str for x in v), "strings must be a list of strings")
    return v


def frames(v: Any) -> list[Frame]:
    need(type(v) is list, "frames must be a list")
    out = []
    for f in v:
        ok = type(f) in (list, tuple) and len(f) == 3 and type(f[0]) is str and type(f[2]) is str
        need(ok and is_int(f[1]), f"a frame must be [file, line, name], got {_show(f)}")
        out.append((f[0], f[1], f[2]))
    return out


def stacks(v: Any, num_frames: int) -> list[tuple[int, ...]]:
    need(type(v) is list, "stacks must be a list")
    out = []
    for s in v:
        need(type(s) in (list, tuple), f"a stack must be a list of frame indices, got {_show(s)}")
        need(
            all(is_int(i, 0, num_frames - 1) for i in s), f"a stack refers to a frame not in the {num_frames}"
        )
        out.append(tuple(s))
    return out


def segment(seg: Any, trace: Trace, what: str) -> dict[str, Any]:
    """A segment of a device's final snapshot, in the shape the trace tools use (checked, copied)."""
    need(type(seg) is dict, f"{what} must be a dict, got {_show(seg)}")
    pool = seg.get("segment_pool_id", [0, 0])
    need(
        type(pool) in (list, tuple) and len(pool) == 2 and all(is_int(x) for x in pool),
        f"{what}: 'segment_pool_id' must be two integers",
    )
    blocks = seg.get("blocks", [])
    need(type(blocks) is list, f"{what}: 'blocks' must be a list")
    return {
        "address": int_field(seg, "address", what),
        "total_size": int_field(seg, "total_size", what, 0, MAX_BYTES),
        "stream": int_field(seg, "stream", what, 0, default=0),
        "segment_type": str_field(seg, "segment_type", what, "large"),
        "segment_pool_id": [pool[0], pool[1]],
        "blocks": [block(b, trace, f"{what}, block {i}") for i, b in enumerate(blocks)],
    }


def block(b: Any, trace: Trace, what: str) -> dict[str, Any]:
    need(type(b) is dict, f"{what} must be a dict, got {_show(b)}")
    out = {
        "address": int_field(b, "address", what),
        "size": int_field(b, "size", what, 0, MAX_BYTES),
        "requested_size": int_field(b, "requested_size", what, 0, MAX_BYTES, default=0),
        "state": str_field(b, "state", what, "inactive"),
    }
    if "stack" in b:
        out["stack"] = int_field(b, "stack", what, -1, len(trace.stacks) - 1)
    if b.get("category"):
        out["category"] = str_field(b, "category", what)
        category_id(trace, out["category"])  # registered now: later code may not add names
    return out


def category_id(trace: Trace, name: str) -> int:
    try:
        return trace.category_id(name)
    except ValueError as e:
        raise TraceFormatError(str(e)) from None


def device(d: Any, segments: Any, trace: Trace) -> dict[str, Any]:
    need(type(d) is dict, f"a device must be a dict, got {_show(d)}")
    index = int_field(d, "index", "a device", 0, MAX_DEVICES - 1)
    what = f"device {index}"
    stats = d.get("stats", {})
    need(type(stats) is dict, f"{what}: 'stats' must be a dict")
    need(type(segments) is list, f"{what}: its segments must be a list")
    out = dict(d)  # other keys are kept as they are: nothing reads them
    out.update(
        index=index,
        name=str_field(d, "name", what, ""),
        total_bytes=int_field(d, "total_bytes", what, 0, MAX_BYTES, default=0),
        limit_bytes=int_field(d, "limit_bytes", what, 0, MAX_BYTES, default=0),
        stats=stats,
        segments=[segment(s, trace, f"{what}, segment {i}") for i, s in enumerate(segments)],
    )
    return out


def meta(m: Any) -> dict[str, Any]:
    need(type(m) is dict, "meta must be a dict")
    dropped = m.get("dropped_events", {})
    need(
        type(dropped) is dict and all(type(k) is str and is_int(v, 0) for k, v in dropped.items()),
        "meta: 'dropped_events' must map device names to counts",
    )
    link = m.get("link_bytes_per_s", {})
    need(
        type(link) is dict
        and all(type(k) is str and type(v) in (int, float) and v > 0 for k, v in link.items()),
        "meta: 'link_bytes_per_s' must map device names to positive rates",
    )
    need(type(m.get("time_is_index", False)) is bool, "meta: 'time_is_index' must be true or false")
    argv = m.get("argv", [])
    need(type(argv) is list and all(type(a) is str for a in argv), "meta: 'argv' must be a list of strings")
    need(is_int(m.get("pid", 0)), "meta: 'pid' must be an integer")
    # rank and world_size: absent in traces from before torch.distributed support (rank 0 of 1)
    world = m.get("world_size", 1)
    need(is_int(world, 1, 1 << 24), "meta: 'world_size' must be an integer >= 1")
    need(is_int(m.get("rank", 0), 0, world - 1), "meta: 'rank' must be an integer in [0, world_size)")
    return m


def check_columns(trace: Trace) -> None:
    """Every column present with its dtype and one length; every index into a table in range."""
    c = trace.cols
    n = len(c["time_ns"])
    for name, dtype in COLUMNS.items():
        col = c.get(name)
        need(isinstance(col, np.ndarray) and col.dtype == dtype and col.shape == (n,), f"column {name!r}")

    def in_range(name: str, lo: int, hi: int, what: str) -> None:
        col = c[name]
        if n and (int(col.min()) < lo or int(col.max()) > hi):
            bad = int(col[(col < lo) | (col > hi)][0])
            raise TraceFormatError(f"column {name!r} holds {bad}: {what} [{lo}, {hi}]")

    in_range("action", 0, len(trace.actions) - 1, "an action index outside")
    in_range("category", 0, len(trace.categories) - 1, "a category index outside")
    in_range("stack", -1, len(trace.stacks) - 1, "a stack index outside")
    in_range("detail", -1, len(trace.strings) - 1, "a string index outside")
    in_range("device", -1, MAX_DEVICES - 1, "a device index outside")
    in_range("size", 0, MAX_BYTES, "a size outside")
    in_range("stream", 0, INT64_MAX, "a stream (cudaStream_t) outside")
    t = c["time_ns"]
    need(not n or (int(t[0]) >= 0 and bool(np.all(t[1:] >= t[:-1]))), "event times are not in order")


def check_trace(trace: Trace) -> Trace:
    """Raises TraceFormatError unless every part of `trace` is as the trace tools expect."""
    check_columns(trace)
    seen = [d["index"] for d in trace.devices]
    need(len(set(seen)) == len(seen), "a device is listed twice")
    trace.devices.sort(key=lambda d: d["index"])
    return trace
