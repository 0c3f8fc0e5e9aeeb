"""Outside uses: whether a light call's input is read outside the call too, decided once a module, in
the backward of the step that verified its call.

A light call's node takes an input once per use in the call (light.py's _PerUse), so that autograd
adds each use's gradient into the input's buffer in plain order, (r + a) + b, where r comes from a use
outside the call (a Llama RMSNorm's input, which the residual add reads too). An input no use outside
reads needs no such slot: the rebuilt call's own backward sums its uses in plain order into a buffer
nothing else adds to, and the call may replay a CUDA graph (light_graphs.py; a ResNet bottleneck reads
its input twice, conv1 and the residual add, both inside: with a slot each, none of its blocks did).

The outside uses come later in the forward, so they are seen in that step's backward, two ways:
- the edges reaching the input from the node backward began at (the graph whole then), past the uses
  in the call: a use outside for sure. That node roots only what is under it: nodes that ran before it
  (a loss the pool does not see, a sum of `x + f(x)`) are not, so a count no larger says little;
- the input's whole gradient against the sum of its uses' in the call, added as autograd adds them
  (each reading node's hook, in the order they run): equal, bitwise, where nothing else added to it.
  A use outside whose gradient is zero that step, or too small to change a bit, and under no node the
  walk saw, would pass: the one case this misses.
Both per call of the module in that step; any doubt (a call run light or not captured, a hook that did
not run, a walk cut) keeps the slots. Read at the next step's opening (one device sync, first steps
only).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .. import torch_private as tp
from .region import consumers


class _Token:
    """Held by the hooks on a probed call's nodes: it dies with them (the graph let go)."""


