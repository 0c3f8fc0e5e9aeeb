"""To and from PyTorch's memory snapshot (the pickle `torch.cuda.memory._dump_snapshot` writes), so
`python -m torch.cuda._memory_viz trace_plot|stats|trace|...` and pytorch.org/memory_viz open
supermem traces, and supermem report/replay read PyTorch's.

Schema written: {"segments": [Segment + "device"], "device_traces": [[TraceEntry] per device]}, where
TraceEntry = {action, addr, size, stream, time_us, frames[, device_free (oom)][, category]}.
Choices, each checked against the viewer's source (torch/utils/viz/MemoryViz.js) and tested:
- only dicts, lists, tuples, str, int, float, bool and None, because MemoryViz.js has its own
  unpickler that knows only those opcodes (no numpy scalars, no bytes);
- alloc and free entries carry "category": the viewer colours the timeline by it. It then needs
  "unknown" among the categories (it crashes otherwise), so each device trace ends with a "snapshot"
  entry (a PyTorch action: "the snapshot was taken here") of category "unknown";
- pool events (offload, prefetch, ...) keep their own action names; both viewers list unknown actions
  and skip them when drawing memory. `pool_events=False` leaves them out.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from . import validate
from .output import write_bytes
from .table import (
    ALLOC,
    FREE_COMPLETED,
    FREE_REQUESTED,
    MEMORY_ACTIONS,
    OOM,
    UNKNOWN_CATEGORY,
    Trace,
    empty_columns,
)
from .timeline import lifetimes, series
from .validate import (
    INT64_MAX,
    INT64_MIN,
    MAX_BYTES,
    MAX_DEVICES,
    TraceFormatError,
    int_field,
    need,
    str_field,
)

PICKLE_PROTOCOL = 4  # MemoryViz.js accepts protocols 2-4
# What a pickle's items take in the file at least: a trace entry or a block of its own about 25 bytes (its
# keys memoized), a frame 2 (a reference to a frame dict PyTorch shares among stacks). A pickle may repeat
# a reference to one dict at 2 bytes a time, so 6 MB named 3 million events (1.1 GB to replay): the
# work is bounded by the file's size, as a .smtrace's by its sections' compression ratio.
MIN_ITEM_BYTES = 16
MIN_FRAME_BYTES = 2


def to_torch_snapshot(trace: Trace, pool_events: bool = True) -> dict[str, Any]:
    """The trace as a PyTorch snapshot dict (plain Python objects only)."""
    frame_cache: dict[int, list[dict[str, Any]]] = {-1: []}

    def frames(stack: int) -> list[dict[str, Any]]:
        f = frame_cache.get(stack)
        if f is None:
            f = frame_cache[stack] = [
                {"filename": fn, "line": int(line), "name": name}
                for fn, line, name in trace.stack_frames(stack)
            ]
        return f

    devices = trace.device_indices()
    segments: list[dict[str, Any]] = []
    for d in trace.devices:
        for seg in d["segments"]:
            segments.append(_segment(seg, d["index"], frames))
    n_dev = max(devices) + 1 if devices else 0
    device_traces: list[list[dict[str, Any]]] = [[] for _ in range(n_dev)]
    c = trace.cols
    use_categories = bool(
        np.any(c["category"][np.isin(c["action"], [ALLOC, FREE_COMPLETED])] != UNKNOWN_CATEGORY)
    )
    for dev in devices:
        device_traces[dev] = _device_trace(trace, dev, frames, pool_events, use_categories)
    return {"segments": segments, "device_traces": device_traces}


def _segment(seg: dict[str, Any], device: int, frames) -> dict[str, Any]:
    blocks = []
    allocated = active = 0
    for b in seg.get("blocks", []):
        state = b.get("state", "inactive")
        size = int(b["size"])
        requested = int(b.get("requested_size") or 0)
        if state == "active_allocated":
            allocated += size
            requested = requested or size
        if state.startswith("active"):
            active += size
        out = {
            "address": int(b["address"]),
            "size": size,
            "requested_size": min(requested, size),
            "state": state,
            "frames": frames(int(b.get("stack", -1))),
        }
        if b.get("category"):
            out["category"] = str(b["category"])
        blocks.append(out)
    pool = seg.get("segment_pool_id", (0, 0))
    return {
        "device": int(device),
        "address": int(seg["address"]),
        "total_size": int(seg["total_size"]),
        "stream": int(seg.get("stream", 0)),
        "segment_type": str(seg.get("segment_type", "large")),
        "segment_pool_id": (int(pool[0]), int(pool[1])),
        "allocated_size": allocated,
        "active_size": active,
        "requested_size": sum(b["requested_size"] for b in blocks if b["state"] == "active_allocated"),
        "blocks": blocks,
    }


def _device_trace(trace: Trace, dev: int, frames, pool_events: bool, use_categories: bool) -> list[dict]:
    c = trace.cols
    idx = np.flatnonzero(c["device"] == dev)
    act = c["action"][idx]
    if not pool_events:
        keep = np.isin(act, list(MEMORY_ACTIONS) + [OOM])
        idx, act = idx[keep], act[keep]
    free_at_oom: dict[int, int] = {}
    oom_pos = np.flatnonzero(act == OOM)
    if len(oom_pos):  # device_free: what the device had left at the OOM (capacity or limit - reserved)
        s = series(trace, dev, lifetimes(trace, dev))
        info = trace.device(dev)
        cap = info.get("limit_bytes") or info.get("total_bytes") or 0
        where = np.searchsorted(s.index, idx[oom_pos])
        for p, w in zip(oom_pos.tolist(), where.tolist(), strict=True):
            free_at_oom[p] = max(0, int(cap) - int(s.reserved[w])) if cap else 0
    names = trace.actions
    t_us = (c["time_ns"][idx] // 1000).tolist()
    addr = c["address"][idx].tolist()
    size = c["size"][idx].tolist()
    stream = c["stream"][idx].tolist()
    cat = c["category"][idx].tolist()
    stack = c["stack"][idx].tolist()
    detail = c["detail"][idx].tolist()
    with_cat = {ALLOC, FREE_REQUESTED, FREE_COMPLETED}
    out = []
    requested: set[int] = set()  # addresses with a free_requested awaiting its free_completed
    for i, a in enumerate(act.tolist()):
        if a == FREE_REQUESTED:
            requested.add(addr[i])
        elif a == FREE_COMPLETED:
            if addr[i] in requested:
                requested.discard(addr[i])
            else:  # PyTorch always logs the request first; its tools pair the two
                out.append(
                    {
                        "action": "free_requested",
                        "addr": addr[i],
                        "size": size[i],
                        "stream": stream[i],
                        "time_us": t_us[i],
                        "frames": frames(stack[i]),
                        **({"category": trace.categories[cat[i]]} if use_categories else {}),
                    }
                )
        e = {
            "action": names[a],
            "addr": addr[i],
            "size": size[i],
            "stream": stream[i],
            "time_us": t_us[i],
            "frames": frames(stack[i]),
        }
        if a == OOM:
            e["device_free"] = free_at_oom.get(i, 0)
        if use_categories and a in with_cat:
            e["category"] = trace.categories[cat[i]]
        if detail[i] >= 0:
            e["user_metadata"] = trace.strings[detail[i]]
        out.append(e)
    if use_categories:
        last_us = t_us[-1] if t_us else 0
        out.append(
            {
                "action": "snapshot",
                "addr": 0,
                "size": 0,
                "stream": 0,
                "time_us": last_us,
                "frames": [],
                "category": "unknown",
            }
        )
    return out


def write_torch_snapshot(trace: Trace, path: str | os.PathLike, pool_events: bool = True) -> Path:
    data = pickle.dumps(to_torch_snapshot(trace, pool_events), protocol=PICKLE_PROTOCOL)
    return write_bytes(path, data)


# ---------------------------------------------------------------- reading PyTorch's snapshots


class _PlainUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """Loads plain data only: a snapshot never needs a class, and a pickle that names one could run
    code on load. Built on the pure-Python unpickler because the C one sizes its memo table by the
    largest index a file names: a 12-byte pickle saying "put at 2**27" makes it allocate and clear
    2 GiB. Frames are skipped rather than buffered (their opcodes follow inline), which makes it
    about twice as fast as the stock pure-Python loop."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def _skip_frame(self) -> None:
        self.read(8)

    dispatch[pickle.FRAME[0]] = _skip_frame  # type: ignore[assignment]

    def find_class(self, module: str, name: str) -> Any:
        raise TraceFormatError(
            f"the pickle refers to {module}.{name}; a PyTorch memory snapshot holds plain data only "
            "(supermem does not load arbitrary pickles)"
        )

    def __init__(self, data: bytes):
        self._stream = io.BytesIO(data)
        super().__init__(self._stream)

    def load(self) -> Any:
        f = self._stream
        self.read, self.readline, self.readinto = f.read, f.readline, f.readinto
        self.metastack: list[Any] = []
        self.stack: list[Any] = []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = self.read, self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError("pickle data was truncated")
                dispatch[key[0]](self)  # type: ignore[arg-type]
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            return stop.value


