"""What each block is: categories and Python stacks, attached after the fact.

The allocator knows addresses and sizes only. Other code knows what a tensor is: nn.Module parameters,
their .grad, optimizer state, and the pool's events (which say "activation"). Each such fact is an
observation "a tensor of category C (made at stack S) lived at address A at time T". When a trace is
built, each observation is matched to the block lifetime at A that was live at T (the latest alloc
at A before T), and its category and stack are written onto that lifetime's events and, if it is
still live, onto its snapshot block. Virtual addresses are unique across devices (CUDA UVA, host
mmaps), so matching needs no device.

What is attributed:
  parameter, gradient, optimizer_state: tensors of the modules and optimizers passed to trace(), or
      found by a gc scan; scanned at start, at every dump, before each optimizer step (gradients) and
      after the first steps (optimizer state is created lazily).
  activation (or what the pool says): blocks named by pool events that carry an address, and by
      context.py's saved-tensor hook while it is on (then owners.py names activations from the phases).
  everything else stays "unknown" here: owners.py names temporaries, inputs and autograd buffers from
      the phases where a recording has them.
Not attributed: a gradient freed before the next optimizer step (e.g. accumulated into another
buffer), and storages of tensors that are views into a block at an offset (the observation carries
the storage's base address, which is the block's address for every storage the allocator made).
"""

from __future__ import annotations

import collections
import gc
import os
import sys
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from .table import UNKNOWN_CATEGORY, Trace
from .timeline import lifetimes

Observation = tuple[int, int, str, int, str]  # (time_ns, address, category, stack id or -1, module path)


class Observations:
    """A bounded log of observations (the oldest are dropped first)."""

    def __init__(self, capacity: int = 1 << 20):
        self.rows: collections.deque[Observation] = collections.deque(maxlen=capacity)

    def add(
        self, address: int, category: str, stack: int = -1, time_ns: int | None = None, module: str = ""
    ) -> None:
        if address:
            now = time.monotonic_ns() if time_ns is None else time_ns
            self.rows.append((now, address, category, stack, module))

    def add_tensor(self, tensor: Any, category: str, now_ns: int, stack: int = -1, module: str = "") -> None:
        try:
            address = tensor.untyped_storage().data_ptr()
        except (RuntimeError, AttributeError, NotImplementedError):  # sparse, meta, fake: no address
            return
        if address:
            self.rows.append((now_ns, address, category, stack, module))


def roots_of(models: Iterable[Any]) -> list[Any]:
    """The modules that are no other's child: the trees a gc scan found every node of."""
    models = list(models)
    children = {id(c) for m in models for c in m.children()}
    return [m for m in models if id(m) not in children]


def owner(name: str, root: Any) -> str:
    """The module path that owns a parameter or buffer named `name` under `root` (context.py's paths)."""
    return name.rpartition(".")[0] or type(root).__name__


def tensors_of(
    models: Iterable[Any],
    optimizers: Iterable[Any],
    gradients_only: bool = False,
    paths: dict[int, str] | None = None,
):
    """(tensor, category, owning module path) for parameters (and buffers: the model's state),
    gradients and optimizer state. `models`: roots (roots_of); a parameter's path is under its root;
    `paths`: id(parameter) -> path for the optimizers' parameters of no model given."""
    seen: set[int] = set()
    path_of: dict[int, str] = dict(paths or {})
    for m in models:
        for name, p in m.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            path_of[id(p)] = path = owner(name, m)
            if not gradients_only:
                yield p, "parameter", path
            if p.grad is not None:
                yield p.grad, "gradient", path
        if not gradients_only:
            for name, b in m.named_buffers():
                if id(b) not in seen:
                    seen.add(id(b))
                    yield b, "parameter", owner(name, m)
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    if not gradients_only:
                        yield p, "parameter", path_of.get(id(p), "")
                    if p.grad is not None:
                        yield p.grad, "gradient", path_of.get(id(p), "")
        if gradients_only:
            continue
        for p, state in opt.state.items():
            for v in state.values() if isinstance(state, dict) else ():
                if hasattr(v, "untyped_storage") and v.numel() > 1:  # skip scalar `step` counters
                    yield v, "optimizer_state", path_of.get(id(p), "")


