"""The in-memory form of a trace: one columnar event table (numpy) plus the final allocator state.

A trace is a contiguous suffix of a process's history that ends at the moment its `devices[i]
["segments"]` were taken: the ring buffer keeps the newest events, so the oldest may be gone, but none
in between. The analysis relies on that to rebuild the memory live before the first event.

Columns (one row per event, sorted by time_ns):
    time_ns   int64   CLOCK_MONOTONIC nanoseconds (allocator ring and supermem.events share it)
    action    uint8   index into `actions`
    device    int16   CUDA device index (-1: none / host)
    address   int64   block or segment address (0 if none)
    size      int64   bytes
    stream    int64   cudaStream_t as an integer
    tag       int64   pool entry id or other producer tag
    category  uint8   index into `categories`
    stack     int32   index into `stacks` (-1: none)
    detail    int32   index into `strings` (-1: none)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..events import CATEGORIES

# The allocator ring's kinds, in the C++ enum's order, then nothing else: pool actions that are not
# among them (supermem.events is open-ended) are appended per trace.
ALLOCATOR_ACTIONS: tuple[str, ...] = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "oom",
    "offload",
    "prefetch",
    "recompute",
    "compress",
    "drop",
    "restore",
    "annotate",
)
ALLOC, FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, SEGMENT_FREE, OOM = range(6)
MEMORY_ACTIONS = (ALLOC, FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, SEGMENT_FREE)
UNKNOWN_CATEGORY = CATEGORIES.index("unknown")

COLUMNS: dict[str, type] = {
    "time_ns": np.int64,
    "action": np.uint8,
    "device": np.int16,
    "address": np.int64,
    "size": np.int64,
    "stream": np.int64,
    "tag": np.int64,
    "category": np.uint8,
    "stack": np.int32,
    "detail": np.int32,
}

Frame = tuple[str, int, str]  # (filename, line, function name)


def empty_columns(n: int = 0) -> dict[str, np.ndarray]:
    cols: dict[str, np.ndarray] = {name: np.zeros(n, dtype) for name, dtype in COLUMNS.items()}
    cols["category"][:] = UNKNOWN_CATEGORY
    cols["stack"][:] = -1
    cols["detail"][:] = -1
    return cols


def concat_columns(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if not parts:
        return empty_columns()
    return {name: np.concatenate([p[name] for p in parts]) for name in COLUMNS}


@dataclass
class Trace:
    """Events plus the state at the end. `devices[i]` is a dict: index, name, total_bytes, limit_bytes,
    segments (PyTorch-shaped snapshot list; blocks may carry "category" and "stack"), stats."""

    cols: dict[str, np.ndarray] = field(default_factory=empty_columns)
    actions: list[str] = field(default_factory=lambda: list(ALLOCATOR_ACTIONS))
    categories: list[str] = field(default_factory=lambda: list(CATEGORIES))
    strings: list[str] = field(default_factory=list)
    frames: list[Frame] = field(default_factory=list)
    stacks: list[tuple[int, ...]] = field(default_factory=list)  # frame indices, innermost first
    devices: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.cols["time_ns"])

    def action_id(self, name: str) -> int:
        """Index of an action name, appended if new."""
        try:
            return self.actions.index(name)
        except ValueError:
            if len(self.actions) >= 255:
                raise ValueError("a trace holds at most 255 distinct actions") from None
            self.actions.append(name)
            return len(self.actions) - 1

    def category_id(self, name: str) -> int:
        try:
            return self.categories.index(name)
        except ValueError:
            if len(self.categories) >= 255:
                raise ValueError("a trace holds at most 255 categories") from None
            self.categories.append(name)
            return len(self.categories) - 1

    def string_id(self, text: str) -> int:
        if not text:
            return -1
        index = self.__dict__.setdefault("_string_index", {s: i for i, s in enumerate(self.strings)})
        i = index.get(text)
        if i is None:
            i = index[text] = len(self.strings)
            self.strings.append(text)
        return i

    def device(self, index: int) -> dict[str, Any]:
        """The device entry for a CUDA index (created empty if the trace has none)."""
        for d in self.devices:
            if d["index"] == index:
                return d
        d = {"index": index, "name": "", "total_bytes": 0, "limit_bytes": 0, "segments": [], "stats": {}}
        self.devices.append(d)
        self.devices.sort(key=lambda x: x["index"])
        return d

    def device_indices(self) -> list[int]:
        """Devices with events or a snapshot, ascending."""
        seen = {int(i) for i in np.unique(self.cols["device"]) if i >= 0}
        seen.update(d["index"] for d in self.devices if d["segments"] or d["index"] in seen)
        return sorted(seen)

    def sort(self) -> None:
        """Orders events by time; ties keep their order (the ring's order within one allocator)."""
        order = np.argsort(self.cols["time_ns"], kind="stable")
        if not np.array_equal(order, np.arange(len(order))):
            self.cols = {k: v[order] for k, v in self.cols.items()}

    def stack_frames(self, stack: int) -> list[Frame]:
        if stack < 0 or stack >= len(self.stacks):
            return []
        return [self.frames[f] for f in self.stacks[stack]]

    def action_mask(self, *names: str) -> np.ndarray:
        ids = [self.actions.index(n) for n in names if n in self.actions]
        return np.isin(self.cols["action"], np.array(ids, dtype=np.uint8))
