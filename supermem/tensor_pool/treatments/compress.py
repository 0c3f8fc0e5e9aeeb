"""Compress: a ReLU output packed on the device (bitmap and nonzeros), unpacked when backward reads it."""

from __future__ import annotations

import collections
import contextlib
import functools
import statistics
import time
import weakref
from collections.abc import Iterable

import torch

from ... import costs
from ...compress import Packed, fitted, packed_nbytes, relu_pack, relu_unpack, trimmed
from ...errors import UsageError
from ...policies import Choice
from ..entry import Entry, State
from ..port import PoolPort
from .base import Treatment

RELU_MADE = frozenset({"ReluBackward0", "ReluBackward1", "ThresholdBackward0", "ThresholdBackward1"})
TIMED_USES = 8  # packs (and unpacks) timed; the fastest per byte prices them (the first one warms up)
ROOM_MARGIN = 1.03  # values room: this times the same saved tensor's nonzeros last step, ...
ROOM_SLACK = 1 / 256  # ... plus this share of the elements (densities drift from step to step)
ROOM_NEW_SLACK = 1 / 16  # a tensor never packed: the densest of its size so far, plus this share
EXACT_SAMPLES = 16  # the last exact packs' host seconds kept; their median prices the next
ROOMS = ("exact", "guess", "full")  # Compress(room=...)


