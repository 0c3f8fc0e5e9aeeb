"""The one registry of tensor-pool policies: the live pool (`supermem.pool(policy=...)`), config
validation (`SUPERMEM_CONF=pool:...`) and the offline replayer (`supermem replay --policy`) all read
`POLICIES` here. Ground floor: no torch, no other supermem module.

A policy answers "which entries leave the device, and how" (the way torch.utils.checkpoint's
CheckpointPolicy answers per op). The live pool offers it `Choice`s: one per way to free bytes (offload
one entry; recompute a region, which frees all of its recomputable entries at once), each with the
bytes it frees, its estimated exposed cost in seconds and its staleness. The replayer, which has only
block lifetimes, asks `key(start, end)` instead (smallest leaves first).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Choice:
    """One way to free device bytes: `treatment` ("offload", "recompute", ...) applied to `target` (an
    entry or a region), freeing `nbytes` at an estimated exposed cost of `cost_s` seconds. `frees` names
    the entries it takes off the device, so two choices that overlap are not both taken."""

    target: Any
    treatment: str
    nbytes: int
    cost_s: float
    last_use: int
    frees: tuple = ()


class Policy:
    name = "base"
    live = True  # usable by the live pool (False: needs the future, replay only)
    kinds: tuple[str, ...] = ("offload",)  # the kinds of treatment it may choose (Treatment.kind)
    plans = False  # it plans each step's shape ahead (solve); else it only chooses as the step runs
    doc = ""

    def solve(self, profile: Any, budget: int) -> Any:
        """A plan (tensor_pool.planner.Plan) for the profiled step under `budget` bytes: the solver a
        planning policy brings. The pool calls it once per step shape, and again lower where a plan
        missed its budget."""
        raise NotImplementedError

    def score(self, c: Choice, now: int) -> float:
        """Lower scores leave first."""
        raise NotImplementedError

    def choose(self, choices: Iterable[Choice], need_bytes: int, now: int) -> list[Choice]:
        """The lowest-scored choices, not overlapping, whose bytes add up to `need_bytes` (or all)."""
        chosen: list[Choice] = []
        taken: set[int] = set()
        total = 0
        usable = [c for c in choices if c.nbytes > 0]  # (the pool asks only its kinds: Budget.choices)
        for c in sorted(usable, key=lambda c: self.score(c, now)):
            if total >= need_bytes:
                break
            ids = {id(x) for x in c.frees}
            if ids & taken:
                continue
            taken |= ids
            chosen.append(c)
            total += c.nbytes
        return chosen

    def key(self, start: int, end: int) -> float:
        """Replay: the order in which live blocks (allocated at `start`, freed at `end`) leave."""
        raise NotImplementedError


class LRU(Policy):
    """Offload least recently used first. In training, the activations saved earliest in the forward
    are used last in backward, so they have the most time to come back."""

    name = "lru"
    doc = "offload least recently used"

    def score(self, c: Choice, now: int) -> float:
        return c.last_use

    def key(self, start: int, end: int) -> float:
        return start


class CostAware(Policy):
    """DTR's rule: the smallest cost / (bytes x staleness) leaves first, over offload (whose cost is
    the copy time the link cannot hide), recompute (the measured forward time of the region rebuilt)
    and compress (the measured pack + unpack time; only where the pool has that treatment). A trace
    has no costs, so the replayer runs it as lru."""

    name = "cost_aware"
    kinds: tuple[str, ...] = ("offload", "recompute", "compress")
    doc = "offload or recompute, whichever costs less per byte freed (DTR)"

    def score(self, c: Choice, now: int) -> float:
        staleness = max(1, now - c.last_use)
        return c.cost_s / (c.nbytes * staleness)

    def key(self, start: int, end: int) -> float:
        return start


class Planned(CostAware):
    """Live: profile the first step of each shape, then plan keep / offload / recompute for every saved
    tensor so the step stays under the budget at every point for the least added time
    (tensor_pool/planner/); until a plan exists, and as a fallback, it acts as cost_aware. Replay
    (block lifetimes only, the future known): Belady's optimal eviction, the block needed furthest
    ahead leaves first."""

    name = "planned"
    kinds = ("offload", "recompute")  # its fallback does not compress
    plans = True
    doc = "plan each saved tensor's treatment from a profiled step (replay: Belady)"

    def solve(self, profile: Any, budget: int) -> Any:
        """The greedy (tensor_pool/planner/greedy.py)."""
        from .tensor_pool.planner import make_plan  # (the pool's package imports this module)

        return make_plan(profile, budget)

    def key(self, start: int, end: int) -> float:
        return -(end if end >= 0 else float("inf"))


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (LRU, CostAware, Planned)}


def live_names() -> list[str]:
    return [n for n, p in POLICIES.items() if p.live]


def make_policy(name: str, live: bool = True) -> Policy:
    """The policy called `name`; ValueError naming the known ones otherwise."""
    known = live_names() if live else list(POLICIES)
    if name not in known:
        where = "the live pool" if live else "replay"
        raise ValueError(f"unknown pool policy {name!r} for {where}; known: {', '.join(known)}")
    return POLICIES[name]()
