"""The tensor pool: autograd's saved tensors, kept under a device memory budget.

Entered through torch.autograd.graph saved-tensor hooks, every tensor saved for backward becomes an
Entry. When device memory would exceed the budget, the policy picks resident entries to offload to
pinned host memory (asynchronously, on the copy engine's D2H stream, as soon as they are saved);
during backward, entries about to be needed are prefetched back (H2D stream) as far ahead as the
budget has room, so copies hide behind compute. With supermem's allocator installed, the pool is
also its pressure handler: before an OOM is raised, it offloads synchronously.

Budget: device bytes for everything on the device (parameters, gradients, temporaries and the
activations the pool keeps), measured from the allocator as the step runs. Between the pool's moves
the step allocates transients it cannot see coming (the loss, say); with supermem's allocator the pool
reads each step's true peak and lowers its working target by the overshoot, so after a step or two
the peak settles at the budget. On CPU, where there is no device, the budget is the bytes of saved
tensors the pool keeps.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from typing import Any

import psutil
import torch

from .. import events
from ..errors import ConfigError
from ..units import parse_bytes
from .copy import CopyEngine
from .entry import Entry, State
from .host import HostPool, pinned_available
from .policy import make_policy

PREFETCH_SCAN = 64  # entries looked at, going back from the one just used, for prefetch


class Pool:
    """Offloads saved activations beyond `budget` to pinned host memory and prefetches them back.

    budget: device bytes (int, "8GiB", "60%" or 0.6 of the card); None: offload only when the
        supermem allocator would otherwise run out of memory.
    policy: "lru".
    host_limit: pinned host bytes the pool may use (int, size string or percentage of host RAM).
    min_bytes: smaller saved tensors stay where they are (default 1 MiB on GPU, 0 on CPU).
    """

    def __init__(
        self,
        budget: int | float | str | None = None,
        policy: str = "lru",
        host_limit: int | float | str | None = "50%",
        *,
        device: torch.device | str | None = None,
        min_bytes: int | None = None,
    ):
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        total = torch.cuda.get_device_properties(self.device).total_memory if self.cuda else None
        self._device_total = total
        self.budget_bytes = None if budget is None else _size("budget", budget, total)
        self.policy = _checked("policy", make_policy, policy)
        host_bytes = _size(
            "host_limit", "50%" if host_limit is None else host_limit, psutil.virtual_memory().total
        )
        self.host = HostPool(host_bytes, pinned=self.cuda and pinned_available())
        self.copies = CopyEngine(self.device)
        self.min_bytes = (1 << 20 if self.cuda else 0) if min_bytes is None else min_bytes
        self._lock = threading.RLock()
        self._entries: dict[int, weakref.ref[Entry]] = {}  # live entries by pack order
        self._seqs: list[int] = []  # pack order, with dead seqs compacted away now and then
        self._lru: dict[int, weakref.ref[Entry]] = {}  # resident entries, least recently used first
        self._dedup: dict[tuple, weakref.ref[Entry]] = {}  # live entries by tensor identity
        self._tick = 0
        self._resident_bytes = 0
        self._margin = 0  # learned: how far a step's peak rises above the most the pool saw (bytes)
        self._seen_peak = 0  # the most device memory the pool saw in use during this step
        self._largest_entry = 0
        self._counters = dict.fromkeys(
            ("packed", "offloads", "prefetches", "sync_restores", "host_full", "pressure_calls"), 0
        )
        self._offloaded_bytes = 0
        self._prefetched_bytes = 0
        self._peak_resident_bytes = 0
        self._hooks: Any = None
        self._pressure_registered = False
        _serve_to_top(self)

    # ------------------------------------------------------------------ activation

    def __enter__(self) -> Pool:
        self._register_pressure_handler()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc)

    def _register_pressure_handler(self) -> None:
        if self._pressure_registered or not self.cuda:
            return
        from ..registry import installed

        if installed():
            from .. import _C

            # its own device's allocator only: under DDP each rank's pool, and in one process one pool
            # per device, offloads only where memory is short
            _C.plugin_add_pressure_handler(_weak_method(self._on_pressure), self.device.index)
            self._pressure_registered = True

    # ------------------------------------------------------------------ hooks

    def _pack(self, t: torch.Tensor) -> Any:
        if t.device != self.device or t.numel() * t.element_size() < self.min_bytes or _alive_anyway(t):
            return t
        if t.numel() == 0:
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype, t._version)
        with self._lock:
            if not self._entries:
                self._learn_margin()  # a new step begins: the last one's peak is known
            self._tick += 1
            same = self._dedup.get(key)
            same = same() if same is not None else None
            if same is not None and same.source() is t:  # saved twice: one entry
                self._touch(same)
                return same
            seq = self._tick
            e = Entry(self, seq, t, key)
            self._largest_entry = max(self._largest_entry, e.nbytes)
            self._entries[seq] = weakref.ref(e)
            self._seqs.append(seq)
            self._dedup[key] = weakref.ref(e)
            self._counters["packed"] += 1
            self._add_resident(e)
            self._touch(e)
            self._fit_budget()
            return e

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, Entry):
            return packed
        with self._lock:
            t = self._materialize(packed)
            self._touch(packed)
            self._prefetch_before(packed)
            return t

    # ------------------------------------------------------------------ moving entries

    def _fit_budget(self) -> None:
        if self.budget_bytes is None:
            return
        over = self._used_bytes() - self._target()
        if over > 0:
            for victim in self.policy.choose(self._resident_entries(), over):
                self._offload(victim)

    def _offload(self, e: Entry) -> bool:
        """Moves a resident entry (or one being restored: its copy is dropped) to host memory; False
        when host memory is full."""
        if e.host is None:
            block = self.host.take(e.nbytes)
            if block is None:
                self._counters["host_full"] += 1
                return False
            e.host = block
            e.event = self.copies.to_host(e.device_span(), e.host_span())
            self._offloaded_bytes += e.nbytes
            self._counters["offloads"] += 1
            events.emit("offload", e.nbytes, e.tensor.data_ptr(), self._device_index(), e.seq, "activation")
        else:  # offloaded before: the host copy is complete (restores wait for it); drop the device copy
            e.event = None
        self._drop_resident(e)
        e.state = State.OFFLOADING if e.event is not None else State.ON_HOST
        return True

    def _restore(self, e: Entry) -> None:
        """Starts bringing an offloaded entry back (state restoring)."""
        if e.event is not None and self.cuda:  # the host copy may still be being written
            self.copies.h2d.wait_event(e.event)
        span, e.event = self.copies.to_device(e.host_span())
        e.tensor = e.from_span(span)
        e.state = State.RESTORING if e.event is not None else State.RESIDENT
        self._add_resident(e)
        events.emit("prefetch", e.nbytes, e.tensor.data_ptr(), self._device_index(), e.seq, "activation")

    def _materialize(self, e: Entry) -> torch.Tensor:
        if e.state in (State.OFFLOADING, State.ON_HOST):  # not prefetched in time: compute waits
            self._counters["sync_restores"] += 1
            self._restore(e)
        if e.state is State.RESTORING or e.event is not None:
            self.copies.use(e.tensor, e.event)
            e.event = None
            e.state = State.RESIDENT
        return e.tensor

    def _prefetch_before(self, e: Entry) -> None:
        """Prefetches the entries saved just before `e`: backward needs them next."""
        room = self._target() - self._used_bytes()
        pos = bisect.bisect_left(self._seqs, e.seq)
        started = 0
        for seq in reversed(self._seqs[max(0, pos - PREFETCH_SCAN) : pos]):
            ref = self._entries.get(seq)
            x = ref() if ref is not None else None
            if x is None or x.state not in (State.OFFLOADING, State.ON_HOST):
                continue
            if x.nbytes > room:
                break
            room -= x.nbytes
            self._restore(x)
            self._counters["prefetches"] += 1
            self._prefetched_bytes += x.nbytes
            started += 1

    def _on_pressure(self, need_bytes: int) -> int:
        """The allocator is about to fail: offload entries, least recently used first, waiting for
        each copy, until the device really has `need_bytes` more free (an entry that something else
        still references frees nothing when it leaves)."""
        with self._lock:
            self._counters["pressure_calls"] += 1
            before, freed = self._used_bytes(), 0
            # Prefetched entries not used yet go last: they come back soonest.
            for victim in self.policy.order(self._resident_entries()) + self._restoring_entries():
                if self._offload(victim):
                    self.copies.wait(victim.event)
                    freed = before - self._used_bytes()
                    if freed >= need_bytes:
                        break
            return max(freed, 0)

    # ------------------------------------------------------------------ bookkeeping

    def _release(self, e: Entry) -> None:
        """The entry died (autograd dropped it): give its memory back."""
        try:
            with self._lock:
                self._entries.pop(e.seq, None)
                ref = self._dedup.get(e.key)
                if ref is not None and ref() in (e, None):
                    del self._dedup[e.key]
                if e.state in (State.RESIDENT, State.RESTORING):
                    self._drop_resident(e)
                e.tensor = None
                if e.host is not None:
                    self.host.give_back(e.host, self.copies.stream_ids)
                    e.host = None
                if len(self._seqs) > 64 and len(self._seqs) > 2 * len(self._entries):
                    self._seqs = [s for s in self._seqs if s in self._entries]
        except Exception:  # noqa: BLE001  (interpreter shutdown: CUDA or modules may be gone)
            pass

    def _add_resident(self, e: Entry) -> None:
        self._resident_bytes += e.nbytes
        self._peak_resident_bytes = max(self._peak_resident_bytes, self._resident_bytes)
        self._lru[e.seq] = weakref.ref(e)

    def _drop_resident(self, e: Entry) -> None:
        self._resident_bytes -= e.nbytes
        self._lru.pop(e.seq, None)
        e.tensor = None

    def _touch(self, e: Entry) -> None:
        self._tick += 1
        e.last_use = self._tick
        if e.seq in self._lru:  # move to the most recently used end
            self._lru[e.seq] = self._lru.pop(e.seq)

    def _restoring_entries(self) -> list[Entry]:
        return [x for ref in self._lru.values() if (x := ref()) is not None and x.state is State.RESTORING]

    def _resident_entries(self) -> list[Entry]:
        """Resident entries, least recently used first (in-flight restores excluded)."""
        out = []
        for ref in self._lru.values():
            x = ref()
            if x is not None and x.state is State.RESIDENT and x.tensor is not None:
                out.append(x)
        return out

    def _target(self) -> int:
        """Device bytes the pool aims at: the budget less the learned margin; with no budget, the
        allocator's limit (or the card) less room for the largest entry, so prefetch never causes an
        OOM. On CPU: the budget (or no bound)."""
        if self.budget_bytes is not None:
            return max(0, self.budget_bytes - self._margin)
        if not self.cuda:
            return 1 << 62
        alloc = self._supermem_allocator()
        cap = (alloc.limit_bytes if alloc is not None else 0) or torch.cuda.get_device_properties(
            self.device
        ).total_memory
        return cap - 2 * self._largest_entry

    def _learn_margin(self) -> None:
        """The margin is the last step's spike: its true peak above the most the pool saw. Transients
        the pool cannot see (the loss, workspaces) are a property of the model, not of the target,
        so this settles in one step and does not oscillate."""
        alloc = self._supermem_allocator() if self.budget_bytes is not None else None
        if alloc is not None:
            peak = alloc.take_watermark()
            if self._seen_peak:
                self._margin = min(self.budget_bytes, max(0, peak - self._seen_peak))
        self._seen_peak = 0

    def _supermem_allocator(self) -> Any:
        if not self.cuda:
            return None
        from ..registry import device_allocator

        return device_allocator(self.device.index)

    def _used_bytes(self) -> int:
        """What the budget counts: bytes allocated on the device now (cheap with supermem's allocator,
        a stats call with PyTorch's), or on CPU the bytes of resident entries."""
        if not self.cuda:
            return self._resident_bytes
        alloc = self._supermem_allocator()
        used = alloc.allocated_bytes if alloc is not None else torch.cuda.memory_allocated(self.device)
        self._seen_peak = max(self._seen_peak, used)
        return used

    def _device_index(self) -> int:
        return self.device.index if self.cuda else -1

    # ------------------------------------------------------------------ inspection

    def check(self) -> None:
        """Walks the entries; raises AssertionError if the accounting is off."""
        with self._lock:
            resident = 0
            for ref in self._entries.values():
                e = ref()
                if e is None:
                    continue
                holds_device = e.state in (State.RESIDENT, State.RESTORING)
                assert (e.tensor is not None) == holds_device, f"{e}: device tensor vs state"
                assert holds_device or e.host is not None, f"{e}: off the device without a host copy"
                resident += e.nbytes if holds_device else 0
            assert resident == self._resident_bytes, f"resident {resident} != counter {self._resident_bytes}"
            assert set(self._lru) <= set(self._entries), "LRU names dead entries"
            self.host.allocator.check()

    def stats(self) -> dict:
        """Bytes by state, totals moved, achieved copy rates (GB/s) and the share of copy time that
        compute did not wait for (hidden_fraction). Reads finished copy timings; does not sync."""
        with self._lock:
            by_state = {s.value: 0 for s in State}
            count = {s.value: 0 for s in State}
            for ref in self._entries.values():
                e = ref()
                if e is not None:
                    if e.state is State.OFFLOADING and (e.event is None or e.event.query()):
                        e.state = State.ON_HOST
                    by_state[e.state.value] += e.nbytes
                    count[e.state.value] += 1
            c = self.copies.collect()
            copy_seconds = c.d2h_seconds + c.h2d_seconds
            return {
                "tracked_bytes": sum(by_state.values()),
                **{f"{k}_bytes": v for k, v in by_state.items()},
                "entries_by_state": count,
                "peak_resident_bytes": self._peak_resident_bytes,
                "budget_bytes": self.budget_bytes,
                "margin_bytes": self._margin,
                "offloaded_bytes": self._offloaded_bytes,
                "prefetched_bytes": self._prefetched_bytes,
                **self._counters,
                "host_reserved_bytes": self.host.reserved_bytes,
                "d2h_gbps": c.d2h_bytes / c.d2h_seconds / 1e9 if c.d2h_seconds else 0.0,
                "h2d_gbps": c.h2d_bytes / c.h2d_seconds / 1e9 if c.h2d_seconds else 0.0,
                "copy_seconds": copy_seconds,
                "wait_seconds": c.wait_seconds,
                "hidden_fraction": max(0.0, 1 - c.wait_seconds / copy_seconds) if copy_seconds else 1.0,
            }

    def synchronize(self) -> None:
        """Waits for every copy in flight and folds all timings into stats()."""
        self.copies.collect(block=True)

    def reset_stats(self) -> None:
        with self._lock:
            self.copies.collect(block=True)
            self.copies.stats = type(self.copies.stats)()
            self._counters = dict.fromkeys(self._counters, 0)
            self._offloaded_bytes = self._prefetched_bytes = 0
            self._peak_resident_bytes = self._resident_bytes


_live_pools: weakref.WeakSet[Pool] = weakref.WeakSet()


def _serve_to_top(pool: Pool) -> None:
    """Lists the pool in the control server's "pool" section (what `supermem top` shows)."""
    from .. import config, control

    _live_pools.add(pool)
    if config.current().control:
        control.start_server()
        control.register_provider("pool", _top_view)


def _top_view() -> dict[str, Any]:
    entries: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    host = host_limit = d2h = h2d = 0
    for p in list(_live_pools):
        s = p.stats()
        for state, n in s["entries_by_state"].items():
            entries[state] = entries.get(state, 0) + n
            nbytes[state] = nbytes.get(state, 0) + s[f"{state}_bytes"]
        host += s["host_reserved_bytes"]
        host_limit += p.host.allocator.device.total_bytes
        d2h += s["d2h_gbps"] * 1e9
        h2d += s["h2d_gbps"] * 1e9
    link = {"d2h_bytes_per_s": d2h, "h2d_bytes_per_s": h2d}
    return {
        "entries_by_state": entries,
        "bytes_by_state": nbytes,
        "host_bytes": host,
        "host_limit_bytes": host_limit,
        "link": link,
    }


def _checked(name: str, parse: Any, value: Any) -> Any:
    try:
        return parse(value)
    except ValueError as e:
        raise ConfigError(f"bad pool option {name}={value!r}: {e}") from None


def _size(name: str, value: Any, total: int | None) -> int:
    return _checked(name, lambda v: parse_bytes(v, total), value)


def _alive_anyway(t: torch.Tensor) -> bool:
    """Parameters and leaf inputs (and views of them) stay alive through the step: moving them
    would free nothing."""
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad


def _weak_method(method: Any) -> Any:
    """A callable that does not keep the pool alive (the allocator holds it for the process)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        m = ref()
        return m(*args) if m is not None else 0

    return call