class _Probe:
    """One input of a noted call, used more than once in it: its autograd edge (its node held for the
    walk, a key by id() staying its own, until that or the call's graph is let go: a forward without a
    backward ends its step), the sum of its uses' gradients in the call and whether its whole one
    differs."""

    __slots__ = ("node", "nr", "inside", "total", "sum", "differs", "handles", "__weakref__")

    def __init__(self, edge: Any, readers: list[tuple[Any, int]]):
        self.node, self.nr = edge.node, edge.output_nr
        self.inside = len(readers)
        self.total: int | None = None  # edges reaching it under the node backward began at
        self.sum: torch.Tensor | None = None
        self.differs: torch.Tensor | bool | None = None  # None: its gradient never came whole
        by_node: dict[int, tuple[Any, list[int]]] = {}
        for node, i in readers:  # (the readers held in by_node: ids stay theirs)
            by_node.setdefault(id(node), (node, []))[1].append(i)
        token = _Token()
        weakref.finalize(token, _let_go, weakref.ref(self))
        self.handles = [node.register_hook(self._read(sorted(i), token)) for node, i in by_node.values()]
        me = weakref.ref(self)  # (the node holds its hook: a strong one would hold the node for good)
        # A tensor the call put into its state and did not read itself (a sliding window cache keeps
        # a slice of the keys its attention read whole) has no reader to hold the token: its own node
        # does, so that the walk still finds it, and finds nothing reaching it where nothing reads it.
        held = token if not by_node else None
        self.handles.append(self.node.register_prehook(lambda grads, _held=held: _whole(me, grads)))

    def _read(self, edges: list[int], _token: _Token) -> Any:
        def hook(grad_inputs: tuple, _grad_outputs: tuple) -> None:
            _token  # noqa: B018  (held by the hook)
            with torch.no_grad():
                for i in edges:  # (one node's edges: autograd adds them in edge order)
                    g = grad_inputs[i]
                    if g is not None:
                        self.sum = g if self.sum is None else self.sum + g

        return hook

    def whole(self, grad_outputs: tuple) -> None:
        g, s = grad_outputs[self.nr], self.sum
        if g is None or s is None or g.shape != s.shape or g.dtype != s.dtype or g.layout != torch.strided:
            self.differs = True
        else:
            with torch.no_grad():
                self.differs = torch.ne(g, s).any()  # (read at the next step's opening: no sync here)
        self.sum = None

    def outside(self) -> bool:
        """Whether a use outside the call may read it (True where unsure)."""
        if self.total is not None and self.total > self.inside:
            return True
        d = self.differs
        if d is None:  # its node never ran: unsure, but where nothing reads it and nothing reached it
            return not (self.inside == 0 and self.total == 0)
        return bool(d)

    def release(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles, self.node, self.sum, self.differs = [], None, None, None


class OutsideUses:
    """The region calls of the modules verified this step, probed until the next step opens; then,
    per module, which inputs a use outside its calls may read (`of`)."""

    def __init__(self, limit: int = 20_000):
        self.limit = limit  # nodes walked at most (past it, the walk tells nothing)
        # per module verified this step: the module, its uses (Regions.uses), its calls' probes
        # [(input, probe)], or None where a call went uncounted (run light, not captured, unknown uses)
        self.pending: dict[int, tuple[torch.nn.Module, tuple, list | None]] = {}
        self.walked = False  # this step's backward began
        self.outside: weakref.WeakKeyDictionary[torch.nn.Module, tuple[bool, ...]] = (
            weakref.WeakKeyDictionary()
        )
        # the tensors calls verified this step put into the state they take, probed as inputs are
        self.state_pending: dict[int, tuple[torch.nn.Module, list[_Probe]]] = {}
        # per module taking state: whether a use outside its call may read what it puts there
        self.state_read: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()

    def of(self, module: torch.nn.Module, n: int) -> tuple[bool, ...]:
        """Per tensor input of the module's calls: a use outside the call may read it (all, until the
        step that verified its call said otherwise)."""
        return self.outside.get(module) or (True,) * n

    def verified(self, module: torch.nn.Module, uses: tuple | None) -> None:
        """The module's call was verified this step, its uses counted (None: unknown, never light)."""
        if uses is not None and any(n > 1 for n in uses):
            self.pending[id(module)] = (module, uses, [])

    def note(
        self,
        module: torch.nn.Module,
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor],
        readers: list | None = None,
    ) -> None:
        """A captured call of a module verified this step: its inputs used more than once in it are
        probed. `readers`: the call's uses (consumers) where the caller just walked them (the verified
        call); a later call is walked here."""
        got = self.pending.get(id(module))
        if got is None or self.walked:
            return
        _, uses, calls = got
        if calls is None:
            return
        if readers is None and len(inputs) == len(uses):
            readers = consumers(inputs, outputs)
        if readers is None or tuple(len(r) for r in readers) != uses:
            self.missed(module)
            return
        probes = []
        for j, (x, r) in enumerate(zip(inputs, readers)):
            if len(r) > 1 and x.requires_grad:
                probes.append((j, _Probe(torch.autograd.graph.get_gradient_edge(x), r)))
        calls.append(probes)

    def state_written(self, module: torch.nn.Module, put: list[torch.Tensor], readers: list | None) -> None:
        """A verified call put `put` (tensors needing grad) into the state it took; `readers`: their
        uses in the call (consumers; None: unknown). Run light, the call would leave them there
        without a graph: it may only where no use outside the call reads them (decided as for an
        input, at the next step's opening: the edges under backward's first node, and their whole
        gradient against the sum of their uses' in the call). A Hugging Face layer's cached keys are
        read by the layer's own attention alone."""
        if readers is None or self.walked:
            self.state_read[module] = True
            return
        if not put:
            self.state_read.setdefault(module, False)
            return
        probes = self.state_pending.setdefault(id(module), (module, []))[1]
        probes += [_Probe(torch.autograd.graph.get_gradient_edge(t), r) for t, r in zip(put, readers)]

    def missed(self, module: torch.nn.Module) -> None:
        """A call of the module went uncounted (run light, not captured): it keeps its slots."""
        got = self.pending.get(id(module))
        if got is not None and got[2] is not None:
            _release(got[2])
            self.pending[id(module)] = (got[0], got[1], None)

    def backward_began(self) -> None:
        """The step's backward began: count each probed input's edges under the node running now."""
        if (not self.pending and not self.state_pending) or self.walked:
            return
        self.walked = True
        root = tp.current_autograd_node()
        probes = [p for _, _, calls in self.pending.values() for c in calls or () for _, p in c]
        probes += [p for _, ps in self.state_pending.values() for p in ps]
        probes = [p for p in probes if p.node is not None]
        if root is not None and probes:
            counts = _edge_counts(root, [(p.node, p.nr) for p in probes], self.limit)
            for p, n in zip(probes, counts or ()):
                p.total = n
        for p in probes:
            p.node = None  # (walked: its hooks hold what the rest needs)

    def step_opened(self) -> None:
        """The step before is over (its backward, or none): decide its modules, let their probes go."""
        pending, self.pending, self.walked = self.pending, {}, False
        state, self.state_pending = self.state_pending, {}
        for module, probes in state.values():
            self.state_read[module] = self.state_read.get(module, False) or any(p.outside() for p in probes)
            for p in probes:
                p.release()
        for module, uses, calls in pending.values():
            if calls is None:
                continue
            outside = [True] * len(uses)
            for j in range(len(uses)):
                probes = [p for c in calls for i, p in c if i == j]
                outside[j] = not probes or any(p.outside() for p in probes)
            self.outside[module] = tuple(outside)
            _release(calls)


def _whole(probe: Any, grad_outputs: tuple) -> None:
    p = probe()
    if p is not None:
        p.whole(grad_outputs)


def _let_go(probe: Any) -> None:
    p = probe()
    if p is not None:
        p.node = None


def _release(calls: list) -> None:
    for c in calls:
        for _, p in c:
            p.release()


def _edge_counts(root: Any, edges: list[tuple[Any, int]], limit: int) -> list[int] | None:
    """Per (node, output_nr) in `edges`, the edges of the graph under `root` reaching it (the nodes
    held: ids stay theirs through the walk); None past `limit` nodes."""
    at: dict[tuple[int, int], list[int]] = {}
    for k, (node, nr) in enumerate(edges):
        at.setdefault((id(node), nr), []).append(k)
    counts = [0] * len(edges)
    stack, seen = [root], {id(root): root}
    while stack:
        node = stack.pop()
        for nxt, nr in node.next_functions:
            if nxt is None:
                continue
            for k in at.get((id(nxt), nr), ()):
                counts[k] += 1
            if id(nxt) not in seen:
                seen[id(nxt)] = nxt  # (held: ids stay unique through the walk)
                if len(seen) > limit:
                    return None
                stack.append(nxt)
    return counts
