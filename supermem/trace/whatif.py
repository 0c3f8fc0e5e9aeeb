"""What a budget would cost, from a trace: `supermem report run.smtrace --budget 8GiB`.

The floor no treatment goes under: parameters + gradients + optimizer state (the most of them live at
once) + the largest block nothing can move (a temporary, a gradient flowing back, an input: the pool
treats only what autograd saves). Above it, the trace's last full step becomes a profile for the
pool's planner (step_profile.py), and the plan is the live pool's own (tensor_pool/planner/, its pure
make_plan): which activations it would keep, offload, or drop and rebuild by recomputing the module
call that made them, the peak its simulator predicts (below the budget where a whole call's bytes
leave at once, as in a live run), the step seconds, and whether the step fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import costs
from .breakdown import NO_MODULE
from .owners import stack_owners
from .step_profile import copy_rate, step_profile
from .table import Trace
from .timeline import category_values, lifetimes, series

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
    pool_host_s: float = 0.0  # of the predicted step, the pool's host work on the step's saves
    # module, keep_bytes, offload_bytes, recompute_bytes (of the activations allocated in it)
    by_module: list[dict[str, Any]] = field(default_factory=list)
    recomputed_calls: list[str] = field(default_factory=list)  # the module calls the plan replays, by path
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
    profile, chosen, step_peak = made.profile, made.chosen, made.step_peak
    if not made.has_calls:
        out.notes.append("the trace records no module calls (traced without context): copies alone planned")
    plan = make_plan(profile, budget_bytes)
    out.measured_step_s = profile.step_s
    out.pool_host_s = len(profile.saved) * costs.SAVE_HOST_PRIOR_S  # (the trace ran without a pool)
    out.predicted_step_s = (plan.predicted_step_s or profile.step_s) + out.pool_host_s
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
        row = rows.setdefault(
            module, {"module": module, "keep_bytes": 0, "offload_bytes": 0, "recompute_bytes": 0}
        )
        treatment = plan.treatment.get(k + 1, "keep")
        row[f"{treatment}_bytes" if f"{treatment}_bytes" in row else "keep_bytes"] += int(lt.size[i])
    out.by_module = sorted(
        rows.values(), key=lambda r: (-r["offload_bytes"] - r["recompute_bytes"], -r["keep_bytes"])
    )
    replayed = {s.unit for s in profile.saved if plan.treatment.get(s.ordinal) == "recompute"}
    calls = {**made.unit_calls, **made.op_calls}
    out.recomputed_calls = [x.module for u, x in sorted(calls.items()) if u in replayed]
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
            f", step {w.predicted_step_s * 1e3:.1f} ms (traced {w.measured_step_s * 1e3:.1f} ms; the pool's "
            f"host work on the saves {w.pool_host_s * 1e3:.1f} ms; copies at {w.link_bytes_per_s / 1e9:.1f} "
            f"GB/s, {w.link_source})"
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
    rebuilt = sum(r.get("recompute_bytes", 0) for r in w.by_module)
    if w.by_module:
        lines.append(
            f"  keep {fb(keep)} of activations; offload {fb(sum(r['offload_bytes'] for r in off))}; "
            f"recompute {fb(rebuilt)} ({len(w.recomputed_calls)} module calls replayed)"
        )
        if w.recomputed_calls:
            names = ", ".join(w.recomputed_calls[:8]) + (", ..." if len(w.recomputed_calls) > 8 else "")
            lines.append(f"    recompute {names}")
        lines.extend(f"    offload {fb(r['offload_bytes'])} of {r['module']}" for r in off[:10])
        if len(off) > 10:
            lines.append(f"    and {len(off) - 10} more modules")
    lines.extend("  note: " + n for n in w.notes)
    return "\n".join(lines)
