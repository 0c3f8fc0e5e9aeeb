"""Where the program is when memory moves: the innermost module call and the phase of the step.

The allocator's ring knows times, addresses and sizes only, and costs no Python per allocation. This
keeps the rest beside it as a log of changes, (time_ns, module, phase), one row per module call's
start and end and per phase change; when a trace is built each block takes the row in force at its
alloc (owners.py). Recording costs one deque append per module call start and end (global forward
hooks, ~2 us a call on CPU with the module hook slow path they turn on) and one pack hook per tensor
autograd saves (~2 us): nothing per allocation.

Phases are events, not guesses:
  forward   from an outermost module call (none open, not in backward or an optimizer step);
  backward  from the first saved tensor autograd unpacks (or the first node of a model output's graph
            that runs, where another saved-tensor hook, the pool's, hides the unpacks) to the end of
            that backward (an engine callback, as torchtune's offloading uses);
  optimizer from an optimizer step's pre hook to its post hook, which also ends the step;
  ""        anything else (data loading, zero_grad, model construction).

What autograd saves is an activation: a saved-tensor pack hook observes its storage (the default hooks,
innermost wins: the pool's own hooks, checkpointing's, a user's save_on_cpu, shadow this one inside
them; the pool says what it saves through supermem.events). The pack hook returns a detached alias, not
the tensor: a saved output returned as itself would hold its own graph (tensor -> grad_fn -> saved
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


def module_paths(root: Any) -> dict[int, str]:
    """id(module) -> its path under `root` (root itself: its class name)."""
    out = {id(root): type(root).__name__}
    for name, m in root.named_modules(remove_duplicate=True):
        if name:
            out.setdefault(id(m), name)
    return out


class Context:
    """The log of (time_ns, module id, phase) changes and the hooks that write it. start()/stop()."""

    def __init__(self, obs: Observations, capacity: int = 1 << 20, activations: bool = True):
        self.obs = obs
        self.activations = activations
        self.log: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=capacity)
        self.phase_events: collections.deque[tuple[int, str]] = collections.deque(maxlen=capacity)
        self.paths: list[str] = []
        self._path_ids: dict[str, int] = {}
        self._module_path: dict[int, int] = {}  # id(module) -> path id, while the module lives
        self._local = threading.local()
        self.phase = NONE
        self.steps = 0
        self._hooks: list[Any] = []
        self._saved_hooks: Any = None
        self._compiling: Any = None

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> Context:
        import torch
        from torch.nn.modules import module as nn_module
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._compiling = torch.compiler.is_compiling
        self._hooks = [
            nn_module.register_module_forward_pre_hook(self._pre),
            nn_module.register_module_forward_hook(self._post, always_call=True),
            register_optimizer_step_pre_hook(self._optimizer_begins),
            register_optimizer_step_post_hook(self._optimizer_ends),
        ]
        if self.activations:
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_hooks.__enter__()
        return self

    def stop(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._saved_hooks is not None:
            try:
                self._saved_hooks.__exit__(None, None, None)
            except RuntimeError:  # not on top of this thread's stack (a hook pushed and never popped)
                pass
            self._saved_hooks = None

    # ---------------------------------------------------------------- the log

    def _path_id(self, path: str) -> int:
        i = self._path_ids.get(path)
        if i is None:
            i = self._path_ids[path] = len(self.paths)
            self.paths.append(path)
        return i

    def _stack(self) -> list[int]:
        s = getattr(self._local, "stack", None)
        if s is None:
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
                weakref.finalize(m, self._module_path.pop, id(m), None)
        return self._module_path[id(module)]

    # ---------------------------------------------------------------- hooks

    def _pre(self, module: Any, args: tuple) -> None:
        if self._compiling():  # dynamo traces the hook: record nothing, break no graph
            return
        s = self._stack()
        pid = self._name(module, s[-1] if s else -1)
        now = time.monotonic_ns()
        if not s and self.phase in (NONE, FORWARD):
            if self.phase != FORWARD:
                self._set_phase(FORWARD, now)
            for t in tensors_in(args):  # the batch (a keyword argument's: owners.py, from its save)
                if not t.requires_grad:
                    self.obs.add_tensor(t, "input", now)
        s.append(pid)
        self.log.append((now, pid, self.phase))

    def _post(self, module: Any, args: tuple, output: Any) -> None:
        if self._compiling():
            return
        s = self._stack()
        if not s:
            return
        s.pop()
        self.log.append((time.monotonic_ns(), s[-1] if s else -1, self.phase))
        if not s and self.phase == FORWARD:
            for t in tensors_in(output):
                if t.grad_fn is not None:  # where another hook hides the unpacks: backward reaches it
                    t.grad_fn.register_prehook(self._node_runs)

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
        if self.phase != BACKWARD:
            self._backward_begins()
        return t

    def _node_runs(self, grad_outputs: Any) -> None:
        if self.phase != BACKWARD:
            self._backward_begins()

    def _backward_begins(self) -> None:
        from .. import torch_private as tp

        try:  # raises outside a backward (a saved tensor read by hand)
            tp.execution_engine.queue_callback(self._backward_ends)
        except RuntimeError:
            return
        self._set_phase(BACKWARD, time.monotonic_ns())

    def _backward_ends(self) -> None:
        if self.phase == BACKWARD:
            self._set_phase(NONE, time.monotonic_ns(), "backward end")

    def _optimizer_begins(self, *_: Any) -> None:
        self._set_phase(OPTIMIZER, time.monotonic_ns())

    def _optimizer_ends(self, *_: Any) -> None:
        self.steps += 1
        self._set_phase(NONE, time.monotonic_ns(), STEP_MARK)

    # ---------------------------------------------------------------- reading

    def snapshot(self) -> tuple[list[tuple[int, int, int]], list[str], list[tuple[int, str]]]:
        """(log, paths, phase events), copied: the program may go on recording."""
        return list(self.log), list(self.paths), list(self.phase_events)
