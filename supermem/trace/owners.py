"""Who owns each block: its module path and phase (from context.py's log), and the categories they imply.

A block's module and phase are those in force at its alloc; a parameter's, gradient's or optimizer
state's module is the one that owns the parameter (the observation's), wherever it was made. They are
written into the trace as the first frames of the block's stack, so every tool that reads stacks (the
report, the export to PyTorch's snapshot, memory_viz) shows them:
    ("<module>", 0, "transformer.h.3.mlp.c_fc")   the innermost module call open at the alloc
    ("<phase>", 0, "forward")                     forward, backward or optimizer
then the Python frames, where stacks were recorded.

Categories that follow from the phase, for blocks nothing else named (PyTorch's memory profiler's
names, by simpler rules: no per-op dataflow is recorded):
    activation       made in a forward and freed inside a backward begun after it (between the call
                     into the engine and its return; not necessarily the next one: a pipeline's
                     micro-batches, a GAN's two losses): what autograd saved (its saved tensors are
                     released as their nodes run; a saved view keeps its base's block; an in-place
                     op's output is its input's block), the wrapped scalars it saves (which no
                     saved-tensor hook sees)
                     and whatever else only the graph held (a custom Function's ctx attributes). Not:
                     a saved tensor the program still holds after the backward (outputs it keeps):
                     a temporary. Blocks made while context.py's saved-tensor hook was on (the first
                     backwards) are named by the hook instead, and the rule is checked against it
                     (RuleCheck, the trace's meta "activation_rule").
    temporary        made in a forward or an optimizer step and not saved for backward (a forward's
                     intermediates, its outputs: the logits; the optimizer's scratch)
    autograd_detail  made in a backward and not a parameter's gradient (the gradients flowing back
                     through the graph, backward's own buffers)
    input            saved for backward but made outside the forward, backward and optimizer step
                     (the batch, its labels), in a program whose module calls make forwards; once
                     the hook is off, what an outermost module call is given (context.py), labels
                     given to a loss outside the model are left unknown
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..units import format_bytes
from .phases import BACKWARD, FORWARD, NONE, OPTIMIZER, PHASES
from .table import UNKNOWN_CATEGORY, Trace

MODULE_FILE, PHASE_FILE = "<module>", "<phase>"
INFERRED = {FORWARD: "temporary", OPTIMIZER: "temporary", BACKWARD: "autograd_detail"}


class ContextLog:
    """context.Context's log as arrays: what was in force at any time. hook_off_ns: when the
    saved-tensor hook came off (None: it is still on)."""

    def __init__(self, log: list[tuple[int, int, int]], paths: list[str], hook_off_ns: int | None = None):
        self.hook_off_ns = hook_off_ns
        self.time_ns = np.array([r[0] for r in log], np.int64)
        self.module = np.array([r[1] for r in log], np.int64)
        self.phase = np.array([r[2] for r in log], np.int64)
        order = np.argsort(self.time_ns, kind="stable")  # rows from two threads may interleave
        self.time_ns, self.module, self.phase = self.time_ns[order], self.module[order], self.phase[order]
        self.paths = paths

    def at(self, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(module id or -1, phase) in force at each time (an alloc at the very time of a change
        happened after it: changes are logged before the call they open)."""
        i = np.searchsorted(self.time_ns, times, side="right") - 1
        ok = i >= 0
        j = np.maximum(i, 0)
        if not len(self.time_ns):
            return np.full(len(times), -1, np.int64), np.zeros(len(times), np.int64)
        return np.where(ok, self.module[j], -1), np.where(ok, self.phase[j], NONE)

    def backwards(self) -> tuple[np.ndarray, np.ndarray]:
        """(begin, end) times of each backward; end: int64 max for one not over."""
        back = self.phase == BACKWARD
        prev = np.concatenate([[False], back[:-1]])
        begins = np.flatnonzero(back & ~prev)
        ends = np.flatnonzero(~back & prev)
        end_t = np.full(len(begins), np.iinfo(np.int64).max)
        end_t[: len(ends)] = self.time_ns[ends]
        return self.time_ns[begins], end_t


def saved_by_phase(ctx: ContextLog, phase: np.ndarray, start_t: np.ndarray, end_t: np.ndarray) -> np.ndarray:
    """Per lifetime: made in a forward and freed inside a backward begun after its alloc."""
    out = np.zeros(len(phase), bool)
    fwd = np.flatnonzero(phase == FORWARD)
    b0, b1 = ctx.backwards()
    if not len(fwd) or not len(b0):
        return out
    k = np.searchsorted(b0, end_t[fwd], side="left") - 1  # the last backward begun before the free
    has = k >= 0
    fwd, k = fwd[has], k[has]
    out[fwd] = (b0[k] > start_t[fwd]) & (end_t[fwd] <= b1[k])
    return out


@dataclass
class RuleCheck:
    """How the phase rule named the blocks made while the saved-tensor hook was on, in bytes (blocks made
    in a forward): the hook's activations, the rule's, and those both named."""

    hook_bytes: int = 0
    rule_bytes: int = 0
    both_bytes: int = 0

    def add(self, hook: np.ndarray, rule: np.ndarray, size: np.ndarray) -> None:
        self.hook_bytes += int(size[hook].sum())
        self.rule_bytes += int(size[rule].sum())
        self.both_bytes += int(size[hook & rule].sum())

    def meta(self, ctx: ContextLog | None) -> dict:
        """For the trace's meta: the check, and from when the rule named activations alone."""
        return {
            "hook_bytes": self.hook_bytes,
            "rule_bytes": self.rule_bytes,
            "both_bytes": self.both_bytes,
            "hook_off_ns": None if ctx is None else ctx.hook_off_ns,
        }


