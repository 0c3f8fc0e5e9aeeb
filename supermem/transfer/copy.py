"""The copy engine: moves tensors between a GPU and pinned host memory on two side streams (one per
direction, so offload and prefetch run at once; one pair per device, shared by every engine on it),
ordered against the compute stream with events.

Timing events around every copy measure the achieved bandwidth; a pair around every wait of the
compute stream measures how long compute stalled for a copy. On CPU, copies are plain and timed
with the host clock.
"""

from __future__ import annotations

import collections
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class CopyStats:
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    d2h_seconds: float = 0.0
    h2d_seconds: float = 0.0
    wait_seconds: float = 0.0  # compute stalled waiting for copies
    pending: list = field(default_factory=list)  # (kind, nbytes, start, end) not yet read


class CopyEngine:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stats = CopyStats()
        self._issue_s: collections.deque[float] = collections.deque(maxlen=64)
        if self.cuda:
            self.d2h, self.h2d = _copy_streams(device)

    @property
    def stream_ids(self) -> tuple[int, ...]:
        return (self.d2h.cuda_stream, self.h2d.cuda_stream) if self.cuda else ()

    def to_host(self, src: torch.Tensor, dst: torch.Tensor) -> torch.cuda.Event | None:
        """Starts copying `src` (device) into `dst` (host); returns the event that marks the end.
        The caller may drop `src` at once: its block is not reused before the copy finished."""
        if not self.cuda:
            t0 = time.perf_counter()
            dst.copy_(src)
            self._host_timed("d2h", dst.nbytes, t0)
            return None
        t0 = time.perf_counter()
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        start, end = _timing_event(), _timing_event()
        with torch.cuda.stream(self.d2h):
            start.record(self.d2h)  # the stream named: record() alone looks the current one up again
            dst.copy_(src, non_blocking=True)
            end.record(self.d2h)
        src.record_stream(self.d2h)
        self.stats.pending.append(("d2h", dst.nbytes, start, end))
        self._issued(t0)
        return end

    def to_host_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event | None:
        """As to_host for several (src, dst) pairs, with one event for them all: one ordering against
        compute and one timing pair instead of one per tensor (a block's gradients: ~100 us less each)."""
        if not self.cuda:
            t0 = time.perf_counter()
            for src, dst in pairs:
                dst.copy_(src)
            self._host_timed("d2h", sum(dst.nbytes for _, dst in pairs), t0)
            return None
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        start, end = _timing_event(), _timing_event()
        with torch.cuda.stream(self.d2h):
            start.record(self.d2h)
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)
            end.record(self.d2h)
        for src, _ in pairs:
            src.record_stream(self.d2h)
        self.stats.pending.append(("d2h", sum(dst.nbytes for _, dst in pairs), start, end))
        return end

    def to_device(self, src: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Starts copying the flat host tensor `src` into a new flat device tensor. Use the result
        only after `use(tensor, event)` on the consuming stream."""
        if not self.cuda:
            t0 = time.perf_counter()
            out = src.clone()
            self._host_timed("h2d", src.nbytes, t0)
            return out, None
        t0 = time.perf_counter()
        with torch.cuda.stream(self.h2d):  # allocated on the copy stream: no hazard with compute's blocks
            out = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        return out, self._h2d(src, out, None, t0)

    def into_device(self, src: torch.Tensor, dst: torch.Tensor, after: Any = None) -> Any:
        """Starts copying the host tensor `src` into the device tensor `dst` once `after` (an event:
        the last use of what `dst` held) has passed; returns the copy's end event (None on CPU)."""
        t0 = time.perf_counter()
        if not self.cuda:
            dst.copy_(src)
            self._host_timed("h2d", src.nbytes, t0)
            return None
        return self._h2d(src, dst, after, t0)

    def _h2d(self, src: torch.Tensor, dst: torch.Tensor, after: Any, t0: float) -> Any:
        """One host-to-device copy on the copy stream, timed by events; its issue began at `t0`."""
        start, end = _timing_event(), _timing_event()
        if after is not None:
            self.h2d.wait_event(after)
        with torch.cuda.stream(self.h2d):
            start.record(self.h2d)
            dst.copy_(src, non_blocking=True)
            end.record(self.h2d)
        self.stats.pending.append(("h2d", src.nbytes, start, end))
        self._issued(t0)
        return end

    def _issued(self, t0: float) -> None:
        self._issue_s.append(time.perf_counter() - t0)

    def issue_s(self) -> float:
        """Host seconds a copy takes to issue (its events, stream switches, the launch), the median of
        the last ones: a host-bound step is longer by it, and the planner prices a copy's host side so."""
        return statistics.median(self._issue_s) if self._issue_s else 0.0

    def use(self, tensor: torch.Tensor, ready: torch.cuda.Event | None, stream: Any = None) -> None:
        """Makes `stream` (default: the current one) wait for `ready` before it uses `tensor` (timing
        the stall)."""
        if ready is None:
            return
        compute = stream if stream is not None else torch.cuda.current_stream(self.device)
        before, after = _timing_event(), _timing_event()
        before.record(compute)
        compute.wait_event(ready)
        after.record(compute)
        tensor.record_stream(compute)
        self.stats.pending.append(("wait", 0, before, after))

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Blocks the host until `event` (e.g. an offload under memory pressure) has completed."""
        if event is not None:
            event.synchronize()

    def collect(self, block: bool = False) -> CopyStats:
        """Folds finished timings into the totals (all of them, after a sync, with block=True)."""
        s = self.stats
        if block and self.cuda:
            torch.cuda.synchronize(self.device)
        still = []
        for kind, nbytes, start, end in s.pending:
            if not end.query():
                still.append((kind, nbytes, start, end))
                continue
            seconds = start.elapsed_time(end) / 1e3
            if kind == "wait":
                s.wait_seconds += seconds
            elif kind == "d2h":
                s.d2h_bytes += nbytes
                s.d2h_seconds += seconds
            else:
                s.h2d_bytes += nbytes
                s.h2d_seconds += seconds
        s.pending = still
        return s

    def _host_timed(self, kind: str, nbytes: int, t0: float) -> None:
        seconds = time.perf_counter() - t0
        if kind == "d2h":
            self.stats.d2h_bytes += nbytes
            self.stats.d2h_seconds += seconds
        else:
            self.stats.h2d_bytes += nbytes
            self.stats.h2d_seconds += seconds


_streams: dict[str, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}


def _copy_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """The device's (d2h, h2d) pair, one per device: the tensor pool and the streamer share the link
    (copies queue in the order they were asked for) and the host pool's blocks wait for two streams."""
    key = str(device)
    if key not in _streams:
        _streams[key] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    return _streams[key]


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)
