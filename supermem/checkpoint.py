"""Divide-and-conquer (binomial) checkpointing for long chains of blocks: Griewank's revolve schedule.

    y = supermem.checkpoint.binomial(model.blocks, x, checkpoints="log")   # nn.Sequential or a list
    y = supermem.checkpoint.binomial(step_fn, x, steps=1000, checkpoints=8)  # one block applied n times

Forward runs every block once without keeping its activations and holds at most `checkpoints` block
boundaries (besides the input). Backward reverses the chain by recursive splits: rebuild the boundary
at the split point from the nearest held one, reverse the right part with one boundary fewer, then the
left part. With s = checkpoints + 1 boundaries (the input counts) and the smallest t such that
C(s + t, s) >= n, the split leaves a left part of min(n - C(s - 1, t - 1), C(s, t - 1)) blocks; this
is Griewank's optimal schedule: the backward advances min over schedules of blocks in total (the
forward sweep already holds the first splits, so those cost nothing), about t extra forwards per block.

Each block is rebuilt with the CPU and CUDA RNG state and the autocast state of the original forward,
and module buffers (BatchNorm running stats) are restored after each rebuild, so gradients and
buffers are bitwise those of plain training. The boundaries held across forward and backward are packed
by the saved-tensor hooks in force, so a supermem.pool around the step can offload them.
Limits: every block maps one tensor to one tensor; parameters are found on nn.Module blocks (a plain
function's closed-over tensors get no gradient: wrap it in a Module). A parameter or buffer changed in
place between forward and backward raises autograd's own error, as plain autograd does for what its ops
saved; binomial checks every one the forward did not itself change, so it also refuses a change to a
training BatchNorm's running stats, which plain autograd lets pass (no op saved them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch

from . import torch_private as tp
from .errors import UsageError

Block = Callable[[torch.Tensor], torch.Tensor]
# Per device and dtype: a block's buffers, copies of their values, and their versions then.
_Saved = list[tuple[list[torch.Tensor], list[torch.Tensor], list[int]]]


def binomial(
    blocks: Sequence[Block] | Block,
    x: torch.Tensor,
    checkpoints: int | str = "log",
    *,
    steps: int | None = None,
    graphs: bool = False,
) -> torch.Tensor:
    """Runs `blocks` in order on `x` (or the one block `blocks` `steps` times) with O(checkpoints)
    memory for the chain's activations and the fewest recomputations for that memory.

    checkpoints: boundaries held besides `x` (an int >= 0), or "log" for about log2(n).
    graphs: on CUDA, blocks of one structure repeated at least 4 times run as CUDA graph replays,
        captured at their first call (checkpoint_graphs.py: what it saves and what it demands of a
        block); elsewhere ignored.
    """
    chain = _blocks(blocks, steps)
    n = len(chain)
    if not isinstance(x, torch.Tensor):
        raise UsageError(f"binomial: x must be a tensor, got {type(x).__name__}")
    k = _checkpoints(checkpoints, n)
    if not isinstance(graphs, bool):
        raise UsageError(f"binomial: graphs must be True or False, got {graphs!r}")
    modules = _modules(chain)
    params = _params(modules)
    if n == 0:
        return x
    if not torch.is_grad_enabled() or not (x.requires_grad or params):
        for block in chain:
            x = _call(block, x)
        return x
    chain_graphs = None
    if graphs:
        from .checkpoint_graphs import graphs_for

        chain_graphs = graphs_for(chain, x)
    return _Chain.apply(_Schedule(chain, k, params, modules, chain_graphs), x, *params)


def split(length: int, free: int) -> int:
    """The left part's length when a chain of `length` blocks is reversed holding its input and `free`
    more boundaries: the optimal split (see the module docstring), the largest one when several are."""
    if length < 2:
        raise ValueError("a chain of fewer than 2 blocks has no split")
    if free == 0:
        return length - 1  # nothing to hold: rebuild each boundary from the input
    snaps, t = free + 1, 0
    while math.comb(snaps + t, snaps) < length:
        t += 1
    right_most = math.comb(free + t - 1, free)  # what `free` boundaries reverse in t - 1 sweeps
    left_most = math.comb(snaps + t - 1, snaps)  # what `snaps` boundaries reverse in t - 1 sweeps
    return max(1, min(length - right_most, left_most, length - 1))


def _blocks(blocks: Sequence[Block] | Block, steps: int | None) -> list[Block]:
    if steps is not None:
        if not callable(blocks):
            raise UsageError("binomial: steps= takes one block (a callable), applied `steps` times")
        if not isinstance(steps, int) or steps < 0:
            raise UsageError(f"binomial: steps must be an int >= 0, got {steps!r}")
        return [blocks] * steps
    if callable(blocks) and not isinstance(blocks, (torch.nn.Sequential, torch.nn.ModuleList)):
        raise UsageError("binomial: a single block needs steps=n (or pass a sequence of blocks)")
    try:  # (a Sequential or ModuleList is a Block that iterates its blocks; each is checked below)
        chain = list(cast("Iterable[Block]", blocks))
    except TypeError:  # None, a number: not iterable
        what = type(blocks).__name__
        raise UsageError(f"binomial: blocks must be a sequence of callables, got {what}") from None
    for i, b in enumerate(chain):
        if not callable(b):
            raise UsageError(f"binomial: block {i} is not callable ({type(b).__name__})")
    return chain


def _checkpoints(checkpoints: int | str, n: int) -> int:
    if checkpoints == "log":
        return max(1, math.ceil(math.log2(max(n, 2))))
    if isinstance(checkpoints, bool) or not isinstance(checkpoints, int) or checkpoints < 0:
        raise UsageError(f"binomial: checkpoints must be an int >= 0 or 'log', got {checkpoints!r}")
    return checkpoints


def _modules(chain: list[Block]) -> list[list[torch.nn.Module]]:
    """Each block's modules (itself and its descendants; none for a plain function), listed once per
    call: its parameters and buffers are read from them at each rebuild (Module.parameters() and
    .buffers() walk the tree again, ~50 us a block each time)."""
    listed: dict[int, list[torch.nn.Module]] = {}  # a block repeated (steps=n): one list, walked once
    for b in chain:
        if isinstance(b, torch.nn.Module) and id(b) not in listed:
            listed[id(b)] = list(b.modules())
    return [listed.get(id(b), []) for b in chain]


def _params(modules: list[list[torch.nn.Module]]) -> list[torch.Tensor]:
    """The parameters that require grad, in Module.parameters() order, each once."""
    seen: dict[int, torch.Tensor] = {}
    for ms in modules:
        for m in ms:
            for p in m._parameters.values():
                if p is not None and p.requires_grad:
                    seen.setdefault(id(p), p)
    return list(seen.values())


def _state_tensors(modules: list[list[torch.nn.Module]]) -> list[torch.Tensor]:
    """Every parameter and buffer of the chain's modules, each once (an inference tensor has no
    version counter to watch)."""
    seen: dict[int, torch.Tensor] = {}
    for ms in {id(ms): ms for ms in modules}.values():
        for m in ms:
            for t in (*m._parameters.values(), *m._buffers.values()):
                if t is not None and not t.is_inference():
                    seen.setdefault(id(t), t)
    return list(seen.values())


def _call(block: Block, x: torch.Tensor) -> torch.Tensor:
    y = block(x)
    if not isinstance(y, torch.Tensor):
        raise UsageError(f"binomial: a block returned {type(y).__name__}; blocks map a tensor to a tensor")
    return y


class _State:
    """The RNG and autocast state a block ran under, to rebuild it bitwise."""

    def __init__(self, device: torch.device, autocast: list | None = None):
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.autocast = autocast or [
            (dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt)) for dt in ("cpu", "cuda")
        ]

    def restore_rng(self, device: torch.device) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, device)

    def autocast_contexts(self, changed_only: bool = False) -> list[Any]:
        """Contexts that set the recorded autocast state (only where it differs now, if changed_only)."""

        def current(dt: str) -> tuple[bool, torch.dtype]:
            return torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt)

        return [
            torch.autocast(dt, dtype=dtype, enabled=on)
            for dt, on, dtype in self.autocast
            if not changed_only or current(dt) != (on, dtype)
        ]


class _Held:
    """A boundary held from forward to backward, packed by the saved-tensor hooks in force (a
    supermem.pool may offload it) and released as soon as the backward has used it."""

    def __init__(self, x: torch.Tensor, state: _State):
        hooks = tp.saved_hooks_in_force()
        self.unpack = hooks[1] if hooks else None
        self.payload = hooks[0](x) if hooks else x
        self.state = state

    def take(self) -> tuple[torch.Tensor, _State]:
        x = self.unpack(self.payload) if self.unpack else self.payload
        self.payload = None
        return x, self.state


class _Schedule:
    """One call's chain, its checkpoint count and parameters, and the bookkeeping of a backward."""

    def __init__(
        self,
        chain: list[Block],
        checkpoints: int,
        params: list[torch.Tensor],
        modules: list[list[torch.nn.Module]] | None = None,
        graphs: Any = None,
    ):
        self.chain = chain
        self.graphs = graphs  # a ChainGraphs, or None: every block runs eagerly
        self.kinds: list[Any] = [None] * len(chain)  # each block's graph kind, found by the sweep
        self.modules = _modules(chain) if modules is None else modules
        self.checkpoints = checkpoints
        self.params = params
        self.index = {id(p): i for i, p in enumerate(params)}
        self.advances = 0  # blocks rebuilt without grad during backward (tests compare it to the optimum)
        # (tensor, version) of each parameter and buffer the rebuilds read and the forward left alone
        self.watched: list[tuple[torch.Tensor, int]] = []

    def sweep(self, x: torch.Tensor) -> torch.Tensor:
        """The forward: every block once, holding the boundaries the backward's first splits need."""
        self.start = _State(x.device)
        state = _state_tensors(self.modules)
        before = [t._version for t in state]
        self.held: dict[int, _Held] = {}
        stops, i, j, free = set(), 0, len(self.chain), self.checkpoints
        while j - i > 1 and free > 0:  # the right-most descent of the reverse recursion
            i, free = i + split(j - i, free), free - 1
            stops.add(i)
        graphed = self.graphs.start(self.chain) if self.graphs is not None else [False] * len(self.chain)
        for k, block in enumerate(self.chain):
            if k in stops:
                self.held[k] = _Held(x, _State(x.device))
            if graphed[k]:
                # this block's kind, and the next one's (its input is this replay's output), so that
                # _forward can prefetch the next block's weights
                kind = self.kinds[k] or self.graphs.kind(block, x, self.start.autocast)
                self.kinds[k] = kind
                if kind is not None and k + 1 < len(self.chain) and graphed[k + 1]:
                    self.kinds[k + 1] = self.graphs.kind(self.chain[k + 1], kind.out, self.start.autocast)
            x = self._forward(k, x, counts=True)
        # What the forward itself changed in place (BatchNorm's running stats in training) is the
        # chain's own state, not an input of its gradients: another forward through the same modules
        # before this backward changes it again, and plain autograd saved none of it.
        self.watched = [(t, t._version) for t, v in zip(state, before) if t._version == v]
        return x

    def _forward(self, k: int, x: torch.Tensor, counts: bool) -> torch.Tensor:
        """Block k without grad by its graph (the next block's weights prefetched); None: eagerly."""
        kind = self.kinds[k]
        if kind is None:
            return _call(self.chain[k], x)
        y = self.graphs.forward(kind, self.chain[k], x, counts)
        if k + 1 < len(self.chain) and self.kinds[k + 1] is kind:
            self.graphs.prefetch(kind, self.chain[k + 1])
        return y

    def reverse(self, x: torch.Tensor, grad_y: torch.Tensor) -> tuple[Any, list[Any]]:
        self._check_versions()
        outer = _State(x.device)
        self.grads: list[torch.Tensor | None] = [None] * len(self.params)
        try:
            gx = self._reverse(0, len(self.chain), self.checkpoints, x, self.start, grad_y)
        finally:
            outer.restore_rng(x.device)  # backward must not move the program's RNG streams
        return gx, self.grads

    def _check_versions(self) -> None:
        """Raises autograd's own error if a parameter or buffer the rebuilds read was changed in place
        since the forward: plain autograd checks the tensors its ops saved, and the rebuilds would
        otherwise differentiate the new values, silently."""
        for t, version in self.watched:
            if t._version != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version "
                    f"{version} instead. Hint: it is {self._name(t)}, which supermem.checkpoint.binomial "
                    "reads again in backward; the operation that changed it in place ran after the forward."
                )

    def _name(self, t: torch.Tensor) -> str:
        for k, block in enumerate(self.chain):
            if isinstance(block, torch.nn.Module):
                for name, u in [*block.named_parameters(), *block.named_buffers()]:
                    if u is t:
                        return f"block {k}'s {name!r}"
        return "a block's parameter or buffer"

    def _reverse(self, i: int, j: int, free: int, x_i: torch.Tensor, s_i: _State, grad: Any) -> Any:
        """Reverses blocks i..j-1 from boundary x_i: split at m, reverse m..j-1 (one boundary fewer
        held), then i..m-1. A stack of parts, not recursion: the splits nest one level per held
        boundary, deeper than Python's recursion limit for a thousand checkpoints."""
        parts = [(i, j, free, x_i, s_i)]  # the last is reversed first
        del x_i, s_i  # a boundary lives as long as its part, no longer
        while parts:
            i, j, free, x_i, s_i = parts[-1]
            if j - i == 1:
                parts.pop()
                grad = self._backward_block(i, x_i, s_i, grad)
                continue
            m = i + split(j - i, free)
            held = self.held.pop(m, None)
            x_m, s_m = held.take() if held else self._advance(i, m, x_i, s_i)
            parts[-1] = (i, m, free, x_i, s_i)  # its left part, once the right one is done
            parts.append((m, j, max(free - 1, 0), x_m, s_m))
            del x_i, s_i, x_m, s_m
        return grad

    def _advance(self, i: int, m: int, x: torch.Tensor, state: _State) -> tuple[torch.Tensor, _State]:
        state.restore_rng(x.device)
        with torch.no_grad():
            for k in range(i, m):
                if self.kinds[k] is not None:
                    x = self._forward(k, x, counts=False)  # a replay leaves the block's buffers alone
                else:
                    saved = self._buffers(k)
                    x = self._rerun(k, x, state)
                    _restore(saved)
                self.advances += 1
        return x, _State(x.device, state.autocast)

    def _backward_block(self, k: int, x: torch.Tensor, state: _State, grad: Any) -> Any:
        if self.kinds[k] is not None:
            return self._backward_replay(k, x, grad)
        block = self.chain[k]
        if isinstance(block, torch.nn.Module):  # once per block and backward: the rebuilds trust the list
            now = list(block.modules())
            if len(now) != len(self.modules[k]) or any(a is not b for a, b in zip(now, self.modules[k])):
                raise UsageError(
                    f"binomial: block {k} holds a module it did not hold in the forward (replaced between "
                    "forward and backward?); its gradient would be lost"
                )
        state.restore_rng(x.device)
        inp = x.detach().requires_grad_(k > 0 or x.requires_grad)
        saved = self._buffers(k)
        with torch.enable_grad():
            y = self._rerun(k, inp, state)
        # The block's parameters as they are now: under supermem.stream, a chain inside a streamed unit saw
        # that unit's device copies in forward, while the rebuild fetched its own (whose gradients go to
        # the host); differentiating with respect to the forward's copies would skip the rebuild's fetch.
        own = _params([self.modules[k]])
        wrt = ([inp] if inp.requires_grad else []) + own
        got = torch.autograd.grad(y, wrt, grad, allow_unused=True) if y.requires_grad and wrt else ()
        _restore(saved)  # after the grad: the block's backward may read what its forward saved
        # (None: unused, or streamed: supermem.stream sends those gradients to the host itself)
        self._add_grads(k, zip(own, got[len(wrt) - len(own) :]))
        return got[0] if inp.requires_grad and got else None

    def _backward_replay(self, k: int, x: torch.Tensor, grad: Any) -> Any:
        kind = self.kinds[k]
        gx, grads = self.graphs.backward(kind, self.chain[k], x, grad)
        self._add_grads(k, grads)
        if k > 0 and self.kinds[k - 1] is kind:
            self.graphs.prefetch(kind, self.chain[k - 1])
        return gx if k > 0 or x.requires_grad else None

    def _add_grads(self, k: int, grads: Any) -> None:
        for p, g in grads:
            if g is None:
                continue
            slot = self.index.get(id(p))
            if slot is None:
                raise UsageError(
                    f"binomial: block {k} holds a parameter it did not hold in the forward (replaced between "
                    "forward and backward?); its gradient would be lost"
                )
            prev = self.grads[slot]
            self.grads[slot] = g if prev is None else prev + g

    def _buffers(self, k: int) -> _Saved | None:
        """Block k's buffers, copies of their values and their versions, to undo what a rebuild changes
        (BatchNorm's running stats), grouped by device and dtype: one foreach copy per group (a single
        kernel; with mixed dtypes PyTorch copies tensor by tensor), not a clone per buffer (a bottleneck
        block has nine buffers, and a launch each cost as much as the block's own convolutions' launches)."""
        groups: dict[
            tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor], list[int]]
        ] = {}
        seen: set[int] = set()
        for m in self.modules[k]:
            for b in m._buffers.values():
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    buffers, values, versions = groups.setdefault((b.device, b.dtype), ([], [], []))
                    buffers.append(b)
                    values.append(torch.empty_like(b))
                    versions.append(b._version)
        if not groups:
            return None
        with torch.no_grad():
            for buffers, values, _ in groups.values():
                tp.foreach_copy_(values, buffers)
        return list(groups.values())

    def _rerun(self, k: int, x: torch.Tensor, state: _State) -> torch.Tensor:
        """Block k again, under the autocast state of the original forward (contexts entered only where
        it differs from the current one: entering two per rebuild cost ~40 us)."""
        contexts = state.autocast_contexts(changed_only=True)
        for c in contexts:
            c.__enter__()
        try:
            return _call(self.chain[k], x)
        finally:
            for c in reversed(contexts):
                c.__exit__(None, None, None)


def _restore(saved: _Saved | None) -> None:
    """Copies back the values the buffers had before a rebuild, and their versions: the values are
    those of that version again, and another chain over the same modules (two calls before one
    backward) watches those versions. (BatchNorm moves its running stats without a version bump, so
    every buffer is copied, not the ones whose version moved.)"""
    if saved is not None:
        with torch.no_grad():
            for buffers, values, versions in saved:
                tp.foreach_copy_(buffers, values)
                _set_versions(buffers, versions)


def _set_versions(tensors: list[torch.Tensor], versions: list[int]) -> None:
    tp.set_versions(tensors, versions)


class _Chain(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, schedule: _Schedule, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.schedule = schedule
        ctx.save_for_backward(x)
        return schedule.sweep(x)

    @staticmethod
    @torch.autograd.function.once_differentiable  # gradients of gradients would be silently wrong
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        gx, grads = ctx.schedule.reverse(x, grad_y)
        return (None, gx, *grads)
