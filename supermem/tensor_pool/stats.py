"""What Pool.stats() returns, typed: a misspelled key is a type checker's error, not a KeyError."""

from __future__ import annotations

from typing import TypedDict

from .planner.plan import TreatmentCounts

# Pool.stats()'s counters, zeroed by reset_stats()
COUNTERS = (
    "packed",
    "offloads",
    "dropped",
    "recomputes",
    "prefetches",
    "sync_restores",
    "host_full",
    "pressure_calls",
    "backpressure_waits",
    "plans",
    "replans",
    "plan_misses",
    "light_calls",
    "bypassed_calls",
    "lean_calls",
    "lean_drops",
    "replays",
    "graph_replays",
    "rest_steps",
    "rest_wakes",
    "offloaded_bytes",
    "dropped_bytes",
)


class PlanStats(TreatmentCounts):
    """The running plan's predictions beside the last step's measurements (planned policy); first the
    saved tensors it offloads, recomputes, compresses and keeps."""

    feasible: bool
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    predicted_step_s: float
    measured_step_s: float
    plan_s: float
    added_s: float
    untreated_peak_bytes: int
    untreated_step_s: float
    plans_cached: int
    resting: bool


class _PoolStats(TypedDict):
    tracked_bytes: int  # the saved tensors the pool tracks, by state
    resident_bytes: int
    leaving_bytes: int
    away_bytes: int
    returning_bytes: int
    plan_kept_bytes: int  # kept by the plan without entries
    entries_by_state: dict[str, int]
    away_bytes_by_treatment: dict[str, int]
    peak_resident_bytes: int
    largest_entry_bytes: int
    budget_bytes: int | None
    margin_bytes: int
    prefetched_bytes: int
    regions: int
    light_split_misses: int
    compiled_kept_bytes: int  # saved by compiled graphs, every step: left to the compiler (compiled.py)
    compiled_step_bytes: int  # of them, the last measured step's activations (parameters left out)
    compile_share: float | None  # the activation_memory_budget graphs compile at under the pool
    compile_recompiles: int  # times the pool had compiled graphs compile again under a new share
    steps: int
    packed: int
    offloads: int
    offloaded_bytes: int
    dropped: int
    dropped_bytes: int
    recomputes: int
    prefetches: int
    sync_restores: int
    host_full: int
    pressure_calls: int
    backpressure_waits: int
    plans: int
    replans: int
    plan_misses: int
    light_calls: int
    bypassed_calls: int
    lean_calls: int
    lean_drops: int
    replays: int
    graph_replays: int
    rest_steps: int
    rest_wakes: int
    host_reserved_bytes: int
    d2h_gbps: float
    h2d_gbps: float
    copy_seconds: float
    wait_seconds: float
    hidden_fraction: float
    plan: PlanStats | None


class PoolStats(_PoolStats, total=False):
    """Pool.stats(). The compression counters are there once compression was offered."""

    compressions: int
    decompressions: int
    compressed_bytes: int
    compressed_payload_bytes: int
    room_misses: int
