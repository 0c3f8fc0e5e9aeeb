"""Recompute: a saved tensor dropped, and rebuilt from its recipe when backward reads it."""

from __future__ import annotations

from collections.abc import Iterable

from ...policies import Choice
from ..entry import Entry, State
from ..port import PoolPort
from .base import Treatment


class Recompute(Treatment):
    """Drops the tensor; rebuilds it when backward needs it, from its recipe: a module call replayed
    from its saved inputs (tensor_pool/region.py), or an autocast weight copy cast again from its
    parameter, or the cheap op that made it run again on its inputs (tensor_pool/op_replay.py).
    Dropping frees the memory at once; nothing crosses the link."""

    name = "recompute"
    kind = "recompute"
    rebuilds = True
    events = ("drop", "recompute")

    def applies(self, e: Entry) -> bool:
        return e.recipe is not None and e.recipe.ready and e.recipe.droppable(e)

    def choices(self, pool: PoolPort, resident: Iterable[Entry]) -> list[Choice]:
        groups: dict[int, list[Entry]] = {}
        recipes = {}
        for e in resident:
            if self.applies(e):
                key = id(e.recipe.group)
                groups.setdefault(key, []).append(e)
                recipes[key] = e.recipe
        out = []
        for key, es in groups.items():
            cost_s = recipes[key].cost_s(pool)
            if cost_s is None:
                continue  # not measured yet
            nbytes = sum(e.nbytes for e in es)
            out.append(
                Choice(recipes[key].group, self.name, nbytes, cost_s, max(e.last_use for e in es), tuple(es))
            )
        return out

    def leave(self, pool: PoolPort, e: Entry) -> bool:
        if not e.recipe.droppable(e):
            return False  # an op replay's input changed, or dropping it would make a cascade (op_replay.py)
        e.state = State.AWAY
        pool.count("dropped")
        pool.count("dropped_bytes", e.nbytes)
        return True

    def come_back(self, pool: PoolPort, e: Entry) -> None:
        pool.count("recomputes")
        e.recipe.rebuild(pool, e)

    def check(self, pool: PoolPort, e: Entry) -> None:
        assert e.recipe is not None and e.payload is None, f"{e}: away without a recipe"
