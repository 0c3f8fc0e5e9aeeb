"""Why the peak is what it is: the blocks live at it by category x module, each step's peak and what set
it, the phases over time, and what the pool held off the device then. Read from a Trace's lifetimes
(owners.py put each block's module and phase in its stack's first frames)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .phases import PHASE_ACTION, STEP_MARK
from .table import ALLOC, Trace
from .timeline import Lifetimes, Series

MAX_OWNERS = 40  # category x module rows listed; the rest are summed
MAX_STEPS = 50  # steps listed: the highest peaks, in step order
NO_MODULE = "(no module)"
PHASE_COLORS = {"forward": "#e3eef9", "backward": "#fbe9d7", "optimizer": "#eee6f3"}


def owners_of(trace: Trace, lt: Lifetimes, live: np.ndarray, modules: list[str]) -> list[dict[str, Any]]:
    """Bytes live at one moment by (category, module), largest first: {category, module, bytes, blocks}."""
    acc: dict[tuple[str, str], list[int]] = {}
    for i in live.tolist():
        st = int(lt.stack[i])
        key = (trace.categories[int(lt.category[i])], modules[st] if st >= 0 and modules[st] else NO_MODULE)
        row = acc.setdefault(key, [0, 0])
        row[0] += int(lt.size[i])
        row[1] += 1
    rows: list[dict[str, Any]] = [
        {"category": c, "module": m, "bytes": b, "blocks": n} for (c, m), (b, n) in acc.items()
    ]
    rows.sort(key=lambda r: (-r["bytes"], r["category"], r["module"]))
    return rows


def owners_at_peak(trace: Trace, device: int) -> tuple[list[dict[str, Any]], int]:
    """Every (category, module) row live at the device's peak of active bytes, and the peak's trace
    event index (-1: before the first event)."""
    from .owners import stack_owners
    from .timeline import lifetimes, series

    lt = lifetimes(trace, device)
    s = series(trace, device, lt)
    index = -1
    if len(s.active) and int(s.active.max()) > s.initial_active:
        index = int(s.index[int(np.argmax(s.active))])
    return owners_of(trace, lt, np.flatnonzero(lt.live_at(index)), stack_owners(trace)[0]), index


def coverage(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Shares of the bytes in `rows`: in a named category, and of activations, with a module path."""
    total = sum(r["bytes"] for r in rows)
    named = sum(r["bytes"] for r in rows if r["category"] != "unknown")
    act = [r for r in rows if r["category"] == "activation"]
    act_total = sum(r["bytes"] for r in act)
    act_mod = sum(r["bytes"] for r in act if r["module"] != NO_MODULE)
    return {
        "categorised": named / total if total else 1.0,
        "activation_with_module": act_mod / act_total if act_total else 1.0,
        "activation_bytes": act_total,
    }


def phase_events(trace: Trace) -> tuple[np.ndarray, list[str]]:
    """(times, names) of the trace's phase changes (context.py)."""
    if PHASE_ACTION not in trace.actions:
        return np.zeros(0, np.int64), []
    idx = np.flatnonzero(trace.cols["action"] == trace.actions.index(PHASE_ACTION))
    names = [trace.strings[int(d)] if d >= 0 else "" for d in trace.cols["detail"][idx]]
    return trace.cols["time_ns"][idx], names


def phase_spans(trace: Trace, t0: int, t1: int, width: int) -> list[tuple[int, int, str]]:
    """(first bin, last bin, phase) of each forward, backward and optimizer phase, merged where one
    bin holds several (a report's size must not grow with the steps)."""
    times, names = phase_events(trace)
    span = max(t1 - t0, 1)
    out: list[tuple[int, int, str]] = []
    for k, name in enumerate(names):
        if name not in PHASE_COLORS:
            continue
        end = int(times[k + 1]) if k + 1 < len(times) else t1
        b0 = int((int(times[k]) - t0) * width // span)
        b1 = int((end - t0) * width // span)
        b0, b1 = min(max(b0, 0), width - 1), min(max(b1, 0), width - 1)
        if out and out[-1][2] == name and out[-1][1] >= b0 - 1:
            out[-1] = (out[-1][0], max(b1, out[-1][1]), name)
        elif out and out[-1][1] >= b0 and out[-1][0] == b0:
            continue  # a phase narrower than a bin: the bin shows the one that began there first
        else:
            out.append((b0, b1, name))
    return out


def step_peaks(trace: Trace, lt: Lifetimes, s: Series, modules: list[str], t0: int) -> list[dict[str, Any]]:
    """Per step (optimizer step to optimizer step; the part after the last, if any events), its peak
    active bytes, when, the allocation that reached it and the largest owners then."""
    if not len(s.index):
        return []
    times, names = phase_events(trace)
    marks = [int(t) for t, n in zip(times, names, strict=True) if n == STEP_MARK]
    edges = np.searchsorted(s.time_ns, np.array(marks, np.int64), side="right")
    starts = np.concatenate([[0], edges]).astype(np.int64)
    ends = np.concatenate([edges, [len(s.index)]]).astype(np.int64)
    steps = []
    for k, (a, b) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        if b <= a:
            continue
        p = a + int(np.argmax(s.active[a:b]))
        steps.append({"step": k + 1, "partial": k == len(marks), "pos": p, "peak_bytes": int(s.active[p])})
    if len(steps) > MAX_STEPS:
        keep = sorted(sorted(steps, key=lambda r: -r["peak_bytes"])[:MAX_STEPS], key=lambda r: r["step"])
        steps = keep
    c = trace.cols
    for r in steps:
        p = r.pop("pos")
        index = int(s.index[p])
        r["time_s"] = (int(s.time_ns[p]) - t0) / 1e9
        r["set_by"] = None
        if c["action"][index] == ALLOC:
            hit = np.flatnonzero(lt.start == index)
            if len(hit):
                i = int(hit[0])
                st = int(lt.stack[i])
                r["set_by"] = {
                    "category": trace.categories[int(lt.category[i])],
                    "module": modules[st] if st >= 0 and modules[st] else NO_MODULE,
                    "bytes": int(lt.size[i]),
                }
        r["owners"] = owners_of(trace, lt, np.flatnonzero(lt.live_at(index)), modules)[:3]
    return steps


AWAY_ACTIONS = {"offload": "offloaded", "drop": "recomputed", "compress": "compressed"}  # -> how
BACK_ACTIONS = ("prefetch", "restore", "recompute", "decompress")


def off_device(trace: Trace, index: int, device: int) -> dict[str, int]:
    """Bytes the pool held off the device just after trace event `index`, by how: offloaded (not yet
    prefetched back), recomputed (dropped, not yet rebuilt), compressed (packed, not yet unpacked; the
    tensor's bytes, its smaller payload still on the device), per pool entry (the events' tag)."""
    c = trace.cols
    away_ids = {trace.actions.index(a): how for a, how in AWAY_ACTIONS.items() if a in trace.actions}
    back_ids = [trace.actions.index(a) for a in BACK_ACTIONS if a in trace.actions]
    if not away_ids or index < 0:
        return {}
    sel = np.flatnonzero(
        np.isin(c["action"][: index + 1], [*away_ids, *back_ids]) & (c["device"][: index + 1] == device)
    )
    away: dict[int, tuple[str, int]] = {}
    for i in sel.tolist():
        tag, how = int(c["tag"][i]), away_ids.get(int(c["action"][i]))
        if how is not None:
            away[tag] = (how, int(c["size"][i]))
        else:
            away.pop(tag, None)
    out: dict[str, int] = {}
    for how, nbytes in away.values():
        out[how] = out.get(how, 0) + nbytes
    return out