class Compress(Treatment):
    """Packs a ReLU's output (about half zeros) into a bitmap and its nonzeros on the device
    (supermem.compress), unpacks it when backward needs it. It frees about half the tensor and needs
    no link; its payload stays on the device, so the pool's device bytes count the packed bytes. A
    saved tensor qualifies when a relu/relu_/threshold made it (its grad_fn) and it is dense in memory
    (it comes back with its exact strides).

    The packed size depends on the data; `room` says how a pack sizes its values:
    - "exact" (the default): each pack reads its nonzero count back to size the values exactly: one
      host sync, which drains the GPU's queue.
    - "guess": after the first pack of each size, room for the same saved tensor's count last step (or
      the densest share seen at its size) plus a margin, and nothing waits: the count comes back by an
      asynchronous copy, and the original tensor is kept until it shows the values fit (`settle`: at
      the pool's next save or decision; at once under pressure). If they did not, the entry is
      resident again with its kept original (a room miss), and its next pack gets room for the count
      now known. On an H100 the originals kept until their counts came back lifted the forward's peak
      (a ResNet at budget 0 saved 22% of the bytes it compressed instead of the 25%+ exact packs save).
    - "full": room for every element, so nothing waits and no pack misses; the original goes at once
      (its memory is the next kernels' in stream order), and once the count is back (`settle`) the
      values move into a buffer of their exact size (a device copy of the nonzeros). Until then the
      pack holds a little more than the tensor did (its bitmap and offsets): a pack frees its bytes
      when its count is back, not when it is made. On an H100, a small ResNet at budget 0: peak 181.8
      MiB with full rooms, 181.1 with exact packs, 192.2 plain (tests/gpu/test_compress_pool_gpu.py).

    ReLU's own backward reads only the mask (1 bit per element), but the same tensor is almost always
    the next layer's input too (one entry, saved twice), which needs the values: the mask-only form is
    not used, since the pool does not know which ops saved an entry."""

    name = "compress"
    kind = "compress"
    events = ("compress", "decompress")

    @classmethod
    def from_spec(cls, arg: str) -> Compress:
        if arg not in ROOMS:
            raise ValueError(f"compress takes a room: {', '.join(ROOMS)}")
        return cls(room=arg)

    @classmethod
    def specs(cls) -> list[str]:
        return [cls.name, *(f"{cls.name}:{r}" for r in ROOMS)]

    def takes(self, e: Entry) -> bool:
        return self.compressible(e)

    def __init__(self, room: str = "exact"):
        if room not in ROOMS:
            raise UsageError(f"Compress: room must be one of {', '.join(ROOMS)}, got {room!r}")
        self.room = room
        self._tensor_bytes = 0  # over all packs: what they took and what they made
        self._packed_bytes = 0
        self._timing = {"pack": _Timing(), "unpack": _Timing()}
        self._packing = 0  # packs in progress (see leave)
        self._incompressible: weakref.WeakSet[Entry] = weakref.WeakSet()
        self._relu_made: weakref.WeakKeyDictionary[Entry, bool] = weakref.WeakKeyDictionary()
        self._last_nnz: dict[tuple[int, int], int] = {}  # (ordinal in its step, elements) -> nonzeros
        self._densest: dict[int, float] = {}  # elements -> the highest nonzero share packed at that size
        self._unsettled: list[weakref.ref[Entry]] = []  # packed, count not read yet (room not exact)
        self._settling = False
        # host seconds of the last exact packs on a GPU (their sync)
        self._exact_s: collections.deque[float] = collections.deque(maxlen=EXACT_SAMPLES)
        # host seconds of the last packs (not waiting), unpacks and trims on a GPU: what a packed
        # tensor costs the host there (relu_pack's allocations and launch, the pool's bookkeeping)
        self._host_s: dict[str, collections.deque[float]] = {
            k: collections.deque(maxlen=EXACT_SAMPLES) for k in ("pack", "unpack", "trim")
        }

    def applies(self, e: Entry) -> bool:
        if e.recipe is not None and not e.recipe.ready:
            return False  # a call still running decides at its end, as for offload
        return self.compressible(e)

    def compressible(self, e: Entry) -> bool:
        """A ReLU made it, and it can be packed here now (what a plan asks, which decided already)."""
        t = e.tensor
        if t is None:
            return False
        made = self._relu_made.get(e)
        if made is None:  # fixed for the entry's life: asked once (a decision prices dozens of entries)
            made = self._relu_made[e] = _relu_output(t, e.made_by)
        if not made or e in self._incompressible:
            return False
        # No kernels; or a CUDA graph is being captured, and a pack may sync.
        return not t.is_cuda or (_kernels_built() and not torch.cuda.is_current_stream_capturing())

    def measured(self) -> bool:
        return all(x.s_per_byte is not None for x in self._timing.values())

    def price(self, pool: PoolPort) -> tuple[float, float, float, float]:
        """(seconds per byte to pack and unpack, packed bytes per tensor byte, host seconds a pack
        waits for its count, host seconds of a pack, its unpack and its trim): measured so far, or the
        priors. The wait is an exact pack's on a GPU; the host seconds are a GPU's (the median of the
        last ones of each), where a host-bound step pays them whatever the kernels take (ResNet-152 at
        checkpoint's peak on an H100: a plan packing 56 tensors a step predicted 127.6 ms, took 208.8
        while pricing kernels alone). On CPU the seconds per byte are the host's already: 0."""
        prior = costs.PRIOR_PASSES / 2 / pool.device_bytes_per_s
        s_per_byte = sum(x.s_per_byte_or(prior) for x in self._timing.values())
        ratio = self._packed_bytes / self._tensor_bytes if self._tensor_bytes else costs.PACKED_RATIO_PRIOR
        wait_s = 0.0
        if pool.cuda and self.room == "exact":
            wait_s = statistics.median_high(self._exact_s) if self._exact_s else costs.EXACT_PACK_PRIOR_S
        host_s = sum(statistics.median_high(d) for d in self._host_s.values() if d) if pool.cuda else 0.0
        return s_per_byte, ratio, wait_s, host_s

    def choices(self, pool: PoolPort, resident: Iterable[Entry]) -> list[Choice]:
        _count(pool)
        if self._packing:
            return []
        s_per_byte, ratio, *_ = self.price(pool)  # (the reactive policies weigh neither wait nor host)
        out = []
        for e in resident:
            if self.applies(e):
                room = self._room(e)  # what the payload will take, when this tensor was packed before
                payload = int(ratio * e.nbytes) if room is None else self._payload_bytes(e, room)
                out.append(Choice(e, self.name, e.nbytes - payload, s_per_byte * e.nbytes, e.last_use, (e,)))
        return out

    def _room(self, e: Entry) -> int | None:
        """Values room for `e`'s pack: its count last step plus the margin; for a tensor not packed
        before, the densest share seen at its size plus a wider margin; None: no size seen, or not
        guessing (exact)."""
        if self.room != "guess":
            return None
        last = self._last_nnz.get((e.ordinal, e.extent))
        if last is not None:
            return int(last * ROOM_MARGIN + e.extent * ROOM_SLACK)
        densest = self._densest.get(e.extent)
        return None if densest is None else int(e.extent * (densest + ROOM_NEW_SLACK))

    @staticmethod
    def _payload_bytes(e: Entry, room: int) -> int:
        return packed_nbytes(e.extent, min(room, e.extent), e.dtype.itemsize)

    def leave(self, pool: PoolPort, e: Entry) -> bool:
        if e.state is not State.RESIDENT or e.tensor is None:
            return False  # taken off by a pressure call nested in another pack
        room = self._room(e)
        if room is not None and self._payload_bytes(e, room) >= e.nbytes:
            room = None  # a room that saves nothing (a small tensor): size it exactly
        # The payload's allocation may call the pool's pressure handler from inside this pack: it must
        # neither pack again nor take this entry from under it.
        self._packing += 1
        try:
            with pool.using(e):
                # Timed unless it waits for its count (an exact pack on a GPU: its host seconds price
                # it, price()).
                t0 = time.perf_counter()
                waits = room is None and self.room != "full" and pool.cuda
                with self._timing["pack"].timed(pool, 0 if waits else e.nbytes):
                    packed = relu_pack(e.tensor, exact=self.room != "full", capacity=room)
                (self._exact_s if waits else self._host_s["pack"]).append(time.perf_counter() - t0)
        except torch.OutOfMemoryError:
            return False  # no room for the payload even after pressure: another treatment frees
        finally:
            self._packing -= 1
        if packed.host_nnz is not None:  # exact (or made on the host)
            if not self._packed(pool, e, packed, packed.host_nnz):
                return False
            e.payload = packed
        else:  # the count comes back without a wait; a guessed room keeps the original until it fits
            e.payload = _Unsettled(packed, e.tensor if room is not None else None)
            self._unsettled.append(weakref.ref(e))
        e.state = State.AWAY
        _count(pool, compressions=1, compressed_bytes=e.nbytes)
        return True

    def _packed(self, pool: PoolPort, e: Entry, packed: Packed, nnz: int) -> bool:
        """Learns from a whole pack of `e`, of `nnz` nonzeros; False if it frees nothing (then `e` is
        never packed again)."""
        self._last_nnz[(e.ordinal, e.extent)] = nnz
        self._densest[e.extent] = max(self._densest.get(e.extent, 0.0), nnz / max(1, e.extent))
        self._tensor_bytes += e.nbytes
        self._packed_bytes += packed.nbytes
        if packed.nbytes >= e.nbytes:  # dense after all: packing it again would free nothing
            self._incompressible.add(e)
            return False
        _count(pool, compressed_payload_bytes=packed.nbytes)
        return True

    def settle(self, pool: PoolPort, wait: bool = False) -> None:
        """Packs whose nonzero count is back (all of them, waiting, with `wait`): a full room's values
        move into a buffer of their size; a guessed room's original goes if the values fit; if not,
        the entry is resident again with its original (no sync, no new allocation), and the count it
        learned sizes its next pack. A trim's allocation may come to the pressure handler, which
        settles: that nested call leaves the packs to this one."""
        if self._settling:
            return
        self._settling = True
        try:
            self._settle(pool, wait)
        finally:
            self._settling = False

    def _settle(self, pool: PoolPort, wait: bool) -> None:
        still = []
        for ref in self._unsettled:
            e = ref()
            if e is None or not isinstance(e.payload, _Unsettled):
                continue  # died, or came back by a replay
            u = e.payload
            if not u.done(wait):
                still.append(ref)
                continue
            t0 = time.perf_counter()
            nnz = u.nnz()
            if u.original is None:  # room for every element
                whole = _trimmed(u.packed, nnz)
            else:
                fits = fitted(u.packed, nnz)
                if fits is None:  # more nonzeros than the room: rare (a margin over last step's count)
                    self._last_nnz[(e.ordinal, e.extent)] = nnz
                    _count(pool, room_misses=1)
                    pool.arrived(e, u.original, None)
                    self.arrived(pool, e)
                    continue
                whole = fits
            self._host_s["trim"].append(time.perf_counter() - t0)
            before = self.device_bytes(e)
            self._packed(pool, e, whole, nnz)  # dense this step: it stays packed (lossless), never again
            e.payload = whole
            pool.payload_resized(e, self.device_bytes(e) - before)
        self._unsettled = still

    def come_back(self, pool: PoolPort, e: Entry) -> None:
        if isinstance(e.payload, _Unsettled):
            self.settle(pool, wait=True)  # long done by backward, as a rule
            if e.state is State.RESIDENT:
                return  # the room was short: it is back already, as its kept original
        p = e.payload
        t0 = time.perf_counter()
        with self._timing["unpack"].timed(pool, e.nbytes):
            t = relu_unpack(p)
        if t.is_cuda:  # read on this stream; packed on the saving op's (the same one, but for odd models)
            stream = torch.cuda.current_stream(t.device)
            for x in (p.bitmap, p.offsets, p.values):
                x.record_stream(stream)
            self._host_s["unpack"].append(time.perf_counter() - t0)
        _count(pool, decompressions=1)
        pool.arrived(e, t, None)
        self.arrived(pool, e)

    def arrived(self, pool: PoolPort, e: Entry) -> None:
        """The entry is back on the device (unpacked, or rebuilt by a region's replay): its payload,
        device memory the pool no longer counts, goes."""
        e.payload = None

    def device_bytes(self, e: Entry) -> int:
        """The packed bytes. A kept original is not counted: it goes as soon as its pack is known to
        fit, and the allocator (what the budget reads on a GPU) sees it until then."""
        p = e.payload
        if isinstance(p, _Unsettled):
            p = p.packed
        return p.nbytes if p is not None else 0

    def check(self, pool: PoolPort, e: Entry) -> None:
        p = e.payload
        if isinstance(p, _Unsettled):
            whole = p.packed.values.numel() == p.packed.numel
            assert whole or p.original is not None, f"{e}: packed into a guessed room without its original"
            p = p.packed
        assert isinstance(p, Packed), f"{e}: away without its packed payload"
        assert (p.shape, p.stride, p.dtype) == (e.shape, e.stride, e.dtype), f"{e}: packed as another tensor"


