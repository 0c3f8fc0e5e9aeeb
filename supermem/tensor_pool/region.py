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
the call may read or change) is replayed on a copy of that state as it was at the call (held.py: a
Hugging Face decoder layer given the cache its training forward builds); where it cannot be copied,
the call is never a region and its children are chosen instead. And the first call of each module at
each kind is replayed at once, its saves matched bitwise against the call's own (the replay that
times it): a module whose replay differs is refused for good, named in one warning.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from .. import torch_private as tp
from ..log import warn
from .call_state import CallState
from .entry import Entry, State, _set_version, bitwise_equal
from .held import thawed

# the saved-tensor hooks on top of this thread's stack (Plan.bypass takes the pool's off around a call)
_top_hooks = tp.top_saved_hooks
_rebuilding = threading.local()  # .depth: this thread's rebuilds bringing back their arguments now

if TYPE_CHECKING:
    from .port import PoolInternals

MAX_SHARE = 0.25  # a call saving more than this share of a step's bytes is split into its children
COST_SAMPLES = 3  # calls timed per kind of call (each with a timed replay); the least prices it


class _Stop(Exception):  # noqa: N818  every dropped tensor of the region is back: end the replay
    pass


_WARNED: set[tuple[str, str]] = set()


def _refusal_warning(module: torch.nn.Module, why: str) -> None:
    """One warning per kind of module and reason, per process."""
    name = type(module).__name__
    if (name, why) in _WARNED:
        return
    _WARNED.add((name, why))
    warn(
        f"supermem: {name} is not recomputed as one call: {why}. The pool recomputes its parts where "
        "they are pure calls and keeps or offloads the rest; training is unchanged.",
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
        "sig",
        "__weakref__",
    )

    def __init__(self, module: torch.nn.Module, call: tuple[tuple, dict], pool: PoolInternals, timed: bool):
        """`call`: its (args, kwargs), state in them frozen (held.freeze_call)."""
        self.module = module
        self.inputs = [(x, x._version) for x in _tensors(call)]
        self.input_ptrs = {_storage_ptr(x) for x, _ in self.inputs}
        self.args: Any = call  # raw until finish() packs them
        self.state = CallState(pool.device, module)  # RNG, autocast, attention backends, the module
        self.slots: list[weakref.ref[Entry] | None] = []  # one per tensor saved, in save order
        # (slot, entry) of each entry the call made, once: its own (this region their recipe) and those
        # another recipe rebuilds (an op replay, a weight cast), which a replay brings back as well
        self.made: tuple[tuple[int, weakref.ref[Entry]], ...] = ()
        self.ready = False
        self.timing: Any = _start_timer(pool) if timed else None
        self.start = 0  # its step's saves before the call (StepClock.region_start)
        self.sig: tuple[int, ...] = ()  # the state it took, as held.signature: () for none
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
        own: list[Entry] = []
        made: list[Entry] = []
        slots: list[tuple[int, weakref.ref[Entry]]] = []
        for k, ref in enumerate(self.slots):
            if ref is None:
                continue
            e = ref()
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
            if changed or self.start not in pool.plans.captures():
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
        in_use = pool.ledger.in_use
        want = {
            k: x
            for k, ref in self.made
            if (x := ref()) is not None
            and x.state is State.AWAY
            and (x.recipe is self or (x.left_by.rebuilds and not any(x is y for y in in_use)))
        }
        if not want:
            return
        depth = getattr(_rebuilding, "depth", 0)
        _rebuilding.depth = depth + 1
        try:
            args, kwargs = self.replay_args(pool)  # (an input dropped too is rebuilt here: nested)
        finally:
            _rebuilding.depth = depth
        # Room for what comes back, but for its inputs and the entries the call made (the replay makes
        # them anyway); not in a rebuild nested in another's arguments (it would move those of the
        # outer one it brought back already)
        if depth == 0:
            spare = [x.packed for x in self.args[0] if isinstance(x, _Input)]
            spare += [x for _, ref in self.made if (x := ref()) is not None]
            pool.room_for(sum(x.nbytes - x.left_by.device_bytes(x) for x in want.values()), spare)
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
            x.left_by.arrived(pool, x)  # e.g. compressed: its payload goes
            if not want:
                raise _Stop
            return None

        try:
            with (
                _Replaying(self.state, self.module, False),
                torch.autograd.graph.saved_tensors_hooks(pack, _NO_UNPACK),
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
        return tp.tree_unflatten(thawed([x.get(pool) if isinstance(x, _Input) else x for x in leaves]), spec)

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
        leaves = thawed(
            [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in leaves]
        )
        args, kwargs = tp.tree_unflatten(leaves, spec)
        try:
            with (
                _Replaying(self.state, self.module, not check),
                torch.autograd.graph.saved_tensors_hooks(pack, _NO_UNPACK),
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
    its outputs back to its inputs) that reaches it. None: an input given twice, an input handed back as
    an output (a T5 block returns the position bias it was given: run light, its node would stand
    between that tensor and the next blocks' uses, whose gradients then summed in another order), or
    a walk over `limit` nodes (the graph leaves the call through a tensor that is not an argument).

    Why it matters: a light call's node hands back each input's gradient, and autograd adds it to the
    input's other uses. Summed over the call's uses first, r + (a + b), it rounds otherwise than plain
    autograd, which adds each use as it comes, (r + a) + b (a Llama's RMSNorm, whose input the residual
    add reads too, trained 1 ulp off from step 6). So the node takes such an input once per use and
    hands back each use's gradient in its own slot (_LightFn): autograd adds them in plain order."""
    # The inputs' nodes are held through the walk: a C++ node's Python object lives only while something
    # holds it (torch 2.11; 2.13 keeps it), and one made again later may sit at another address, so a
    # key by id() of an object let go would not match (a Llama's norms read 0 uses on an H200: their
    # gradients were summed in the call, 1 ulp off plain from the first light step).
    if any(o is x for o in outputs for x in inputs):
        return None
    fns = [x.grad_fn for x in inputs]
    at: dict[Any, int] = {}
    for j, (x, fn) in enumerate(zip(inputs, fns)):
        key = (id(fn), x.output_nr) if fn is not None else id(x)
        if key in at:
            return None
        at[key] = j
    stop = {id(fn) for fn in fns if fn is not None}
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
            input_at = at.get((id(nxt), nr), at.get(id(var)) if var is not None else None)
            if input_at is not None:
                found[input_at].append((node, i))
            elif id(nxt) not in stop:
                stack.append(nxt)
    return found


def _none(*_: Any) -> None:
    """Nothing: an unpack hook with nothing to give back, a pack hook that drops, a dead weakref."""
    return None


# an unpack hook never run (a replay's graph is dropped unused), where torch's stubs want one giving a Tensor
_NO_UNPACK: Any = _none


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


def _submodules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The module and its children, by a plain walk: module.parameters() / .buffers() and their
    named-member generators cost a light call ~35 us on this CPU, a replay of a tiny GPT block ~10."""
    out, stack = [], [module]
    while stack:
        m = stack.pop()
        out.append(m)
        stack.extend(c for c in m._modules.values() if c is not None)
    return out


class _Input:
    """A region's tensor input, held by the pool (an entry it may offload) for a replay. The replay
    gets it detached, with the requires_grad it had: what an op saves depends on it."""

    __slots__ = ("packed", "requires_grad")

    def __init__(self, pool: PoolInternals, x: torch.Tensor):
        self.packed = pool.pack_tensor(x, saved=False)
        self.requires_grad = x.requires_grad

    def get(self, pool: PoolInternals) -> torch.Tensor:
        return pool.unpack_input(self.packed).detach().requires_grad_(self.requires_grad)


def _start_timer(pool: PoolInternals) -> Any:
    """GPU: CUDA events on the compute stream (copies run on side streams). CPU: the host clock, less
    the time the pool itself spent inside the call (its synchronous copies are not the module's)."""
    if pool.cuda:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return ("cuda", start, None)
    return ("cpu", time.perf_counter() + pool.busy_s, None)


def _stop_timer(timer: Any, pool: PoolInternals | None) -> Any:
    """`pool`: None where it was collected during the call (Regions._post_call runs on)."""
    kind, start, _ = timer
    if kind == "cuda":
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return (kind, start, end)
    return (kind, start, time.perf_counter() + (pool.busy_s if pool is not None else 0.0))


def _read_timer(timer: Any) -> float | None:
    kind, start, end = timer
    if kind == "cpu":
        return end - start
    if not end.query():
        return None
    return start.elapsed_time(end) / 1e3
