"""Offload: a saved tensor copied to pinned host memory, and back before backward reads it."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ... import costs, events
from ...policies import Choice
from ..cast import Cast
from ..entry import Entry, State
from ..port import PoolPort
from .base import Treatment

LINK_PROBE_BYTES = 64 << 20
_link_probed: dict[int, float] = {}  # CUDA device index -> D2H bytes per second to pinned memory


def link_rate(device: torch.device) -> float:
    """The device's copy rate to pinned host memory (Offload.rate), probed once a process (the fastest
    of three 64 MiB copies on a side stream, ~4 ms; one copy read 29 GB/s once on an H100 host whose
    link gave 55 in the process before): a plan made before the pool copied anything priced copies at
    25 GB/s, which an H100's link more than doubles (54-55 GB/s measured)."""
    index = torch.device(device).index or 0
    if index not in _link_probed:
        rate = costs.GPU_LINK_BYTES_PER_S
        try:
            src = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, device=torch.device("cuda", index))
            dst = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
            stream = torch.cuda.Stream(src.device)
            stream.wait_stream(torch.cuda.current_stream(src.device))
            events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)  # (a first copy: the link's setup is not its rate)
                for e in events[:-1]:
                    e.record()
                    dst.copy_(src, non_blocking=True)
                events[-1].record()
            events[-1].synchronize()
            least_ms = min(a.elapsed_time(b) for a, b in zip(events, events[1:]))
            rate = LINK_PROBE_BYTES / (least_ms / 1e3)
        except (RuntimeError, torch.OutOfMemoryError):  # no room for the probe: the default stands
            pass
        _link_probed[index] = rate
    return _link_probed[index]


class Offload(Treatment):
    """Copies the tensor's storage span to pinned host memory on the copy engine's D2H stream; brings
    it back on the H2D stream (prefetched during backward). The host copy is kept while the entry lives:
    leaving again after a return is free."""

    name = "offload"
    kind = "offload"
    prefetch = True

    def __init__(self, link_bytes_per_s: float | None = None):
        """link_bytes_per_s: the copy rate to price copies at; None: the rate the copy engine achieved
        (until it has copied: 25 GB/s on a GPU, 5 GB/s on CPU)."""
        self.link_bytes_per_s = link_bytes_per_s

    def rate(self, pool: PoolPort) -> float:
        if self.link_bytes_per_s is not None:
            return self.link_bytes_per_s
        c = pool.copies.stats
        if c.d2h_seconds > 0 and c.d2h_bytes > 1 << 20:
            return c.d2h_bytes / c.d2h_seconds
        if not pool.cuda:
            return costs.CPU_COPY_BYTES_PER_S
        return _link_probed.get(torch.device(pool.device).index or 0, costs.GPU_LINK_BYTES_PER_S)

    def probe(self, pool: PoolPort) -> None:
        """Before a plan: the link's rate, measured (link_rate) where no copy measured it yet. Never
        from a pressure handler: the probe allocates."""
        if pool.cuda and self.link_bytes_per_s is None:
            link_rate(pool.device)

    def hideable_bytes(self, pool: PoolPort, bps: float) -> int:
        """Bytes the link can still carry before backward starts, judging by the last step's forward
        (what it already carries this step counts against it). On CPU copies are synchronous: none."""
        window = pool.copy_window()
        if window is None:
            return 0
        elapsed, forward_s, copied = window
        queued = max(0.0, copied - bps * elapsed)
        return int(bps * max(0.0, forward_s - elapsed) - queued)

    def applies(self, e: Entry) -> bool:
        # Weight copies are rebuilt, never copied to host; a call still running decides at its end.
        return e.recipe is None or (e.recipe.ready and not isinstance(e.recipe, Cast))

    def choices(self, pool: PoolPort, resident: Iterable[Entry]) -> list[Choice]:
        bps = self.rate(pool)
        hideable = self.hideable_bytes(pool, bps)
        out = []
        for e in resident:
            if not self.applies(e):
                continue
            exposed = e.nbytes if e.payload is None else 0  # a kept host copy costs nothing to reuse
            hidden = min(exposed, max(0, hideable))
            hideable -= hidden
            cost_s = ((exposed - hidden) + costs.REACTIVE_COPY_INTERFERENCE * exposed) / bps
            out.append(Choice(e, self.name, e.nbytes, cost_s, e.last_use, (e,)))
        return out

    def leave(self, pool: PoolPort, e: Entry) -> bool:
        if e.payload is None:
            block = pool.host.take(e.nbytes)
            if block is None:
                pool.count("host_full")
                return False
            e.payload = block
            e.event = pool.copies.to_host(e.device_span(), _host_span(e))
            pool.count("offloaded_bytes", e.nbytes)
            e.step.offloaded += e.nbytes
            pool.count("offloads")
            events.emit(
                "offload", e.nbytes, e.device_tensor.data_ptr(), pool.device_index, e.seq, "activation"
            )
        else:  # offloaded before: the host copy is complete (returns wait for it)
            e.event = None
        e.state = State.LEAVING if e.event is not None else State.AWAY
        return True

    def come_back(self, pool: PoolPort, e: Entry) -> None:
        if e.event is not None and pool.cuda:  # the host copy may still be being written
            pool.copies.h2d.wait_event(e.event)
        span, event = pool.copies.to_device(_host_span(e))
        pool.arrived(e, e.from_span(span), event)
        events.emit("prefetch", e.nbytes, e.device_tensor.data_ptr(), pool.device_index, e.seq, "activation")

    def ready(self, pool: PoolPort, e: Entry) -> None:
        pool.copies.use(e.tensor, e.event)
        super().ready(pool, e)

    def host_bytes(self, e: Entry) -> int:
        return e.payload.nbytes if e.payload is not None else 0

    def forget(self, pool: PoolPort, e: Entry) -> None:
        if e.payload is not None:
            pool.host.give_back(e.payload, pool.copies.stream_ids)
        e.payload = None

    def check(self, pool: PoolPort, e: Entry) -> None:
        assert e.payload is not None and e.payload.nbytes >= e.nbytes, f"{e}: away without a host copy"


def _host_span(e: Entry) -> torch.Tensor:
    return e.payload.tensor.view(e.dtype)
