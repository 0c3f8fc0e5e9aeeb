"""Regions: recomputation at module granularity.

A region is one call of a chosen module. The tensors its forward saves that it made itself (not its
inputs) can be dropped and rebuilt by calling the module again on its inputs, which the pool keeps as
entries of their own (offloadable, or rebuilt by the region before). Replay is what non-reentrant
torch.utils.checkpoint does: the CPU and CUDA RNG state and the autocast state of the original call,
inputs detached with their requires_grad, saved tensors matched by the order they are saved in, an
early stop once every dropped one is back; on CUDA also the attention backends enabled at the call.
Module buffers (BatchNorm's running statistics) are put back after a replay, versions included, so a
replay changes nothing the step can see.

Which modules: on the pool's first step (the profiling step) global module hooks see every call and how
many bytes each call saves that it made itself. From the top call down, a call that holds more than
MAX_SHARE of the step's saved bytes is split into its child calls; the others are the regions (GPT: the
blocks; ResNet: the bottlenecks; an MLP: its layers). After that step the global hooks go and only the
chosen modules carry two forward hooks: nothing runs per op, a few microseconds per region per step.

Excluded explicitly: a call that changes one of its inputs in place (its replay would start from the
changed value), calls made with grad disabled, and tensors that are views of the call's inputs.

Trusted only where proven: a call that takes anything but values (a KV cache, a user object: state
the call may read or change, so that a replay is not the call) is never a region; its children are
chosen instead (a Hugging Face decoder layer given the cache its training forward builds: its MLP and
norms are recomputed, its attention's saves kept or offloaded). And the first call of each module at
each kind is replayed at once, its saves matched bitwise against the call's own (the replay that
times it): a module whose replay differs is refused for good, named in one warning.
"""

from __future__ import annotations

import enum
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules import module as _nn

from .. import torch_private as tp
from .call_state import CallState
from .entry import Entry, State, _set_version, bitwise_equal
from .light_graphs import LightGraphs, light_graphs_of

# the saved-tensor hooks on top of this thread's stack (Plan.bypass takes the pool's off around a call)
_top_hooks = tp.top_saved_hooks

if TYPE_CHECKING:
    from .port import PoolInternals

MAX_SHARE = 0.25  # a call saving more than this share of a step's bytes is split into its children
COST_SAMPLES = 3  # calls timed per kind of call (each with a timed replay); the least prices it


class _Stop(Exception):  # noqa: N818  every dropped tensor of the region is back: end the replay
    pass


_VALUES = (
    torch.Tensor,
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    enum.Enum,
    slice,
    type(Ellipsis),
)


