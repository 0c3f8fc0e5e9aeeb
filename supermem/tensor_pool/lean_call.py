"""A region call run with the pool's hooks off (Plan.bypass) of which the plan drops some saves for a
cheap rebuild: a weight's autocast copy, or an op replay (GELU, LayerNorm, BatchNorm + ReLU) from
tensors the call keeps. The call runs under hooks of its own, which make no entry: a kept save is a
Kept (its version checked at unpack, as autograd does without hooks), a dropped one a Dropped that
holds what its rebuild reads and rebuilds it at its unpack.

Why: through the pool, a save the plan drops cost an H100 host ~55 us (its entry, its recipe, the
plan's treatment) and its rebuild ~85 us; GPT-24's 75% plan drops ~150 such tensors a step, and its
forward and backward are host-bound. Here a save costs a counter and a Kept, a drop the walk of its op
chain and a dictionary lookup.

Which saves: the plan names them by their place among the call's saves (Profile.call_slots), the
tensors its rebuilds read likewise. Correctness does not rest on the place: a drop rebuilds the very
tensor saved, by the chain its own grad_fn names, from the very tensors it read, on a site the pool
verified bitwise in the recorded step (op_replay.py). A save whose chain, bytes or site does not
match is kept.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from .cast import autocast_copy_of
from .entry import Kept, _check, movable, storage_extent
from .op_replay import _run, _Unsupported, chain_of

if TYPE_CHECKING:
    from .port import PoolInternals


class Dropped:
    """A save dropped in a lean call: rebuilt at its first unpack (its chain, or the parameter's cast),
    kept from then until autograd frees it (a tensor saved twice is rebuilt once)."""

    __slots__ = ("prog", "inputs", "versions", "variant", "cuda", "dtype", "layout", "value", "source")

    def __init__(self, prog: list | None, inputs: list, variant: Any, cuda: bool, t: torch.Tensor):
        self.prog = prog  # None: an autocast copy of inputs[0]
        self.inputs = inputs
        self.versions = [x._version for x in inputs]
        self.variant = variant
        self.cuda = cuda
        self.dtype = t.dtype
        base = t._base if t._base is not None else t
        self.layout = (t.shape, t.stride(), t.storage_offset() - base.storage_offset())
        self.value: torch.Tensor | None = None
        self.source = weakref.ref(t)

    def rebuild(self) -> torch.Tensor:
        if self.value is not None:
            return self.value
        for x, version in zip(self.inputs, self.versions):
            if x._version != version:
                _check(x, x._version, version, x.shape)
        if self.prog is None:
            base = self.inputs[0].detach().to(self.dtype)
        else:
            base = _run(self.prog, self.inputs, self.variant, self.cuda)
        self.value = base.as_strided(*self.layout)
        return self.value


class LeanCall:
    """The saved-tensor hooks of one lean call. `drops`: the call's save number (0-based, every save
    counted) -> the plan's ordinal of it; `reads`: the save numbers of tensors a drop reads."""

    __slots__ = ("pool", "drops", "reads", "n", "tags", "made", "dropped", "dropped_bytes")

    def __init__(self, pool: PoolInternals, drops: dict[int, int], reads: frozenset[int]):
        self.pool: PoolInternals | None = pool  # (None once closed)
        self.drops = drops
        self.reads = reads
        self.n = 0
        self.tags: dict[tuple, tuple[torch.Tensor, int]] = {}  # (grad_fn, output_nr) -> (tensor, version)
        self.made: dict[int, Dropped] = {}  # ordinal -> its Dropped (saved twice: the same one)
        self.dropped = 0
        self.dropped_bytes = 0

    def pack(self, t: torch.Tensor) -> Any:
        k = self.n
        self.n = k + 1
        if k in self.reads and t.grad_fn is not None:
            self.tags[(t.grad_fn, t.output_nr)] = (t, t._version)
        ordinal = self.drops.get(k)
        if ordinal is not None:
            dropped = self._drop(t, ordinal)
            if dropped is not None:
                return dropped
        return Kept(t) if type(t) is torch.Tensor or movable(t) else t

    def close(self) -> None:
        """The call returned: what it held to find a drop's inputs goes (autograd keeps this object, in
        its pack hook, as long as the call's graph; the tags would hold the graph's nodes)."""
        self.tags = {}
        self.made = {}
        self.pool = None

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        t = type(packed)
        return packed.rebuild() if t is Dropped else packed.unpack() if t is Kept else packed

    def _drop(self, t: torch.Tensor, ordinal: int) -> Dropped | None:
        same = self.made.get(ordinal)
        if same is not None:
            return same if same.source() is t else None
        pool = self.pool
        if pool is None:  # (closed: its call returned, and its hooks with it)
            return None
        sig = pool.plans.plan.signature
        nbytes = storage_extent(t) * t.element_size()
        if type(t) is not torch.Tensor or ordinal > len(sig) or sig[ordinal - 1] != nbytes:
            return None
        param = autocast_copy_of(t)
        if param is not None:
            dropped = Dropped(None, [param], None, pool.cuda, t)
        else:
            chain = chain_of(t, self._kept_at)
            if chain is None:
                return None
            base, prog, leaves = chain
            site = pool.op_replays.site_of(prog, leaves, base)
            if site is None:
                return None
            dropped = Dropped(prog, leaves, site.variant, pool.cuda, t)
        self.made[ordinal] = dropped
        self.dropped += 1
        self.dropped_bytes += nbytes
        return dropped

    def _kept_at(self, node: Any, nr: int) -> torch.Tensor | None:
        """The tensor this call saved and kept that is output `nr` of `node`, unchanged since."""
        tagged = self.tags.get((node, nr))
        if tagged is None:
            return None
        t, version = tagged
        if t._version != version:
            raise _Unsupported  # changed in place since it was saved: the op may have read another value
        return t
