"""A plan (what the planner returns: a treatment per saved tensor and the events that run it) and a
simulated run of one (the simulator's curve and added seconds)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict


class TreatmentCounts(TypedDict):
    """Saved tensors a plan offloads, recomputes, compresses and keeps (Plan.counts)."""

    offload: int
    recompute: int
    compress: int
    keep: int


@dataclass
class Plan:
    signature: tuple[int, ...]
    budget_bytes: int
    treatment: dict[int, str] = field(default_factory=dict)  # ordinal -> "offload" | "recompute" | "compress"
    lean: frozenset[int] = frozenset()  # kept, and no planned rebuild reads them: no entry needed
    region_starts: frozenset[int] = frozenset()  # the regions it replays, by the step's saves before them
    # region calls whose recording's capture made a save of the step (Profile.capture_made): captured
    # in every step it runs, which makes that save too, or the step's ordinals would skip it
    captures: frozenset[int] = frozenset()
    # regions it replays whole by checkpoint: the step's saves before the call -> at its end (light())
    light: dict[int, int] = field(default_factory=dict)
    # region calls whose saves it all keeps: run with the pool's hooks off (bypass()), same keys
    bypass: dict[int, int] = field(default_factory=dict)
    # of those calls, the outputs they save that are saved again after them: Profile.call_outputs
    outputs: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    # of those calls, the ones run lean (lean_call.py): call -> its save number -> the ordinal it drops,
    # and call -> the save numbers of what those rebuilds read
    drops: dict[int, dict[int, int]] = field(default_factory=dict)
    reads: dict[int, frozenset[int]] = field(default_factory=dict)
    event_of: dict[tuple[str, int], int] = field(default_factory=dict)  # ("p"|"u", ordinal) -> event
    prefetch_at: dict[int, list[int]] = field(default_factory=dict)  # event -> ordinals to bring back
    wait_at: dict[int, list[int]] = field(default_factory=dict)  # event -> copies that must have landed
    predicted_peak_bytes: int = 0
    predicted_step_s: float = 0.0
    added_s: float = 0.0
    feasible: bool = True
    plan_s: float = 0.0
    curve: list[int] = field(default_factory=list)  # per event of the profiled step: the bytes predicted
    untreated_peak_bytes: int = 0  # the profiled step's curve with nothing treated, the spike included
    untreated_step_s: float = 0.0  # the profiled step's seconds without the pool's own (Recorder.pause)

    def captured(self, start: int) -> bool:
        """Whether a step running it captures the region call after `start` saves: one it replays or
        runs unseen, or one whose capture makes a save of the step."""
        return start in self.region_starts or start in self.bypass or start in self.captures

    @property
    def idle(self) -> bool:
        """It moves nothing: every save kept, no call replayed, nothing waited for (PlanRunner.rests)."""
        moves = self.treatment or self.light or self.drops or self.wait_at or self.prefetch_at
        return self.feasible and not moves

    def counts(self) -> TreatmentCounts:
        n = {"offload": 0, "recompute": 0, "compress": 0}
        for t in self.treatment.values():
            n[t] += 1
        keep = len(self.signature) - sum(n.values())
        return {"offload": n["offload"], "recompute": n["recompute"], "compress": n["compress"], "keep": keep}


@dataclass
class Simulated:
    curve: list[int]
    land: dict[int, int]  # offloaded ordinal -> event from which it is off the device
    land_s: dict[int, float]  # offloaded ordinal -> when its copy out lands (seconds)
    fetch: dict[int, int]  # offloaded ordinal -> event its prefetch is issued
    need: dict[int, int]  # offloaded ordinal -> event it must be back by
    added_s: float
    late: bool = False  # a copy lands after the point it was chosen to lower (compute would wait)