def find_models_and_optimizers() -> tuple[list[Any], list[Any]]:
    """Every nn.Module and torch.optim.Optimizer alive in the process (one gc walk: ~10 ms per 10^5
    objects; done at start and at dumps only)."""
    import torch

    models, optimizers = [], []
    module, optimizer = torch.nn.Module, torch.optim.Optimizer
    for obj in gc.get_objects():
        cls = type(obj)  # not isinstance: that reads __class__, which some lazy module proxies warn on
        if issubclass(cls, module):
            models.append(obj)
        elif issubclass(cls, optimizer):
            optimizers.append(obj)
    return models, optimizers


class ModelScanner:
    """Observes parameters, gradients and optimizer state of the given (or found) models/optimizers."""

    def __init__(
        self, obs: Observations, models=(), optimizers=(), find: bool = True, full_scan_every: int = 50
    ):
        self.obs = obs
        self.models = list(models)
        self.optimizers = list(optimizers)
        self.find = find and not self.models and not self.optimizers
        self.full_scan_every = full_scan_every  # steps between scans of parameters and optimizer state
        self._steps: dict[int, int] = {}  # id(optimizer) -> steps seen
        self._hooks: list[Any] = []
        self._paths: dict[int, str] = {}  # id(parameter) -> its module's path, as of the last scan
        # id(optimizer) -> (its param lists as (id, len), its parameters' paths in order): before_step's
        self._params: dict[int, tuple[tuple[tuple[int, int], ...], list[str]]] = {}

    def scan(self, gradients_only: bool = False) -> None:
        self._params.clear()  # (paths may change: before_step reads them again)
        if self.find:
            models, self.optimizers = find_models_and_optimizers()
            self.models = roots_of(models)
        now = time.monotonic_ns()
        try:
            for t, cat, path in tensors_of(self.models, self.optimizers, gradients_only):
                self.obs.add_tensor(t, cat, now, module=path)
                if cat == "parameter":
                    self._paths[id(t)] = path
        except RuntimeError:  # a dump from another thread (an OOM) raced a change of optimizer state
            pass

    def install_hooks(self) -> None:
        """Gradients are observed before every optimizer step (zero_grad frees them), parameters and
        state after steps 1, 2 and every `full_scan_every`-th (Adam makes its state at step 1). With
        nothing given, PyTorch's global optimizer hooks cover optimizers created after the start."""
        if self.find:
            from torch.optim.optimizer import (
                register_optimizer_step_post_hook,
                register_optimizer_step_pre_hook,
            )

            self._hooks.append(register_optimizer_step_pre_hook(lambda opt, *_: self.before_step(opt)))
            self._hooks.append(register_optimizer_step_post_hook(lambda opt, *_: self.after_step(opt)))
            return
        for opt in self.optimizers:
            self._hooks.append(opt.register_step_pre_hook(lambda o, *_: self.before_step(o)))
            self._hooks.append(opt.register_step_post_hook(lambda o, *_: self.after_step(o)))

    def before_step(self, opt: Any) -> None:
        """Observes the gradients. Their paths are looked up again only when the optimizer's parameter
        lists change (one made or grown; a parameter put in place of another in the same list keeps
        the path of the one before): a host-bound HF Llama step has 111, and looking them up every
        step cost ~0.3 ms of an H200's host."""
        groups = opt.param_groups
        lists = tuple((id(g["params"]), len(g["params"])) for g in groups)
        params = [p for g in groups for p in g["params"]]
        known = self._params.get(id(opt))
        if known is None or known[0] != lists:
            if any(id(p) not in self._paths for p in params):
                self._learn_paths(opt)
            known = self._params[id(opt)] = (lists, [self._paths.get(id(p), "") for p in params])
        now = time.monotonic_ns()
        add = self.obs.rows.append
        for p, path in zip(params, known[1], strict=True):
            g = p.grad
            if g is not None:  # (Observations.add_tensor, inline: a call a gradient took this hook
                try:  # from 25 to ~40 us a step for 75 gradients on the development CPU)
                    address = g.untyped_storage().data_ptr()
                except (RuntimeError, AttributeError, NotImplementedError):
                    continue
                if address:
                    add((now, address, "gradient", -1, path))

    def after_step(self, opt: Any) -> None:
        n = self._steps[id(opt)] = self._steps.get(id(opt), 0) + 1
        if n <= 2 or n % self.full_scan_every == 0:
            now = time.monotonic_ns()
            for t, cat, path in tensors_of((), (opt,), paths=self._paths):
                self.obs.add_tensor(t, cat, now, module=path)

    def _learn_paths(self, opt: Any) -> None:
        """The paths of `opt`'s parameters, from their models: found by a gc walk (the models of a
        `supermem trace` run are made after the start) at most at an optimizer's first two steps."""
        if self.find and self._steps.get(id(opt), 0) < 2:
            models, _ = find_models_and_optimizers()
            self.models = roots_of(models)
        for t, cat, path in tensors_of(self.models, ()):
            if cat == "parameter":
                self._paths[id(t)] = path
        for group in opt.param_groups:
            for p in group["params"]:
                self._paths.setdefault(id(p), "")  # a model not found: asked no more

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


