"""Steps: the entries saved for one forward/backward belong to one Step, with an ordinal inside it.

A step starts at the first tensor saved after a backward began (or when the pool holds nothing) and
marks where its backward began (its first unpack). The pool uses steps to keep graphs apart
(prefetch looks only at the entries of the step being unpacked) and to carry what it learned (the
forward's duration, which bounds what the link can hide) from one step to the next.
"""

from __future__ import annotations

import time

import torch

NO_EARLY_CALL = object()  # Step.early_plan of a step that opened at a save


class Step:
    __slots__ = (
        "index",
        "early_plan",
        "started_s",
        "backward_s",
        "events",
        "ordinals",
        "saved_bytes",
        "offloaded",
        "held",
    )

    def __init__(self, index: int, cuda: bool = False):
        self.index = index
        self.started_s = time.perf_counter()
        self.backward_s: float | None = None  # when its first entry was unpacked (host clock)
        self.events: list | None = None  # on a GPU: the forward's start and end, on the compute stream
        if cuda:
            self.events = [torch.cuda.Event(enable_timing=True)]
            self.events[0].record()
        self.ordinals = 0
        self.saved_bytes = 0
        self.offloaded = 0  # bytes sent to host in this step's forward
        # outputs of calls the pool did not see, for their next save (PlanRunner._unseen_outputs)
        self.held: list = []
        # the plan that decided the step's first call, where a region call came before the step opened
        # (a call at the very start of the forward: the step opens inside it, and may plan the shape
        # again there); NO_EARLY_CALL where a save opened it
        self.early_plan: object = NO_EARLY_CALL

    @property
    def forward_s(self) -> float | None:
        """The forward's duration: GPU time where there is one (the host runs ahead of it)."""
        if self.backward_s is None:
            return None
        if self.events is not None and len(self.events) == 2 and self.events[1].query():
            return self.events[0].elapsed_time(self.events[1]) / 1e3
        return self.backward_s - self.started_s

    def unpacked(self) -> None:
        """Its first unpack marks where backward began (no save comes after: what was held goes)."""
        self.backward_s = time.perf_counter()
        self.held = []
        if self.events is not None:
            self.events.append(torch.cuda.Event(enable_timing=True))
            self.events[1].record()

    def __repr__(self) -> str:
        return f"Step({self.index}, {self.ordinals} entries)"
