"""A weight's autocast copy saved for backward: found (autocast_copy_of) and rebuilt by casting its
parameter again (Cast, a recipe).

Autocast keeps the copies it makes of fp32 weights (leaves that require grad, cast to its own dtype,
with its cache on: autocast_mode.cpp, `cached_cast`) until its outermost region exits, which is before
backward in the usual step: a Linear called twice saves one storage twice, and dropping such a copy in
the forward frees nothing before then (Cast.cached: docs/design.md, "Autocast's weight copies")."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .port import PoolPort

if TYPE_CHECKING:
    from .entry import Entry


class Cast:
    """Recipe for an autocast copy of a parameter (about 8% of GPT-24's saved bytes): cast it again."""

    __slots__ = ("param", "dtype", "shape", "stride", "offset", "param_version", "cached")
    ready = True

    def __init__(self, param: torch.Tensor, t: torch.Tensor):
        self.param = param
        self.dtype = t.dtype
        self.shape, self.stride, self.offset = t.shape, t.stride(), t.storage_offset()
        self.param_version = param._version
        self.cached = autocast_caches(param, t)  # its bytes stay on the device until autocast exits

    @property
    def group(self) -> Cast:
        return self

    def cost_s(self, pool: PoolPort) -> float:
        return 3 * self.param.nbytes / pool.device_bytes_per_s  # read fp32, write bf16

    def droppable(self, e: Entry) -> bool:
        return True

    def rebuild(self, pool: PoolPort, e: Entry) -> None:
        if self.param._version != self.param_version:
            raise RuntimeError(
                "supermem: a parameter changed in place between forward and backward; its autocast "
                "copy saved for backward cannot be rebuilt (plain autograd would use the stale copy)"
            )
        copy = self.param.detach().to(self.dtype)  # detached: no graph, and no no_grad context to enter
        pool.arrived(e, copy.as_strided(self.shape, self.stride, self.offset), None)


def autocast_copy_of(t: torch.Tensor) -> torch.Tensor | None:
    """The parameter `t` is an autocast copy of (or a view of one), else None: its base was made by
    one cast (ToCopyBackward0) straight from a leaf that requires grad, with the same shape."""
    base = t._base if t._base is not None else t
    fn = base.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or not base.is_contiguous():
        return None
    nxt = fn.next_functions
    if len(nxt) != 1 or nxt[0][0] is None or not hasattr(nxt[0][0], "variable"):
        return None
    param = nxt[0][0].variable
    if param.shape != base.shape or not param.is_contiguous() or param.device != base.device:
        return None
    return param


def autocast_caches(param: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether autocast's cache holds the copy `t` of `param` (its conditions in cached_cast): the copy
    is made under autocast with its cache on, to autocast's dtype, of an fp32 leaf that requires grad.
    An explicit `param.to(dtype)` under autocast reads as cached too: the plan then waits for backward
    to count its bytes freed, which is safe."""
    dev = t.device.type
    return (
        torch.is_autocast_enabled(dev)
        and torch.is_autocast_cache_enabled()
        and t.dtype == torch.get_autocast_dtype(dev)
        and param.dtype == torch.float32
        and param.requires_grad
        and param.is_leaf
        and param._base is None
    )
