"""The host optimizer step of a streamed model, overlapped with its backward:
stream(..., optimizer_step="overlap").

With the host step, the optimizer runs after backward over every parameter (1.9 s of a 22 s step at
10,001 layers, all of it exposed). Here a worker thread steps each unit's parameters as soon as their
gradients have landed on the host, while backward goes on with the units before it; the user's
`opt.step()` then only steps what was not streamed. The arithmetic is the optimizer's own, per
parameter, as in the host step (PyTorch's optimizers update each parameter from its own gradient and
state): results are bitwise those of unstreamed training on the host.

How: the first backward counts the gradient contributions of each parameter and the first step names
the optimizer. From then on a unit whose parameters each get their one contribution is handed to the
worker with the event its gradient copies end with; the worker waits for it, puts the gradients in
`.grad` and runs the optimizer's undecorated step over those parameters (param_groups confined to
them, as the device step does). Backward's end waits for the worker, so `.grad` is set when
backward returns; `opt.step()` hides the stepped parameters' gradients from the optimizer and gives
them back after it.

The contract (why it is opt-in): each backward is followed by one optimizer step, nothing changes the
gradients in between (no clipping, no accumulation over several backwards, no GradScaler), and the
optimizer's settings for a step are those in force during its backward. A gradient that arrives for a
parameter already stepped in this backward raises; parameters with several contributions per backward
(shared weights) step as usual, in `opt.step()`.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # streaming/streamer.py imports this module when it is built: types only here, the
    # streamer named as units.py names it (an import of streamer.py would close a circle)
    from .streaming.units import Streamer, _Param

BATCH_UNITS = 64  # units per optimizer call of the worker (and per wake-up of its thread)


class Overlap:
    def __init__(self, streamer: Streamer):
        self.streamer = streamer
        self.expected: dict[_Param, int] = {}  # contributions per parameter in one backward (the first)
        self.counting = True  # until the first optimizer step
        self.optimizer: Any = None  # a weakref to the optimizer the first step named
        self.group_of: dict[int, int] = {}  # id(parameter) -> its param group's index
        self.eligible: dict[Any, int] = {}  # units that step during backward -> their trainable params
        self.landed: dict[Any, dict[_Param, tuple[torch.Tensor, Any]]] = {}  # unit -> this step's so far
        self.stepped: list[torch.nn.Parameter] = []  # this backward's, by the worker
        self.stepped_ids: set[int] = set()
        self.ready: list[dict[_Param, tuple[torch.Tensor, Any]]] = []  # units not yet handed over
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()  # batches of units for the worker
        self.pending = 0  # batches handed over and not finished
        self.done = threading.Condition()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ backward (streamer's lock held)

    def take(self, landing: list[tuple[_Param, torch.Tensor, bool]], event: Any) -> set[_Param]:
        """`landing`: a batch's (slot, host destination, whether it is the gradient's only term so
        far). Keeps the slots of units that step during backward and hands a unit to the worker once
        all its parameters' gradients are on their way; returns the slots kept (the streamer does not
        wait for or sum those)."""
        if self.counting:
            for slot, _, _ in landing:
                self.expected[slot] = self.expected.get(slot, 0) + 1
            return set()
        kept = set()
        for slot, dst, first in landing:
            unit = slot.owner
            if unit not in self.eligible:
                continue
            if id(slot.param) in self.stepped_ids or slot in self.landed.get(unit, {}) or not first:
                raise RuntimeError(
                    "supermem.stream(optimizer_step='overlap'): a gradient arrived for a parameter that "
                    "already has one in this step (several backwards per optimizer step, .grad not None "
                    "before backward, or a parameter used more often than in the first step?); use "
                    "optimizer_step='host'"
                )
            landed = self.landed.setdefault(unit, {})
            landed[slot] = (dst, event)
            kept.add(slot)
            if len(landed) == self.eligible[unit]:
                self._hand_over(self.landed.pop(unit))
        return kept

    def _hand_over(self, landed: dict[_Param, tuple[torch.Tensor, Any]]) -> None:
        for slot in landed:
            self.stepped.append(slot.param)
            self.stepped_ids.add(id(slot.param))
        self.ready.append(landed)
        if len(self.ready) >= BATCH_UNITS:
            self._send()

    def _send(self) -> None:
        """Hands the units ready so far to the worker, in one piece: each wake-up of the worker takes
        the GIL from backward's thread (up to the 5 ms switch interval), so it wakes once per batch."""
        # the copies that read these host parameters for the device (issued so far) must end first
        fetched = None
        if self.streamer.cuda:
            fetched = torch.cuda.Event()
            fetched.record(self.streamer.copies.h2d)
        self._start()
        with self.done:
            self.pending += 1
        self.jobs.put((fetched, self.ready))
        self.ready = []

    def wait(self) -> dict[_Param, tuple[torch.Tensor, Any]]:
        """Until the worker has stepped everything handed to it (backward's end, the optimizer's step).
        Returns the gradients of units that did not get all theirs this time: the user's step has them."""
        if self.ready:
            self._send()
        with self.done:
            while self.pending:
                self.done.wait()
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        left = {slot: item for landed in self.landed.values() for slot, item in landed.items()}
        self.landed = {}
        return left

    # ------------------------------------------------------------------ the optimizer's step

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The user's step: names the optimizer (first step), then hides what the worker stepped."""
        self.wait()
        groups = optimizer.param_groups
        if self.counting and any(id(p) in self.streamer._params for g in groups for p in g["params"]):
            self.counting = False
            # its undecorated step (no step hooks) is what the worker calls; without one, no overlap
            if getattr(type(optimizer).step, "__wrapped__", None) is not None:
                self.optimizer = weakref.ref(optimizer)
                self.group_of = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
                self.eligible = {}
                for unit in self.streamer.units:
                    # its copy is checked against all its parameters' versions: it steps once none of
                    # them is needed again, i.e. when every one has had its single contribution
                    trainable = [s for s in unit.params if s.param.requires_grad]
                    if trainable and all(
                        self.expected.get(s) == 1 and id(s.param) in self.group_of for s in trainable
                    ):
                        self.eligible[unit] = len(trainable)
        for p in self.stepped:
            self.streamer._hidden_grads.append((p, p.grad))
            p.grad = None
        self.stepped, self.stepped_ids = [], set()

    # ------------------------------------------------------------------ the worker

    def _start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="supermem-overlap-step", daemon=True)
            self.thread.start()

    def stop(self) -> None:
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join()
            self.thread = None

    def _run(self) -> None:
        while True:
            batch = self.jobs.get()
            if batch is None:
                return
            try:
                self._step(*batch)
            except BaseException as e:  # noqa: BLE001  (raised in the main thread by wait())
                self.error = self.error or e
            finally:
                with self.done:
                    self.pending -= 1
                    self.done.notify_all()

    def _step(self, fetched: Any, units: list[dict[_Param, tuple[torch.Tensor, Any]]]) -> None:
        optimizer = self.optimizer()
        if optimizer is None:
            raise RuntimeError("supermem.stream(optimizer_step='overlap'): the optimizer is gone")
        # Copies on one stream end in the order they were issued: the last unit's last gradient copy
        # ends after all the others (one wait, not one per unit: each wait gives up the GIL).
        last = next(reversed(units[-1].values()))[1]
        if last is not None:
            last.synchronize()  # the gradients are on the host
        if fetched is not None:
            fetched.synchronize()  # no copy to the device reads what the step writes
        groups = optimizer.param_groups
        subset: list[list[torch.nn.Parameter]] = [[] for _ in groups]
        for landed in units:
            for slot, (dst, _) in landed.items():
                slot.param.grad = dst
                subset[self.group_of[id(slot.param)]].append(slot.param)
        step = type(optimizer).step.__wrapped__  # no step hooks: those ran (or run) for the user's step
        saved = [g["params"] for g in groups]
        try:
            for g, ps in zip(groups, subset):
                g["params"] = ps
            with torch.no_grad():
                step(optimizer)
        finally:
            for g, ps in zip(groups, saved):
                g["params"] = ps
