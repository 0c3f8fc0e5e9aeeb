"""State a call takes beside its values, frozen at the call so that a replay sees what the call saw.

A Hugging Face decoder's training forward builds a KV cache and hands it to every layer, which
appends its keys and values to it. A replay handed the same cache saw the keys of the whole forward
and appended its own again (a crash, or on Llama other gradients without a word). So at the call each
argument that is not a value is frozen: the contents of its objects, lists and dicts copied as they
are then, each tensor inside them kept as its shape alone. A replay gets a fresh thaw of that copy:
it reads the state the call read and changes only its own copy; the live object is never touched,
and the copy holds no memory of the step (no large tensor, no reference to the live objects).

A tensor inside the state thaws to a tensor of its shape on the meta device: a replay may read its
shape (a cache's length), never its values. One of SMALL bytes or fewer that needs no grad (the
window a sliding-window cache keeps as a tensor, a scalar) is copied whole and thaws to a copy. A
replay that reads the values of another (a static cache, written in place and read whole) raises on
the meta tensor or saves other tensors at the verification replay of the module's first call
(region.py): it is then refused.

Two more guards (regions.py). A module's replay is verified again for a call whose state holds more
tensors than the one verified (`signature`: a cache carried into a second chunk, whose layers read the
first chunk's keys). And a call that puts tensors needing grad into its state (`written`: a cache's
keys) runs light, with grad off, only where no use outside the call reads them (outside_uses.py): they
would stay there without a graph.

What cannot be frozen, the call is never replayed: an object without a plain `__dict__` (a C type, a
class with `__slots__`) or with a `__new__` of its own, a module, a method or other callable bound to
state, or state over LIMIT objects.
"""

from __future__ import annotations

import collections
import enum
import types
from typing import Any

import torch

from .. import torch_private as tp

LIMIT = 4096  # objects, lists, dicts and tensors one argument may hold
DEPTH = 100  # how deep they may nest (a thaw in backward recurses as deep, on a deeper stack)
SMALL = 256  # bytes: a tensor this small is copied whole