def _trimmed(packed: Packed, nnz: int) -> Packed:
    """A full room trimmed to its count; kept whole where the device has no room for the copy."""
    try:
        return trimmed(packed, nnz)
    except torch.OutOfMemoryError:
        whole = fitted(packed, nnz)
        if whole is None:  # (never: trimmed checked the count against the room before it ran out)
            raise
        return whole


class _Unsettled:
    """A pack whose nonzero count is on its way to the host: into a guessed room, with the original
    kept; or into room for every element (`original` None)."""

    __slots__ = ("packed", "original", "_count", "_event")

    def __init__(self, packed: Packed, original: torch.Tensor | None):
        self.packed, self.original = packed, original
        last = packed.offsets[-1:]
        if last.is_cuda:
            self._count = torch.empty(1, dtype=torch.int64, pin_memory=True)
            self._count.copy_(last, non_blocking=True)
            self._event: torch.cuda.Event | None = torch.cuda.Event()
            self._event.record()
        else:
            self._count, self._event = last, None

    def done(self, wait: bool) -> bool:
        if self._event is None:
            return True
        if wait:
            self._event.synchronize()
            return True
        return self._event.query()

    def nnz(self) -> int:
        return int(self._count[0])


class _Timing:
    """Seconds per byte of one operation, from its first TIMED_USES runs: CUDA events on a GPU (read
    when done, never waited for), the host clock on CPU. The fastest run prices it."""

    def __init__(self):
        self.s_per_byte: float | None = None
        self._runs = 0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []

    def s_per_byte_or(self, prior: float) -> float:
        self._collect()
        return prior if self.s_per_byte is None else self.s_per_byte

    @contextlib.contextmanager
    def timed(self, pool: PoolPort, nbytes: int):
        if self._runs >= TIMED_USES or nbytes == 0:
            yield
            return
        self._runs += 1
        if not pool.cuda:
            t0 = time.perf_counter()
            yield
            self._add(time.perf_counter() - t0, nbytes)
            return
        stream = torch.cuda.current_stream(pool.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(stream)
        self._pending.append((start, end, nbytes))

    def _collect(self) -> None:
        still = []
        for start, end, nbytes in self._pending:
            if end.query():
                self._add(start.elapsed_time(end) / 1e3, nbytes)
            else:
                still.append((start, end, nbytes))
        self._pending = still

    def _add(self, seconds: float, nbytes: int) -> None:
        v = seconds / nbytes
        self.s_per_byte = v if self.s_per_byte is None else min(self.s_per_byte, v)


_PACKABLE = (torch.float32, torch.float16, torch.bfloat16)
_COUNTERS = ("compressions", "decompressions", "compressed_bytes", "compressed_payload_bytes", "room_misses")


def _count(pool: PoolPort, **add: int) -> None:
    """Compress's counters, kept in the pool's (stats() shows them, reset_stats() zeroes them) from
    the first decision compression is offered in."""
    for k in _COUNTERS:
        pool.count(k, add.get(k, 0))


def _dense(t: torch.Tensor) -> bool:
    """Elements dense in memory in some dimension order: relu_pack keeps such a layout exactly."""
    if t.is_contiguous():
        return True
    return t.permute(sorted(range(t.dim()), key=t.stride, reverse=True)).is_contiguous()


def _relu_output(t: torch.Tensor, made_by: str) -> bool:
    """A relu/relu_/threshold made it (`made_by`: its grad_fn's name when saved), in a packable dtype
    and dense in memory."""
    return made_by in RELU_MADE and t.dtype in _PACKABLE and _dense(t)


@functools.cache
def _kernels_built() -> bool:
    from ... import _C

    return bool(getattr(_C, "has_relu_kernels", False))
