"""The port: what a treatment, a recipe, a region or a light call may use of the pool that holds it.

The pool implements it (pool.py); the parts are typed against it and none of them imports the pool.
Every name here is public: nothing outside pool.py reaches a pool's underscore members.
PoolPort is the narrow part, all a treatment or a weight-cast recipe uses. PoolInternals adds what
regions, op and lean replays, light-call graphs and entries use: the pool's parts and its hooks'
steps (pack a tensor, unpack a region's input, release an entry). PoolOwner is the pool as the parts
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
    graphs and entries use: the pool's parts (the plan runner, the ledger, the step clock, the rest)
    and the steps of its hooks."""

    # (typed Any: the parts import this module, and an import back, even for types, is a circle)
    plans: Any  # PlanRunner (plan_run.py)
    ledger: Any  # Ledger (ledger.py)
    clock: Any  # StepClock (step.py)
    rest: Any  # Rest (rest.py)
    lock: Any  # the pool's RLock: entries, ledger and plan change under it
    passthrough: bool  # saves are left alone (a checkpoint's own of its inputs)
    busy_s: float  # minus the seconds the pool spent in its own work (CPU region timing)
    device_total_bytes: int | None  # the card's memory; None on CPU
    light_graphs: Any  # LightGraphs (light_graphs.py), made at the first light call on CUDA
    compiled: Any  # CompiledGraphs (compiled.py)

    def room_for(self, nbytes: int, spare: list[Any]) -> None:
        """A rebuild is about to bring `nbytes` back at once: entries backward has not used yet, but
        those in `spare`, leave first where nothing else would make room for them."""

    def active_here(self) -> bool:
        """Whether the pool's hooks serve this thread now."""

    def own_work(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` as the pool's own work: a step being recorded does not count its seconds."""

    def pack(self, t: torch.Tensor) -> Any:
        """The pool's pack hook."""

    def pack_tensor(self, t: torch.Tensor, saved: bool = True) -> Any:
        """`t` as the pool keeps it: an Entry, or what it leaves alone (saved False: a region's input)."""

    def region_done(self, region: Any = None, outputs: list | None = None) -> None:
        """A region's call ended: its entries became recomputable."""

    def unpack_input(self, packed: Any) -> Any:
        """A region's input back on the device, for its replay."""

    def release(self, e: Any) -> None:
        """Entry `e` died: its memory goes back."""


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
    by_kind: dict[str, Any]  # the Treatment a plan uses for each kind
    settlers: list[Any]  # the treatments that finish work in the background
    prefetched_bytes: int
    per_thread: threading.local  # per thread: the stack of entered hook contexts

    def leave(self, e: Any, t: Any) -> bool:
        """Takes entry `e` off the device by treatment `t`; False when `t` cannot."""

    def come_back(self, e: Any) -> None:
        """Starts bringing entry `e` back by its treatment."""

    def settle(self) -> None:
        """What the treatments finished in the background frees."""

    def left_alone(self, t: torch.Tensor) -> Any:
        """What the pool keeps of `t` without an entry, or None where it makes one."""

    def on_pressure(self, need_bytes: int) -> int:
        """The allocator's pressure handler: frees about `need_bytes`, returns the bytes freed."""

    def unpack(self, packed: Any) -> torch.Tensor:
        """The pool's unpack hook."""

    def backward_began(self) -> None:
        """Backward unpacked a tensor the pool left where it was."""


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