def held_state(tree: Any) -> str | None:
    """The type name of the first argument of a call that is not a value (tensors, numbers, strings,
    None, and tuples, lists and dicts of them), or None. Such an argument is state the call may read
    or change, which a replay would see changed: Hugging Face decoders append each layer's keys and
    values to the cache their training forward builds, so a replayed layer appended them again and
    attended over twice the keys (a crash, or on Llama other gradients without a word)."""
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, _VALUES):
            continue
        if isinstance(x, (tuple, list)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        else:
            return type(x).__name__
    return None


def _takes_state(held: str) -> str:
    return f"its call takes a {held}, state a replay would see changed"


_WARNED: set[tuple[str, str]] = set()


def _refusal_warning(module: torch.nn.Module, why: str) -> None:
    """One warning per kind of module and reason, per process."""
    name = type(module).__name__
    if (name, why) in _WARNED:
        return
    _WARNED.add((name, why))
    warnings.warn(
        f"supermem: {name} is not recomputed as one call: {why}. The pool recomputes its parts where "
        "they are pure calls and keeps or offloads the rest; training is unchanged.",
        stacklevel=2,
    )


def _storage_ptr(t: Any) -> int | None:
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of a call's arguments or output, in tree_flatten's order. A tensor, a tuple of
    tensors and (tensors, no keywords) skip pytree's walk (~16 us a call on this CPU, a few a block)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if type(tree) is tuple:
        out: list[torch.Tensor] = []
        for x in tree:
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif type(x) is tuple and all(isinstance(y, torch.Tensor) for y in x):
                out += x
            elif not (type(x) is dict and not x):
                break
        else:
            return out
    return [x for x in tp.tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


class Region:
    """One call of a chosen module: enough to call it again (also the recipe of its dropped entries)."""

    __slots__ = (
        "module",
        "inputs",
        "input_ptrs",
        "args",
        "state",
        "slots",
        "made",
        "ready",
        "timing",
        "start",
        "places",
        "__weakref__",
    )

    def __init__(self, module: torch.nn.Module, args: tuple, kwargs: dict, pool: PoolInternals, timed: bool):
        self.module = module
        self.inputs = [(x, x._version) for x in _tensors((args, kwargs))]
        self.input_ptrs = {_storage_ptr(x) for x, _ in self.inputs}
        self.args: Any = (args, kwargs)  # raw until finish() packs them
        self.state = CallState(pool.device, module)  # RNG, autocast, attention backends, the module
        self.slots: list[weakref.ref[Entry] | None] = []  # one per tensor saved, in save order
        # (slot, entry) of each entry the call made, once: its own (this region their recipe) and those
        # another recipe rebuilds (an op replay, a weight cast), which a replay brings back as well
        self.made: tuple[tuple[int, weakref.ref[Entry]], ...] = ()
        self.ready = False
        self.timing: Any = _start_timer(pool) if timed else None
        self.start = 0  # its step's saves before the call (Pool._region_start)
        self.places: dict[int, int] = {}  # the number of a save in the call -> the ordinal it saved

    @property
    def group(self) -> Region:
        return self

    def saw(self, packed: Any, t: torch.Tensor) -> None:
        """The call saved `t` (packed as `packed`): a slot, recomputable if the call made it."""
        ordinal = getattr(packed, "ordinal", 0)
        if ordinal > self.start:
            self.places[len(self.slots)] = ordinal
        mine = isinstance(packed, Entry) and _storage_ptr(t) not in self.input_ptrs
        self.slots.append(weakref.ref(packed) if mine else None)
        if mine and packed.recipe is None:
            packed.recipe = self  # not ready: it stays until the call returns and the policy can weigh both

    def finish(self, pool: PoolInternals) -> bool:
        """The call returned: True if it can be replayed (then its own entries take it as recipe)."""
        own, made, slots = [], [], []
        for k, ref in enumerate(self.slots):
            e = ref() if ref is not None else None
            if e is not None and not any(e is x for x in made):  # one saved twice: its first slot
                made.append(e)
                slots.append((k, ref))
                if e.recipe is self:
                    own.append(e)
        # A call that changed an input in place would be replayed from the changed value.
        changed = any(x._version != v for x, v in self.inputs)
        if changed or not own:
            for e in own:
                e.recipe = None
            if changed or self.start not in pool._plan_captures():
                return False
        self.inputs = []  # the raw inputs go; the pool keeps them as entries from here
        # Flat, with the tree's spec: a replay fills the inputs in and rebuilds the tree in one step.
        leaves, spec = tp.tree_flatten(self.args)
        args = ([_Input(pool, x) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
        if not own:
            # (its recording made its inputs entries here, saves of the step, a first block's batch:
            # so does this step, or its ordinals would fall one short of the plan's)
            return False
        self.args = args
        self.made = tuple(slots)
        self.ready = True
        return True

    def cost_s(self, pool: PoolInternals) -> float | None:
        return pool.regions.cost_s(self.module)

    def droppable(self, e: Entry) -> bool:
        return True  # an op replay reading it rebuilds it first: one region replay, bounded

    def rebuild(self, pool: PoolInternals, e: Entry) -> None:
        """Replays the call; every entry it made that is away comes back: its own (dropped or
        compressed), and those another recipe would rebuild (an op replay's, a weight cast's: the
        replay computes them anyway, and each rebuild of its own costs the host a call), except those
        being rebuilt now (an op replay that reads one of this region's)."""
        in_use = pool._in_use
        want = {
            k: x
            for k, ref in self.made
            if (x := ref()) is not None
            and x.state is State.AWAY
            and (x.recipe is self or (x.treatment.rebuilds and not any(x is y for y in in_use)))
        }
        if not want:
            return
        args, kwargs = self.replay_args(pool)
        arrived = pool.arrived
        k = -1  # the slot of the tensor being saved

        def pack(t: torch.Tensor) -> None:
            nonlocal k
            k += 1
            x = want.pop(k, None)
            if x is None:
                return None
            if t.shape != x.shape or t.dtype != x.dtype or t.stride() != x.stride:
                raise RuntimeError(
                    f"supermem: replaying {type(self.module).__name__} saved a different tensor "
                    f"(#{k}: {tuple(t.shape)} {t.dtype}, expected {tuple(x.shape)} {x.dtype}); "
                    "its forward is not deterministic in what it saves"
                )
            arrived(x, t.detach(), None)
            x.treatment.arrived(pool, x)  # e.g. compressed: its payload goes
            if not want:
                raise _Stop
            return None

        try:
            with (
                _Replaying(self.state, self.module, False),
                torch.autograd.graph.saved_tensors_hooks(pack, _none),
            ):
                pool.regions.call(self.module, args, kwargs)
        except _Stop:
            pass
        if want:
            raise RuntimeError(
                f"supermem: replaying {type(self.module).__name__} saved fewer tensors than its first "
                "call did; its forward is not deterministic in what it saves"
            )

    def replay_args(self, pool: PoolInternals) -> tuple[tuple, dict]:
        """The call's arguments again, its tensors brought back (or rebuilt) by the pool."""
        leaves, spec = self.args
        return tp.tree_unflatten([x.get(pool) if isinstance(x, _Input) else x for x in leaves], spec)

    def verify(self, pool: PoolInternals, call: tuple, check: bool = True) -> str | None:
        """Calls the module again at once on `call`, the (args, kwargs) it got, as a rebuild would, and
        matches each tensor it saves against the call's own save at that place, bitwise where the pool
        still holds it: None if the replay is the call, else what differs. Not `check`: a replay only
        timed, BatchNorm quiet (_saved_buffers)."""
        k, why = -1, None

        def pack(t: torch.Tensor) -> None:
            nonlocal k, why
            k += 1
            if not check:
                return None
            ref = self.slots[k] if k < len(self.slots) else None
            x = ref() if ref is not None else None
            if why is None and x is not None and x.state is State.RESIDENT and x.tensor is not None:
                if not bitwise_equal(t.detach(), x.tensor):
                    why = f"its replay saved another tensor #{k} ({tuple(t.shape)} {t.dtype})"
            return None

        leaves, spec = tp.tree_flatten(call)
        leaves = [
            x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in leaves
        ]
        args, kwargs = tp.tree_unflatten(leaves, spec)
        try:
            with (
                _Replaying(self.state, self.module, not check),
                torch.autograd.graph.saved_tensors_hooks(pack, _none),
            ):
                pool.regions.call(self.module, args, kwargs)
        except Exception as err:  # noqa: BLE001  (the replay is not the call: refused, not raised)
            return f"its replay raised {type(err).__name__}: {str(err)[:200]}"
        if check and why is None and k + 1 != len(self.slots):
            why = f"its replay saved {k + 1} tensors, the call {len(self.slots)}"
        return why

    def unready(self) -> None:
        """Not a recipe after all (its replay was refused): its entries stay as they are."""
        self.ready = False
        for _, ref in self.made:
            e = ref()
            if e is not None and e.recipe is self:
                e.recipe = None


def consumers(inputs: list[torch.Tensor], outputs: list[torch.Tensor], limit: int = 10_000) -> list | None:
    """The call's uses of each input: per input, the (node, edge) of each edge of the call's graph (from
    its outputs back to its inputs) that reaches it. None: an input given twice, or
    a walk over `limit` nodes (the graph leaves the call through a tensor that is not an argument).

    Why it matters: a light call's node hands back each input's gradient, and autograd adds it to the
    input's other uses. Summed over the call's uses first, r + (a + b), it rounds otherwise than plain
    autograd, which adds each use as it comes, (r + a) + b (a Llama's RMSNorm, whose input the residual
    add reads too, trained 1 ulp off from step 6). So the node takes such an input once per use and
    hands back each use's gradient in its own slot (_LightFn): autograd adds them in plain order."""
    at: dict[Any, int] = {}
    for j, x in enumerate(inputs):
        key = (id(x.grad_fn), x.output_nr) if x.grad_fn is not None else id(x)
        if key in at:
            return None
        at[key] = j
    stop = {id(x.grad_fn) for x in inputs if x.grad_fn is not None}
    found: list[list] = [[] for _ in inputs]
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    seen: dict[int, Any] = {}
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node  # (held: ids stay unique through the walk)
        if len(seen) > limit:
            return None
        for i, (nxt, nr) in enumerate(node.next_functions):
            if nxt is None:
                continue
            var = getattr(nxt, "variable", None)
            j = at.get((id(nxt), nr), at.get(id(var)) if var is not None else None)
            if j is not None:
                found[j].append((node, i))
            elif id(nxt) not in stop:
                stack.append(nxt)
    return found


def _none(*_: Any) -> None:
    """Nothing: an unpack hook with nothing to give back, a pack hook that drops, a dead weakref."""
    return None


_BN_FORWARD = tp.BatchNorm.forward


def _saved_buffers(module: torch.nn.Module, quiet_bn: bool) -> tuple[list, list]:
    """What a replay of `module` must leave as it found it (before the replay; _put_back after).
    `quiet_bn`: its BatchNorm layers in training stop tracking running statistics for the replay: their
    output is the same without them (as op_replay's BatchNorm replay verified) and nothing is copied,
    but they save other tensors (a Region's rebuild, which matches saves by order, cannot). Copying their
    buffers and putting them back cost 18 small copies a ResNet bottleneck: on an H100 45 replayed
    blocks made 822 cudaMemcpyAsync calls, ~9 ms of a host-bound step's host time. Any other buffer is
    copied, to be put back."""
    quiet, saved = [], []
    for m in _submodules(module):
        if quiet_bn and type(m).forward is _BN_FORWARD and m.training and m.track_running_stats:
            quiet.append(m)
        else:
            saved += [(b, b.detach().clone(), b._version) for b in m._buffers.values() if b is not None]
    for m in quiet:
        m.__dict__["track_running_stats"] = False  # (a plain attribute: Module.__setattr__ not needed)
    return quiet, saved


def _put_back(buffers: tuple[list, list]) -> None:
    """After a replay: BatchNorm layers track their statistics again; the other buffers get their
    values back, without a version bump."""
    quiet, saved = buffers
    for m in quiet:
        m.__dict__["track_running_stats"] = True
    if saved:
        with torch.no_grad():
            for b, value, version in saved:
                b.copy_(value)
                _set_version(b, version)


class _Replaying:
    """A replay of `module` under `state`: the state first (the module as it was at the call), then
    what the replay must leave as it found (_saved_buffers), put back before the state goes. (The other
    way round, the state set BatchNorm's `track_running_stats` back on in a quiet replay, which then
    moved the running statistics for good.)"""

    __slots__ = ("replay", "module", "quiet", "buffers")

    def __init__(self, state: CallState, module: torch.nn.Module, quiet_bn: bool):
        self.replay, self.module, self.quiet = state.replay(), module, quiet_bn

    def __enter__(self) -> _Replaying:
        self.replay.__enter__()
        try:
            self.buffers = _saved_buffers(self.module, self.quiet)
        except BaseException:
            self.replay.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            _put_back(self.buffers)
        finally:
            self.replay.__exit__(*exc)


class _Alive:
    """Held by the autograd graph of a call the pool did not see (by the rebuild of a call run under
    checkpoint; by a hook on a bypassed call's input, which runs once backward is through the call):
    the step is not over while one lives (Pool._between_steps), though the pool holds none of the
    call's saved tensors."""

    __slots__ = ("pool", "nbytes")

    def __init__(self, pool: PoolInternals, nbytes: int = 0):
        """`nbytes`: what the call's graph holds that the plan keeps (a bypassed call's saves), in the
        pool's count of kept bytes meanwhile (on a CPU, the step's peak is that count)."""
        self.pool = weakref.ref(pool)
        self.nbytes = nbytes
        with pool._lock:
            pool._unseen_live += 1
            pool._kept_bytes += nbytes
            pool._note_peak()

    def release(self, *_: Any) -> None:
        pool, self.pool = self.pool(), _none
        if pool is not None:  # (autograd's thread may free the graph)
            with pool._lock:
                pool._unseen_live -= 1
                pool._kept_bytes -= self.nbytes

    __del__ = release

    def through(self, _grad: Any) -> None:
        """The hook on a bypassed call's input: backward is through the call."""
        pool = self.pool()
        if pool is not None:
            pool._backward_began()
        self.release()


def _pool_hooks(pool: PoolInternals, args: tuple) -> tuple | None:
    """The saved-tensor hooks on top of this thread's stack if they are the pool's (a call with the
    pool's hooks off, Plan.bypass, pops them; not the user's own, pushed inside the pool's) and the
    call has an input made in the graph (its hook tells when backward is through the call); else None."""
    top = _top_hooks(False) if _top_hooks is not None else None
    if top is None or top[0] != pool._pack or not any(x.grad_fn is not None for x in _tensors(args)):
        return None
    return top


def _kind(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """A call's kind: its module's type, its tensor arguments' shapes, dtypes and whether they need
    grad (GPT-24's 24 block calls are one kind)."""
    return (type(module), *((x.shape, x.dtype, x.requires_grad) for x in _tensors((args, kwargs))))


def _identity(t: Any) -> Any:
    return t


_ANCHOR = torch.empty(0, requires_grad=True)  # an input of every _LightFn: its outputs need grad always


class _Light:
    """A call run with grad off (Regions._light): what calling it again in backward needs. No tensor:
    its tensor inputs are saved by its node (_LightFn), its outputs are the step's."""

    __slots__ = (
        "state",
        "call",
        "tracker",
        "module",
        "spec",
        "leaves",
        "places",
        "out_places",
        "alive",
        "graphs",
        "uses",
        "extra",
    )

    def __init__(self, state: CallState):
        self.state = state  # RNG, autocast, attention backends at the call
        self.uses: tuple | None = None  # per tensor input, its uses in the call (Regions.uses)
        self.extra: list[int] = []  # the node's extra slots: an input once more per use past its first
        self.graphs: LightGraphs | None = None  # replays its backward where it can (light_graphs.py)

    def attach(
        self, tracker: Regions, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any, pool: Any
    ) -> Any:
        """The call's output with its floating-point tensors given one node (_LightFn)."""
        if not kwargs and all(isinstance(x, torch.Tensor) for x in args):
            leaves, self.spec = list(args), None  # (tensors alone: no pytree, ~8 us a flatten)
        else:
            leaves, self.spec = tp.tree_flatten((args, kwargs))
        self.places = [k for k, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.leaves = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        outs, out_spec = _flatten(output)
        self.out_places = [
            k for k, x in enumerate(outs) if isinstance(x, torch.Tensor) and x.is_floating_point()
        ]
        if not self.out_places:
            return output
        self.tracker, self.module = weakref.ref(tracker), module
        self.alive = _Alive(pool) if pool is not None else None  # the step lasts while the node lives
        inputs = [leaves[k] for k in self.places]
        params = _params(module)
        outputs = [outs[k] for k in self.out_places]
        if self.uses is not None and len(self.uses) == len(inputs):
            self.extra = [j for j, n in enumerate(self.uses) for _ in range(n - 1) if inputs[j].requires_grad]
        if (
            not self.extra
            and pool is not None
            and self.spec is None
            and len(inputs) == 1
            and len(outputs) == 1
        ):
            self.graphs = light_graphs_of(pool)
            if self.graphs is not None:
                self.graphs.note(self, inputs[0])
        if pool is not None:
            pool._passthrough = True  # the node saves the call's inputs itself: not the step's saves
        try:
            extra = [inputs[j] for j in self.extra]
            attached = _light_apply(self, outputs, len(inputs), _ANCHOR, *inputs, *params, *extra)
        finally:
            if pool is not None:
                pool._passthrough = False
        for k, x in zip(self.out_places, attached):
            outs[k] = x
        return outs[0] if out_spec is None else tp.tree_unflatten(outs, out_spec)

    def again(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The call once more, with grad on, under its state, the module's buffers put back after; the
        saves it makes stay with autograd (the pool's hooks are not asked)."""
        leaves = list(self.leaves)
        for k, x in zip(self.places, inputs):
            leaves[k] = x
        args, kwargs = (tuple(leaves), {}) if self.spec is None else tp.tree_unflatten(leaves, self.spec)
        tracker = self.tracker()
        with (
            _Replaying(self.state, self.module, True),
            torch.autograd.graph.saved_tensors_hooks(_identity, _identity),
        ):
            out = tracker.call(self.module, args, kwargs) if tracker else self.module(*args, **kwargs)
        outs = _flatten(out)[0]
        return [outs[k] for k in self.out_places]


def _flatten(tree: Any) -> tuple[list, Any]:
    """tree_flatten, but a lone tensor costs no pytree walk (its spec: None)."""
    return ([tree], None) if isinstance(tree, torch.Tensor) else tp.tree_flatten(tree)


def _submodules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The module and its children, by a plain walk: module.parameters() / .buffers() and their
    named-member generators cost a light call ~35 us on this CPU, a replay of a tiny GPT block ~10."""
    out, stack = [], [module]
    while stack:
        m = stack.pop()
        out.append(m)
        stack.extend(c for c in m._modules.values() if c is not None)
    return out


def _params(module: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters that need grad of the module and its children, each once."""
    out = {id(w): w for m in _submodules(module) for w in m._parameters.values() if w is not None}
    return [w for w in out.values() if w.requires_grad]


class _LightFn(torch.autograd.Function):
    """The node of a call run with grad off, its inputs and parameters: its backward runs the call
    again from the inputs it saved and differentiates that call (torch.autograd.grad, so the gradients
    go where autograd sends them: .grad and its hooks, or autograd.grad's results)."""

    @staticmethod
    def forward(
        ctx: Any, light: _Light, outputs: list, n: int, _anchor: torch.Tensor, *tensors: Any
    ) -> tuple:
        ctx.light, ctx.params = light, tensors[n : len(tensors) - len(light.extra)]
        ctx.save_for_backward(*tensors[:n])
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        # Grad on: a backward with create_graph, whose gradients a second backward goes through; the
        # call then runs on its inputs themselves, so the gradients' graph reaches back past them.
        create = torch.is_grad_enabled()
        light = ctx.light
        if light.graphs is not None and not create and grads[0] is not None:
            (x,) = ctx.saved_tensors
            got = light.graphs.backward(light, x, grads[0], ctx.params)
            if got is not None:
                if light.alive is not None:
                    light.alive.through(None)
                return (None, None, None, None, got[0] if x.requires_grad else None, *got[1:])
        inputs = [x if create else x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        outputs = light.again(inputs)
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        # each tensor once (under create_graph an input passed twice, or a parameter passed as an
        # input, is one tensor: autograd.grad would give it its whole gradient at each place)
        slots = {id(x): x for x in (*inputs, *ctx.params) if x.requires_grad}
        wrt = list(slots.values())
        got = dict.fromkeys(slots)
        per_use = _PerUse(light, inputs, outputs) if light.extra and not create else None
        if pairs and wrt:
            outs, gs = [o for o, _ in pairs], [g for _, g in pairs]
            try:
                got.update(
                    zip(slots, torch.autograd.grad(outs, wrt, gs, allow_unused=True, create_graph=create))
                )
            finally:
                if per_use is not None:
                    per_use.remove()
        if light.alive is not None:
            light.alive.through(None)  # backward is through the call (a second one is the pool's no more)
        if per_use is not None:
            if per_use.complete():
                params = (got.get(id(w)) for w in ctx.params)
                return (None, None, None, None, *per_use.first(), *params, *per_use.rest())
            tracker = light.tracker()
            if tracker is not None:
                tracker.split_misses += 1  # (summed: the rounding may differ from plain; stats())
        extra = [None] * len(light.extra)
        return (None, None, None, None, *(got.pop(id(x), None) for x in (*inputs, *ctx.params)), *extra)


class _PerUse:
    """Each use's gradient of a light call's inputs, caught as the replay's backward runs (the hook of
    each node that reads an input: consumers), for _LightFn's slots, in the order autograd runs them."""

    def __init__(self, light: _Light, inputs: list[torch.Tensor], outputs: list[torch.Tensor]):
        self.light, self.handles = light, []
        self.wanted = [x.requires_grad for x in inputs]
        self.got: list[list] = [[] for _ in inputs]
        uses = consumers(inputs, outputs)
        self.expected = light.uses if uses is not None and tuple(len(u) for u in uses) == light.uses else None
        if self.expected is None:
            return
        by_node: dict[int, tuple[Any, list]] = {}
        for j, us in enumerate(uses):
            for node, i in us:
                by_node.setdefault(id(node), (node, []))[1].append((i, j))
        for node, edges in by_node.values():
            self.handles.append(node.register_hook(self._catch(edges)))

    def _catch(self, edges: list[tuple[int, int]]) -> Any:
        got = self.got

        def hook(grad_inputs: tuple, _grad_outputs: tuple) -> None:
            for i, j in sorted(edges):  # (one node's edges: autograd adds them in edge order)
                got[j].append(grad_inputs[i])

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def complete(self) -> bool:
        return self.expected is not None and all(len(g) == n for g, n in zip(self.got, self.expected))

    def first(self) -> list:
        return [g[0] if g and wanted else None for g, wanted in zip(self.got, self.wanted)]

    def rest(self) -> list:
        k = [1] * len(self.got)
        out = []
        for j in self.light.extra:
            out.append(self.got[j][k[j]])
            k[j] += 1
        return out


_RAW_APPLY = tp.FUNCTION_APPLY.__get__(None, _LightFn)


def _light_apply(*args: Any) -> tuple:
    """_LightFn.apply without its Python wrapper where no functorch transform is active: the wrapper
    looks at each argument (with a block's 9 parameters 19.5 against 9.4 us on this repository's CPU;
    on an H100's host the apply took 80 us of a light call's ~235, in a forward the host bounds)."""
    if tp.functorch_transforms_active():
        return _LightFn.apply(*args)
    return _RAW_APPLY(*args)


class _Input:
    """A region's tensor input, held by the pool (an entry it may offload) for a replay. The replay
    gets it detached, with the requires_grad it had: what an op saves depends on it."""

    __slots__ = ("packed", "requires_grad")

    def __init__(self, pool: PoolInternals, x: torch.Tensor):
        self.packed = pool._pack_tensor(x, saved=False)
        self.requires_grad = x.requires_grad

    def get(self, pool: PoolInternals) -> torch.Tensor:
        return pool._unpack_input(self.packed).detach().requires_grad_(self.requires_grad)


class _Call:
    """Profiling step: one module call, and the bytes saved during it that it made itself."""

    __slots__ = ("module", "input_ptrs", "own_bytes", "outside", "children", "held")

    def __init__(self, module: torch.nn.Module, args: tuple):
        self.module = module
        self.input_ptrs = {_storage_ptr(x) for x in _tensors(args)}
        self.held: str | None = None  # held_state of its arguments: not a region, its children may be
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


def choose_regions(roots: list[_Call], refused: Any = None) -> set[torch.nn.Module]:
    """The modules whose calls are regions; `refused` (a dict) gets the calls that would have been
    chosen but take state (held_state), with why."""
    total = sum(c.own_bytes for c in roots) or 1
    chosen: set[torch.nn.Module] = set()

    def visit(c: _Call, top: bool) -> None:
        if c.own_bytes <= 0:
            return
        kids = [k for k in c.children if k.own_bytes > 0]
        if not top and c.held is not None and refused is not None and c.module not in refused:
            refused[c.module] = _takes_state(c.held)
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
        # the uses of each tensor input in a module's verified call (consumers); None where unknown:
        # such a module never runs light
        self.uses: weakref.WeakKeyDictionary[torch.nn.Module, tuple | None] = weakref.WeakKeyDictionary()
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
        return (
            torch.is_grad_enabled() and pool._active_here() and not getattr(self._local, "replaying", False)
        )

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
        if pool._resting:  # (PlanRunner._rests) a call unlike the recorded step's wakes it
            if self._capturing(pool):
                pool._rest_call((id(module), _kind(module, args, kwargs)))
            return
        pool._own(self._pre_call, module, args, kwargs, pool)

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
        if module not in self.refused and (held := held_state((args, kwargs))) is not None:
            self.refuse(module, _takes_state(held))
        start = pool._region_start()
        if start is None:
            return
        light_ok = self.uses.get(module, ()) is not None and module not in self.refused
        unseen, hooks = pool._unseen_call(start, light_ok, False), None  # (run light: no hooks to know)
        if unseen is None:
            hooks = _pool_hooks(pool, args)
            if hooks is not None:
                unseen = pool._unseen_call(start, False, True)
        if unseen is not None:
            light, end, lean = unseen
            if light:
                self._light(module, args, kwargs, pool, end)
            else:
                tp.pop_saved_hooks()  # Plan.bypass: autograd keeps them
                if lean is not None:  # but for those the plan drops (Plan.drops)
                    tp.push_saved_hooks(lean.pack, lean.unpack)
                self._local.__dict__.setdefault("unseen", []).append((module, hooks, end, lean))
            return
        if hooks is None and pool._rec is not None and pool._rec.full:
            pool._rec.no_bypass.add(start)  # (nothing would tell when backward is through it)
        kind = self._kind[id(module)] = _kind(module, args, kwargs)
        pool._note_call((id(module), kind))
        cost = self._costs.setdefault(kind, [0.0, 0, [], 0])
        timed = cost[3] < COST_SAMPLES
        cost[3] += timed
        region = Region(module, args, kwargs, pool, timed)
        region.start = start
        self._stack().append(region)

    def _light(
        self, module: torch.nn.Module, args: tuple, kwargs: dict, pool: PoolInternals, end: int
    ) -> None:
        """The call runs with grad off (Plan.light): autograd builds no graph in it and saves nothing;
        at its end `_Light` gives its outputs one node, whose backward calls it again with grad on and
        backpropagates through that call (reentrant checkpointing). Non-reentrant checkpointing, which
        this replaced, builds the graph and hands each save to hooks of its own: on an H100 ResNet-152
        with every block so took 1.89x native against 1.31x (host 143 ms a step against 75)."""
        light = _Light(CallState(pool.device, module))
        # The arguments as the call got them: a pre-hook of the user's, which runs after this one,
        # runs with grad off too, and again in the replay; the node must start from its inputs.
        light.call = (args, kwargs)
        light.uses = self.uses.get(module)
        self._local.__dict__.setdefault("unseen", []).append((module, light, end, None))
        tp.set_grad_enabled(False)

    def _post(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """The call's output, or what replaces it (a call run with grad off: its outputs with a node)."""
        pool = self._pool()
        if pool is not None and pool._resting and not getattr(self._local, "unseen", None) and not self.top():
            return None  # (resting: nothing to undo, unless the call began before the rest did)
        if pool is None:
            return self._post_call(module, args, kwargs, output)  # (the hooks a call popped go back still)
        return pool._own(self._post_call, module, args, kwargs, output)

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
                pool._unseen_outputs(_tensors(output), light=not bypassed)
                if bypassed:  # its kept saves count until backward is through the call (or its graph dies)
                    alive = _Alive(pool, pool._unseen_bytes(end) - (lean.dropped_bytes if lean else 0))
                    for x in _tensors(args):
                        if x.grad_fn is not None:  # (a leaf would keep each step's hook)
                            x.register_hook(alive.through)
                pool._unseen_done(end, not bypassed, lean)
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
        if pool is not None and region.finish(pool):
            verified = (id(module), self._kind[id(module)]) in self._verified
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
                    elif not verified and self.uses.get(module, ()) is not None:  # (unknown stays)
                        uses = consumers(_tensors(call), _tensors(output))
                        self.uses[module] = None if uses is None else tuple(len(u) for u in uses)
            if self.uses.get(module, ()) is None and pool._rec is not None and pool._rec.full:
                pool._rec.no_light.add(region.start)
            pool._region_done(region, _tensors(output))

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
        c = self._costs.get(self._kind.get(id(module)))
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


def _start_timer(pool: PoolInternals) -> Any:
    """GPU: CUDA events on the compute stream (copies run on side streams). CPU: the host clock, less
    the time the pool itself spent inside the call (its synchronous copies are not the module's)."""
    if pool.cuda:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return ("cuda", start, None)
    return ("cpu", time.perf_counter() + pool._busy_s, None)


def _stop_timer(timer: Any, pool: PoolInternals) -> Any:
    kind, start, _ = timer
    if kind == "cuda":
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return (kind, start, end)
    return (kind, start, time.perf_counter() + pool._busy_s)


def _read_timer(timer: Any) -> float | None:
    kind, start, end = timer
    if kind == "cpu":
        return end - start
    if not end.query():
        return None
    return start.elapsed_time(end) / 1e3


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