class StackTable:
    """Interned Python stacks: frames (filename, line, name) and stacks (tuples of frame ids)."""

    _SKIP_DIRS: tuple[str, ...] = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)

    def __init__(self, max_depth: int = 32):
        self.max_depth = max_depth
        self.frames: list[tuple[str, int, str]] = []
        self.stacks: list[tuple[int, ...]] = []
        self._frame_ids: dict[tuple[str, int, str], int] = {}
        self._stack_ids: dict[tuple, int] = {}
        try:
            import torch

            self._SKIP_DIRS = (*self._SKIP_DIRS, os.path.dirname(torch.__file__) + os.sep)
        except ImportError:
            pass

    def capture(self, op_name: str = "", skip: int = 1) -> int:
        """Id of the current Python stack (frames in torch and supermem omitted), innermost first,
        with `op_name` as an innermost pseudo-frame."""
        f: Any = sys._getframe(skip)
        key: list[Any] = [op_name]
        while f is not None and len(key) <= self.max_depth:
            code = f.f_code
            if not code.co_filename.startswith(self._SKIP_DIRS):
                key.append((code, f.f_lineno))
            f = f.f_back
        k = tuple(key)
        sid = self._stack_ids.get(k)
        if sid is None:
            ids = []
            if op_name:
                ids.append(self._frame_id(("<op>", 0, op_name)))
            ids.extend(self._frame_id((c.co_filename, line, c.co_name)) for c, line in key[1:])
            sid = self._stack_ids[k] = len(self.stacks)
            self.stacks.append(tuple(ids))
        return sid

    def _frame_id(self, frame: tuple[str, int, str]) -> int:
        i = self._frame_ids.get(frame)
        if i is None:
            i = self._frame_ids[frame] = len(self.frames)
            self.frames.append(frame)
        return i


