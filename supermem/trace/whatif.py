"""What a budget would cost, from a trace: `supermem report run.smtrace --budget 8GiB`.

The floor no treatment goes under: parameters + gradients + optimizer state (the most of them live at
once) + the largest block nothing can move (a temporary, a gradient flowing back, an input: the pool
treats only what autograd saves). Above it, the trace's last full step becomes a profile for the
pool's planner (tensor_pool/planner/, its pure make_plan): each activation block is a saved tensor,
saved at its alloc and used at its free (its last use in backward: the trace holds no unpack times),
the step's curve is the trace's active bytes at those events, and what rises above the curve between
them (the loss's spike) is the transient the planner puts at backward's start. The plan says which
activations it would keep and which offload, the peak and step seconds it predicts, and whether the
step fits. Copies are priced at the link the recording probed (copy_rate). Recompute is not offered:
its price is a module call's seconds, which a trace does not time (a live pool measures them;
supermem.pool(budget=...) plans with them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import costs
from .breakdown import NO_MODULE, phase_events
from .owners import stack_owners
from .phases import STEP_MARK
from .table import Trace
from .timeline import category_values, lifetimes, series

if TYPE_CHECKING:
    from ..tensor_pool.profile import Profile

PERSISTENT = ("parameter", "gradient", "optimizer_state")
UNMOVABLE = ("temporary", "autograd_detail", "input", "unknown")


@dataclass
class WhatIf:
    budget_bytes: int
    device: int
    peak_bytes: int  # the trace's peak of active bytes
    floor_bytes: int
    floor_parts: dict[str, int]  # persistent (by category at their joint most), largest_unmovable
    largest_unmovable: dict[str, Any]  # category, module, bytes
    fits: bool
    predicted_peak_bytes: int
    predicted_step_s: float
    measured_step_s: float  # the step planned from, as traced
    by_module: list[dict[str, Any]] = field(default_factory=list)  # module, keep_bytes, offload_bytes
    link_bytes_per_s: float = 0.0  # what the plan's copies were priced at (copy_rate)
    sync_copies: bool = False
    link_source: str = ""
    notes: list[str] = field(default_factory=list)


def floor(trace: Trace, device: int) -> tuple[int, dict[str, int], dict[str, Any]]:
    """(floor bytes, its parts, the largest unmovable block) on one device."""
    lt = lifetimes(trace, device)
    s = series(trace, device, lt)
    positions = np.arange(-1, len(s.index))
    values = category_values(trace, lt, s, positions)
    joint = sum((values[c] for c in PERSISTENT if c in values), np.zeros(len(positions), np.int64))
    at = int(np.argmax(joint)) if len(joint) else 0
    parts = {c: int(values[c][at]) if c in values else 0 for c in PERSISTENT}
    modules = stack_owners(trace)[0]
    ids = [trace.categories.index(c) for c in UNMOVABLE if c in trace.categories]
    cand = np.flatnonzero(np.isin(lt.category, ids))
    largest: dict[str, Any] = {"category": "", "module": "", "bytes": 0}
    if len(cand):
        i = int(cand[np.argmax(lt.size[cand])])
        st = int(lt.stack[i])
        largest = {
            "category": trace.categories[int(lt.category[i])],
            "module": modules[st] if st >= 0 and modules[st] else NO_MODULE,
            "bytes": int(lt.size[i]),
        }
    parts["largest_unmovable"] = largest["bytes"]
    return sum(parts.values()), parts, largest


def _last_step(trace: Trace) -> tuple[int, int] | None:
    """(start, end) times of the last step that ran whole: from the forward after the next-to-last
    step's end (or the trace's first forward) to the last step's end."""
    times, names = phase_events(trace)
    marks = [int(t) for t, n in zip(times, names, strict=True) if n == STEP_MARK]
    forwards = [int(t) for t, n in zip(times, names, strict=True) if n == "forward"]
    if not marks:
        return None
    before = marks[-2] if len(marks) > 1 else -1
    starts = [t for t in forwards if before < t < marks[-1]]
    return (starts[0], marks[-1]) if starts else None


def copy_rate(trace: Trace, device: int) -> tuple[float, bool, str]:
    """(bytes per second, whether copies block the step, where the rate is from) of the pool's copies
    off `device`: the link the recording probed (Recorder._link_rates); a CPU trace's host memcpy,
    which blocks as the pool's CPU offload does; else the default a pool prices copies at before it
    probed (an H200's link is twice it)."""
    probed = trace.meta.get("link_bytes_per_s", {}).get(str(device))
    if probed:
        return float(probed), False, "probed when traced"
    name = next((str(d.get("name", "")) for d in trace.devices if d["index"] == device), "")
    if name.startswith("cpu"):
        return costs.CPU_COPY_BYTES_PER_S, True, "host memcpy"
    return costs.GPU_LINK_BYTES_PER_S, False, "default: the trace holds no probe"


