"""A pool entry: one tensor autograd saved for backward, and where its bytes are now.

    resident    the pool holds the device tensor (and maybe a host copy from an earlier offload)
    offloading  a device -> host copy is in flight; the device tensor went back to the allocator
    on_host     only the host copy exists
    restoring   a host -> device copy is in flight into a new device tensor

Invariants (Pool.check): an entry holds a device tensor iff it is resident or restoring, and a host
block whenever it is off the device; the pool's resident-bytes counter equals the bytes of entries
holding a device tensor; the LRU list names live entries only; the host pool's own invariants hold.
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
        "extent",
        "dtype",
        "tensor",
        "host",
        "event",
        "state",
        "last_use",
        "key",
        "source",
    )

    def __init__(self, pool: Pool, seq: int, tensor: torch.Tensor, key: tuple):
        self._pool = weakref.ref(pool)
        self.seq = seq  # pack order
        self.shape = tensor.shape
        self.stride = tensor.stride()
        self.extent = storage_extent(tensor)
        self.dtype = tensor.dtype
        self.nbytes = self.extent * tensor.element_size()
        self.tensor: torch.Tensor | None = tensor
        self.host: HostBlock | None = None
        self.event: torch.cuda.Event | None = None  # end of the copy in flight (either direction)
        self.state = State.RESIDENT
        self.last_use = 0
        self.key = key
        self.source = weakref.ref(tensor)  # the saved tensor object, to recognise it when saved again

    def host_span(self) -> torch.Tensor:
        """The host copy of the tensor's storage span, flat and typed."""
        return self.host.tensor.view(self.dtype)

    def device_span(self) -> torch.Tensor:
        """The device tensor's storage span, flat: what a copy moves."""
        return self.tensor.as_strided((self.extent,), (1,))

    def from_span(self, span: torch.Tensor) -> torch.Tensor:
        """The tensor again, with its exact shape and strides, over a restored span."""
        return span.as_strided(self.shape, self.stride)

    def __del__(self) -> None:
        pool = self._pool()
        if pool is not None:
            pool._release(self)

    def __repr__(self) -> str:
        return f"Entry(seq={self.seq}, {self.state.value}, {self.nbytes} bytes)"


def storage_extent(t: torch.Tensor) -> int:
    """Elements from the tensor's first to its last element in storage. The pool moves this span,
    not the elements one by one: the tensor comes back with its exact strides (elementwise kernels
    take other code paths, with other rounding, for other layouts), expanded tensors move once,
    and a span is one contiguous DMA."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
