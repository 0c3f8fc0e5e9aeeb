"""What a report shows, computed once from a Trace: per device, memory over time by category
(downsampled to `width` bins, peaks kept), reserved bytes, the peak and every block live at it
(full detail, not downsampled), OOMs, the pool's actions and copy throughput per bin.

Bounded output: the series have `width` points whatever the trace's length, and the peak table
lists the `max_blocks` largest live blocks exactly, plus a total of the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..events import CATEGORIES
from ..units import format_bytes
from . import breakdown
from .owners import python_frames, rule_note, stack_owners
from .phases import CALL_ACTION, OUTPUT_ACTION, PHASE_ACTION, RETURN_ACTION
from .table import MEMORY_ACTIONS, OOM, Trace
from .timeline import bin_sums, category_values, downsample, lifetimes, series

# Series plotted per device, at most: the rest are summed into one. A file may name 255 categories
# and 255 actions on each of 128 devices; a series per pair would make a report of gigabytes.
MAX_SERIES = 10
OTHER_CATEGORIES, OTHER_ACTIONS = "other categories", "other actions"
D2H_ACTIONS = ("offload",)  # device -> host copies
H2D_ACTIONS = ("prefetch", "restore")  # host -> device copies


@dataclass
class DeviceReport:
    device: int
    name: str
    total_bytes: int
    limit_bytes: int
    num_events: int
    by_category: dict[str, list[int]]  # active bytes per bin, stacking order = CATEGORIES order
    active: list[int]  # bytes per bin
    reserved: list[int]  # bytes per bin
    reserved_known: bool
    peak_bytes: int
    peak_time_s: float | None  # None: the peak is the state before the first event
    peak_reserved_bytes: int
    reserved_at_peak_bytes: int  # reserved when active memory peaked
    max_idle_reserved_bytes: int  # the most reserved memory that held no block at any one time
    peak_by_category: dict[str, int]
    peak_blocks: list[dict[str, Any]]  # largest first: size, category, address, alloc_s, frames
    peak_other_blocks: int  # live at the peak but not listed
    peak_other_bytes: int
    peak_num_blocks: int
    ooms: list[dict[str, Any]]
    pool_bytes: dict[str, list[float]]  # action -> bytes per bin
    pool_counts: dict[str, int]
    copy_rate: dict[str, list[float]]  # "d2h"/"h2d" -> bytes/s per bin
    dropped_events: int
    # Who holds the peak (breakdown.py): {category, module, bytes, blocks}, largest first, at most
    # breakdown.MAX_OWNERS rows, then what the rest add up to
    peak_owners: list[dict[str, Any]] = field(default_factory=list)
    peak_owners_other: dict[str, int] = field(default_factory=dict)  # bytes, rows
    coverage: dict[str, float] = field(default_factory=dict)  # categorised, activation_with_module
    off_device_at_peak: dict[str, int] = field(default_factory=dict)  # what the pool held away then
    steps: list[dict[str, Any]] = field(default_factory=list)  # breakdown.step_peaks
    phase_spans: list[tuple[int, int, str]] = field(default_factory=list)  # (bin, bin, phase)


@dataclass
class Report:
    source: str
    meta: dict[str, Any]
    t0_ns: int
    span_s: float
    width: int
    bin_s: float
    num_events: int
    devices: list[DeviceReport] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    what_if: list[Any] = field(default_factory=list)  # whatif.WhatIf per device, where a budget was given

    @property
    def time_is_index(self) -> bool:
        return bool(self.meta.get("time_is_index"))


def analyze(trace: Trace, width: int = 1000, max_blocks: int = 500, source: str = "") -> Report:
    """Report data for `trace`: `width` points per series, the `max_blocks` largest blocks at the peak."""
    t = trace.cols["time_ns"]
    t0 = int(t.min()) if len(t) else 0
    t1 = int(t.max()) if len(t) else 0
    span_ns = max(t1 - t0, 1)
    rep = Report(source, dict(trace.meta), t0, span_ns / 1e9, width, span_ns / 1e9 / width, len(trace))
    not_pool = list(MEMORY_ACTIONS) + [OOM]
    not_pool += [
        trace.actions.index(a)
        for a in (PHASE_ACTION, CALL_ACTION, RETURN_ACTION, OUTPUT_ACTION)
        if a in trace.actions
    ]
    pool_mask = ~np.isin(trace.cols["action"], not_pool)
    devices = trace.device_indices()
    modules = stack_owners(trace)[0]
    for n, dev in enumerate(devices):
        d = _device(trace, dev, t0, t1, width, max_blocks, pool_mask, first=n == 0, modules=modules)
        rep.devices.append(d)
    dropped = {k: v for k, v in trace.meta.get("dropped_events", {}).items() if v}
    if dropped:
        rep.notes.append(
            "The ring buffer overwrote the oldest events ("
            + ", ".join(f"device {k}: {v}" for k, v in dropped.items())
            + "): the trace starts mid-run; memory live before its first event is rebuilt from the "
            "final snapshot."
        )
    if trace.meta.get("time_is_index"):
        rep.notes.append("The snapshot has no timestamps: the time axis counts events.")
    return rep


def _device(
    trace: Trace,
    dev: int,
    t0: int,
    t1: int,
    width: int,
    max_blocks: int,
    pool_mask,
    first: bool,
    modules: list[str],
):
    info = trace.device(dev)
    lt = lifetimes(trace, dev)
    s = series(trace, dev, lt)
    pos = downsample(s.time_ns, s.active, t0, t1, width)
    cat_vals = category_values(trace, lt, s, pos)
    order = [c for c in CATEGORIES if c in cat_vals] + [c for c in cat_vals if c not in CATEGORIES]
    shown = [c for c in order if cat_vals[c].any()]
    rest: list[str] = []
    if len(shown) > MAX_SERIES:  # keep the largest, sum the others
        largest = set(sorted(shown, key=lambda c: -int(cat_vals[c].max()))[: MAX_SERIES - 1])
        rest = [c for c in shown if c not in largest]
        shown = [c for c in shown if c in largest]
    by_category = {c: cat_vals[c].tolist() for c in shown}
    if rest:
        by_category[OTHER_CATEGORIES] = np.sum([cat_vals[c] for c in rest], axis=0).tolist()
    active = np.where(pos >= 0, s.active[np.maximum(pos, 0)], s.initial_active) if len(s.active) else None
    if active is None:
        active = np.full(width, s.initial_active)
    reserved_full = s.reserved if len(s.reserved) else np.zeros(0, np.int64)
    # Reserved is downsampled on its own: its peak need not coincide with the active peak.
    rpos = downsample(s.time_ns, reserved_full, t0, t1, width)
    reserved = np.where(
        rpos >= 0, reserved_full[np.maximum(rpos, 0)] if len(reserved_full) else 0, s.initial_reserved
    )

    if len(s.active) and int(s.active.max()) > s.initial_active:
        p = int(np.argmax(s.active))
        peak_index = int(s.index[p])
        peak_bytes = int(s.active[p])
        peak_time_s = (int(s.time_ns[p]) - t0) / 1e9
    else:
        peak_index, peak_bytes, peak_time_s = -1, s.initial_active, None
    live = np.flatnonzero(lt.live_at(peak_index))
    live = live[np.argsort(-lt.size[live], kind="stable")]
    peak_by_category: dict[str, int] = {}
    for k in np.unique(lt.category[live]):
        peak_by_category[trace.categories[int(k)]] = int(lt.size[live][lt.category[live] == k].sum())
    t = trace.cols["time_ns"]
    blocks = []
    for i in live[:max_blocks]:
        start = int(lt.start[i])
        frames = trace.stack_frames(int(lt.stack[i]))
        st = int(lt.stack[i])
        blocks.append(
            {
                "size": int(lt.size[i]),
                "category": trace.categories[int(lt.category[i])],
                "module": modules[st] if st >= 0 else "",
                "phase": next((f[2] for f in frames[:2] if f[0] == "<phase>"), ""),
                "address": int(lt.address[i]),
                "alloc_s": (int(t[start]) - t0) / 1e9 if start >= 0 else None,
                "frames": python_frames(frames),
            }
        )
    owners = breakdown.owners_of(trace, lt, live, modules)
    listed = owners[: breakdown.MAX_OWNERS]
    others = owners[breakdown.MAX_OWNERS :]
    rest_blocks = live[max_blocks:]

    c = trace.cols
    sel = pool_mask & ((c["device"] == dev) | ((c["device"] < 0) & first))
    pool_bytes, pool_counts = {}, {}
    acts = c["action"][sel]
    for a in np.unique(acts):
        m = acts == a
        name = trace.actions[int(a)]
        pool_counts[name] = int(m.sum())
        pool_bytes[name] = bin_sums(c["time_ns"][sel][m], c["size"][sel][m], t0, t1, width).tolist()
    bin_s = max(t1 - t0, 1) / 1e9 / width
    copy_rate = {}
    for label, names in (("d2h", D2H_ACTIONS), ("h2d", H2D_ACTIONS)):
        per_bin = np.zeros(width)
        for name in names:
            if name in pool_bytes:
                per_bin += np.array(pool_bytes[name])
        if per_bin.any():
            copy_rate[label] = (per_bin / bin_s).tolist()
    if len(pool_bytes) > MAX_SERIES:
        copies = [a for a in (*D2H_ACTIONS, *H2D_ACTIONS) if a in pool_bytes]
        by_count = [a for a in sorted(pool_counts, key=lambda a: -pool_counts[a]) if a not in copies]
        keep = set(copies + by_count[: MAX_SERIES - 1 - len(copies)])
        summed = [a for a in pool_bytes if a not in keep]
        merged = np.sum([pool_bytes.pop(a) for a in summed], axis=0)
        pool_bytes[OTHER_ACTIONS] = merged.tolist()
        pool_counts[OTHER_ACTIONS] = sum(pool_counts.pop(a) for a in summed)

    ooms = []
    dev_idx = s.index
    for i in np.flatnonzero((c["action"] == OOM) & (c["device"] == dev)):
        w = int(np.searchsorted(dev_idx, i))
        ooms.append(
            {
                "time_s": (int(t[i]) - t0) / 1e9,
                "requested_bytes": int(c["size"][i]),
                "active_bytes": int(s.active[w]) if w < len(s.active) else 0,
                "reserved_bytes": int(s.reserved[w]) if w < len(s.reserved) else 0,
            }
        )
    dropped = int(trace.meta.get("dropped_events", {}).get(str(dev), 0))
    peak_reserved = int(max(reserved_full.max(initial=0), s.initial_reserved))
    reserved_at_peak = s.initial_reserved
    if peak_index >= 0:
        reserved_at_peak = int(s.reserved[int(np.searchsorted(s.index, peak_index))])
    idle = int((reserved_full - s.active).max(initial=0)) if len(reserved_full) else 0
    idle = max(idle, s.initial_reserved - s.initial_active)
    return DeviceReport(
        device=dev,
        name=str(info.get("name", "")),
        total_bytes=int(info.get("total_bytes") or 0),
        limit_bytes=int(info.get("limit_bytes") or 0),
        num_events=len(s.index),
        by_category=by_category,
        active=[int(x) for x in active],
        reserved=[int(x) for x in reserved],
        reserved_known=s.reserved_known,
        peak_bytes=peak_bytes,
        peak_time_s=peak_time_s,
        peak_reserved_bytes=peak_reserved,
        reserved_at_peak_bytes=reserved_at_peak,
        max_idle_reserved_bytes=idle,
        peak_by_category=dict(sorted(peak_by_category.items(), key=lambda kv: -kv[1])),
        peak_blocks=blocks,
        peak_other_blocks=len(rest_blocks),
        peak_other_bytes=int(lt.size[rest_blocks].sum()),
        peak_num_blocks=len(live),
        ooms=ooms,
        pool_bytes=pool_bytes,
        pool_counts=pool_counts,
        copy_rate=copy_rate,
        dropped_events=dropped,
        peak_owners=listed,
        peak_owners_other={"bytes": sum(r["bytes"] for r in others), "rows": len(others)},
        coverage=breakdown.coverage(owners),
        off_device_at_peak=breakdown.off_device(trace, peak_index, dev),
        steps=breakdown.step_peaks(trace, lt, s, modules, t0),
        phase_spans=breakdown.phase_spans(trace, t0, t1, width),
    )


def summary_text(rep: Report) -> str:
    """A few lines for a terminal or a CI log."""
    lines = [f"{rep.source or 'trace'}: {rep.num_events} events over {_fmt_s(rep.span_s, rep.time_is_index)}"]
    note = rule_note(rep.meta)
    if note:
        lines.append("  " + note)
    for d in rep.devices:
        cap = d.limit_bytes or d.total_bytes
        lines.append(
            f"device {d.device} ({d.name or '?'}): peak active {format_bytes(d.peak_bytes)}"
            + (f" at {_fmt_s(d.peak_time_s, rep.time_is_index)}" if d.peak_time_s is not None else "")
            + f", peak reserved {format_bytes(d.peak_reserved_bytes)}"
            + (f" of {format_bytes(cap)}" if cap else "")
            + f", {d.peak_num_blocks} blocks live at the peak"
        )
        if d.peak_by_category:
            parts = [f"{k} {format_bytes(v)}" for k, v in d.peak_by_category.items()]
            lines.append("  at the peak: " + ", ".join(parts))
        if d.peak_owners:
            total = d.peak_bytes or 1
            top = [
                f"{r['category']} {r['module']} {format_bytes(r['bytes'])} ({r['bytes'] / total:.0%})"
                for r in d.peak_owners[:5]
            ]
            lines.append("  largest owners: " + "; ".join(top))
            cov = d.coverage
            lines.append(
                f"  categorised {cov['categorised']:.1%} of the peak; activations with a module "
                f"{cov['activation_with_module']:.1%}"
            )
        if d.off_device_at_peak:
            parts = [f"{k} {format_bytes(v)}" for k, v in d.off_device_at_peak.items()]
            lines.append("  off the device at the peak (pool): " + ", ".join(parts))
        if len(d.steps) > 1:
            worst = max(d.steps, key=lambda r: r["peak_bytes"])
            by = worst["set_by"]
            lines.append(
                f"  {len(d.steps)} steps; highest step {worst['step']}: {format_bytes(worst['peak_bytes'])}"
                + (f", reached by {by['category']} {by['module']} {format_bytes(by['bytes'])}" if by else "")
            )
        if d.ooms:
            lines.append(
                f"  {len(d.ooms)} OOM(s), first asking for {format_bytes(d.ooms[0]['requested_bytes'])}"
            )
        if d.pool_counts:
            lines.append("  pool: " + ", ".join(f"{k} x{v}" for k, v in sorted(d.pool_counts.items())))
    lines.extend("note: " + n for n in rep.notes)
    return "\n".join(lines)


def _fmt_s(s: float, is_index: bool = False) -> str:
    if is_index:
        return f"event {s * 1e6:.0f}"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.2f} ms"
