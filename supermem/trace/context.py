"""Where the program is when memory moves: the innermost module call and the phase of the step.

The allocator's ring knows times, addresses and sizes only, and costs no Python per allocation. This
keeps the rest beside it as a log of changes, (time_ns, module, phase), one row per module call's
start and end and per phase change; when a trace is built each block takes the row in force at its
alloc (owners.py). Recording costs one deque append per module call start and end (nn.Module.__call__
replaced: Context._module_call, +1.3 us a call of one tensor on an H200's host) and a Python call per
backward: nothing per allocation, nothing per saved tensor once the first backwards are over.

Phases are events, not guesses:
  forward   from an outermost module call (none open, not in backward or an optimizer step);
  backward  from the call into autograd's engine (Tensor.backward, autograd.grad: before the loss's
            own nodes run) to its return (torch_private.watch_backward);
  optimizer from an optimizer step's pre hook to its post hook, which also ends the step;
  ""        anything else (data loading, zero_grad, model construction).

Activations are named from the phases when the trace is built (owners.py: made in a forward, freed in
a backward begun after it). For the first `hook_backwards` backwards a saved-tensor pack hook also observes
what autograd saves (the default hooks, innermost wins: the pool's own hooks, checkpointing's, a user's
save_on_cpu, shadow this one inside them; the pool says what it saves through supermem.events): those
blocks are named by it, and it is what the rule is checked against. Under a pool for every backward
(SUPERMEM_CONF=pool:...) it is never on: pushed after the pool's, it would shadow the pool, and the
recorded steps would run without it. It costs ~2 us per saved tensor and
a Python call per unpack (+20% of a host-bound step), so it is taken off at the end of the backward that
completes the count, where it is on top of this thread's hook stack (else at a later backward's end);
hook_backwards None keeps it for the whole recording. The pack hook returns a detached alias, not the
tensor: a saved output returned as itself would hold its own graph (tensor -> grad_fn -> saved
variable -> tensor) where Python's collector cannot see it.

Module paths are relative to the outermost module called (`transformer.h.3.mlp.c_fc`); the outermost
one is its class name. A module called outside any tree that named it is its caller's path plus its
class name. Threads share one log: a module call on another thread is attributed by time as well.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from typing import Any

from .attribution import Observations
from .phases import BACKWARD, FORWARD, NONE, OPTIMIZER, PHASES, STEP_MARK

# The forward's module calls (Context.calls: what `report --budget` plans recomputes from) are recorded
# in a recording's first 3 steps and every CALLS_EVERY-th after (steps 10, 18, ...): they are half of
# what a recording costs a module call (+0.5 of +1.15 us, one tensor in and out, on the development
# CPU), and step_profile.py plans from the last step that has them.
CALLS_EVERY = 8


def records_calls(step: int) -> bool:
    """Whether a recording's step `step` (0: its first) records its forward's module calls."""
    return step < 3 or step % CALLS_EVERY == 2


def tensors_in(x: Any, depth: int = 3):
    """Tensors in a call's arguments or outputs: nested tuples, lists and dicts (HF's ModelOutput)."""
    import torch

    if isinstance(x, torch.Tensor):
        yield x
    elif depth and isinstance(x, (tuple, list)):
        for v in x:
            yield from tensors_in(v, depth - 1)
    elif depth and isinstance(x, dict):
        for v in x.values():
            yield from tensors_in(v, depth - 1)


def _ptr(t: Any) -> int:
    """A tensor's data_ptr; 0 for one without (sparse, meta, a subclass without storage)."""
    try:
        return t.data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def module_paths(root: Any) -> dict[int, str]:
    """id(module) -> its path under `root` (root itself: its class name)."""
    out = {id(root): type(root).__name__}
    for name, m in root.named_modules(remove_duplicate=True):
        if name:
            out.setdefault(id(m), name)
    return out


