"""Eviction policies: which resident entries leave the device when the pool is over budget.

A policy sees entries through two attributes only, `nbytes` and `last_use` (a tick that grows with
every pack and unpack), so the same class scores live pool entries and simulated ones in the
offline replayer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class Candidate(Protocol):
    nbytes: int
    last_use: int


class Policy:
    name = "base"

    def score(self, entry: Candidate) -> float:
        """Lower scores leave first."""
        raise NotImplementedError

    def order(self, candidates: Iterable[Candidate]) -> list[Candidate]:
        """All candidates, first to leave first."""
        return sorted(candidates, key=self.score)

    def choose(self, candidates: Iterable[Candidate], need_bytes: int) -> list[Candidate]:
        """The lowest-scored candidates whose sizes add up to at least `need_bytes` (or all of them)."""
        chosen, total = [], 0
        for entry in self.order(candidates):
            if total >= need_bytes:
                break
            chosen.append(entry)
            total += entry.nbytes
        return chosen


class LRU(Policy):
    """Least recently used first. In training, the activations saved earliest in the forward pass
    are used last in the backward pass, so they have the most time to come back."""

    name = "lru"

    def score(self, entry: Candidate) -> float:
        return entry.last_use


POLICIES: dict[str, type[Policy]] = {"lru": LRU}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown pool policy {name!r}; known: {', '.join(POLICIES)}") from None
