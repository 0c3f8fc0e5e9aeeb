"""A fourth treatment, as a user or a contributor would add one: this file and its registry line.

Stash keeps a copy of the tensor in ordinary (pageable) memory and gives the device's back: an offload
without the pinned host pool or the copy streams. It declares the kind the planner and the policies
price it as ("offload": bytes that cross the link and come back) and the rate they price it at."""

from __future__ import annotations

from supermem.tensor_pool.treatments import Treatment, register


@register
class Stash(Treatment):
    name = "stash"
    kind = "offload"
    prefetch = True

    def __init__(self):
        self.left = self.back = 0

    # what the planner asks of the offload kind
    def rate(self, pool) -> float:
        return 1e9

    def probe(self, pool) -> None:
        pass

    # what the reactive policies ask
    def choices(self, pool, resident):
        from supermem.policies import Choice

        return [Choice(e, self.name, e.nbytes, e.nbytes / 1e9, e.last_use, (e,)) for e in resident]

    def leave(self, pool, e) -> bool:
        from supermem.tensor_pool.entry import State

        e.payload = e.device_span().clone()
        e.state = State.AWAY
        self.left += 1
        return True

    def come_back(self, pool, e) -> None:
        self.back += 1
        pool.arrived(e, e.from_span(e.payload.clone()), None)

    def host_bytes(self, e) -> int:
        return e.payload.nbytes if e.payload is not None else 0

    def check(self, pool, e) -> None:
        assert e.payload is not None, f"{e}: stashed without its copy"
