"""The port: what a treatment, a recipe, a region or a light call may use of the pool that holds it.

The pool implements it (pool.py); the parts are typed against it and none of them imports the pool.
PoolPort is the narrow, public part, all a treatment or a weight-cast recipe uses. PoolInternals adds
the members that regions, op and lean replays, light-call graphs and entries still reach into: each
leaves that list once the pool offers what it does in public words. PoolOwner is the pool as the parts
it owns (its budget, plan runner, rest, step clock, compiled graphs) see it, through `owner`.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import torch

from ..policies import Policy
from .rebuild_times import RebuildTimes


class PoolPort(Protocol):
    device: torch.device
    cuda: bool
    budget_bytes: int | None
    graphs: bool
    copies: Any  # transfer.copy.CopyEngine: the device-host copy streams
    host: Any  # the pool's share of the pinned host pool (transfer.host)
    regions: Any  # regions.Regions
    op_replays: Any  # op_replay.OpReplays

    @property
    def device_index(self) -> int: ...

    @property
    def device_bytes_per_s(self) -> float: ...

    def arrived(self, e: Any, tensor: torch.Tensor, event: Any) -> None:
        """A treatment or a recipe brought entry `e` back into `tensor` (ready after `event`)."""

    def count(self, name: str, n: int = 1) -> None:
        """Adds `n` to the counter `name` (stats())."""

    def using(self, e: Any) -> AbstractContextManager[None]:
        """`e` is being worked on: the pressure handler does not choose it meanwhile."""

    def copy_window(self) -> tuple[float, float, int] | None:
        """Where copies out hide behind the forward: (seconds into the step, forward seconds, bytes
        copied out so far), or None."""

    def payload_resized(self, e: Any, delta: int) -> None:
        """The device payload of away entry `e` grew by `delta` bytes."""


class PoolInternals(PoolPort, Protocol):
    """What regions and light calls (regions.py, region.py, light.py), op and lean replays, light-call
    graphs and entries still use: the pool's parts (the plan runner, the ledger, the step clock, the
    rest) and a few members of its own."""

    # (typed Any: the parts import this module, and an import back, even for types, is a circle)
    plans: Any  # PlanRunner (plan_run.py)
    ledger: Any  # Ledger (ledger.py)
    clock: Any  # StepClock (step.py)
    rest: Any  # Rest (rest.py)
    _counters: dict[str, int]
    _lock: Any
    _passthrough: bool
    _busy_s: float
    _device_total: int | None
    _light_graphs: Any

    def _active_here(self) -> bool: ...
    def _own(self, fn: Any, *args: Any) -> Any: ...
    def _pack(self, t: torch.Tensor) -> Any: ...
    def _pack_tensor(self, t: torch.Tensor, saved: bool = True) -> Any: ...
    def _region_done(self, region: Any = None, outputs: list | None = None) -> None: ...
    def _unpack_input(self, packed: Any) -> Any: ...
    def _release(self, e: Any) -> None: ...


class PoolOwner(PoolInternals, Protocol):
    """What the pool's own parts (budget.py, plan_run.py, rest.py, step.py, compiled.py) reach: each
    other, the policy and the treatments, and the pool's moves of an entry."""

    budget: Any  # Budget (budget.py)
    policy: Policy
    planning: bool  # the policy plans (Policy.plans)
    nvtx: bool
    always_active: bool
    treatments: dict[str, Any]  # Treatment (treatments/base.py) by name
    rebuild_times: RebuildTimes
    _by_kind: dict[str, Any]  # the Treatment a plan uses for each kind
    _settlers: list[Any]
    _prefetched_bytes: int
    _local: threading.local

    def _leave(self, e: Any, t: Any) -> bool: ...
    def _come_back(self, e: Any) -> None: ...
    def _settle(self) -> None: ...
    def _left_alone(self, t: torch.Tensor) -> Any: ...
    def _on_pressure(self, need_bytes: int) -> int: ...
    def _unpack(self, packed: Any) -> torch.Tensor: ...


P = TypeVar("P")


def owner(ref: weakref.ref[P]) -> P:
    """The pool a part holds weakly (the pool owns the part): alive whenever the pool's own calls reach
    the part. A late call after the pool is collected (a hook or a finalizer left behind) raises
    ReferenceError, as a weakref.proxy does."""
    pool = ref()
    if pool is None:
        raise ReferenceError("supermem pool: a part of a pool that was collected was called")
    return pool


class TreatmentLike(Protocol):
    """What an entry knows of the treatment that holds it (treatments/base.py's Treatment)."""

    name: str
    kind: str
    rebuilds: bool
    prefetch: bool
    events: tuple[str, str] | None

    def come_back(self, pool: Any, e: Any) -> None: ...
    def ready(self, pool: Any, e: Any) -> None: ...
    def arrived(self, pool: Any, e: Any) -> None: ...
    def device_bytes(self, e: Any) -> int: ...
    def forget(self, pool: Any, e: Any) -> None: ...
    def check(self, pool: Any, e: Any) -> None: ...


class LightCall(Protocol):
    """What light-call graphs read of a light call (light.py's _Light)."""

    module: torch.nn.Module
    state: Any
