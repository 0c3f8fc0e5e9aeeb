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

from .format import TraceFormatError
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

PICKLE_PROTOCOL = 4  # MemoryViz.js accepts protocols 2-4


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


class _PlainUnpickler(pickle.Unpickler):
    """Loads plain data only: a snapshot never needs a class, and a pickle that names one could run
    code on load."""

    def find_class(self, module: str, name: str) -> Any:
        raise TraceFormatError(
            f"the pickle refers to {module}.{name}; a PyTorch memory snapshot holds plain data only "
            "(supermem does not load arbitrary pickles)"
        )


def load_pickle(path: str | os.PathLike) -> Trace:
    """Reads a PyTorch memory snapshot pickle as a Trace."""
    data = Path(path).read_bytes()
    try:
        obj = _PlainUnpickler(io.BytesIO(data)).load()
    except TraceFormatError as e:
        raise TraceFormatError(f"{path}: {e}") from None
    except Exception as e:  # truncated or corrupt pickles raise many kinds of errors
        raise TraceFormatError(f"{path}: not a readable pickle ({type(e).__name__}: {e})") from None
    try:
        return from_torch_snapshot(obj)
    except TraceFormatError as e:
        raise TraceFormatError(f"{path}: {e}") from None


def from_torch_snapshot(snap: Any) -> Trace:
    """A Trace from a snapshot dict (`torch.cuda.memory._snapshot()` or its pickle)."""
    if isinstance(snap, list):  # segments only, as _memory_viz accepts
        snap = {"segments": snap, "device_traces": []}
    if not isinstance(snap, dict) or "segments" not in snap:
        got = type(snap).__name__ if not isinstance(snap, dict) else f"dict with keys {sorted(snap)[:8]}"
        raise TraceFormatError(f"not a PyTorch memory snapshot: expected a dict with 'segments', got {got}")
    traces = snap.get("device_traces", [])
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise TraceFormatError("not a PyTorch memory snapshot: 'device_traces' is not a list of lists")
    trace = Trace()
    stack_ids: dict[tuple, int] = {}
    frame_ids: dict[tuple, int] = {}

    def stack_of(frames: Any) -> int:
        if not frames:
            return -1
        key = tuple((f.get("filename", "?"), int(f.get("line", 0)), f.get("name", "?")) for f in frames)
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
        return sid

    # "snapshot" entries only mark when a snapshot was taken: nothing to plot or replay
    rows = [
        (dev, e)
        for dev, entries in enumerate(traces)
        for e in entries
        if isinstance(e, dict) and e.get("action") != "snapshot"
    ]
    has_time = bool(rows) and all("time_us" in e for _, e in rows)
    cols = empty_columns(len(rows))
    rename = {"segment_map": "segment_alloc", "segment_unmap": "segment_free"}  # expandable segments
    for i, (dev, e) in enumerate(rows):
        action = str(e.get("action", "annotate"))
        cols["time_ns"][i] = int(e["time_us"]) * 1000 if has_time else i * 1000
        cols["action"][i] = trace.action_id(rename.get(action, action))
        cols["device"][i] = dev
        cols["address"][i] = int(e.get("addr", 0) or 0)
        cols["size"][i] = int(e.get("size", 0) or 0)
        cols["stream"][i] = int(e.get("stream", 0) or 0)
        cols["stack"][i] = stack_of(e.get("frames"))
        if e.get("category"):
            cols["category"][i] = trace.category_id(str(e["category"]))
        if action in rename:
            cols["detail"][i] = trace.string_id(action)
        elif action == "oom":
            cols["detail"][i] = trace.string_id(f"device_free={int(e.get('device_free', 0))}")
    trace.cols = cols
    trace.sort()
    for seg in snap["segments"]:
        if not isinstance(seg, dict) or "address" not in seg or "total_size" not in seg:
            raise TraceFormatError("not a PyTorch memory snapshot: a segment lacks 'address'/'total_size'")
        d = trace.device(int(seg.get("device", 0)))
        addr = int(seg["address"])
        blocks = []
        for b in seg.get("blocks", []):
            nb = {
                "address": int(b.get("address", addr)),
                "size": int(b["size"]),
                "requested_size": int(b.get("requested_size", b["size"]) or 0),
                "state": b.get("state", "inactive"),
            }
            frames = b.get("frames") or (b.get("history") or [{}])[0].get("frames")
            sid = stack_of(frames)
            if sid >= 0:
                nb["stack"] = sid
            if b.get("category"):
                nb["category"] = str(b["category"])
            blocks.append(nb)
            addr += int(b["size"])
        d["segments"].append(
            {
                "address": int(seg["address"]),
                "total_size": int(seg["total_size"]),
                "stream": int(seg.get("stream", 0)),
                "segment_type": seg.get("segment_type", "large"),
                "segment_pool_id": list(seg.get("segment_pool_id", (0, 0))),
                "blocks": blocks,
            }
        )
    trace.meta = {"source": "pytorch-snapshot", "time_is_index": not has_time}
    return trace
