"""Every allocator supermem serves, in one place on the ground floor of the package.

Two kinds: the per-device allocators of the PyTorch plug-in (created by C++ at a device's first CUDA
allocation; `activate` hands their source over at install), and allocators registered by hand (e.g.
over a simulated device). activate, tensor_pool, control and the trace recorder all read this module,
and it imports none of them, nor torch nor _C at load: PyTorch's autoload hook can run while any
other supermem module is half-imported, and everything the hook needs must stay importable then.

Subscribers (the trace recorder) hear of each allocator when it first appears here. Plug-in
allocators appear when someone looks (`allocators()`, `device_allocator()` of a device not yet
known), not at their creation in C++ (calling Python from inside a malloc is not worth its
deadlocks); so that nothing is lost in between, `set_recording_ring_events` sizes the trace ring of
allocators created from then on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .allocator import CachingAllocator


class DeviceSource(Protocol):
    """The plug-in's per-device allocators, as activate exposes them (tests use a simulated one)."""

    def devices(self) -> list[int]: ...  # devices whose allocator exists

    def allocator(self, device: int) -> Any: ...  # a CachingAllocator wrapper, or None if absent

    def set_new_ring_events(self, n: int) -> None: ...  # ring size of allocators created from now


Subscriber = Callable[[int, Any], None]  # (device index, CachingAllocator)

_lock = threading.RLock()
_source: DeviceSource | None = None
_base_ring_events = 0  # what the options ask for (trace:N, or the OOM ring)
_recording_ring_events = 0  # what a recording in progress asks for
_device_allocators: dict[int, Any] = {}  # device -> the one wrapper handed out for it
_registered: list[tuple[int, Any]] = []
_subscribers: list[Subscriber] = []


def set_device_source(source: DeviceSource | None, ring_events: int = 0) -> None:
    """Called by activate at install (None: uninstalled, for tests). ring_events: the trace ring the
    options give each device allocator."""
    global _source, _base_ring_events
    with _lock:
        _source, _base_ring_events = source, ring_events
        _device_allocators.clear()
        if source is not None:
            source.set_new_ring_events(max(ring_events, _recording_ring_events))


def installed() -> bool:
    """True once supermem's allocator serves PyTorch in this process."""
    return _source is not None


def device_allocator(device: int = 0) -> CachingAllocator | None:
    """The allocator serving PyTorch on CUDA device `device`, or None (not installed, or the device
    has not been used yet). The same object every time for a device."""
    a = _device_allocators.get(device)
    if a is None:  # a known one needs no look (the pool asks on every saved tensor)
        _poll()
        a = _device_allocators.get(device)
    return a


def allocators() -> list[tuple[int, Any]]:
    """(device index, CachingAllocator) of every allocator: those registered by hand, then the
    plug-in's, one entry per allocator."""
    _poll()
    with _lock:
        out = list(_registered)
        for device, a in sorted(_device_allocators.items()):
            if not any(same(a, b) for _, b in out):
                out.append((device, a))
    return out


def register(alloc: Any, device: int | None = None) -> None:
    """Makes a CachingAllocator visible to recordings and `top`. device: the index to file it under
    (default: its device's index)."""
    with _lock:
        if any(a is alloc for _, a in _registered):
            return
        pair = (alloc.device.index if device is None else device, alloc)
        _registered.append(pair)
    _notify([pair])


def unregister(alloc: Any) -> None:
    with _lock:
        _registered[:] = [(d, a) for d, a in _registered if a is not alloc]


def subscribe(fn: Subscriber) -> None:
    """fn(device, alloc) for every allocator that appears from now on (on the thread that finds it)."""
    with _lock:
        _subscribers.append(fn)


def unsubscribe(fn: Subscriber) -> None:
    with _lock:
        _subscribers[:] = [s for s in _subscribers if s != fn]


def set_recording_ring_events(n: int) -> None:
    """Device allocators created from now on get a trace ring of at least `n` events (0: what the
    options say): a recording started before the first CUDA tensor then misses nothing."""
    global _recording_ring_events
    with _lock:
        _recording_ring_events = n
        if _source is not None:
            _source.set_new_ring_events(max(_base_ring_events, n))


def ring_events_at_rest(alloc: Any) -> int:
    """The ring `alloc` keeps outside recordings: the options' ring for device allocators (those
    created during a recording were made larger), its own size for the others."""
    with _lock:
        if any(same(alloc, a) for a in _device_allocators.values()):
            return _base_ring_events
    return alloc.trace_capacity


def same(a: Any, b: Any) -> bool:
    """One allocator, even through two Python wrappers of it."""
    return getattr(a, "_impl", a) is getattr(b, "_impl", b)


def _poll() -> None:
    """Wraps device allocators the plug-in created since the last look, and tells subscribers."""
    source = _source
    if source is None:
        return
    new = []
    with _lock:
        for device in source.devices():
            if device not in _device_allocators:
                a = source.allocator(device)
                if a is not None:
                    _device_allocators[device] = a
                    new.append((device, a))
    _notify(new)


def _notify(pairs: list[tuple[int, Any]]) -> None:
    with _lock:
        subscribers = list(_subscribers)
    for device, alloc in pairs:
        for fn in subscribers:
            fn(device, alloc)