def stack_mode(table: StackTable, obs: Observations):
    """A TorchDispatchMode that observes the storage of every op output with the Python stack that
    made it (category left unknown). Costs ~10-20 us per op: off unless stacks are asked for."""
    import torch

    from .. import torch_private as tp

    dispatch_mode: Any = tp.torch_dispatch_mode()
    tree_leaves = tp.tree_leaves

    class _StackMode(dispatch_mode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            sid = -1
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    if sid < 0:
                        sid = table.capture(str(func), skip=2)
                    obs.add_tensor(t, "unknown", time.monotonic_ns(), sid)
            return out

    return _StackMode()


def apply(trace: Trace, rows: Iterable[Observation], context: Any = None, check: Any = None) -> int:
    """Writes observed categories, stacks and owning modules onto the trace's events and final snapshot
    blocks, with what `context` (an owners.ContextLog) says of each block (owners.compose; `check`, an
    owners.RuleCheck, adds up how its activation rule matched the saved-tensor hook). Returns the
    number of block lifetimes that got a category or a stack."""
    from . import owners

    rows = list(rows)
    if not rows and context is None:
        return 0
    n_obs = len(rows)
    o_time = np.fromiter((r[0] for r in rows), np.int64, n_obs)
    o_addr = np.fromiter((r[1] for r in rows), np.int64, n_obs)
    o_cat = np.fromiter((trace.category_id(r[2]) for r in rows), np.uint8, n_obs)
    o_stack = np.fromiter((r[3] for r in rows), np.int32, n_obs)
    o_module = [r[4] if len(r) > 4 else "" for r in rows]
    t = trace.cols["time_ns"]
    total = 0
    for dev in trace.device_indices():
        lt = lifetimes(trace, dev)
        nl = len(lt)
        if not nl:
            continue
        if len(t):
            start_t = np.where(lt.start >= 0, t[np.maximum(lt.start, 0)], np.iinfo(np.int64).min)
            end_t = np.where(lt.end >= 0, t[np.maximum(lt.end, 0)], np.iinfo(np.int64).max)
        else:  # no events, only the final snapshot's blocks: each lived through the whole recording
            start_t = np.full(nl, np.iinfo(np.int64).min)
            end_t = np.full(nl, np.iinfo(np.int64).max)
        # Merge lifetime starts and observations by (address, time), lifetimes first on ties, then carry
        # the last lifetime id forward: lifetime ids already increase in (address, time) order.
        addr = np.concatenate([lt.address, o_addr])
        when = np.concatenate([start_t, o_time])
        kind = np.concatenate([np.zeros(nl, np.int8), np.ones(n_obs, np.int8)])
        val = np.concatenate([np.arange(nl), np.full(n_obs, -1)])
        order = np.lexsort((kind, when, addr))
        carried = np.maximum.accumulate(val[order])
        is_obs = kind[order] == 1
        life = carried[is_obs]
        obs_i = order[is_obs] - nl
        ok = life >= 0
        life, obs_i = life[ok], obs_i[ok]
        ok = (lt.address[life] == o_addr[obs_i]) & (end_t[life] >= o_time[obs_i])
        life, obs_i = life[ok], obs_i[ok]
        if not len(life) and context is None:
            continue
        cat = lt.category.copy()
        stack = lt.stack.copy()
        known = o_cat[obs_i] != UNKNOWN_CATEGORY
        cat[life[known]] = o_cat[obs_i][known]  # the latest known category wins
        with_stack = o_stack[obs_i] >= 0
        first = np.full(nl, -1, np.int32)  # the earliest stack wins: later ones are in-place ops
        first[life[with_stack][::-1]] = o_stack[obs_i][with_stack][::-1]
        stack = np.where((stack < 0) & (first >= 0), first, stack)
        module = {int(li): o_module[oi] for li, oi in zip(life, obs_i, strict=True) if o_module[oi]}
        if module or context is not None:  # (the latest observation's module wins, as its category)
            cat, stack = owners.compose(
                trace, start_t, cat, stack, module, context, end_t=end_t, size=lt.size, check=check
            )
        changed = (cat != lt.category) | (stack != lt.stack)
        total += int(changed.sum())
        ev, evl = lt.event_index, lt.event_lifetime
        trace.cols["category"][ev] = cat[evl]
        trace.cols["stack"][ev] = stack[evl]
        _annotate_snapshot(trace, dev, lt, cat, stack)
    return total


def _annotate_snapshot(trace: Trace, dev: int, lt, cat: np.ndarray, stack: np.ndarray) -> None:
    live = np.flatnonzero(lt.end < 0)
    by_addr = {int(lt.address[i]): i for i in live}
    for seg in trace.device(dev)["segments"]:
        for b in seg.get("blocks", []):
            i = by_addr.get(b["address"])
            if i is not None and b.get("state", "").startswith("active"):
                if cat[i] != UNKNOWN_CATEGORY:
                    b["category"] = trace.categories[int(cat[i])]
                if stack[i] >= 0:
                    b["stack"] = int(stack[i])
