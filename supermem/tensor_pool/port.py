"""The port: what a treatment, a recipe, a region or a light call may use of the pool that holds it.

The pool implements it (pool.py); the parts are typed against it and none of them imports the pool.
PoolPort is the narrow, public part, all a treatment or a weight-cast recipe uses. PoolInternals adds
the members that regions, op and lean replays, light-call graphs and entries still reach into: each
leaves that list once the pool offers what it does in public words.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch


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


class TreatmentLike(Protocol):
    """What an entry knows of the treatment that holds it (treatments/base.py's Treatment)."""

    name: str
    kind: str
    rebuilds: bool
    prefetch: bool


class LightCall(Protocol):
    """What light-call graphs read of a light call (light.py's _Light)."""

    module: torch.nn.Module
    state: Any
