"""Pool and runtime events for the trace tool: a process-wide list of subscribers, free when none.

Emitters (the tensor pool, the copy engine) call `emit(...)`; the trace recorder subscribes.
Times use time.monotonic_ns(), the same clock (CLOCK_MONOTONIC) as the C++ trace ring's steady_clock,
so pool events and allocator events interleave on one timeline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

# What a tensor is, for reports (PyTorch's memory profiler's categories; supermem.trace.owners says how
# each is told). The pool tags what it saves as "activation".
CATEGORIES = (
    "parameter",
    "gradient",
    "optimizer_state",
    "activation",
    "input",
    "temporary",
    "autograd_detail",
    "unknown",
)


class Event(NamedTuple):
    time_ns: int
    action: str  # offload, prefetch, restore, drop, recompute, compress, oom, annotate, ...
    nbytes: int
    address: int  # device address concerned (0 if none)
    device: int  # CUDA device index, -1 for CPU
    tag: int  # pool entry id (0 if none)
    category: str  # one of CATEGORIES
    detail: str  # free text (e.g. "d2h 12.3 GB/s")


Subscriber = Callable[[Event], None]
_subscribers: list[Subscriber] = []


def subscribe(fn: Subscriber) -> None:
    _subscribers.append(fn)


def unsubscribe(fn: Subscriber) -> None:
    if fn in _subscribers:
        _subscribers.remove(fn)


def enabled() -> bool:
    return bool(_subscribers)


def emit(
    action: str,
    nbytes: int = 0,
    address: int = 0,
    device: int = -1,
    tag: int = 0,
    category: str = "unknown",
    detail: str = "",
) -> None:
    if not _subscribers:
        return
    ev = Event(time.monotonic_ns(), action, nbytes, address, device, tag, category, detail)
    for fn in list(_subscribers):
        fn(ev)