def step_profile(trace: Trace, device: int) -> tuple[Profile, np.ndarray, int] | None:
    """The trace's last whole step as the planner's profile on `device`, the lifetimes (indices into
    timeline.lifetimes) of its saved tensors, ordinal k + 1 at k, and the step's peak of active bytes;
    None without a whole step."""
    from ..tensor_pool.profile import Profile, Saved

    window = _last_step(trace)
    if window is None:
        return None
    w0, w1 = window
    lt = lifetimes(trace, device)
    s = series(trace, device, lt)
    t = trace.cols["time_ns"]
    start_t = np.where(lt.start >= 0, t[lt.start.clip(0)], np.iinfo(np.int64).min)
    end_t = np.where(lt.end >= 0, t[lt.end.clip(0)], w1)
    act = trace.categories.index("activation") if "activation" in trace.categories else -1
    chosen = np.flatnonzero((lt.category == act) & (start_t >= w0) & (start_t < w1))
    chosen = chosen[np.argsort(start_t[chosen], kind="stable")]
    saves = start_t[chosen]
    uses = np.minimum(end_t[chosen], w1)
    times = np.concatenate([saves, uses])
    order = np.argsort(times, kind="stable")
    event_of = np.empty(len(order), np.int64)
    event_of[order] = np.arange(len(order))
    n = len(chosen)
    sel = (s.time_ns >= w0) & (s.time_ns <= w1)
    at = np.searchsorted(s.time_ns, times[order], side="right") - 1
    base = np.where(at >= 0, s.active[at.clip(0)], s.initial_active).astype(np.int64).tolist()
    saved = [
        Saved(ordinal=k + 1, nbytes=int(lt.size[i]), save=int(event_of[k]), use=int(event_of[n + k]))
        for k, i in enumerate(chosen.tolist())
    ]
    for sv in saved:
        sv.end = min(sv.use + 1, len(base))
    backward = min((sv.use for sv in saved), default=len(base))
    transient = [0] * len(base)
    step_peak = int(s.active[sel].max()) if sel.any() else int(s.active.max(initial=s.initial_active))
    if base and backward < len(base):
        transient[backward] = max(0, step_peak - max(base))
    link_bytes_per_s, sync_copies, _ = copy_rate(trace, device)
    profile = Profile(
        saved=saved,
        times_s=((times[order] - w0) / 1e9).tolist(),
        base_bytes=base,
        transient_bytes=transient,
        backward_event=backward,
        step_s=(w1 - w0) / 1e9,
        tail_s=(w1 - int(times[order][-1])) / 1e9 if len(times) else 0.0,
        link_bytes_per_s=link_bytes_per_s,
        sync_copies=sync_copies,
    )
    return profile, chosen, step_peak


def what_if(trace: Trace, budget_bytes: int, device: int | None = None) -> WhatIf:
    """What the pool would do at `budget_bytes` on `device` (default: the trace's first)."""
    from ..tensor_pool.planner import make_plan

    devices = trace.device_indices()
    device = devices[0] if device is None and devices else (device or 0)
    lt = lifetimes(trace, device)
    s = series(trace, device, lt)
    peak = int(s.active.max()) if len(s.active) else s.initial_active
    floor_bytes, parts, largest = floor(trace, device)
    out = WhatIf(budget_bytes, device, peak, floor_bytes, parts, largest, False, peak, 0.0, 0.0)
    out.link_bytes_per_s, out.sync_copies, out.link_source = copy_rate(trace, device)
    made = step_profile(trace, device)
    if made is None:
        out.notes.append("no whole step (forward, backward, optimizer step) in the trace: only the floor")
        out.fits = floor_bytes <= budget_bytes and peak <= budget_bytes
        return out
    profile, chosen, step_peak = made
    plan = make_plan(profile, budget_bytes)
    out.measured_step_s = profile.step_s
    out.predicted_step_s = plan.predicted_step_s or profile.step_s
    out.predicted_peak_bytes = step_peak
    if profile.saved:
        out.predicted_peak_bytes = max(int(plan.predicted_peak_bytes), floor_bytes)
    out.fits = (
        bool(plan.feasible) and floor_bytes <= budget_bytes and out.predicted_peak_bytes <= budget_bytes
    )
    modules = stack_owners(trace)[0]
    rows: dict[str, dict[str, Any]] = {}
    for k, i in enumerate(chosen.tolist()):
        st = int(lt.stack[i])
        module = modules[st] if st >= 0 and modules[st] else NO_MODULE
        row = rows.setdefault(module, {"module": module, "keep_bytes": 0, "offload_bytes": 0})
        treatment = plan.treatment.get(k + 1, "keep")
        row["offload_bytes" if treatment == "offload" else "keep_bytes"] += int(lt.size[i])
    out.by_module = sorted(rows.values(), key=lambda r: (-r["offload_bytes"], -r["keep_bytes"]))
    if floor_bytes > budget_bytes:
        out.notes.append("the budget is under the floor: no treatment of activations makes the step fit")
    return out


def summary(w: WhatIf) -> str:
    """A few lines for a terminal."""
    from ..units import format_bytes as fb

    p = w.floor_parts
    step = ""
    if w.measured_step_s:
        step = (
            f", step {w.predicted_step_s * 1e3:.1f} ms (traced {w.measured_step_s * 1e3:.1f} ms; copies at "
            f"{w.link_bytes_per_s / 1e9:.1f} GB/s, {w.link_source})"
        )
    lines = [
        f"what if the budget were {fb(w.budget_bytes)} (device {w.device}, traced peak {fb(w.peak_bytes)}):",
        f"  floor {fb(w.floor_bytes)} = parameters {fb(p['parameter'])} + gradients {fb(p['gradient'])}"
        f" + optimizer state {fb(p['optimizer_state'])} + largest unmovable block "
        f"{fb(p['largest_unmovable'])} ({w.largest_unmovable['category']} {w.largest_unmovable['module']})",
        f"  {'fits' if w.fits else 'does not fit'}: predicted peak {fb(w.predicted_peak_bytes)}{step}",
    ]
    off = [r for r in w.by_module if r["offload_bytes"]]
    keep = sum(r["keep_bytes"] for r in w.by_module)
    if w.by_module:
        lines.append(f"  keep {fb(keep)} of activations; offload {fb(sum(r['offload_bytes'] for r in off))}:")
        lines.extend(f"    offload {fb(r['offload_bytes'])} of {r['module']}" for r in off[:10])
        if len(off) > 10:
            lines.append(f"    and {len(off) - 10} more modules")
    lines.extend("  note: " + n for n in w.notes)
    return "\n".join(lines)
