"""A pool entry: one tensor autograd saved for backward, and where its bytes are now.

States are treatment-neutral; the entry's `treatment` (Offload, Recompute, ...) says what they mean:

    resident   the pool holds the device tensor
    leaving    on its way off the device (an offload copy in flight); the device tensor is gone
    away       off the device: only the treatment's payload remains (a host copy, a recipe, ...)
    returning  on its way back (a copy in flight into a new device tensor, which the entry holds)

Invariants (Pool.check): an entry holds a device tensor iff it is resident or returning; an entry that
is not resident has a treatment, whose own `check` holds (Offload: a host block of the span's size;
Recompute: a recipe); the pool's device-bytes counter equals the bytes of entries holding a device
tensor plus the device payloads of the others; the LRU list names live resident entries only.
"""

from __future__ import annotations

import enum
import weakref
from typing import TYPE_CHECKING, Any

import torch

from .. import torch_private as tp

if TYPE_CHECKING:
    from .port import PoolInternals, TreatmentLike
    from .step import Step


class State(enum.Enum):
    RESIDENT = "resident"
    LEAVING = "leaving"
    AWAY = "away"
    RETURNING = "returning"


class Entry:
    __slots__ = (
        "__weakref__",
        "_pool",
        "seq",
        "nbytes",
        "shape",
        "stride",
        "extent",
        "dtype",
        "tensor",
        "treatment",
        "payload",
        "event",
        "state",
        "last_use",
        "key",
        "source",
        "version",
        "watch",
        "step",
        "ordinal",
        "recipe",
        "readers",
        "made_by",
    )

    def __init__(self, pool: PoolInternals, seq: int, tensor: torch.Tensor, key: tuple, step: Step):
        self._pool = weakref.ref(pool)
        self.seq = seq  # pack order, over all steps
        self.shape = tensor.shape
        self.stride = tensor.stride()
        self.extent = storage_extent(tensor)
        self.dtype = tensor.dtype
        self.nbytes = self.extent * tensor.element_size()
        self.tensor: torch.Tensor | None = _graphless(tensor)
        self.treatment: TreatmentLike | None = None  # what holds it while not resident
        self.payload: Any = None  # the treatment's (a host block, compressed bytes, ...)
        self.event: torch.cuda.Event | None = None  # end of the copy in flight (either direction)
        self.state = State.RESIDENT
        self.last_use = 0
        self.key = key
        self.source = weakref.ref(tensor)  # the saved tensor object, to recognise it when saved again
        self.version = tensor._version  # checked at unpack, as autograd does without hooks
        self.watch: torch.Tensor | None = None  # shares the saved tensor's version counter, no storage
        self.step = step  # the step (forward + backward) it was saved in
        step.ordinals += 1
        self.ordinal = step.ordinals  # its place in that step
        self.recipe: Any = None  # how to rebuild it on the device (region, cast, op replay), if any
        self.readers: list | None = None  # weakrefs to entries whose op replay reads this one
        fn = tensor.grad_fn
        self.made_by = "" if fn is None else type(fn).__name__  # the op that made it (its node's name)

    @property
    def device_tensor(self) -> torch.Tensor:
        """`tensor`, read where the entry holds it: resident or returning (the module's invariants)."""
        if self.tensor is None:
            raise RuntimeError(f"supermem pool: {self!r} holds no device tensor")
        return self.tensor

    @property
    def left_by(self) -> TreatmentLike:
        """`treatment`, read where the entry left the device (it keeps it after it comes back)."""
        if self.treatment is None:
            raise RuntimeError(f"supermem pool: {self!r} never left the device")
        return self.treatment

    def device_span(self) -> torch.Tensor:
        """The device tensor's storage span, flat: what a copy moves."""
        return self.device_tensor.as_strided((self.extent,), (1,))

    def from_span(self, span: torch.Tensor) -> torch.Tensor:
        """The tensor again, with its exact shape and strides, over a restored span."""
        return span.as_strided(self.shape, self.stride)

    def watch_version(self) -> None:
        """The device tensor is about to go: keep watching its version counter without its memory."""
        if self.watch is None and self.tensor is not None:
            self.watch = version_watcher(self.tensor)

    def __del__(self) -> None:
        pool = self._pool()
        if pool is not None:
            pool.release(self)

    def __repr__(self) -> str:
        how = f" by {self.treatment.name}" if self.treatment is not None else ""
        return f"Entry(seq={self.seq}, {self.state.value}{how}, {self.nbytes} bytes)"