def rule_note(meta: dict) -> str:
    """How a trace's activations were named, for the report: one line ("" for a trace that does not say,
    or says it in a shape this version does not read: a report never fails on its meta)."""
    r = meta.get("activation_rule")
    if not isinstance(r, dict):
        return ""
    if r.get("hook_off_ns") is None:
        return "activations: what autograd saved (its saved-tensor hook on for the whole recording)"
    try:
        n = int(r.get("hook_backwards", 0))
        hook, rule, both = int(r["hook_bytes"]), int(r["rule_bytes"]), int(r["both_bytes"])
    except (KeyError, TypeError, ValueError):
        return ""
    if n <= 0:
        return "activations named from the phases (made in a forward, freed in a backward); not checked"
    found = both / hook if hook > 0 else 1.0
    return (
        f"activations named from the phases after the first {n} backward(s), where autograd's saves were "
        f"observed: the rule found {found:.1%} of their {format_bytes(hook)} and named "
        f"{format_bytes(max(rule - both, 0))} more"
    )


def compose(
    trace: Trace,
    start_t: np.ndarray,
    cat: np.ndarray,
    stack: np.ndarray,
    module_override: dict[int, str],
    ctx: ContextLog | None,
    end_t: np.ndarray | None = None,
    size: np.ndarray | None = None,
    check: RuleCheck | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """New (category, stack) per lifetime: context frames prepended, categories inferred.
    start_t, end_t: each lifetime's alloc and free time (int64 min where it began before the trace,
    max where it is live; no end_t: no activation rule); size: its bytes, for `check`."""
    n = len(cat)
    began = start_t > np.iinfo(np.int64).min
    if ctx is not None:
        mod_id, phase = ctx.at(start_t)
        mod_id = np.where(began, mod_id, -1)
        phase = np.where(began, phase, NONE)
    else:
        mod_id, phase = np.full(n, -1, np.int64), np.zeros(n, np.int64)
    cat = cat.copy()
    if ctx is not None and end_t is not None:
        rule = saved_by_phase(ctx, phase, start_t, end_t)
        hooked = start_t < ctx.hook_off_ns if ctx.hook_off_ns is not None else np.ones(n, bool)
        act = trace.categories.index("activation") if "activation" in trace.categories else -1
        if check is not None and size is not None:
            seen = hooked & (phase == FORWARD)
            check.add(seen & (cat == act) if act >= 0 else np.zeros(n, bool), seen & rule, size)
        named = rule & ~hooked & (cat == UNKNOWN_CATEGORY)
        if named.any():
            cat[named] = trace.category_id("activation")
    unknown = cat == UNKNOWN_CATEGORY
    for ph, name in INFERRED.items():
        m = unknown & (phase == ph)
        if m.any():
            cat[m] = trace.category_id(name)
    if "activation" in trace.categories:
        saved_before = (cat == trace.categories.index("activation")) & began & (phase == NONE)
        # (where the log has forwards: a program with no module calls, whose pool names what it saves,
        # has no step to be outside of)
        if ctx is not None and (ctx.phase == FORWARD).any() and saved_before.any():
            cat[saved_before] = trace.category_id("input")
    frame_ids = {f: i for i, f in enumerate(trace.frames)}
    stack_ids = {s: i for i, s in enumerate(trace.stacks)}

    def frame(f: tuple[str, int, str]) -> int:
        i = frame_ids.get(f)
        if i is None:
            i = frame_ids[f] = len(trace.frames)
            trace.frames.append(f)
        return i

    paths = ctx.paths if ctx is not None else []
    memo: dict[tuple[str, int, int], int] = {}
    out = stack.copy()
    todo = set(np.flatnonzero((mod_id >= 0) | (phase != NONE)).tolist()) | set(module_override)
    for i in sorted(todo):
        path = module_override.get(i) or (paths[int(mod_id[i])] if mod_id[i] >= 0 else "")
        key = (path, int(phase[i]), int(stack[i]))
        sid = memo.get(key)
        if sid is None:
            head = []
            if path:
                head.append(frame((MODULE_FILE, 0, path)))
            if phase[i] != NONE:
                head.append(frame((PHASE_FILE, 0, PHASES[int(phase[i])])))
            frames = tuple(head) + (trace.stacks[int(stack[i])] if stack[i] >= 0 else ())
            sid = stack_ids.get(frames)
            if sid is None:
                sid = stack_ids[frames] = len(trace.stacks)
                trace.stacks.append(frames)
            memo[key] = sid
        out[i] = sid
    return cat, out


def stack_owners(trace: Trace) -> tuple[list[str], list[str]]:
    """Per stack id: (module path or "", phase or ""), read from its leading context frames."""
    modules, phases = [], []
    for s in trace.stacks:
        module = phase = ""
        for f in s[:2]:
            filename, _, name = trace.frames[f]
            if filename == MODULE_FILE:
                module = name
            elif filename == PHASE_FILE:
                phase = name
        modules.append(module)
        phases.append(phase)
    return modules, phases


def python_frames(frames: list[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
    """A stack's frames without the context ones."""
    return [f for f in frames if f[0] not in (MODULE_FILE, PHASE_FILE)]