class Context:
    """The log of (time_ns, module id, phase) changes and the hooks that write it. start()/stop()."""

    def __init__(self, obs: Observations, capacity: int = 1 << 20, hook_backwards: int | None = 2):
        """hook_backwards: backwards the saved-tensor hook stays on for (None: all; 0: never on)."""
        self.obs = obs
        self.hook_backwards = hook_backwards
        self.backwards = 0
        self.hooked_backwards = 0  # backwards over while the hook was on: what checked the rule
        self.hook_off_ns: int | None = None  # when the hook came off, or the start if never on (None: on)
        self.log: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=capacity)
        # each module call begun in a forward that records them (CALLS_EVERY): (start_ns, end_ns, path
        # id, its first positional tensor argument's data_ptr or 0, the type name of an argument that is
        # state, not a value, or "", the data_ptrs of the tensors it returned: itself, or those of a
        # tuple or list of them)
        self.calls: collections.deque[tuple[int, int, int, int, str, tuple[int, ...]]] = collections.deque(
            maxlen=capacity
        )
        self.phase_events: collections.deque[tuple[int, str]] = collections.deque(maxlen=capacity)
        self.paths: list[str] = []
        self._path_ids: dict[str, int] = {}
        self.module_types: dict[str, str] = {}  # path -> the module's class name (step_profile.py's op units)
        self._module_path: dict[int, int] = {}  # id(module) -> path id, while the module lives
        self._local = threading.local()
        self.phase = NONE
        self.steps = 0
        self.record_calls = True  # this step's forward records its module calls (CALLS_EVERY)
        self._hooks: list[Any] = []
        self._unwrap: Any = None  # takes the module call wrapper off (torch_private.patch_module_call)
        self._hook_thread: int | None = None  # the thread whose hook stack holds the pack hook
        self._backward_depth = 0
        self._stop_watch: Any = None
        self._tensor: Any = None  # torch.Tensor, once started
        self._held_state: Any = None  # tensor_pool.held.held_state, once started

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> Context:
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        from .. import process_hooks
        from .. import torch_private as tp
        from ..tensor_pool.held import held_state

        self._tensor, self._held_state = torch.Tensor, held_state
        unwrap = tp.patch_module_call(self._module_call)  # (not global module hooks: cheaper)
        self._hooks = [
            register_optimizer_step_pre_hook(self._optimizer_begins),
            register_optimizer_step_post_hook(self._optimizer_ends),
        ]
        self._unwrap = unwrap
        self._stop_watch = tp.watch_backward(self._backward_begins, self._backward_ends)
        if self.hook_backwards != 0 and not process_hooks.pushed():
            tp.push_saved_hooks(self._pack, self._unpack)
            self._hook_thread = threading.get_ident()
        else:
            self.hook_off_ns = time.monotonic_ns()
        return self

    def stop(self) -> None:
        if self._unwrap is not None:
            self._unwrap()
            self._unwrap = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._stop_watch is not None:
            self._stop_watch()
            self._stop_watch = None
        if self._hook_thread is not None and not self._remove_hook():
            # Not on top of the stack (a hook pushed and never popped above it, or another thread):
            # popping would take someone else's off. It stays, and observes into a log no one reads.
            self._hook_thread = None

    def _remove_hook(self) -> bool:
        """Takes the pack hook off where it is on top of this thread's stack. True if it did."""
        from .. import torch_private as tp

        if self._hook_thread != threading.get_ident():
            return False
        top = tp.saved_hooks_in_force()
        if top is None or top[0] != self._pack:  # (no getter in this PyTorch: it stays, to be safe)
            return False
        tp.pop_saved_hooks()
        self._hook_thread = None
        self.hook_off_ns = time.monotonic_ns()
        return True

    # ---------------------------------------------------------------- the log

    def _path_id(self, path: str) -> int:
        i = self._path_ids.get(path)
        if i is None:
            i = self._path_ids[path] = len(self.paths)
            self.paths.append(path)
        return i

    def _stack(self) -> list[int]:
        """This thread's open module calls' path ids."""
        try:
            return self._local.stack
        except AttributeError:  # this thread's first module call
            s = self._local.stack = []
            return s

    def _set_phase(self, phase: int, now: int, detail: str = "") -> None:
        self.phase = phase
        s = self._stack()
        self.log.append((now, s[-1] if s else -1, phase))
        self.phase_events.append((now, detail or PHASES[phase]))

    def _name(self, module: Any, parent: int) -> int:
        pid = self._module_path.get(id(module))
        if pid is not None:
            return pid
        if parent < 0:
            names = module_paths(module)
        else:
            names = {id(module): f"{self.paths[parent]}.{type(module).__name__}"}
        for m in module.modules() if parent < 0 else (module,):
            path = names.get(id(m))
            if path is not None and id(m) not in self._module_path:
                self._module_path[id(m)] = self._path_id(path)
                self.module_types.setdefault(path, type(m).__name__)
                weakref.finalize(m, self._module_path.pop, id(m), None)
        return self._module_path[id(module)]

    # ---------------------------------------------------------------- hooks

    def _module_call(self, orig: Any, on: list[bool]) -> Any:
        """nn.Module.__call__ as recorded (torch_private.patch_module_call): a log row at the call's
        start and end, and for a forward's call a `calls` row. One function, no hooks of its own: a
        module call is the hot path (GPT-2: 151 a step, +1.3 us for a call of one tensor on an H200's
        host, more for one given a KV cache: tools/diag/module_call_profile.py)."""
        import torch

        from .. import torch_private as tp

        compiling = torch.compiler.is_compiling
        tensor = torch.Tensor
        direct = tp.is_torchs_module_call(orig)  # (its two lines then run here: a frame less a call)
        local, paths, clock = self._local, self._module_path, time.monotonic_ns
        log, calls = self.log.append, self.calls.append

        def call(module: Any, *args: Any, **kwargs: Any) -> Any:
            if not on[0] or compiling():
                return orig(module, *args, **kwargs)
            try:
                s = local.stack
            except AttributeError:  # this thread's first module call
                s = local.stack = []
            pid = paths.get(id(module))
            if pid is None:
                pid = self._name(module, s[-1] if s else -1)
            start = clock()
            if not s and self.phase in (NONE, FORWARD):
                if self.phase != FORWARD:
                    self._set_phase(FORWARD, start)
                self._inputs(args, start)  # the batch (a keyword argument's: below)
            forward = self.phase == FORWARD and self.record_calls
            s.append(pid)
            log((start, pid, self.phase))
            out: Any = None
            try:
                if not direct:
                    out = orig(module, *args, **kwargs)
                elif module._compiled_call_impl is None:
                    out = module._call_impl(*args, **kwargs)
                else:
                    out = module._compiled_call_impl(*args, **kwargs)
                return out
            finally:
                s.pop()
                end = clock()
                log((end, s[-1] if s else -1, self.phase))
                if forward:
                    if not kwargs and len(args) == 1 and isinstance(args[0], tensor):  # (most calls)
                        held, first = "", _ptr(args[0])
                    else:
                        held, first = self._call_inputs(args, kwargs)
                    if isinstance(out, tensor):
                        outputs: tuple[int, ...] = (_ptr(out),)
                    elif type(out) in (tuple, list):
                        outputs = tuple(_ptr(x) for x in out[:8] if isinstance(x, tensor))
                    else:
                        outputs = ()
                    calls((start, end, pid, first, held, outputs))
                if not s and kwargs and self.phase == FORWARD:
                    self._inputs(kwargs, end)  # the batch given by keyword (HF's input_ids=, labels=)

        return call

    def _inputs(self, args: Any, now: int) -> None:
        for t in tensors_in(args):
            if not t.requires_grad:
                self.obs.add_tensor(t, "input", now)

    def _call_inputs(self, args: tuple, kwargs: dict) -> tuple[str, int]:
        """A forward's module call, for `report --budget` (step_profile.py: a call is a unit the pool may
        recompute, its input what the replay reads, its outputs no part of it): the type name of an
        argument that is state (a KV cache: the pool never replays such a call, region.py) or "", and
        its first positional tensor argument's data_ptr or 0. (The calls of one tensor in: inline.)"""
        held = self._held_state((args, kwargs)) or ""
        return held, _ptr(args[0]) if args and isinstance(args[0], self._tensor) else 0

    def _pack(self, t: Any) -> Any:
        # A parameter (a leaf that needs grad) is saved too; the batch is, and owners.py calls a save
        # made outside the step an input.
        if not (t.requires_grad and t.is_leaf):
            try:
                address = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):  # sparse, meta, fake: no address
                address = 0
            if address:
                self.obs.add(address, "activation", time_ns=time.monotonic_ns())
        return t.detach()

    def _unpack(self, t: Any) -> Any:
        return t

    def _backward_begins(self) -> None:
        self._backward_depth += 1
        if self._backward_depth == 1 and self.phase != BACKWARD:
            self._set_phase(BACKWARD, time.monotonic_ns())

    def _backward_ends(self) -> None:
        self._backward_depth = max(0, self._backward_depth - 1)
        if self._backward_depth or self.phase != BACKWARD:
            return
        self._set_phase(NONE, time.monotonic_ns(), "backward end")
        self.backwards += 1
        if self._hook_thread is not None:
            self.hooked_backwards += 1
            if self.hook_backwards is not None and self.backwards >= self.hook_backwards:
                self._remove_hook()

    def _optimizer_begins(self, *_: Any) -> None:
        self._set_phase(OPTIMIZER, time.monotonic_ns())

    def _optimizer_ends(self, *_: Any) -> None:
        self.steps += 1
        self.record_calls = records_calls(self.steps)
        self._set_phase(NONE, time.monotonic_ns(), STEP_MARK)

    # ---------------------------------------------------------------- reading

    def snapshot(self) -> tuple[list[tuple[int, int, int]], list[str], list[tuple[int, str]]]:
        """(log, paths, phase events), copied: the program may go on recording."""
        return list(self.log), list(self.paths), list(self.phase_events)

    def calls_snapshot(self) -> list[tuple[int, int, int, int, str, tuple[int, ...]]]:
        """The forward's module calls so far (`calls`), copied."""
        return list(self.calls)
