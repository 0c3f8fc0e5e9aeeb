"""A pool entry: one tensor autograd saved for backward, and where its bytes are now.

    resident    the pool holds the device tensor (and maybe a host copy from an earlier offload)
    offloading  a device -> host copy is in flight; the device tensor went back to the allocator
    on_host     only the host copy exists
    restoring   a host -> device copy is in flight into a new device tensor

Invariants (Pool.check): every live entry is in exactly one state;
resident + offloading + on_host + restoring == tracked (counts and bytes); an entry holds a device
tensor iff it is resident or restoring, and a host block iff it was ever offloaded.
"""

from __future__ import annotations

import enum
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .host import HostBlock
    from .pool import Pool


class State(enum.Enum):
    RESIDENT = "resident"
    OFFLOADING = "offloading"
    ON_HOST = "on_host"
    RESTORING = "restoring"


class Entry:
    __slots__ = (
        "__weakref__",
        "_pool",
        "seq",
        "nbytes",
        "shape",
        "stride",
        "dtype",
        "tensor",
        "host",
        "event",
        "state",
        "last_use",
        "key",
    )

    def __init__(self, pool: Pool, seq: int, tensor: torch.Tensor, key: tuple):
        self._pool = weakref.ref(pool)
        self.seq = seq  # pack order
        self.nbytes = tensor.numel() * tensor.element_size()
        self.shape = tensor.shape
        self.stride = tensor.stride() if _keeps_strides(tensor) else _contiguous_strides(tensor.shape)
        self.dtype = tensor.dtype
        self.tensor: torch.Tensor | None = tensor
        self.host: HostBlock | None = None
        self.event: torch.cuda.Event | None = None  # end of the copy in flight (either direction)
        self.state = State.RESIDENT
        self.last_use = 0
        self.key = key

    def host_view(self) -> torch.Tensor:
        """The host copy, typed and shaped like the tensor."""
        flat = self.host.tensor.view(self.dtype)
        return flat.as_strided(self.shape, self.stride)

    def like(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")

    def __del__(self) -> None:
        pool = self._pool()
        if pool is not None:
            pool._release(self)

    def __repr__(self) -> str:
        return f"Entry(seq={self.seq}, {self.state.value}, {self.nbytes} bytes)"


def _keeps_strides(t: torch.Tensor) -> bool:
    """Dense layouts keep their strides on the way back; anything else comes back contiguous."""
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))