def parse_pickle(data: bytes, name: str = "snapshot") -> Trace:
    """A Trace from a snapshot pickle's bytes; `name` (the file) starts every error message."""
    try:
        obj = _PlainUnpickler(data).load()
    except TraceFormatError as e:
        raise TraceFormatError(f"{name}: {e}") from None
    except Exception as e:  # truncated or corrupt pickles raise many kinds of errors
        raise TraceFormatError(f"{name}: not a readable pickle ({type(e).__name__}: {e})") from None
    try:
        return from_torch_snapshot(obj, file_bytes=len(data))
    except TraceFormatError as e:
        raise TraceFormatError(f"{name}: {e}") from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError) as e:
        # the checks above should have caught it first: still one line naming the file
        raise TraceFormatError(f"{name}: not a PyTorch memory snapshot ({type(e).__name__}: {e})") from None


def from_torch_snapshot(snap: Any, file_bytes: int | None = None) -> Trace:
    """A Trace from a snapshot dict (`torch.cuda.memory._snapshot()` or its pickle). Every field it
    uses is type- and range-checked: anything else raises TraceFormatError. file_bytes: the size of the
    pickle it came from, which bounds the entries, blocks and frames read (MIN_ITEM_BYTES)."""
    if type(snap) is list:  # segments only, as _memory_viz accepts
        snap = {"segments": snap, "device_traces": []}
    if type(snap) is not dict or "segments" not in snap:
        got = type(snap).__name__ if type(snap) is not dict else "a dict without 'segments'"
        raise TraceFormatError(f"not a PyTorch memory snapshot: expected a dict with 'segments', got {got}")
    traces = snap.get("device_traces", [])
    need(
        type(traces) is list and all(type(t) is list for t in traces),
        "not a PyTorch memory snapshot: 'device_traces' is not a list of lists",
    )
    need(len(traces) <= MAX_DEVICES, f"{len(traces)} device traces: CUDA has at most {MAX_DEVICES} devices")
    shared = [t for t in traces if t]
    need(len({id(t) for t in shared}) == len(shared), "two devices share one trace list")
    segments = snap["segments"]
    need(type(segments) is list, "'segments' is not a list")
    frame_budget = [None if file_bytes is None else file_bytes // MIN_FRAME_BYTES]
    if file_bytes is not None:
        blocks_n = sum(
            len(s["blocks"]) for s in segments if type(s) is dict and type(s.get("blocks")) is list
        )
        items = sum(map(len, traces)) + blocks_n
        need(
            items <= file_bytes // MIN_ITEM_BYTES,
            f"{items} trace entries and blocks in {file_bytes} bytes, more than one per {MIN_ITEM_BYTES} "
            "bytes: the pickle repeats references to the same few (not a snapshot PyTorch writes)",
        )
    trace = Trace()
    stack_ids: dict[tuple, int] = {}
    frame_ids: dict[tuple, int] = {}
    by_list: dict[int, int] = {}  # id(frames list) -> stack: PyTorch shares one list among entries
    by_frame: dict[int, tuple[str, int, str]] = {}  # id(frame dict) -> frame: and one dict among stacks

    def frame(f: Any) -> tuple[str, int, str]:
        got = by_frame.get(id(f))
        if got is None:
            need(type(f) is dict, "a frame is not a dict")
            got = by_frame[id(f)] = (
                str_field(f, "filename", "a frame", "?"),
                int_field(f, "line", "a frame", default=0),
                str_field(f, "name", "a frame", "?"),
            )
        return got

    def stack_of(frames: Any) -> int:
        if not frames:
            return -1
        need(type(frames) is list, "'frames' is not a list")
        sid = by_list.get(id(frames))
        if sid is not None:
            return sid
        if frame_budget[0] is not None:
            frame_budget[0] -= len(frames)
            need(
                frame_budget[0] >= 0,
                f"more frames than one per {MIN_FRAME_BYTES} bytes of the file: the pickle repeats "
                "references to the same frame lists (not a snapshot PyTorch writes)",
            )
        key = tuple(frame(f) for f in frames)
        sid = stack_ids.get(key)
        if sid is None:
            ids = []
            for fr in key:
                fid = frame_ids.get(fr)
                if fid is None:
                    fid = frame_ids[fr] = len(trace.frames)
                    trace.frames.append(fr)
                ids.append(fid)
            sid = stack_ids[key] = len(trace.stacks)
            trace.stacks.append(tuple(ids))
        by_list[id(frames)] = sid
        return sid

    rows = []
    for dev, entries in enumerate(traces):
        for e in entries:
            need(type(e) is dict, f"device {dev}: a trace entry is not a dict")
            if e.get("action") != "snapshot":  # it only marks when a snapshot was taken
                rows.append((dev, e))
    has_time = bool(rows) and all("time_us" in e for _, e in rows)
    cols = empty_columns(len(rows))
    rename = {"segment_map": "segment_alloc", "segment_unmap": "segment_free"}  # expandable segments
    for i, (dev, e) in enumerate(rows):
        what = f"device {dev}, trace entry"
        action = str_field(e, "action", what, "annotate")
        if has_time:
            cols["time_ns"][i] = int_field(e, "time_us", what, 0, INT64_MAX // 1000) * 1000
        else:
            cols["time_ns"][i] = i * 1000
        cols["action"][i] = _name_id(trace.action_id, rename.get(action, action))
        cols["device"][i] = dev
        cols["address"][i] = _int_or_none(e, "addr", what)
        cols["size"][i] = _int_or_none(e, "size", what, 0, MAX_BYTES)
        cols["stream"][i] = _int_or_none(e, "stream", what, 0)
        cols["stack"][i] = stack_of(e.get("frames"))
        if e.get("category"):
            cols["category"][i] = _name_id(trace.category_id, str_field(e, "category", what))
        if action in rename:
            cols["detail"][i] = trace.string_id(action)
        elif action == "oom":
            free = int_field(e, "device_free", what, default=0)
            cols["detail"][i] = trace.string_id(f"device_free={free}")
    trace.cols = cols
    trace.sort()
    for k, seg in enumerate(segments):
        what = f"segment {k}"
        need(type(seg) is dict, f"{what} is not a dict")
        need("address" in seg and "total_size" in seg, f"{what} lacks 'address'/'total_size'")
        d = trace.device(int_field(seg, "device", what, 0, MAX_DEVICES - 1, default=0))
        addr = int_field(seg, "address", what)
        blocks = seg.get("blocks", [])
        need(type(blocks) is list, f"{what}: 'blocks' is not a list")
        out = []
        for j, b in enumerate(blocks):
            need(type(b) is dict, f"{what}, block {j} is not a dict")
            size = int_field(b, "size", f"{what}, block {j}", 0, MAX_BYTES)
            requested = b.get("requested_size", size)
            nb = {
                "address": b.get("address", addr),
                "size": size,
                "requested_size": 0 if requested is None else requested,
                "state": b.get("state", "inactive"),
            }
            history = b.get("history") or [{}]
            need(type(history) is list and type(history[0]) is dict, f"{what}, block {j}: bad 'history'")
            sid = stack_of(b.get("frames") or history[0].get("frames"))
            if sid >= 0:
                nb["stack"] = sid
            if b.get("category"):
                nb["category"] = b["category"]
            out.append(nb)
            addr = int_field(nb, "address", f"{what}, block {j}") + size
        norm = {
            k: seg[k]
            for k in ("address", "total_size", "stream", "segment_type", "segment_pool_id")
            if k in seg
        }
        d["segments"].append(validate.segment({**norm, "blocks": out}, trace, what))
    trace.meta = {"source": "pytorch-snapshot", "time_is_index": not has_time}
    return validate.check_trace(trace)


def _name_id(register, name: str) -> int:
    try:
        return register(name)
    except ValueError as e:  # more than 255 distinct names
        raise TraceFormatError(str(e)) from None


def _int_or_none(e: dict, key: str, what: str, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
    """An integer field that PyTorch may leave out or set to None (an OOM entry has no address)."""
    return 0 if e.get(key) is None else int_field(e, key, what, lo, hi)
