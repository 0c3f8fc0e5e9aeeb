"""Regions: which module calls the pool recomputes (region.py's docstring says how), found on the
profiling step by global module hooks, then followed by two forward hooks on each chosen module."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.nn.modules import module as _nn

from .. import torch_private as tp
from .call_state import CallState
from .entry import Entry
from .held import freeze_call, held_state, release, signature, written
from .light import _Alive, _Light, _pool_hooks
from .outside_uses import OutsideUses
from .region import (
    COST_SAMPLES,
    MAX_SHARE,
    Region,
    _read_timer,
    _refusal_warning,
    _start_timer,
    _stop_timer,
    _storage_ptr,
    _tensors,
    consumers,
)

if TYPE_CHECKING:
    from .port import PoolInternals


def _kind(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """A call's kind: its module's type, its tensor arguments' shapes, dtypes and whether they need
    grad (GPT-24's 24 block calls are one kind)."""
    return (type(module), *((x.shape, x.dtype, x.requires_grad) for x in _tensors((args, kwargs))))


class _Call:
    """Profiling step: one module call, and the bytes saved during it that it made itself."""

    __slots__ = ("module", "input_ptrs", "own_bytes", "outside", "children", "held")

    def __init__(self, module: torch.nn.Module, args: tuple):
        self.module = module
        self.input_ptrs = {_storage_ptr(x) for x in _tensors(args)}
        self.held: str | None = None  # why its state cannot be frozen (held_state): not a region
        self.own_bytes = 0
        self.outside: list[tuple[int | None, int]] = []  # saved bytes it did not make: (storage, bytes)
        self.children: list[_Call] = []

    def saw(self, packed: Any, t: torch.Tensor) -> None:
        if not isinstance(packed, Entry):
            return
        ptr = _storage_ptr(t)
        if ptr in self.input_ptrs:
            self.outside.append((ptr, packed.nbytes))
        else:
            self.own_bytes += packed.nbytes

    def close_into(self, parent: _Call) -> None:
        parent.children.append(self)
        parent.own_bytes += self.own_bytes
        for ptr, n in self.outside:
            if ptr in parent.input_ptrs:
                parent.outside.append((ptr, n))
            else:
                parent.own_bytes += n


class CallTree(Protocol):
    """What choose_regions reads of a call: a profiling step's _Call, or a trace's (trace/step_profile.py,
    whose module is the call's path)."""

    @property
    def module(self) -> Any: ...
    @property
    def own_bytes(self) -> int: ...
    @property
    def held(self) -> str | None: ...
    @property
    def children(self) -> Sequence[CallTree]: ...


def choose_regions(roots: Sequence[CallTree], refused: Any = None) -> set[Any]:
    """The modules whose calls are regions; `refused` (a dict) gets the calls that would have been
    chosen but take state that cannot be frozen (held_state), with why."""
    total = sum(c.own_bytes for c in roots) or 1
    chosen: set[Any] = set()

    def visit(c: CallTree, top: bool) -> None:
        if c.own_bytes <= 0:
            return
        kids = [k for k in c.children if k.own_bytes > 0]
        if not top and c.held is not None and refused is not None and c.module not in refused:
            refused[c.module] = c.held
        if kids and (top or c.own_bytes > MAX_SHARE * total or c.held is not None):
            for k in kids:
                visit(k, False)
        elif c.held is None:
            chosen.add(c.module)

    # A lone top call is the model: always split. Top calls of a step that calls its parts itself
    # (GPT.hidden's blocks, one by one, under supermem.linear_cross_entropy) are split by share alone,
    # as they would be inside a model's call.
    for r in roots:
        visit(r, len(roots) == 1)
    return chosen


class Regions:
    """The pool's region tracker: profiles the first step, then hooks the chosen modules."""

    def __init__(self, pool: PoolInternals):
        self._pool = weakref.ref(pool)
        self.phase = "off"  # off -> profiling (first step) -> on
        self._local = threading.local()  # stack of open calls/regions; replaying flag
        self._global: list[Any] = []
        self._handles: list[Any] = []
        self._roots: list[_Call] = []
        # per kind of call (module type, input shapes and dtypes: GPT-24's 24 blocks are one kind):
        # [least seconds, samples read, pending timers, calls timed]
        self._costs: dict[tuple, list] = {}
        self._kind: dict[int, tuple] = {}  # id(module) -> the kind of its last captured call
        self._own_hooks: dict[int, tuple[int, int]] = {}  # id(module) -> its pre and post hook's ids
        self.modules: list[torch.nn.Module] = []
        self.roots: list[weakref.ref[torch.nn.Module]] = []
        # modules never replayed, with why: their calls take state, or a replay was not the call
        self.refused: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self._verified: set[tuple[int, tuple]] = set()  # (id(module), kind) replayed and matched
        # (id(module), held.signature) of calls taking state, replayed on its copy and matched
        self._state_verified: set[tuple[int, tuple]] = set()
        # the uses of each tensor input in a module's verified call (consumers); None where unknown:
        # such a module never runs light
        self.uses: weakref.WeakKeyDictionary[torch.nn.Module, tuple | None] = weakref.WeakKeyDictionary()
        self.outside_uses = OutsideUses()  # which of those inputs a use outside the call reads too
        self.split_misses = 0  # light backwards whose uses' gradients were not all caught (_PerUse)
        # id(weight) -> the module with an `eps` that owns it, seen in the first step (op replay's
        # LayerNorm: its node does not keep its eps)
        self._eps_owners: dict[int, weakref.ref[torch.nn.Module]] = {}
        # calls captured before the step's first save, the step's recorder not made yet (Recorder.calls)
        self.early_calls: list[tuple[int, tuple]] = []

    # -- phases

    def start_profiling(self) -> None:
        if self.phase != "off":
            return
        self._global = [
            _hook(_nn.register_module_forward_pre_hook, self._profile_pre),
            _hook(_nn.register_module_forward_hook, self._profile_post, with_kwargs=True, always_call=True),
        ]
        self.phase = "profiling"

    def end_profiling(self) -> None:
        """Backward began: choose the regions from what the forward saved, hook them."""
        if self.phase != "profiling":
            return
        for h in self._global:
            h.remove()
        self._global = []
        self.phase = "on"
        refused: dict[torch.nn.Module, str] = {}
        self.modules = sorted(choose_regions(self._roots, refused), key=id)
        for m, why in refused.items():
            self.refuse(m, why)
        self.roots = [weakref.ref(c.module) for c in self._roots]  # the step's top calls: the model
        self._roots = []
        self._local.stack = []
        for m in self.modules:
            # First in, last out: the call's own hooks run inside the region, so a replay, which calls
            # the module again, runs them on the very arguments they saw (a hook ahead of the region's
            # would change its arguments twice).
            hooks = (
                _hook(m.register_forward_pre_hook, self._pre, with_kwargs=True, prepend=True),
                _hook(m.register_forward_hook, self._post, with_kwargs=True, always_call=True),
            )
            self._handles += hooks
            self._own_hooks[id(m)] = (hooks[0].id, hooks[1].id)

    def close(self) -> None:
        """Takes the hooks off, by id from torch's dicts: a handle reaches its dict through a weak
        reference, which the garbage collector clears when the handle dies in a cycle with this
        tracker (a pool in a reference cycle), and its remove() then left the hook on for good. Not
        while dynamo traces (a collection can run then), whose guards read these dicts: the hooks,
        finding their tracker gone, take themselves off at their next call outside a trace (_hook)."""
        if not _tracing():
            _unhook([h.id for h in self._global + self._handles], self.modules)
        self._global, self._handles = [], []
        self._own_hooks = {}

    def call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """A replay's call of `module` (this thread captures nothing meanwhile): straight to its forward
        when the only hooks are this tracker's own, which do nothing in a replay (torch's path for a
        module with hooks cost ~10 us a replay of a tiny GPT block); any other hook, tracing or a
        compiled module takes the usual path."""
        local = self._local
        before = getattr(local, "replaying", False)
        local.replaying = True
        try:
            return self._call(module, args, kwargs)
        finally:
            local.replaying = before

    def _call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        ids = self._own_hooks.get(id(module))
        if (
            ids is None
            or len(module._forward_pre_hooks) != 1
            or ids[0] not in module._forward_pre_hooks
            or len(module._forward_hooks) != 1
            or ids[1] not in module._forward_hooks
            or module._backward_hooks
            or module._backward_pre_hooks
            or any(tp.global_module_hooks())
            or getattr(module, "_compiled_call_impl", None) is not None
            or type(module).__call__ is not torch.nn.Module.__call__
            or tp.jit_tracing_state()
        ):
            return module(*args, **kwargs)
        return module.forward(*args, **kwargs)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    # -- hooks

    def _stack(self) -> list:
        st = getattr(self._local, "stack", None)
        if st is None:
            st = self._local.stack = []
        return st

    def top(self) -> Any:
        st = getattr(self._local, "stack", None)
        return st[-1] if st else None

    def _capturing(self, pool: PoolInternals) -> bool:
        return torch.is_grad_enabled() and pool.active_here() and not getattr(self._local, "replaying", False)

    def _profile_pre(self, module: torch.nn.Module, args: tuple) -> None:
        pool = self._pool()
        if pool is not None and self.phase == "profiling" and self._capturing(pool):
            self._stack().append(_Call(module, args))
            w = module._parameters.get("weight")
            if w is not None and isinstance(module.__dict__.get("eps"), float):
                self._eps_owners[id(w)] = weakref.ref(module)

    def eps_of(self, weight: torch.Tensor) -> float | None:
        """The eps of the module owning `weight` now, if the first step saw it called."""
        ref = self._eps_owners.get(id(weight))
        m = ref() if ref is not None else None
        if m is None or m._parameters.get("weight") is not weight:
            return None
        eps = m.__dict__.get("eps")
        return eps if isinstance(eps, float) else None

    def _profile_post(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        st = getattr(self._local, "stack", None)
        if not st or not isinstance(st[-1], _Call) or st[-1].module is not module:
            return
        call = st.pop()
        call.held = held_state((args, kwargs))
        if st:
            call.close_into(st[-1])
        else:
            self._roots.append(call)

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        pool = self._pool()
        if pool is None:
            return
        if pool.rest.resting:  # (Rest: rest.py) a call unlike the recorded step's wakes it
            if self._capturing(pool):
                pool.rest.call((id(module), _kind(module, args, kwargs)))
            return
        pool.own_work(self._pre_call, module, args, kwargs, pool)

    def refuse(self, module: torch.nn.Module, why: str) -> None:
        """`module` is never replayed from now on (see the module's docstring), said once."""
        if module not in self.refused:
            self.refused[module] = why
            _refusal_warning(module, why)

    def _pre_call(self, module: torch.nn.Module, args: tuple, kwargs: dict, pool: PoolInternals) -> None:
        if not self._capturing(pool) or getattr(self._local, "unseen", None):
            return  # (inside a call the pool does not see: under checkpoint or with its hooks off)
        # (a refused module's calls are captured all the same, never ready: a plan's ordinals count
        # the inputs a capture keeps)
        raw = (args, kwargs)
        call, held = freeze_call(raw)  # (its state as it is now: a replay's)
        sig = signature(tp.tree_leaves(call)) if call is not raw else ()
        if module not in self.refused and held is not None:
            self.refuse(module, held)
        start = pool.clock.region_start()
        if start is None:
            self.outside_uses.missed(module)  # (a call not counted: its module keeps its slots)
            return
        light_ok = (
            self.uses.get(module, ()) is not None
            and module not in self.refused
            and (not sig or self._state_light(module, sig))
        )
        unseen, hooks = pool.plans.unseen_call(start, light_ok, False), None  # (run light: no hooks to know)
        if unseen is None:
            hooks = _pool_hooks(pool, args)
            if hooks is not None:
                unseen = pool.plans.unseen_call(start, False, True)
        if unseen is not None:
            light, end, lean = unseen
            self.outside_uses.missed(module)
            if light:
                self._light(module, call, pool, end)
            else:
                tp.pop_saved_hooks()  # Plan.bypass: autograd keeps them
                if lean is not None:  # but for those the plan drops (Plan.drops)
                    tp.push_saved_hooks(lean.pack, lean.unpack)
                self._local.__dict__.setdefault("unseen", []).append((module, hooks, end, lean))
            return
        if hooks is None and pool.plans.rec is not None and pool.plans.rec.full:
            pool.plans.rec.no_bypass.add(start)  # (nothing would tell when backward is through it)
        kind = self._kind[id(module)] = _kind(module, args, kwargs)
        pool.plans.note_call((id(module), kind))
        cost = self._costs.setdefault(kind, [0.0, 0, [], 0])
        timed = cost[3] < COST_SAMPLES
        cost[3] += timed
        region = Region(module, call, pool, timed)
        region.start, region.sig = start, sig
        self._stack().append(region)

    def _state_light(self, module: torch.nn.Module, sig: tuple) -> bool:
        """Whether a call taking state may run light: a call with as much in its state was replayed
        on the state's copy and matched, and nothing outside the call reads what it put into the state
        (a light call runs with grad off: those tensors would stay there without a graph)."""
        return (id(module), sig) in self._state_verified and self.outside_uses.state_read.get(module) is False

    def _light(self, module: torch.nn.Module, call: tuple, pool: PoolInternals, end: int) -> None:
        """The call runs with grad off (Plan.light): autograd builds no graph in it and saves nothing;
        at its end `_Light` gives its outputs one node, whose backward calls it again with grad on and
        backpropagates through that call (reentrant checkpointing). Non-reentrant checkpointing, which
        this replaced, builds the graph and hands each save to hooks of its own: on an H100 ResNet-152
        with every block so took 1.89x native against 1.31x (host 143 ms a step against 75)."""
        light = _Light(CallState(pool.device, module))
        # The arguments as the call got them: a pre-hook of the user's, which runs after this one,
        # runs with grad off too, and again in the replay; the node must start from its inputs.
        light.call = call
        light.uses = self.uses.get(module)
        if light.uses is not None:
            light.outside = self.outside_uses.of(module, len(light.uses))
        self._local.__dict__.setdefault("unseen", []).append((module, light, end, None))
        tp.set_grad_enabled(False)

    def _post(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """The call's output, or what replaces it (a call run with grad off: its outputs with a node)."""
        pool = self._pool()
        if (
            pool is not None
            and pool.rest.resting
            and not getattr(self._local, "unseen", None)
            and not self.top()
        ):
            return None  # (resting: nothing to undo, unless the call began before the rest did)
        if pool is None:
            return self._post_call(module, args, kwargs, output)  # (the hooks a call popped go back still)
        return pool.own_work(self._post_call, module, args, kwargs, output)

    def _post_call(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        unseen = getattr(self._local, "unseen", None)
        if unseen and unseen[-1][0] is module:
            _, call, end, lean = unseen.pop()  # call: a _Light, or the pool's hooks (bypassed)
            bypassed = isinstance(call, tuple)
            if lean is not None:
                tp.pop_saved_hooks()
                lean.close()
            pool = self._pool()
            if bypassed:  # the pool's hooks back on
                tp.push_saved_hooks(*call)
            else:
                tp.set_grad_enabled(True)
                if output is not None:  # (None: the call raised)
                    output = call.attach(self, module, *call.call, output, pool)
                call.call = None
            if pool is not None:
                pool.plans.unseen_outputs(_tensors(output), light=not bypassed)
                if bypassed:  # its kept saves count until backward is through the call (or its graph dies)
                    alive = _Alive(pool, pool.plans.unseen_bytes(end) - (lean.dropped_bytes if lean else 0))
                    for x in _tensors(args):
                        if x.grad_fn is not None:  # (a leaf would keep each step's hook)
                            x.register_hook(alive.through)
                pool.plans.unseen_done(end, not bypassed, lean)
            return output
        st = getattr(self._local, "stack", None)
        if not st or not isinstance(st[-1], Region) or st[-1].module is not module:
            return
        region = st.pop()
        pool = self._pool()
        timed = region.timing is not None
        if timed:
            self._costs[self._kind[id(module)]][2].append(_stop_timer(region.timing, pool))
            region.timing = None
        call = region.args  # (as the call got them: finish() packs them)
        frozen: list = tp.tree_leaves(call) if region.sig else []
        if pool is not None and region.finish(pool):
            verified = (id(module), self._kind[id(module)]) in self._verified and (
                not region.sig or (id(module), region.sig) in self._state_verified
            )
            readers = None  # the call's uses, where its verification walks them
            if module in self.refused:
                region.unready()
            elif not verified or timed:
                if pool.cuda and torch.cuda.is_current_stream_capturing():
                    if not verified:  # (a CUDA graph is being captured: nothing can be read back)
                        region.unready()
                else:
                    why = self._time_replay(region, call, pool, not verified, timed)
                    if why is not None:  # (its entries stay; the step records the call all the same)
                        region.unready()
                        self.refuse(module, why)
                    elif not verified:
                        if region.sig:
                            self._state_verified.add((id(module), region.sig))
                            put = written(frozen, tp.tree_leaves((args, kwargs)))
                            self.outside_uses.state_written(module, put, consumers(put, _tensors(output)))
                        if self.uses.get(module, ()) is not None:  # (unknown stays)
                            readers = consumers(_tensors(call), _tensors(output))
                            self.uses[module] = None if readers is None else tuple(len(u) for u in readers)
                            self.outside_uses.verified(module, self.uses[module])
            self.outside_uses.note(module, _tensors(call), _tensors(output), readers)
            if self.uses.get(module, ()) is None and pool.plans.rec is not None and pool.plans.rec.full:
                pool.plans.rec.no_light.add(region.start)
            pool.region_done(region, _tensors(output))
        else:
            self.outside_uses.missed(module)
        release(frozen)

    def _time_replay(
        self, region: Region, call: tuple, pool: PoolInternals, verify: bool, timed: bool
    ) -> str | None:
        """Runs the call once more, timed from an idle stream: a sample of what a replay costs, the
        larger of its kernels and its own host work. The call itself ran in a step the pool records,
        whose host pace its CUDA events measure: GPT-24's blocks were priced at 7.2 ms each on an H100
        (their kernels take about 0.8), and a plan replayed 7 of 24 where checkpointing half of them
        by hand was cheaper. `verify`: the module's first call of this kind, its saves matched against
        the call's (Region.verify): what differs, or None."""
        if pool.cuda and timed:
            torch.cuda.current_stream(pool.device).synchronize()
        timer = _start_timer(pool) if timed else None
        why = region.verify(pool, call, check=verify)
        kind = self._kind[id(region.module)]
        if why is None:
            if timer is not None:
                self._costs[kind][2].append(_stop_timer(timer, pool))
            if verify:
                self._verified.add((id(region.module), kind))
        return why

    # -- costs

    def cost_s(self, module: torch.nn.Module) -> float | None:
        """The least measured seconds of a call of the module's kind, in the forward or replayed (None
        before one finished timing)."""
        kind = self._kind.get(id(module))
        c = self._costs.get(kind) if kind is not None else None
        if c is None:
            return None
        still = []
        for timer in c[2]:
            s = _read_timer(timer)
            if s is None:
                still.append(timer)
            else:
                c[0] = min(c[0], s) if c[1] else s  # the least of a few calls: noise only adds
                c[1] += 1
        c[2] = still
        return c[0] if c[1] else None


def _hook(register: Any, method: Any, **kwargs: Any) -> Any:
    """`register(hook, **kwargs)`'s handle, for a hook calling `method` through a weak reference. Once
    `method`'s object is gone, the hook takes itself off from torch's global dicts and its module's."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        if torch.compiler.is_compiling():
            return None  # traced by dynamo: nothing in the graph (recompute cannot reach inside one)
        m = ref()
        if m is not None:
            return m(*args)
        if not _tracing():
            _unhook([handle.id], [args[0]])
        return None

    handle = register(call, **kwargs)
    return handle


def _tracing() -> bool:
    """Dynamo is tracing (what a garbage collection run inside a compile sees)."""
    return torch.compiler.is_compiling() or tp.dynamo_tracing()


def _unhook(hook_ids: list[int], modules: list[torch.nn.Module]) -> None:
    """Hooks `hook_ids` out of torch's global forward hook dicts and those of `modules` (ids are unique
    over all of torch's hook handles)."""
    dicts = tp.global_forward_hook_dicts()
    for m in modules:
        dicts += [m._forward_pre_hooks, m._forward_pre_hooks_with_kwargs, m._forward_hooks]
        dicts += [m._forward_hooks_with_kwargs, m._forward_hooks_always_called]
    for d in dicts:
        for i in hook_ids:
            d.pop(i, None)