def _graphless(t: torch.Tensor) -> torch.Tensor:
    """`t` without its autograd graph (same storage, same version counter), what a saved tensor is kept
    as. Kept with its grad_fn, a tensor its own op saved (tanh's, relu's output) held that op's node,
    which held the saved tensor: a cycle through autograd's C++ that the garbage collector cannot see,
    so a forward whose backward never ran kept its saved tensors, and the pool, for good. Autograd
    gives the unpacked tensor its place in the graph again."""
    return t if t.grad_fn is None else t.detach()


def storage_extent(t: torch.Tensor) -> int:
    """Elements from the tensor's first to its last element in storage. The pool moves this span,
    not the elements one by one: the tensor comes back with its exact strides (elementwise kernels
    take other code paths, with other rounding, for other layouts), expanded tensors move once,
    and a span is one contiguous DMA."""
    if t.is_contiguous():
        return t.numel()
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


class Kept:
    """A saved tensor the pool leaves where it is (small, a parameter, a leaf input), with the version
    it had when saved: autograd skips its own check when saved-tensor hooks are on, so the pool does it."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = _graphless(tensor)
        self.version = tensor._version

    def unpack(self) -> torch.Tensor:
        _check(self.tensor, self.tensor._version, self.version, self.tensor.shape)
        return self.tensor


class PlanKept(Kept):
    """A saved tensor the running plan keeps on the device and no planned rebuild reads: no entry,
    only its place in the step (its ordinal, for the plan's events) and its bytes (the budget's count).
    About a third of an entry's host cost per saved tensor, which is most of a pool step's overhead
    where the step is host-bound."""

    __slots__ = ("_pool", "ordinal", "nbytes", "step", "key", "source", "__weakref__")

    def __init__(
        self, pool: PoolInternals, tensor: torch.Tensor, ordinal: int, nbytes: int, step: Step, key: tuple
    ):
        super().__init__(tensor)
        self._pool = weakref.ref(pool)
        self.ordinal = ordinal
        self.nbytes = nbytes
        self.step = step
        self.key = key
        self.source = weakref.ref(tensor)

    def __del__(self) -> None:
        pool = self._pool()
        if pool is not None:
            pool.plans.release_kept(self)


def check_version(e: Entry) -> None:
    """Raises autograd's own error if the saved tensor was changed in place after it was saved."""
    holder = e.watch if e.watch is not None else e.tensor
    if holder is not None:
        _check(holder, holder._version, e.version, e.shape)


def _check(t: torch.Tensor, now: int, saved: int, shape: torch.Size) -> None:
    if now != saved:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{t.type()} {list(shape)}] is at version {now}; expected version {saved} "
            "instead. Hint: it was saved for backward under supermem's tensor pool; the operation "
            "that changed it in place ran after it was saved (autograd's anomaly detection can find it)."
        )


def version_watcher(t: torch.Tensor) -> torch.Tensor:
    """A tensor without storage that shares `t`'s version counter (detach() shares it; `.data =`
    swaps in an empty tensor's storage and keeps the counter, unbumped). It lets the pool check a
    saved tensor's version after the pool let go of its memory. Not set_(): that bumps the counter
    for a moment, and another thread checking `t` then reads a change no one made."""
    w = tp.detach_sharing_version(t)
    key = (t.dtype, t.device)
    empty = _EMPTY.get(key)
    if empty is None:
        empty = _EMPTY.setdefault(key, torch.empty(0, dtype=t.dtype, device=t.device))
    w.data = empty
    return w


_EMPTY: dict[tuple, torch.Tensor] = {}  # one storage-less tensor per (dtype, device) for the watchers


def _set_version(t: torch.Tensor, version: int) -> None:
    tp.set_versions((t,), (version,))


def movable(t: torch.Tensor) -> bool:
    """Plain strided tensors with ordinary storage. Sparse, nested, meta, quantized and MKL-DNN
    tensors, subclasses (wrappers, FakeTensor) and functorch-wrapped tensors pass through untouched."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return False
    if t.layout is not torch.strided or t.is_nested or t.is_meta or t.is_quantized or t.is_mkldnn:
        return False
    return not tp.is_functorch_wrapped(t)


def alive_anyway(t: torch.Tensor) -> bool:
    """Parameters and leaf inputs (and views of them) stay alive through the step: moving them
    would free nothing."""
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


def dedup_key(t: torch.Tensor) -> tuple:
    """A saved tensor's identity for the pool (saved twice, one entry); data_ptr: storage + offset."""
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t._version)


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same layout and the same bits (torch.equal calls -0.0 and 0.0 equal, and NaN unequal to itself)."""
    if (a.shape, a.stride(), a.dtype, a.device) != (b.shape, b.stride(), b.dtype, b.device):
        return False
    if a.is_floating_point() and a.element_size() in _SAME_SIZE_INT:
        it = _SAME_SIZE_INT[a.element_size()]
        return torch.equal(a.view(it), b.view(it))
    return torch.equal(a, b)
