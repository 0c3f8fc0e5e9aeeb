"""What the streamer fetches and tracks: a streamed parameter (_Param), a unit fetched as one (_Unit),
one call that swapped device weights in (_Use), a saved weight packed as a token (_Token), and the
autograd function that swaps the device views in and sends gradients to the host (_Fetch)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..transfer.host import HostBlock

Streamer = Any  # streamer.py imports this module: named, not imported (no circle)

# The attribute a streamed model holds its Streamer in (None once closed).
STREAMER_ATTR = "_supermem_streamer"

ALIGN = 512  # bytes between parameters in a flat buffer, as PyTorch's allocator: kernels choose alike


class _Param:
    """One streamed parameter: its host data lives in its owner unit's flat block (`param.data` views
    it); its gradient lands in a persistent host buffer."""

    __slots__ = ("param", "owner", "offset", "nbytes", "grad_block", "grad_view", "shape", "stride")

    def __init__(self, param: torch.nn.Parameter, owner: _Unit, offset: int):
        self.param = param
        self.owner = owner
        self.offset = offset
        self.nbytes = param.numel() * param.element_size()
        self.grad_block: HostBlock | None = None
        self.grad_view: torch.Tensor | None = None  # grad_block seen as the gradient
        self.shape = param.shape
        self.stride = _contiguous_stride(param.shape)

    def device_view(self) -> torch.Tensor:
        """The parameter's view of its unit's device copy: one op (the copy is viewed as each dtype once
        per fetch), not a slice and two views (~3 us each, per parameter and call)."""
        unit, p = self.owner, self.param
        typed = unit.typed.get(p.dtype)
        if typed is None:
            typed = unit.typed[p.dtype] = unit.held_copy().view(p.dtype)
        return typed.as_strided(self.shape, self.stride, self.offset // p.element_size())


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


class _Unit:
    """What is fetched as one: a module (with its whole subtree when that is at most `unit_bytes`, else
    its own parameters only). Its own parameters sit in one flat host block and come over in one copy;
    parameters it shares with units met earlier belong to those (`deps`), held along with it."""

    __slots__ = (
        "module",
        "slots",
        "params",
        "deps",
        "flat",
        "nbytes",
        "copy",
        "ready",
        "used_on",
        "version",
        "holds",
        "typed",
        "inner",
    )

    def __init__(self, module: torch.nn.Module, slots: list[tuple[torch.nn.Module, str, _Param]]):
        self.module = module
        self.slots = slots  # (module, name, param) for every parameter the unit's modules hold
        self.params: list[_Param] = []  # the ones stored in this unit's flat block
        self.deps: list[_Unit] = []
        self.flat: HostBlock | None = None
        self.nbytes = 0
        self.copy: torch.Tensor | None = None  # the flat device copy, while held
        self.ready: Any = None  # the event the copy ends with (None on CPU)
        self.used_on = -1  # the stream last made to wait for `ready`
        self.version: tuple[int, ...] = ()  # the host versions the copy was made from
        self.holds = 0
        self.typed: dict[torch.dtype, torch.Tensor] = {}  # the device copy viewed as each dtype
        # (module, pre-hook id, hook id) of the hooked modules inside: muted during the unit's call
        self.inner: list[tuple[torch.nn.Module, int, int]] = []

    def host_version(self) -> tuple[int, ...]:
        return tuple(p.param._version for p in self.params)

    def held_copy(self) -> torch.Tensor:
        """The device copy, read only while the unit is held (a call or a backward acquired it)."""
        if self.copy is None:
            raise RuntimeError(f"supermem.stream: a {type(self.module).__name__} unit read while not held")
        return self.copy


class _Use:
    """One call of a module that swapped device weights in: the host parameters it swapped out, and, as
    its backward sees it, the weight tokens saved and how many were unpacked (the device copy is held
    from the first unpack to the last)."""

    __slots__ = ("unit", "saved", "pushed", "tokens", "unpacked", "muted")

    def __init__(self, unit: _Unit):
        self.unit = unit
        self.muted: list[tuple[torch.nn.Module, int, int]] = []  # inner hooks taken out for the call
        self.saved: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
        self.pushed = False  # whether the call pushed saved-tensor hooks (grad mode was on)
        self.tokens = 0
        self.unpacked = 0


class _Token:
    """A saved weight, packed: which unit's copy it views, how, and the host versions it was made from."""

    __slots__ = ("use", "unit", "dtype", "size", "stride", "offset", "version")

    def __init__(self, use: _Use, unit: _Unit, t: torch.Tensor):
        self.use, self.unit, self.dtype = use, unit, t.dtype
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        self.version = unit.version


class _Box:
    """Carries the streamer and the parameters into _Fetch.apply (a non-tensor argument)."""

    __slots__ = ("streamer", "params")

    def __init__(self, streamer: Streamer, params: list[_Param]):
        self.streamer, self.params = streamer, params


class _Fetch(torch.autograd.Function):
    """host parameters -> their device views; the gradients go to the host, not through autograd."""

    @staticmethod
    def forward(ctx: Any, box: _Box, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.box = box
        ctx.set_materialize_grads(False)
        views = tuple(p.device_view() for p in box.params)
        frozen = [v for p, v in zip(box.params, views) if not p.param.requires_grad]
        ctx.mark_non_differentiable(*frozen)  # as in plain training: no gradient computed for them
        return views

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        ready = [(p, g) for p, g in zip(ctx.box.params, grads) if g is not None and p.param.requires_grad]
        if ready:
            ctx.box.streamer._grads_ready(ready)
        return (None,) * (1 + len(grads))