_VALUES = (
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
# held by reference: immutable, or code (a function or class a cache keeps as a factory)
_SHARED = (*_VALUES, type, types.FunctionType, types.BuiltinFunctionType)


_VALUE_TYPES = (torch.Tensor, *_VALUES)


def is_value(x: Any) -> bool:
    return isinstance(x, _VALUE_TYPES)


class CannotFreeze(Exception):  # noqa: N818  (the reason a call's state cannot be frozen)
    pass


class Frozen:
    """One argument as it was at the call (`freeze`); `thaw()` gives a fresh copy of it for a replay.
    `tensors`: how many tensors it holds; `before`: those tensors themselves, until the call's
    verification has compared them with the state after the call (`written`), then None."""

    __slots__ = ("node", "tensors", "before")

    def __init__(self, node: Any, tensors: int, before: list | None):
        self.node, self.tensors, self.before = node, tensors, before

    def thaw(self) -> Any:
        return _thaw(self.node, {})


def freeze(x: Any, copy: bool = True) -> Frozen:
    """`x` frozen (module docstring); raises CannotFreeze with why not. Not `copy`: only whether it
    can be (no small tensor copied)."""
    walk = _Freezer(copy)
    node = walk.node(x, 0)
    return Frozen(node, walk.tensors, walk.seen if copy else None)


class _Freezer:
    def __init__(self, copy: bool) -> None:
        self.copy = copy
        self.memo: dict[int, Any] = {}  # id(object) -> its node: one object held twice thaws once
        self.keep: list[Any] = []  # (the objects walked, alive while their ids key memo)
        self.seen: list[torch.Tensor] = []  # the tensors
        self.tensors = 0

    def node(self, x: Any, depth: int) -> Any:
        if isinstance(x, _SHARED):
            return ("v", x)
        got = self.memo.get(id(x))
        if got is not None:
            return got
        if depth > DEPTH:
            raise CannotFreeze(f"it nests over {DEPTH} deep")
        if isinstance(x, torch.Tensor):
            self.tensors += 1
            self._count()
            self.seen.append(x)
            # (a copy of one that needs grad would cut its gradient in a light call's backward: it goes
            # as a shape, and a replay that reads it is refused)
            small = x.numel() * x.element_size() <= SMALL and x.layout == torch.strided
            if small and self.copy and not x.requires_grad:
                node: Any = ("c", x.detach().clone())
            else:
                node = ("t", tuple(x.shape), x.stride(), x.dtype, x.requires_grad and x.is_floating_point())
            self._remember(x, node)
            return node
        self._count()
        depth += 1
        cls = type(x)
        if cls in (list, tuple, set, frozenset) or (cls.__bases__ == (tuple,) and hasattr(cls, "_fields")):
            node = ["s", cls, None]
            self._remember(x, node)
            node[2] = [self.node(y, depth) for y in x]
            return node
        if cls in (dict, collections.OrderedDict):
            node = ["d", cls, None]
            self._remember(x, node)
            node[2] = [(self.node(k, depth), self.node(v, depth)) for k, v in x.items()]
            return node
        if isinstance(x, torch.nn.Module):
            raise CannotFreeze(f"it holds a module ({cls.__name__})")
        if isinstance(x, (dict, list, tuple, set, frozenset)):
            raise CannotFreeze(f"a {cls.__name__} is a container of its own kind")
        state = getattr(x, "__dict__", None)
        if type(state) is not dict or any(k.__dict__.get("__slots__") for k in cls.__mro__[:-1]):
            raise CannotFreeze(f"a {cls.__name__} has no plain __dict__ to copy")
        if cls.__new__ is not object.__new__:  # (a C type's, functools.partial's: a thaw could not make one)
            raise CannotFreeze(f"a {cls.__name__} is made by a __new__ of its own")
        node = ["o", cls, None]
        self._remember(x, node)
        node[2] = [(k, self.node(v, depth)) for k, v in state.items()]
        return node

    def _remember(self, x: Any, node: Any) -> None:
        self.memo[id(x)] = node
        self.keep.append(x)

    def _count(self) -> None:
        if len(self.keep) > LIMIT:
            raise CannotFreeze(f"it holds over {LIMIT} objects")


def _thaw(node: Any, made: dict[int, Any]) -> Any:
    kind = node[0]
    if kind == "v":
        return node[1]
    got = made.get(id(node))  # (one object or tensor held twice: one thawed, held twice)
    if got is not None:
        return got
    if kind == "t":
        _, shape, stride, dtype, grad = node
        t = torch.empty_strided(shape, stride, dtype=dtype, device="meta", requires_grad=grad)
        made[id(node)] = t
        return t
    if kind == "c":
        made[id(node)] = t = node[1].clone()
        return t
    _, cls, items = node
    if kind == "o":
        obj = cls.__new__(cls)
        made[id(node)] = obj
        obj.__dict__.update((k, _thaw(v, made)) for k, v in items)
        return obj
    if kind == "d":
        d = cls()
        made[id(node)] = d
        d.update((_thaw(k, made), _thaw(v, made)) for k, v in items)
        return d
    if cls is list:
        out: list[Any] = []
        made[id(node)] = out
        out.extend(_thaw(v, made) for v in items)
        return out
    values = [_thaw(v, made) for v in items]  # (a tuple or set cannot hold itself but through another)
    return cls(*values) if hasattr(cls, "_fields") else cls(values)


def freeze_call(call: tuple[tuple, dict], copy: bool = True) -> tuple[tuple[tuple, dict], str | None]:
    """The call's (args, kwargs) with each argument that is not a value (nor a tuple, list or dict of
    values) frozen; and None, or why one cannot be: the call is then never replayed. Not `copy`: only
    the why (freeze's)."""
    if _values_only(call):
        return call, None
    leaves, spec = tp.tree_flatten(call)
    if all(is_value(x) for x in leaves):
        return call, None
    out = []
    for x in leaves:
        if is_value(x):
            out.append(x)
            continue
        try:
            out.append(freeze(x, copy))
        except CannotFreeze as e:
            return call, f"its call takes a {type(x).__name__}, state a replay would see changed: {e}"
    return tp.tree_unflatten(out, spec), None


def _values_only(call: tuple[tuple, dict]) -> bool:
    """Most calls: tensors and values (a mask, a flag, None), nothing to walk."""
    args, kwargs = call
    values = _VALUE_TYPES
    return all(isinstance(a, values) for a in args) and all(isinstance(v, values) for v in kwargs.values())


def thawed(leaves: list) -> list:
    """A call's flat arguments for a replay: each frozen one thawed afresh."""
    return [x.thaw() if isinstance(x, Frozen) else x for x in leaves]


_VERDICTS: dict[type, str | None] = {}  # per type of state, the first freeze_call's why (held_state)
# The exact types of most arguments: a set lookup, where isinstance against _VALUE_TYPES tries each
# (torch.Tensor's and Enum's checks are Python's: ~0.35 us for an argument that is none of them).
_EXACT_VALUES = frozenset({torch.Tensor, torch.nn.Parameter, *(t for t in _VALUES if t is not enum.Enum)})


def held_state(call: tuple[tuple, dict]) -> str | None:
    """Why a call's (args, kwargs) could not be frozen, or None, from the first verdict on each type of
    state in it: the trace and the profiling step ask at every module call (a 12-layer KV cache took
    ~0.1 ms to walk), and a call captured for replay freezes what it got all the same (freeze_call)."""
    args, kwargs = call
    for top in (*args, *kwargs.values()):  # (tree_leaves(call), in its order, without a walk of values)
        cls = type(top)
        if cls in _EXACT_VALUES:
            continue
        if cls in _VERDICTS:  # (a type with a verdict is a leaf: only leaves get one)
            if _VERDICTS[cls] is not None:
                return _VERDICTS[cls]
            continue
        if isinstance(top, _VALUE_TYPES):
            continue
        if cls is tuple and all(isinstance(v, _VALUE_TYPES) for v in top):  # (RoPE's cos and sin)
            continue
        for x in (top,) if tp.tree_is_leaf(top) else tp.tree_leaves(top):
            if is_value(x):
                continue
            cls = type(x)
            if cls not in _VERDICTS:
                _VERDICTS[cls] = freeze_call(((x,), {}), copy=False)[1]
            if _VERDICTS[cls] is not None:
                return _VERDICTS[cls]
    return None


def signature(leaves: list) -> tuple[int, ...]:
    """How many tensors each frozen argument of a call holds: a call whose state holds more than the
    one its module's replay was verified on (a cache carried over from an earlier chunk, whose keys
    a later layer reads) is verified again."""
    return tuple(x.tensors for x in leaves if isinstance(x, Frozen))


def release(leaves: Any) -> None:
    """The frozen arguments among `leaves` let go of the tensors their state held at the call."""
    for x in leaves:
        if isinstance(x, Frozen):
            x.before = None


def written(leaves: list, live: list) -> list[torch.Tensor]:
    """The tensors needing grad the call put into its state (`live`: its arguments' leaves, as
    `leaves` are the frozen ones): what a light call, run with grad off, would leave there without a
    graph. Lets go of each frozen argument's `before`."""
    out: list[torch.Tensor] = []
    for x, y in zip(leaves, live):
        if not isinstance(x, Frozen) or x.before is None:
            continue
        before = {id(t) for t in x.before}
        walk = _Freezer(copy=False)
        try:
            walk.node(y, 0)
        except CannotFreeze:
            pass  # (what it walked counts)
        out += [t for t in walk.seen if id(t) not in before and t.grad_fn is not None]
        x.before = None
    return out
