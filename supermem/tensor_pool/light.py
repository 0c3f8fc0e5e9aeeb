"""Light calls: a region call run with grad off (Plan.light), its node (_LightFn) whose backward
runs the call again with grad on and differentiates it, each input use's gradient in its own slot
(_PerUse), and what keeps the step alive while such a node lives (_Alive)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .. import torch_private as tp
from .call_state import CallState
from .held import release, thawed
from .light_graphs import LightGraphs, light_graphs_of
from .region import _none, _Replaying, _submodules, _tensors, _top_hooks, consumers

if TYPE_CHECKING:
    from .port import PoolInternals


class _Alive:
    """Held by the autograd graph of a call the pool did not see (by the rebuild of a call run under
    checkpoint; by a hook on a bypassed call's input, which runs once backward is through the call):
    the step is not over while one lives (StepClock.between), though the pool holds none of the
    call's saved tensors."""

    __slots__ = ("pool", "nbytes")

    def __init__(self, pool: PoolInternals, nbytes: int = 0):
        """`nbytes`: what the call's graph holds that the plan keeps (a bypassed call's saves), in the
        pool's count of kept bytes meanwhile (on a CPU, the step's peak is that count)."""
        self.pool: Callable[[], PoolInternals | None] = weakref.ref(pool)  # (_none once released)
        self.nbytes = nbytes
        with pool.lock:
            pool.ledger.unseen_live += 1
            pool.ledger.kept_bytes += nbytes
            pool.ledger.note_peak()

    def release(self, *_: Any) -> None:
        pool, self.pool = self.pool(), _none
        if pool is not None:  # (autograd's thread may free the graph)
            with pool.lock:
                pool.ledger.unseen_live -= 1
                pool.ledger.kept_bytes -= self.nbytes

    __del__ = release

    def through(self, _grad: Any) -> None:
        """The hook on a bypassed call's input: backward is through the call."""
        pool = self.pool()
        if pool is not None:
            pool.clock.backward_began()
        self.release()


def _pool_hooks(pool: PoolInternals, args: tuple) -> tuple | None:
    """The saved-tensor hooks on top of this thread's stack if they are the pool's (a call with the
    pool's hooks off, Plan.bypass, pops them; not the user's own, pushed inside the pool's) and the
    call has an input made in the graph (its hook tells when backward is through the call); else None."""
    top = _top_hooks(False) if _top_hooks is not None else None
    if top is None or top[0] != pool.pack or not any(x.grad_fn is not None for x in _tensors(args)):
        return None
    return top


def _identity(t: Any) -> Any:
    return t


_ANCHOR = torch.empty(0, requires_grad=True)  # an input of every _LightFn: its outputs need grad always


class _Light:
    """A call run with grad off (Regions._light): what calling it again in backward needs. No tensor:
    its tensor inputs are saved by its node (_LightFn), its outputs are the step's."""

    __slots__ = (
        "state",
        "call",
        "tracker",
        "module",
        "spec",
        "leaves",
        "places",
        "out_places",
        "alive",
        "graphs",
        "uses",
        "outside",
        "extra",
    )

    def __init__(self, state: CallState):
        self.state = state  # RNG, autocast, attention backends at the call
        self.uses: tuple | None = None  # per tensor input, its uses in the call (Regions.uses)
        # per tensor input, whether a use outside the call may read it too (outside_uses.py): only
        # such an input needs a slot per use; the call's own backward sums the others in plain order
        self.outside: tuple[bool, ...] | None = None
        self.extra: list[int] = []  # the node's extra slots: an input once more per use past its first
        self.graphs: LightGraphs | None = None  # replays its backward where it can (light_graphs.py)
        self.call: tuple[tuple, dict] | None = None  # (args, kwargs) as the call got them, until it returns

    def attach(
        self, tracker: Any, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any, pool: Any
    ) -> Any:
        """The call's output with its floating-point tensors given one node (_LightFn)."""
        if not kwargs and all(isinstance(x, torch.Tensor) for x in args):
            leaves, self.spec = list(args), None  # (tensors alone: no pytree, ~8 us a flatten)
        else:
            leaves, self.spec = tp.tree_flatten((args, kwargs))
        self.places = [k for k, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.leaves = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        release(self.leaves)  # (what its state held at the call: no verification here)
        outs, out_spec = _flatten(output)
        self.out_places = [
            k for k, x in enumerate(outs) if isinstance(x, torch.Tensor) and x.is_floating_point()
        ]
        if not self.out_places:
            return output
        self.tracker, self.module = weakref.ref(tracker), module
        self.alive = _Alive(pool) if pool is not None else None  # the step lasts while the node lives
        inputs = [leaves[k] for k in self.places]
        params = _params(module)
        outputs = [outs[k] for k in self.out_places]
        if self.uses is not None and len(self.uses) == len(inputs):
            outside = self.outside or (True,) * len(inputs)
            self.extra = [
                j
                for j, n in enumerate(self.uses)
                for _ in range(n - 1)
                if inputs[j].requires_grad and outside[j]
            ]
        if (
            not self.extra
            and pool is not None
            and self.spec is None
            and len(inputs) == 1
            and len(outputs) == 1
        ):
            self.graphs = light_graphs_of(pool)
            if self.graphs is not None:
                self.graphs.note(self, inputs[0])
        if pool is not None:
            pool.passthrough = True  # the node saves the call's inputs itself: not the step's saves
        try:
            extra = [inputs[j] for j in self.extra]
            attached = _light_apply(self, outputs, len(inputs), _ANCHOR, *inputs, *params, *extra)
        finally:
            if pool is not None:
                pool.passthrough = False
        for k, x in zip(self.out_places, attached):
            outs[k] = x
        return outs[0] if out_spec is None else tp.tree_unflatten(outs, out_spec)

    def again(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The call once more, with grad on, under its state, the module's buffers put back after; the
        saves it makes stay with autograd (the pool's hooks are not asked)."""
        leaves = thawed(self.leaves)  # (state frozen at the call: held.py)
        for k, x in zip(self.places, inputs):
            leaves[k] = x
        args, kwargs = (tuple(leaves), {}) if self.spec is None else tp.tree_unflatten(leaves, self.spec)
        tracker = self.tracker()
        with (
            _Replaying(self.state, self.module, True),
            torch.autograd.graph.saved_tensors_hooks(_identity, _identity),
        ):
            out = tracker.call(self.module, args, kwargs) if tracker else self.module(*args, **kwargs)
        outs = _flatten(out)[0]
        return [outs[k] for k in self.out_places]


def _flatten(tree: Any) -> tuple[list, Any]:
    """tree_flatten, but a lone tensor costs no pytree walk (its spec: None)."""
    return ([tree], None) if isinstance(tree, torch.Tensor) else tp.tree_flatten(tree)


def _params(module: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters that need grad of the module and its children, each once."""
    out = {id(w): w for m in _submodules(module) for w in m._parameters.values() if w is not None}
    return [w for w in out.values() if w.requires_grad]


class _LightFn(torch.autograd.Function):
    """The node of a call run with grad off, its inputs and parameters: its backward runs the call
    again from the inputs it saved and differentiates that call (torch.autograd.grad, so the gradients
    go where autograd sends them: .grad and its hooks, or autograd.grad's results)."""

    @staticmethod
    def forward(
        ctx: Any, light: _Light, outputs: list, n: int, _anchor: torch.Tensor, *tensors: Any
    ) -> tuple:
        ctx.light, ctx.params = light, tensors[n : len(tensors) - len(light.extra)]
        ctx.save_for_backward(*tensors[:n])
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        # Grad on: a backward with create_graph, whose gradients a second backward goes through; the
        # call then runs on its inputs themselves, so the gradients' graph reaches back past them.
        create = torch.is_grad_enabled()
        light = ctx.light
        if light.graphs is not None and not create and grads[0] is not None:
            (x,) = ctx.saved_tensors
            got = light.graphs.backward(light, x, grads[0], ctx.params)
            if got is not None:
                if light.alive is not None:
                    light.alive.through(None)
                return (None, None, None, None, got[0] if x.requires_grad else None, *got[1:])
        inputs = [x if create else _fresh(x) for x in ctx.saved_tensors]
        outputs = light.again(inputs)
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        # each tensor once (under create_graph an input passed twice, or a parameter passed as an
        # input, is one tensor: autograd.grad would give it its whole gradient at each place)
        slots = {id(x): x for x in (*inputs, *ctx.params) if x.requires_grad}
        wrt = list(slots.values())
        got = dict.fromkeys(slots)
        per_use = _PerUse(light, inputs, outputs) if light.extra and not create else None
        if pairs and wrt:
            outs, gs = [o for o, _ in pairs], [g for _, g in pairs]
            try:
                got.update(
                    zip(slots, torch.autograd.grad(outs, wrt, gs, allow_unused=True, create_graph=create))
                )
            finally:
                if per_use is not None:
                    per_use.remove()
        if light.alive is not None:
            light.alive.through(None)  # backward is through the call (a second one is the pool's no more)
        if per_use is not None:
            if per_use.complete():
                params = (got.get(id(w)) for w in ctx.params)
                firsts = per_use.first([got.get(id(x)) for x in inputs])
                return (None, None, None, None, *firsts, *params, *per_use.rest())
            tracker = light.tracker()
            if tracker is not None:
                tracker.split_misses += 1  # (summed: the rounding may differ from plain; stats())
        extra = [None] * len(light.extra)
        return (None, None, None, None, *(got.pop(id(x), None) for x in (*inputs, *ctx.params)), *extra)


def _fresh(x: torch.Tensor) -> torch.Tensor:
    """`x` again, its own graph's input: detached, with the requires_grad it had, and where it needs
    grad a view of that leaf. A float leaf that needs grad is what autocast caches a cast of (as it does
    a weight's): the call's uses would share one cast and add their gradients in the low precision
    before it, where the call itself (on an input made by the step, not a leaf) cast at each use and
    added the float gradients after (a BERT layer's q, k, v under bf16 autocast: its input gradient off
    plain at rounding level). A view is not cached; its backward hands the gradient on as it is."""
    leaf = x.detach().requires_grad_(x.requires_grad)
    if not x.requires_grad:
        return leaf
    with torch.enable_grad():  # (a backward runs with grad off: a view made there is a leaf of its own)
        return leaf.view_as(leaf)


class _PerUse:
    """Each use's gradient of a light call's inputs, caught as the replay's backward runs (the hook of
    each node that reads an input: consumers), for _LightFn's slots, in the order autograd runs them."""

    def __init__(self, light: _Light, inputs: list[torch.Tensor], outputs: list[torch.Tensor]):
        self.light, self.handles = light, []
        self.wanted = [x.requires_grad for x in inputs]
        self.got: list[list] = [[] for _ in inputs]
        uses = consumers(inputs, outputs)
        self.expected = light.uses if uses is not None and tuple(len(u) for u in uses) == light.uses else None
        if self.expected is None or uses is None:  # (the one with the other)
            return
        by_node: dict[int, tuple[Any, list]] = {}
        for j, us in enumerate(uses):
            for node, i in us:
                by_node.setdefault(id(node), (node, []))[1].append((i, j))
        for node, edges in by_node.values():
            self.handles.append(node.register_hook(self._catch(edges)))

    def _catch(self, edges: list[tuple[int, int]]) -> Any:
        got = self.got

        def hook(grad_inputs: tuple, _grad_outputs: tuple) -> None:
            for i, j in sorted(edges):  # (one node's edges: autograd adds them in edge order)
                got[j].append(grad_inputs[i])

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def complete(self) -> bool:
        return self.expected is not None and all(len(g) == n for g, n in zip(self.got, self.expected))

    def first(self, summed: list) -> list:
        """Each input's first slot: its first use's gradient where it has more slots, else the sum of
        its uses' gradients in the call (`summed`, in the order its backward added them)."""
        split = set(self.light.extra)
        return [
            (g[0] if j in split else s) if g and wanted else None
            for j, (g, wanted, s) in enumerate(zip(self.got, self.wanted, summed))
        ]

    def rest(self) -> list:
        k = [1] * len(self.got)
        out = []
        for j in self.light.extra:
            out.append(self.got[j][k[j]])
            k[j] += 1
        return out


_RAW_APPLY = tp.FUNCTION_APPLY.__get__(None, _LightFn)


def _light_apply(*args: Any) -> tuple:
    """_LightFn.apply without its Python wrapper where no functorch transform is active: the wrapper
    looks at each argument (with a block's 9 parameters 19.5 against 9.4 us on this repository's CPU;
    on an H100's host the apply took 80 us of a light call's ~235, in a forward the host bounds)."""
    if tp.functorch_transforms_active():
        return _LightFn.apply(*args)
    return _RAW_APPLY(*args)
