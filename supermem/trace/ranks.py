"""Several ranks' traces as one, for `supermem report run-0.smtrace run-1.smtrace -o report.html`: one page
with a section per rank and device, drawn on one time axis.

Each rank's devices get new indices in the merged trace (rank order, then device order) and names that
say whose they are ("rank 1 · cuda:1 · NVIDIA H100"); the ranks' string, stack and frame tables are
concatenated and the columns that index them shifted. Ranks of one host share CLOCK_MONOTONIC, so their
events line up as they happened; traces from different hosts each start at time 0.
"""

from __future__ import annotations

import numpy as np

from . import validate
from .table import Trace, concat_columns
from .validate import TraceFormatError


def merge_ranks(traces: list[Trace], names: list[str] | None = None) -> Trace:
    """One Trace holding every rank's devices side by side (see the module's doc). `names`: the files,
    for the meta and error messages."""
    names = names or [f"trace {i}" for i in range(len(traces))]
    ranks = [t.meta.get("rank", i) for i, t in enumerate(traces)]
    if len(set(ranks)) != len(ranks):
        raise TraceFormatError(
            "two traces are of the same rank: " + ", ".join(f"{n} (rank {r})" for n, r in zip(names, ranks))
        )
    one_host = len({t.meta.get("host") for t in traces}) == 1
    out = Trace()
    parts = []
    ranks_meta = []
    dropped: dict[str, int] = {}
    next_index = 0
    if len({bool(t.meta.get("time_is_index")) for t in traces}) > 1:
        raise TraceFormatError("some traces have times and some only event order: report them apart")
    for t, rank, name in sorted(zip(traces, ranks, names), key=lambda x: x[1]):
        cols = {k: v.copy() for k, v in t.cols.items()}
        cols["action"] = _lookup([out.action_id(a) for a in t.actions], cols["action"])
        cols["category"] = _lookup([out.category_id(c) for c in t.categories], cols["category"])
        cols["detail"] = _lookup([out.string_id(s) if s else -1 for s in t.strings], cols["detail"])
        stack_shift, frame_shift = len(out.stacks), len(out.frames)
        out.frames.extend(t.frames)
        out.stacks.extend(tuple(f + frame_shift for f in s) for s in t.stacks)
        cols["stack"] = np.where(cols["stack"] >= 0, cols["stack"] + stack_shift, -1).astype(np.int32)
        if not one_host and len(cols["time_ns"]):
            cols["time_ns"] -= cols["time_ns"].min()
        new_device = {}
        for index in sorted(set(t.device_indices()) | {d["index"] for d in t.devices}):
            if next_index >= validate.MAX_DEVICES:
                raise TraceFormatError(f"more than {validate.MAX_DEVICES} devices in all: report fewer ranks")
            new_device[index] = next_index
            d = dict(t.device(index))
            d["index"] = next_index
            d["name"] = " · ".join(x for x in (f"rank {rank}", f"cuda:{index}", d.get("name", "")) if x)
            d["segments"] = [_shift_segment(s, stack_shift) for s in d.get("segments", [])]
            out.devices.append(d)
            next_index += 1
        for index, count in t.meta.get("dropped_events", {}).items():
            if index.lstrip("-").isdigit() and int(index) in new_device:
                dropped[str(new_device[int(index)])] = count
        dev = cols["device"]
        cols["device"] = np.array([new_device.get(int(x), -1) if x >= 0 else x for x in dev], np.int16)
        parts.append(cols)
        ranks_meta.append({"rank": rank, "file": name, "pid": t.meta.get("pid"), "host": t.meta.get("host")})
    out.cols = concat_columns(parts)
    out.sort()
    world = {t.meta.get("world_size") for t in traces}
    out.meta = {
        "ranks": ranks_meta,
        "world_size": world.pop() if len(world) == 1 else None,
        "dropped_events": dropped,
        "time_is_index": bool(traces and traces[0].meta.get("time_is_index")),
        "argv": list(traces[0].meta.get("argv", [])) if traces else [],
    }
    validate.check_trace(out)
    return out


def _lookup(table: list[int], col: np.ndarray) -> np.ndarray:
    """col's values (indices into a rank's table; -1 none) mapped through `table`."""
    if not len(col):
        return col
    mapped = np.array(table + [-1], dtype=np.int64)  # index -1 picks the trailing -1
    return mapped[col.astype(np.int64)].astype(col.dtype)


def _shift_segment(seg: dict, stack_shift: int) -> dict:
    blocks = []
    for b in seg.get("blocks", []):
        b = dict(b)
        if b.get("stack", -1) >= 0:
            b["stack"] += stack_shift
        blocks.append(b)
    return {**seg, "blocks": blocks}
