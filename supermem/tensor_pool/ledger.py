"""The ledger: the pool's entries, which of them hold the device, and the bytes they hold.

It only keeps books: the pool (pool.py) moves entries, asks their treatments, tells the step being
recorded, and writes each move here. Invariants, next to the data and walked by check():
- an entry holds its device tensor exactly while resident or returning;
- device_bytes == the sum over live entries of nbytes (resident, returning) or of the device payload
  their treatment keeps (leaving, away: a compressed entry's packed bytes, else 0);
- the LRU names live entries only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from .entry import Entry, PlanKept, State
from .port import TreatmentLike


class Ledger:
    """Entries by pack order, the least recently used resident ones, dedup by tensor identity, and
    the device bytes held (by entries, and by the plan's PlanKept tensors and unseen calls' saves)."""

    def __init__(self) -> None:
        self.entries: dict[int, weakref.ref[Entry]] = {}  # live entries by pack order
        self.seqs: list[int] = []  # pack order, with dead seqs compacted away now and then
        self.lru: dict[int, weakref.ref[Entry]] = {}  # resident entries, least recently used first
        self.dedup: dict[tuple, weakref.ref[Any]] = {}  # live entries (and PlanKept) by tensor identity
        self.tick = 0  # the use clock: each save and use stamps an entry's last_use
        self.device_bytes = 0  # held by entries: resident tensors and away payloads on the device
        self.kept_bytes = 0  # held by the plan's PlanKept tensors (no entries)
        self.kept_live = 0  # PlanKept tensors alive
        self.unseen_live = 0  # calls the pool did not see (light.py: _Alive) whose saves autograd holds
        self.largest_entry = 0  # bytes
        self.peak_resident_bytes = 0  # the most device_bytes + kept_bytes since stats were reset
        self.step_peak = 0  # the same, in this step (the step's peak on CPU)
        self.in_use: list[Entry] = []  # entries being materialized (under the lock): never chosen
        self.away_to_fetch: set[int] = set()  # seqs off the device by a treatment that prefetches

    # ------------------------------------------------------------------ moves

    def add(self, e: Entry) -> None:
        """A new entry, resident: at the LRU's most recent end already, so only its use is stamped."""
        self.largest_entry = max(self.largest_entry, e.nbytes)
        self.entries[e.seq] = weakref.ref(e)
        self.seqs.append(e.seq)
        self.dedup[e.key] = weakref.ref(e)
        self.add_resident(e)
        self.tick += 1
        e.last_use = self.tick

    def add_resident(self, e: Entry) -> None:
        self.device_bytes += e.nbytes
        self.note_peak()
        self.lru[e.seq] = weakref.ref(e)

    def note_peak(self) -> None:
        held = self.device_bytes + self.kept_bytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, held)
        self.step_peak = max(self.step_peak, held)

    def drop_resident(self, e: Entry) -> None:
        self.device_bytes -= e.nbytes
        self.lru.pop(e.seq, None)
        e.watch_version()
        e.tensor = None

    def touch(self, e: Entry) -> None:
        self.tick += 1
        e.last_use = self.tick
        if e.seq in self.lru:  # move to the most recently used end
            self.lru[e.seq] = self.lru.pop(e.seq)

    def left(self, e: Entry, t: TreatmentLike, payload_bytes: int) -> None:
        """`e` left the device by treatment `t`, which keeps `payload_bytes` of it there."""
        self.drop_resident(e)
        if t.prefetch:
            self.away_to_fetch.add(e.seq)
        self.device_bytes += payload_bytes

    def came_back(self, e: Entry, payload_bytes: int, tensor: torch.Tensor, event: Any) -> None:
        """`e` is back in `tensor` (ready after `event`, if any); its treatment kept `payload_bytes`."""
        self.device_bytes -= payload_bytes
        self.away_to_fetch.discard(e.seq)
        e.tensor = tensor
        e.event = event
        e.state = State.RETURNING if event is not None else State.RESIDENT
        self.add_resident(e)
        self.touch(e)

    def release(self, e: Entry) -> int | None:
        """The entry died: its books close and its tensor goes. The device bytes its treatment kept,
        where it was away (None where it was on the device or never left)."""
        self.entries.pop(e.seq, None)
        self.away_to_fetch.discard(e.seq)
        payload = None
        if e.state in (State.RESIDENT, State.RETURNING):
            self.device_bytes -= e.nbytes
            self.lru.pop(e.seq, None)
        elif e.treatment is not None:
            payload = e.treatment.device_bytes(e)
            self.device_bytes -= payload
        e.tensor = None
        if len(self.seqs) > 64 and len(self.seqs) > 2 * len(self.entries):
            self.seqs = [s for s in self.seqs if s in self.entries]
        return payload

    def forget(self, x: Entry | PlanKept) -> None:
        """`x` died: its dedup key goes, unless a newer save holds it."""
        ref = self.dedup.get(x.key)
        if ref is not None and ref() in (x, None):
            del self.dedup[x.key]

    # ------------------------------------------------------------------ queries

    def saved(self, key: tuple) -> Any:
        """The live entry (or PlanKept) saved under dedup `key`, or None."""
        ref = self.dedup.get(key)
        return ref() if ref is not None else None

    def entry(self, seq: int) -> Entry | None:
        ref = self.entries.get(seq)
        return ref() if ref is not None else None

    def restoring_entries(self) -> list[Entry]:
        return [x for ref in self.lru.values() if (x := ref()) is not None and x.state is State.RETURNING]

    def resident_entries(
        self, limit: int | None = None, keep: Callable[[Entry], bool] | None = None
    ) -> list[Entry]:
        """Resident entries, least recently used first (in-flight returns excluded), those `keep`
        accepts when given; the first `limit` of them when given."""
        out = []
        for ref in self.lru.values():
            x = ref()
            if (
                x is not None
                and x.state is State.RESIDENT
                and x.tensor is not None
                and (keep is None or keep(x))
            ):
                out.append(x)
                if limit is not None and len(out) >= limit:
                    break
        return out

    def by_state(self, treatments: Any) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Bytes and entries by state, and bytes off the device by the name of the treatment holding
        them (one key per name in `treatments` at least). A leaving entry whose copy landed is away."""
        nbytes = {s.value: 0 for s in State}
        count = {s.value: 0 for s in State}
        away = {name: 0 for name in treatments}
        for ref in self.entries.values():
            e = ref()
            if e is not None:
                if e.state is State.LEAVING and (e.event is None or e.event.query()):
                    e.state = State.AWAY
                nbytes[e.state.value] += e.nbytes
                count[e.state.value] += 1
                if e.state is not State.RESIDENT and e.treatment is not None:
                    away[e.treatment.name] = away.get(e.treatment.name, 0) + e.nbytes
        return nbytes, count, away

    def check(self, port: Any) -> None:
        """Walks the entries (the caller holds the pool's lock); AssertionError if the books or a
        treatment's invariant (asked through `port`, the pool) are off."""
        device = 0
        for ref in self.entries.values():
            e = ref()
            if e is None:
                continue
            holds_device = e.state in (State.RESIDENT, State.RETURNING)
            assert (e.tensor is not None) == holds_device, f"{e}: device tensor vs state"
            if holds_device:
                device += e.nbytes
            else:
                assert e.treatment is not None, f"{e}: off the device without a treatment"
                e.treatment.check(port, e)
                device += e.treatment.device_bytes(e)
        assert device == self.device_bytes, f"device bytes {device} != counter {self.device_bytes}"
        assert set(self.lru) <= set(self.entries), "LRU names dead entries"
