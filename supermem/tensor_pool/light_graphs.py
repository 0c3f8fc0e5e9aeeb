"""CUDA graph replays of light calls' backward (Plan.light; light.py's _LightFn).

A light call's backward runs the call again with grad on and differentiates it: on an H100 host that
is the step's slow side. ResNet-152 at checkpoint's peak, 45 of its 50 blocks run light: the planned
step and reentrant checkpointing took 107-153 ms, step to step, where native took 80 and the plan
predicted 113; the host was busy for about the whole step (native's: 58 ms). So where the plan runs
at least costs.LIGHT_GRAPHS_MIN_CALLS modules of one structure light, their backward is captured
once (checkpoint_graphs: a device copy of the block, its weights copied in before each replay) and
replayed.

Which: a call of one tensor in and one out, autocast off (a capture would hold autocast's weight
casts), parameters on the device and not streamed, no RNG drawn (refused, as binomial refuses). The
structures whose static tensors (input, output gradient, input gradient, weights and their gradients)
fit costs.LIGHT_GRAPHS_MAX_SHARE of the budget, most calls per byte first; the graphs'
intermediates share one memory pool. A capture that fails (out of memory under the budget, an op
that cannot be captured) leaves that structure eager, said once.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from .. import costs
from ..checkpoint_graphs import ChainGraphs
from ..log import warn

if TYPE_CHECKING:
    from .port import LightCall


class LightGraphs:
    """A pool's graphs of light calls (Pool(graphs=True), on CUDA)."""

    def __init__(self, pool: Any):
        self.pool = weakref.ref(pool)
        self.graphs = ChainGraphs(pool.device, slots=1, forward=False)
        budget = pool.budget_bytes
        self.cap = costs.LIGHT_GRAPHS_MAX_SHARE * (budget if budget is not None else pool.device_total_bytes)
        self.seen: dict[int, set[int]] = {}  # structure (_Block.sig) -> ids of the modules run light
        self.static: dict[int, int] = {}  # structure -> a slot's static bytes
        self.chosen: set[int] | None = None  # the structures graphed (None: to choose again)
        self.failed: set[int] = set()

    def note(self, light: LightCall, x: torch.Tensor) -> None:
        """A light call ran (forward): its structure counts toward being graphed."""
        info = self.graphs._block(light.module)
        if info is None or info.unit is not None:
            return
        ids = self.seen.setdefault(info.sig, set())
        if id(light.module) not in ids:
            ids.add(id(light.module))
            self.static[info.sig] = 3 * x.numel() * x.element_size() + 2 * info.nbytes
            self.chosen = None

    def backward(self, light: LightCall, x: torch.Tensor, grad: torch.Tensor, params: tuple) -> list | None:
        """The gradients of the call's input and of `params` by a replay, or None (eager)."""
        info = self.graphs._block(light.module)
        if info is None or not x.is_cuda:
            return None
        if any(on for _, on, _ in light.state.autocast) or info.sig not in self._chosen():
            return None
        try:
            kind = self.graphs.kind(light.module, x, light.state.autocast)
        except Exception as e:  # noqa: BLE001  (an OOM under the budget, an op a graph cannot hold)
            self.failed.add(info.sig)
            self.chosen = None
            cause = e.__cause__ or e  # (binomial's words around it do not fit here)
            warn(
                f"supermem: the pool runs {type(light.module).__name__} calls' backward eagerly: its "
                f"CUDA graph capture failed ({type(cause).__name__}: {cause})",
            )
            return None
        if kind is None:
            return None
        self.graphs.epoch += 1  # the weights may have changed since the slot took them: copy them in
        gx, pairs = self.graphs.backward(kind, light.module, x, grad)
        pool = self.pool()
        if pool is not None:
            pool.count("graph_replays")
        unused = {id(info.params[i]) for i in kind.slots[0].unused}
        got = {id(p): g for p, g in pairs if id(p) not in unused}
        return [gx, *(got.get(id(p)) for p in params)]

    def _chosen(self) -> set[int]:
        """The structures with at least costs.LIGHT_GRAPHS_MIN_CALLS modules run light, most calls per
        static byte first, while their static bytes fit the cap."""
        if self.chosen is None:
            self.chosen, used = set(), 0
            ranked = sorted(
                (
                    sig
                    for sig, ids in self.seen.items()
                    if len(ids) >= costs.LIGHT_GRAPHS_MIN_CALLS and sig not in self.failed
                ),
                key=lambda sig: -len(self.seen[sig]) / self.static[sig],
            )
            for sig in ranked:
                if used + self.static[sig] <= self.cap:
                    self.chosen.add(sig)
                    used += self.static[sig]
        return self.chosen


def light_graphs_of(pool: Any) -> LightGraphs | None:
    """The pool's LightGraphs, made at its first light call on CUDA; None where it runs none."""
    if not pool.cuda or not pool.graphs:
        return None
    if pool.light_graphs is None:
        pool.light_graphs = LightGraphs(pool)
    return pool.light_graphs
