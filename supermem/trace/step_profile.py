"""A trace's last whole step (of those with module calls: last_step) as the planner's profile
(tensor_pool/profile.py's Profile), so that `report --budget` (whatif.py) plans with the solver and the
simulator the live pool runs (tensor_pool/planner/'s make_plan):

- each activation block of the step is a saved tensor, saved at its alloc and used at its free (its last
  use in backward: the trace holds no unpack times);
- the curve is the trace's active bytes at those events; what rises above it before the next event (the
  loss's spike at backward's start, the optimizer step's temporaries at the end) is that event's
  transient, as the live pool's Recorder counts its rises;
- the recompute units are module calls, chosen as the live pool chooses its regions (regions.py's
  choose_regions over each call's activation bytes, from the top call down; a call given state, a KV
  cache, is split into its parts): a call's members are the activations allocated during it, free to
  leave once it returned, rebuilt for its seconds in the traced forward, reading the activation its
  first tensor argument lives in (context.py records it: another call's output, kept as the live pool
  keeps a region's input, not dropped with the call that made it);
- a call of a module that runs one op the live pool replays alone (OP_MODULES: a BatchNorm, a LayerNorm,
  a ReLU, a GELU; op_replay.py's OPS) is a unit of its own: the tensor it returned, rebuilt from its first
  argument (and its caller's, where the caller returns that tensor changed in place) for the call's
  seconds, as the live pool rebuilds a ResNet block's ReLU output from its BatchNorm's input;
- copies are priced at the link the recording probed (copy_rate).

Not in a trace, so not offered: the live pool's op replays the trace cannot see (ops run outside a module
of their own: a residual add, a cast), autocast weight copies cast again, and compression. The host's cost
of the pool's entries, which a step traced without a pool never paid, whatif.py adds at a prior. A trace
recorded without module calls (context off, or by an older supermem) plans copies alone; one without
module types (an older supermem) offers no op units.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .. import costs
from .breakdown import phase_events
from .phases import CALL_ACTION, OUTPUT_ACTION, RETURN_ACTION, STEP_MARK
from .table import Trace
from .timeline import lifetimes, series

if TYPE_CHECKING:
    from ..tensor_pool.profile import Profile

# Module types whose call runs one op that op_replay.py's OPS rebuilds from its input
OP_MODULES = frozenset({"BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "LayerNorm", "ReLU", "GELU"})


@dataclass(eq=False)
class TraceCall:
    """One module call of a trace's forward, as regions.choose_regions reads a call (its module: the
    call's path, so that a module chosen is chosen in each of its calls, as the live pool's are)."""

    start_ns: int
    end_ns: int
    module: str
    input_ptr: int  # its first tensor argument's data_ptr (0: none)
    held: str | None  # why its state cannot be frozen for a replay (tensor_pool/held.py), or None
    output_ptrs: tuple[int, ...] = ()  # the data_ptrs of the tensors it returned
    children: list[TraceCall] = field(default_factory=list)
    own_bytes: int = 0  # activation bytes allocated during it


@dataclass
class StepProfile:
    """step_profile's result: the profile, the lifetimes (indices into timeline.lifetimes) of its saved
    tensors (ordinal k + 1 at k), the step's peak of active bytes, and each recompute unit's call."""

    profile: Profile
    chosen: np.ndarray
    step_peak: int
    unit_calls: dict[int, TraceCall]  # the region units' calls
    has_calls: bool  # the trace records module calls (else no recompute units)
    op_calls: dict[int, TraceCall] = field(default_factory=dict)  # the op units' calls


def last_step(trace: Trace) -> tuple[int, int] | None:
    """(start, end) times of the last step that ran whole and, where the trace records module calls,
    recorded them (context.py records them on some steps only): from the forward after the step before
    it ended (or the trace's first forward) to its end."""
    starts, k = _steps(trace)
    return None if k is None else starts[k]


def step_period_s(trace: Trace) -> float | None:
    """Seconds from the forward of the step before last_step's to its own: a step as the training loop
    takes it (zero_grad, and on a GPU the wait for its kernels where the host ran ahead of them: the
    trace's times are the host's). None unless the step before it is neither the trace's first
    (first-time costs: the optimizer's state made) nor missing."""
    return _period_s(*_steps(trace))


def _period_s(starts: list[tuple[int, int]], k: int | None) -> float | None:
    """step_period_s of step `k` among `starts`."""
    if k is None or k < 2:
        return None
    return (starts[k][0] - starts[k - 1][0]) / 1e9


def _steps(trace: Trace) -> tuple[list[tuple[int, int]], int | None]:
    """The steps that ran whole (_step_starts), and the index among them of last_step's."""
    starts = _step_starts(trace)
    if not starts:
        return starts, None
    if CALL_ACTION in trace.actions:
        t = np.sort(trace.cols["time_ns"][trace.cols["action"] == trace.actions.index(CALL_ACTION)])
        w = np.array(starts, np.int64)
        with_calls = np.flatnonzero(np.searchsorted(t, w[:, 1]) > np.searchsorted(t, w[:, 0]))
        if len(with_calls):
            return starts, int(with_calls[-1])
    return starts, len(starts) - 1


def _step_starts(trace: Trace) -> list[tuple[int, int]]:
    """(first forward, end) of each step that ran whole, in order."""
    times, names = phase_events(trace)
    marks = [int(t) for t, n in zip(times, names, strict=True) if n == STEP_MARK]
    forwards = [int(t) for t, n in zip(times, names, strict=True) if n == "forward"]
    out = []
    for k, end in enumerate(marks):
        before = marks[k - 1] if k else -1
        starts = [t for t in forwards if before < t < end]
        if starts:
            out.append((starts[0], end))
    return out


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


def _rises(t: np.ndarray, active: np.ndarray, events: np.ndarray, base: list[int], end: int) -> list[int]:
    """Per event, what the active bytes `active` (at times `t`) reach above its base strictly between it
    and the next event (the last: up to `end`)."""
    if not len(events):
        return []
    out = np.zeros(len(events), np.int64)
    k = np.searchsorted(events, t, side="right") - 1
    inside = (k >= 0) & (t > events[k.clip(0)]) & (t <= end)
    np.maximum.at(out, k[inside], active[inside])
    return np.maximum(out - np.asarray(base, np.int64), 0).tolist()


def module_calls(trace: Trace, t0: int, t1: int) -> list[TraceCall]:
    """The top module calls begun in [t0, t1) (context.py's "call" and "return" events), each with the
    calls nested in it (by time: calls on one thread nest)."""
    if CALL_ACTION not in trace.actions or RETURN_ACTION not in trace.actions:
        return []
    c = trace.cols
    t, action = c["time_ns"], c["action"]
    ci = np.flatnonzero((action == trace.actions.index(CALL_ACTION)) & (t >= t0) & (t < t1))
    ri = np.flatnonzero((action == trace.actions.index(RETURN_ACTION)) & (t >= t0))  # (ends after starts)
    returns = zip(c["tag"][ri].tolist(), t[ri].tolist(), c["detail"][ri].tolist(), strict=True)
    ends = {tag: (end, held) for tag, end, held in returns}
    outputs: dict[int, list[int]] = {}
    if OUTPUT_ACTION in trace.actions:
        oi = np.flatnonzero((action == trace.actions.index(OUTPUT_ACTION)) & (t >= t0))
        for tag, ptr in zip(c["tag"][oi].tolist(), c["address"][oi].tolist(), strict=True):
            outputs.setdefault(tag, []).append(ptr)
    calls = []
    begun = zip(
        t[ci].tolist(),
        c["tag"][ci].tolist(),
        c["detail"][ci].tolist(),
        c["address"][ci].tolist(),
        strict=True,
    )
    for start, tag, d, ptr in begun:
        if tag not in ends:
            continue
        end, held = ends[tag]
        path = trace.strings[d] if d >= 0 else ""
        held_type = trace.strings[held] if held >= 0 else None
        calls.append(TraceCall(start, end, path, ptr, held_type, tuple(outputs.get(tag, ()))))
    calls.sort(key=lambda x: (x.start_ns, -x.end_ns))
    roots: list[TraceCall] = []
    stack: list[TraceCall] = []
    for x in calls:
        while stack and x.end_ns > stack[-1].end_ns:
            stack.pop()
        (stack[-1].children if stack else roots).append(x)
        stack.append(x)
    return roots


def step_profile(trace: Trace, device: int) -> StepProfile | None:
    """The trace's last whole step as the planner's profile on `device`; None without a whole step."""
    from ..tensor_pool.profile import Profile, Saved

    starts, k = _steps(trace)  # (last_step's and step_period_s's, read once)
    if k is None:
        return None
    w0, w1 = starts[k]
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
    step_peak = int(s.active[sel].max()) if sel.any() else int(s.active.max(initial=s.initial_active))
    transient = _rises(s.time_ns[sel], s.active[sel], times[order], base, w1)
    link_bytes_per_s, sync_copies, _ = copy_rate(trace, device)
    step_s = max((w1 - w0) / 1e9, _period_s(starts, k) or 0.0)
    profile = Profile(
        saved=saved,
        times_s=((times[order] - w0) / 1e9).tolist(),
        base_bytes=base,
        transient_bytes=transient,
        backward_event=backward,
        step_s=step_s,
        tail_s=step_s - (int(times[order][-1]) - w0) / 1e9 if len(times) else step_s,
        link_bytes_per_s=link_bytes_per_s,
        sync_copies=sync_copies,
    )
    roots = module_calls(trace, w0, w1)
    out = StepProfile(profile, chosen, step_peak, {}, bool(roots))
    if roots and n:
        _add_regions(out, roots, lt, saves, end_t[chosen], np.sort(times), trace.meta.get("module_types", {}))
    return out


def _add_regions(
    out: StepProfile,
    roots: list[TraceCall],
    lt,
    saves: np.ndarray,
    ends: np.ndarray,
    event_times: np.ndarray,
    module_types: dict[str, str],
) -> None:
    """The module calls the live pool would make regions, as the profile's recompute units (Recorder
    .recomputable's: members, the event they may leave from, seconds, the saves the replay reads, and
    the saves before the call and at its end). A call's own bytes (what choose_regions weighs) and its
    members are the activations allocated during it but those it returned: the live pool counts a save
    for the call open when it is saved, and a call's output is saved after it (a Linear's by the next
    op, an embedding's by the first block), where it is no member of the call's replay."""
    from ..tensor_pool.regions import choose_regions

    p = out.profile
    addr, size = lt.address[out.chosen], lt.size[out.chosen]
    owned: dict[int, np.ndarray] = {}  # id(call) -> the indices of its own saves

    def holding(ptrs, lo: int, hi: int, alive_ns: int) -> np.ndarray:
        """Of the saves lo..hi, those whose block holds one of `ptrs` at `alive_ns`."""
        hit = np.zeros(hi - lo, bool)
        for ptr in ptrs:
            if ptr:
                a, z = addr[lo:hi], ends[lo:hi]
                hit |= (a <= ptr) & (ptr < a + size[lo:hi]) & (z > alive_ns)
        return hit

    def span(x: TraceCall) -> tuple[int, int]:
        """The saves made during call `x`: lo..hi."""
        return int(np.searchsorted(saves, x.start_ns, "left")), int(np.searchsorted(saves, x.end_ns, "right"))

    def read(ptr: int, x: TraceCall, lo: int) -> list[int]:
        """The save before `lo` whose block holds `ptr` when call `x` begins (the latest), or none."""
        return [int(i) for i in np.flatnonzero(holding((ptr,), 0, lo, x.start_ns))[-1:]]

    def add_unit(u: int, x: TraceCall, inputs: list[int]) -> None:
        """Unit `u` rebuilds by running call `x` again, for its seconds, reading the saves `inputs`."""
        p.unit_ready[u] = int(np.searchsorted(event_times, x.end_ns, "right"))
        p.unit_cost_s[u] = (x.end_ns - x.start_ns) / 1e9
        p.unit_inputs[u] = tuple(i + 1 for i in inputs)

    def count(x: TraceCall) -> None:
        lo, hi = span(x)
        own = lo + np.flatnonzero(~holding(x.output_ptrs, lo, hi, x.end_ns))
        owned[id(x)] = own
        x.own_bytes = int(size[own].sum())
        for k in x.children:
            count(k)

    for r in roots:
        count(r)
    chosen_paths = choose_regions(roots)
    regions: list[TraceCall] = []
    todo = list(reversed(roots))
    while todo:  # the outermost chosen calls, in call order
        x = todo.pop()
        if x.module in chosen_paths:
            regions.append(x)
        else:
            todo.extend(reversed(x.children))
    for x in regions:
        own = owned[id(x)]
        if not len(own):
            continue
        u = len(out.unit_calls)
        out.unit_calls[u] = x
        lo = span(x)[0]
        add_unit(u, x, read(x.input_ptr, x, lo))
        p.unit_start[u], p.unit_end[u] = lo, int(own[-1]) + 1
        for k in own.tolist():
            p.saved[k].unit = u
    # Op units (the live pool's op recipes take their tensor from the region it was saved in). One may read
    # another's member (a ResNet block's input, the block before's output), as in the live pool's
    # profile: the planner never drops what an op replay reads (simulate.py; op_replay.py's cascades)
    for x, parent in _leaves(roots):
        if module_types.get(x.module) not in OP_MODULES:
            continue
        lo, hi = span(x)
        made = np.flatnonzero(holding(x.output_ptrs, lo, hi, x.end_ns))
        if len(made) != 1:
            continue
        k = lo + int(made[0])
        inputs = read(x.input_ptr, x, lo)
        # A tensor its caller returns was changed in place after the op (a ResNet block's BatchNorm
        # output: the residual added to it, then ReLU): the live pool's chain reads the caller's input too.
        if inputs and parent is not None and holding(parent.output_ptrs, k, k + 1, parent.end_ns)[0]:
            inputs += read(parent.input_ptr, x, lo)
        if not inputs:
            continue
        u = len(p.unit_cost_s)
        out.op_calls[u] = x
        add_unit(u, x, inputs)
        p.saved[k].unit = u


def _leaves(roots: list[TraceCall]) -> list[tuple[TraceCall, TraceCall | None]]:
    """The calls that made no call, each with its caller, in call order."""
    out = []
    todo: list[tuple[TraceCall, TraceCall | None]] = [(r, None) for r in reversed(roots)]
    while todo:
        x, parent = todo.pop()
        if x.children:
            todo.extend((k, x) for k in reversed(x.children))
        else:
            out.append((x, parent))
    return out
