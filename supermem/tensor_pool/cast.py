"""A weight's autocast copy saved for backward: found (autocast_copy_of) and rebuilt by casting its
parameter again (Cast, a recipe)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .port import PoolPort

if TYPE_CHECKING:
    from .entry import Entry


class Cast:
    """Recipe for an autocast copy of a parameter (about 8% of GPT-24's saved bytes): cast it again."""

    __slots__ = ("param", "dtype", "shape", "stride", "offset", "param_version")
    ready = True

    def __init__(self, param: torch.Tensor, t: torch.Tensor):
        self.param = param
        self.dtype = t.dtype
        self.shape, self.stride, self.offset = t.shape, t.stride(), t.storage_offset()
        self.param_version = param._version

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
