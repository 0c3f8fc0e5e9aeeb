"""From events to memory over time: block lifetimes, active and reserved bytes, the peak, and
peak-preserving downsampling for display. Everything is vectorised (numpy): 10^6 events take
well under a second.

"Active" bytes are what memory_viz's Active Memory Timeline shows: a block counts from its alloc
until its free_completed (a block freed while another stream still uses it stays active).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .table import ALLOC, FREE_COMPLETED, FREE_REQUESTED, SEGMENT_ALLOC, SEGMENT_FREE, UNKNOWN_CATEGORY, Trace

_LIVE_STATES = ("active_allocated", "active_pending_free", "active_awaiting_free")


@dataclass
class Lifetimes:
    """One row per block lifetime on one device, ordered by (address, time).

    start/end are trace indices of the alloc and free_completed events; -1 means before the first
    event (the block was already live) / after the last (still live at the end)."""

    address: np.ndarray
    size: np.ndarray
    start: np.ndarray
    end: np.ndarray
    category: np.ndarray
    stack: np.ndarray
    event_index: np.ndarray  # trace indices of this device's alloc/free events...
    event_lifetime: np.ndarray  # ...and the lifetime each belongs to

    def __len__(self) -> int:
        return len(self.address)

    def live_at(self, index: int) -> np.ndarray:
        """Mask of lifetimes active just after trace event `index` (-1: before the first event)."""
        started = (self.start < 0) | ((self.start <= index) & (index >= 0))
        return started & ((self.end < 0) | (self.end > index))


def live_snapshot_blocks(trace: Trace, device: int) -> list[dict]:
    """Blocks live in the device's final snapshot."""
    out: list[dict] = []
    for seg in trace.device(device)["segments"] if device in trace.device_indices() else []:
        out.extend(b for b in seg.get("blocks", []) if b.get("state") in _LIVE_STATES)
    return out


def lifetimes(trace: Trace, device: int) -> Lifetimes:
    c = trace.cols
    kinds = np.array([ALLOC, FREE_REQUESTED, FREE_COMPLETED], dtype=np.uint8)
    sel = np.flatnonzero((c["device"] == device) & np.isin(c["action"], kinds))
    order = np.lexsort((sel, c["address"][sel]))  # by address, then time
    ev = sel[order]
    addr = c["address"][ev]
    act = c["action"][ev]
    n = len(ev)
    new_group = np.ones(n, bool)
    new_group[1:] = addr[1:] != addr[:-1]
    # A lifetime starts at each alloc, or at an address's first event when that is a free (the block
    # was allocated before the trace began).
    new_life = new_group | (act == ALLOC)
    lid = np.cumsum(new_life) - 1
    first = np.flatnonzero(new_life)
    nl = len(first)
    start = np.where(act[first] == ALLOC, ev[first], -1).astype(np.int64)
    end = np.full(nl, -1, np.int64)
    done = act == FREE_COMPLETED
    end[lid[done]] = ev[done]
    address = addr[first]
    size = c["size"][ev[first]].astype(np.int64)
    # Two allocs at one address with no free between them mean lost events: end the first at the second
    # rather than let it inflate memory to the end of the trace.
    if nl > 1:
        same_next = address[1:] == address[:-1]
        open_ = (end[:-1] < 0) & same_next
        end[:-1][open_] = start[1:][open_]
    category = np.full(nl, UNKNOWN_CATEGORY, np.uint8)
    stack = np.full(nl, -1, np.int32)
    cat_ev = c["category"][ev]
    known = cat_ev != UNKNOWN_CATEGORY
    category[lid[known]] = cat_ev[known]
    st_ev = c["stack"][ev]
    has = st_ev >= 0
    stack[lid[has]] = st_ev[has]

    # Blocks live in the final snapshot with no event in the trace were live throughout.
    blocks = live_snapshot_blocks(trace, device)
    seen = set(address.tolist())
    extra = [b for b in blocks if b["address"] not in seen]
    by_addr = {b["address"]: b for b in blocks}
    for i in np.flatnonzero(end < 0):  # fill what the snapshot knows about blocks live at the end
        b = by_addr.get(int(address[i]))
        if b is not None:
            if category[i] == UNKNOWN_CATEGORY and b.get("category"):
                category[i] = trace.category_id(b["category"])
            if stack[i] < 0 and b.get("stack", -1) >= 0:
                stack[i] = b["stack"]
    if extra:
        e_addr = np.array([b["address"] for b in extra], np.int64)
        e_cat = np.array([trace.category_id(b.get("category") or "unknown") for b in extra], np.uint8)
        e_stack = np.array([b.get("stack", -1) for b in extra], np.int32)
        e_size = np.array([b["size"] for b in extra], np.int64)
        address = np.concatenate([address, e_addr])
        size = np.concatenate([size, e_size])
        start = np.concatenate([start, np.full(len(extra), -1, np.int64)])
        end = np.concatenate([end, np.full(len(extra), -1, np.int64)])
        category = np.concatenate([category, e_cat])
        stack = np.concatenate([stack, e_stack])
        # keep (address, time) order: the extras have no events, so each is alone at its address
        order = np.lexsort((start, address))
        remap = np.empty(len(order), np.int64)
        remap[order] = np.arange(len(order))
        lid = remap[lid]
        address, size, start, end = address[order], size[order], start[order], end[order]
        category, stack = category[order], stack[order]
    return Lifetimes(address, size, start, end, category, stack, ev, lid)


@dataclass
class Series:
    """Active and reserved bytes on one device after each of its events."""

    device: int
    index: np.ndarray  # trace indices of the device's events, in time order
    time_ns: np.ndarray
    active: np.ndarray  # bytes, after each event
    reserved: np.ndarray  # bytes, after each event
    initial_active: int  # bytes before the first event
    initial_reserved: int
    reserved_known: bool  # False when the trace lacks the final segments (reserved is a lower bound)


def _deltas(positions_plus, sizes_plus, positions_minus, sizes_minus, n) -> np.ndarray:
    plus = np.bincount(positions_plus, weights=sizes_plus.astype(np.float64), minlength=n)
    minus = np.bincount(positions_minus, weights=sizes_minus.astype(np.float64), minlength=n)
    return plus.astype(np.int64) - minus.astype(np.int64)  # one event per position: exact


def series(trace: Trace, device: int, lt: Lifetimes) -> Series:
    c = trace.cols
    index = np.flatnonzero(c["device"] == device)
    n = len(index)
    s_mask = lt.start >= 0
    e_mask = lt.end >= 0
    d_active = _deltas(
        np.searchsorted(index, lt.start[s_mask]),
        lt.size[s_mask],
        np.searchsorted(index, lt.end[e_mask]),
        lt.size[e_mask],
        n,
    )
    initial_active = int(lt.size[~s_mask].sum())
    active = initial_active + np.cumsum(d_active)

    act = c["action"][index]
    sz = c["size"][index]
    seg_in = np.where(act == SEGMENT_ALLOC, sz, 0)
    seg_out = np.where(act == SEGMENT_FREE, sz, 0)
    d_res = np.cumsum(seg_in - seg_out)
    segments = trace.device(device)["segments"]
    final_reserved = sum(s["total_size"] for s in segments)
    reserved_known = bool(segments) or not len(index)
    net = int(d_res[-1]) if n else 0
    initial_reserved = final_reserved - net
    low = int(d_res.min()) if n else 0
    if not reserved_known or initial_reserved + low < 0:
        initial_reserved = max(initial_reserved, -low, 0)
    reserved = initial_reserved + d_res
    return Series(
        device, index, c["time_ns"][index], active, reserved, initial_active, initial_reserved, reserved_known
    )


def category_values(trace: Trace, lt: Lifetimes, s: Series, positions: np.ndarray) -> dict[str, np.ndarray]:
    """Active bytes per category at the given positions of `s` (-1: before the first event)."""
    n = len(s.index)
    out = {}
    for k in np.unique(lt.category):
        m = lt.category == k
        sm = m & (lt.start >= 0)
        em = m & (lt.end >= 0)
        d = _deltas(
            np.searchsorted(s.index, lt.start[sm]),
            lt.size[sm],
            np.searchsorted(s.index, lt.end[em]),
            lt.size[em],
            n,
        )
        initial = int(lt.size[m & (lt.start < 0)].sum())
        cum = np.concatenate([[initial], initial + np.cumsum(d)])
        out[trace.categories[int(k)]] = cum[positions + 1]
    return out


def downsample(time_ns: np.ndarray, values: np.ndarray, t0: int, t1: int, width: int) -> np.ndarray:
    """One representative position per time bin, `width` bins over [t0, t1]: the position of the
    bin's largest value (so peaks survive), or for an empty bin the last position before it (the
    value then still holds). -1 where no event precedes the bin."""
    span = max(int(t1) - int(t0), 1)
    if not len(time_ns):
        return np.full(width, -1, np.int64)
    b = ((time_ns - t0).astype(np.float64) * width / span).astype(np.int64).clip(0, width - 1)
    order = np.lexsort((-values, b))  # per bin, largest value first (earliest on ties)
    head = np.ones(len(order), bool)
    head[1:] = b[order][1:] != b[order][:-1]
    rep = np.full(width, -1, np.int64)
    rep[b[order][head]] = order[head]
    carry = np.searchsorted(b, np.arange(width), side="right") - 1
    return np.where(rep >= 0, rep, carry)


def bin_sums(time_ns: np.ndarray, weights: np.ndarray, t0: int, t1: int, width: int) -> np.ndarray:
    """Sum of `weights` per time bin (same bins as downsample)."""
    span = max(int(t1) - int(t0), 1)
    b = ((time_ns - t0).astype(np.float64) * width / span).astype(np.int64).clip(0, width - 1)
    return np.bincount(b, weights=weights.astype(np.float64), minlength=width)
