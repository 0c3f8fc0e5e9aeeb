"""Op-level replay: a saved tensor rebuilt by running again the cheap op (or short chain of ops) that
made it, from tensors the step keeps anyway.

At pack time the pool looks at the saved tensor's grad_fn (its base's, for a view). If the node is in
OPS (GELU, ReLU, add, LayerNorm, BatchNorm in training, a cast, a reshape that copies) and each of
its inputs is, within MAX_OPS such nodes, a tensor the step keeps anyway (another entry of the pool,
or a parameter), the entry gets an OpReplay recipe, which the Recompute treatment uses like any
other: the policy may drop the tensor, and its unpack rebuilds it. GPT: a block's GELU output from
fc1's, its two bf16 LayerNorm outputs from the fp32 residuals, the output projection's input from
the attention output; ResNet: each ReLU output from its BatchNorm's input (and the residual).
Nothing runs per op in the forward, only per saved tensor.

How inputs are found without unpacking anything (reading a node's saved tensor would call the pool's
unpack hook): each entry tags its tensor's autograd node (node.metadata, which lives as long as the
node) with itself under its output number; an input of a node is the edge (node, output number) in
its next_functions, so the tag there is the entry holding that very tensor. A parameter is the edge's
AccumulateGrad variable. The op's non-tensor arguments are read from the node (GELU's approximate,
LayerNorm's normalized_shape, BatchNorm's eps and training flag, add's alpha). An input without an
edge (no grad, or None) is not guessed: no recipe. Random ops (dropout) are not in OPS.

Proven, not assumed: the first time a site is seen (the chain, its arguments, its parameters and its
tensors' shapes, strides and dtypes), the chain is run once beside the original and must match it
bitwise, strides included. LayerNorm's eps, which its node does not keep, is read from the module
that owns its weight (found by the pool's first step, Regions.eps_of) and is part of the site: a
model whose eps changes between steps is verified again at the new eps, never rebuilt with the old
one. A LayerNorm with no such owner gets no recipe. A site that does not match never gets a recipe.
The same run times the replay: the cost the policy prices the drop at (the first rebuilds refine it,
as a region's calls do). On a GPU the comparison reads one bool back (a host sync), once per site.

In-place changes: a recipe whose input changed since it was saved does not drop (the tensor stays);
one that changes after the drop raises autograd's error at the rebuild, as plain autograd does when
the op that saved that input runs backward. Cascades: ResNet's block output reads the previous
block's output; were both dropped, a rebuild would run back through the model. So a recipe whose
input is away by an op recipe does not drop, nor does an entry that a dropped op recipe reads.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .entry import Entry, State, _check, bitwise_equal
from .region import _read_timer, _start_timer, _stop_timer

if TYPE_CHECKING:
    from .port import PoolInternals

MAX_OPS = 4  # nodes in one chain (BatchNorm + BatchNorm + add + ReLU: a ResNet downsample block's output)
COST_SAMPLES = 3  # runs timed per site; the fastest prices it
MAX_SITES = 4096  # verified sites remembered per pool (shapes that keep changing: the oldest go)
_TAG = "supermem.entries"  # node.metadata key: output number -> weakref to the entry of that tensor


@dataclass(frozen=True)
class Op:
    """One replayable node type: how many of its next_functions edges are the op's tensor inputs, its
    non-tensor arguments read from the node (None: this call cannot be replayed), and the op itself,
    run(args, variant, *inputs). `variants`: what the node does not keep, tried in turn (eps)."""

    inputs: int
    read: Any
    run: Any
    variants: tuple = (None,)


def _batch_norm(eps_attr: str) -> Op:
    # Training mode only (eval reads the running statistics, buffers with no edge). Replayed without
    # running statistics: the output is the same (verified), and the buffers are left alone.
    return Op(
        3,
        lambda n: (getattr(n, eps_attr),) if n._saved_training else None,
        lambda a, v, x, w, b: torch.batch_norm(x, w, b, None, None, True, 0.0, a[0], True),
    )


OPS: dict[str, Op] = {
    "GeluBackward0": Op(1, lambda n: (n._saved_approximate,), lambda a, v, x: F.gelu(x, approximate=a[0])),
    "ReluBackward0": Op(1, lambda n: (), lambda a, v, x: torch.relu(x)),
    "AddBackward0": Op(2, lambda n: (n._saved_alpha,), lambda a, v, x, y: torch.add(x, y, alpha=a[0])),
    "NativeLayerNormBackward0": Op(
        3,
        lambda n: (tuple(n._saved_normalized_shape),),
        lambda a, eps, x, w, b: torch.native_layer_norm(x, a[0], w, b, eps)[0],
        ("eps",),  # one variant: the eps of the weight's module (_eps), put in at _verify
    ),
    "NativeBatchNormBackward0": _batch_norm("_saved_eps"),
    "CudnnBatchNormBackward0": _batch_norm("_saved_epsilon"),
    # an autocast cast (or any .to(dtype)): its output's dtype and device are the node's input metadata
    "ToCopyBackward0": Op(
        1,
        lambda n: (n._input_metadata[0].dtype, n._input_metadata[0].device),
        lambda a, v, x: x.to(dtype=a[0], device=a[1]),
    ),
    # a reshape that copies (attention's heads merged back: a.transpose(1, 2).reshape(b, t, d), what
    # the output projection saves): transpose, clone (its memory format tried: the node does not keep
    # it), view to the output's shape (the node's input metadata)
    "TransposeBackward0": Op(
        1,
        lambda n: (n._saved_dim0, n._saved_dim1),
        lambda a, v, x: x.transpose(a[0], a[1]),
    ),
    "CloneBackward0": Op(
        1,
        lambda n: (),
        lambda a, v, x: x.clone(memory_format=v),
        (torch.contiguous_format, torch.preserve_format),
    ),
    "UnsafeViewBackward0": Op(
        1,
        lambda n: (tuple(n._input_metadata[0].shape),),
        lambda a, v, x: x.view(a[0]),
    ),
}


class _Unsupported(Exception):  # noqa: N818  (the chain leaves OPS or its inputs are unknown)
    pass


class _Site:
    """A chain verified (or refuted) on this pool, with its measured run time."""

    __slots__ = ("ok", "variant", "params", "best_s", "samples", "pending")

    def __init__(self, params: list[torch.Tensor]):
        self.ok = False
        self.variant: Any = None
        self.params = [weakref.ref(p) for p in params]  # ids in the key: the very same tensors
        self.best_s: float | None = None
        self.samples = 0
        self.pending: list = []

    def same_params(self, params: list[torch.Tensor]) -> bool:
        return len(params) == len(self.params) and all(r() is p for r, p in zip(self.params, params))

    def timer(self, pool: PoolInternals) -> Any:
        return _start_timer(pool) if self.samples + len(self.pending) < COST_SAMPLES else None

    def timed(self, timer: Any, pool: PoolInternals) -> None:
        if timer is not None:
            self.pending.append(_stop_timer(timer, pool))

    def cost_s(self) -> float | None:
        still = []
        for t in self.pending:
            s = _read_timer(t)
            if s is None:
                still.append(t)
            else:
                self.best_s = s if self.best_s is None else min(self.best_s, s)
                self.samples += 1
        self.pending = still
        return self.best_s


class OpReplay:
    """Recipe: rebuild an entry by running its chain of ops again on its inputs (entries and parameters)."""

    __slots__ = ("site", "prog", "leaves", "sources", "held", "offset", "ops")
    ready = True

    def __init__(self, site: _Site, prog: list, leaves: list[Entry | torch.Tensor], offset: int):
        self.site = site
        self.prog = prog  # [(Op, args, operand indices)]: operands are leaves, then earlier results
        self.leaves = leaves  # Entry (held: the step keeps it anyway) or a parameter
        # per leaf, what a rebuild reads and checks: the entry, or (parameter, its version now)
        self.sources: tuple[Entry | tuple[torch.Tensor, int], ...] = tuple(
            x if isinstance(x, Entry) else (x, x._version) for x in leaves
        )
        self.held = tuple(x for x in leaves if isinstance(x, Entry))
        self.offset = offset  # the saved tensor's storage offset in its base
        self.ops = tuple(name for name, _, _, _ in prog)

    @property
    def group(self) -> OpReplay:
        return self

    def cost_s(self, pool: PoolInternals) -> float | None:
        return self.site.cost_s()

    def input_entries(self) -> list[Entry]:
        """The entries its rebuild reads (the planner keeps them while this recipe may be needed)."""
        return list(self.held)

    def droppable(self, e: Entry) -> bool:
        """Its inputs are as they were saved and none is away by an op recipe; no dropped op recipe
        reads `e` (see the module's docstring: cascades)."""
        for source in self.sources:
            if isinstance(source, Entry):
                if _away_by_op(source) or _version(source) != source.version:
                    return False
            elif source[0]._version != source[1]:
                return False
        return not any(_away_by_op(r()) for r in e.readers or ())

    def rebuild(self, pool: PoolInternals, e: Entry) -> None:
        # A replay's allocations may call the pool's pressure handler: its input entries are not to be
        # taken meanwhile (that frees nothing while the replay holds them, and costs another rebuild later).
        in_use = pool.ledger.in_use
        in_use += self.held
        try:
            inputs = []
            for source in self.sources:
                if isinstance(source, Entry):
                    inputs.append(
                        pool.unpack_input(source)
                    )  # rebuilt or brought back if away; versions checked
                else:
                    param, version = source
                    if param._version != version:
                        _check(param, param._version, version, param.shape)
                    inputs.append(param)
            site = self.site
            timer = site.timer(pool)
            base = _run(self.prog, inputs, site.variant, pool.cuda)
            site.timed(timer, pool)
        finally:
            for x in self.held:
                in_use.remove(x)
        pool.count("replays")
        pool.arrived(e, base.as_strided(e.shape, e.stride, self.offset), None)


class OpReplays:
    """The pool's op replay: tags entries on their nodes, makes recipes, keeps the verified sites."""

    def __init__(self, pool: PoolInternals):
        self._pool = weakref.ref(pool)
        self._sites: dict[tuple, _Site] = {}

    def remember(self, e: Entry, t: torch.Tensor) -> None:
        """Tags `t`'s node with its entry, so that a later op reading `t` finds it."""
        fn: Any = t.grad_fn  # (torch's stubs make a node's metadata a method: it is a dict)
        if fn is not None:
            fn.metadata.setdefault(_TAG, {})[t.output_nr] = weakref.ref(e)

    def recipe_for(self, e: Entry, t: torch.Tensor) -> OpReplay | None:
        """A recipe that rebuilds `t` bitwise from entries and parameters, or None."""
        chain = chain_of(t)
        if chain is None:
            return None
        base, prog, leaves = chain
        pool = self._pool()
        if pool is None or any(x is e or (isinstance(x, Entry) and x._pool() is not pool) for x in leaves):
            return None  # itself, or an entry of another pool (not this one's to bring back)
        if pool.cuda and torch.cuda.is_current_stream_capturing():
            return None  # a CUDA graph is being captured: a verification would read a result back
        params = [x for x in leaves if not isinstance(x, Entry)]
        eps = _eps(prog, leaves, pool.regions.eps_of)
        if eps is _UNKNOWN:
            return None
        key = (_site_key(prog, leaves, base), eps)
        site = self._sites.get(key)
        if site is None or not site.same_params(params):
            site = self._verify(pool, base, prog, leaves, params, eps)
            self._sites.pop(key, None)
            self._sites[key] = site
            if len(self._sites) > MAX_SITES:
                del self._sites[next(iter(self._sites))]
        if not site.ok:
            return None
        recipe = OpReplay(site, prog, leaves, int(t.storage_offset() - base.storage_offset()))
        for x in leaves:
            if isinstance(x, Entry):
                x.readers = (x.readers or []) + [weakref.ref(e)]
        return recipe

    def site_of(self, prog: list, leaves: list, base: torch.Tensor) -> _Site | None:
        """The verified site of a chain whose leaves are tensors (saved ones have a grad_fn) and
        parameters, as the pool saw it in a recorded step; None if none (LeanCall: it verifies none)."""
        pool = self._pool()
        eps = _eps(prog, leaves, pool.regions.eps_of) if pool is not None else _UNKNOWN
        site = self._sites.get((_site_key(prog, leaves, base), eps))
        if site is None or not site.ok or not site.same_params([x for x in leaves if x.is_leaf]):
            return None
        return site

    def _verify(
        self, pool: PoolInternals, base: torch.Tensor, prog: list, leaves: list, params: list, eps: Any
    ) -> _Site:
        site = _Site(params)
        variants = [v for name, _, _, _ in prog for v in [OPS[name].variants] if v != (None,)]
        if len(variants) > 1:
            return site  # two ops each with unknowns: not tried
        if variants == [("eps",)]:
            variants = [(eps,)]
        held = [x for x in leaves if isinstance(x, Entry)]
        pool.ledger.in_use += held  # as in a rebuild
        try:
            # An input already taken off the device comes back for this once (its host copy is kept).
            inputs = [pool.unpack_input(x) if isinstance(x, Entry) else x for x in leaves]
            for v in variants[0] if variants else (None,):
                if bitwise_equal(_run(prog, inputs, v, pool.cuda), base):
                    site.ok, site.variant = True, v
                    # Timed once more: a first call of a shape pays one-time costs (cuDNN builds its
                    # plan, CUDA loads the kernel): ResNet-152's BatchNorm+ReLU sites were priced at
                    # ~5 ms each so on an H100, 20 times their run.
                    timer = site.timer(pool)
                    _run(prog, inputs, v, pool.cuda)
                    site.timed(timer, pool)
                    break
        finally:
            for x in held:
                pool.ledger.in_use.remove(x)
        return site


def chain_of(t: torch.Tensor, find: Any = None) -> tuple[torch.Tensor, list, list] | None:
    """(base, chain, leaves) that made `t` (its base, for a view) from kept tensors, or None where its
    node leaves OPS; `find` as _visit's."""
    base = t._base if t._base is not None else t
    fn = base.grad_fn
    if fn is None or type(fn).__name__ not in OPS:
        return None
    prog: list = []
    leaves: list = []
    try:
        _visit(fn, base.output_nr, 0, prog, leaves, find)
    except _Unsupported:
        return None
    return base, prog, leaves


_UNKNOWN = object()


def _eps(prog: list, leaves: list, eps_of: Any) -> Any:
    """The eps of the chain's LayerNorm (None without one; _UNKNOWN where its weight has no module
    with an eps): its node does not keep it."""
    for name, _, _, operands in prog:
        if name == "NativeLayerNormBackward0":
            w = leaves[operands[1]] if operands[1] < len(leaves) else None
            eps = eps_of(w) if isinstance(w, torch.Tensor) and w.is_leaf else None
            return _UNKNOWN if eps is None else eps
    return None


def _site_key(prog: list, leaves: list, base: torch.Tensor) -> tuple:
    """A chain's identity: its ops and arguments, its leaves' layouts (an entry's, or a saved tensor's)
    or identities (a parameter's), and its output's layout."""
    return (
        tuple((name, args) for name, _, args, _ in prog),
        tuple(
            (x.shape, x.stride, x.dtype)
            if isinstance(x, Entry)
            else ("param", id(x))
            if x.is_leaf
            else (x.shape, x.stride(), x.dtype)
            for x in leaves
        ),
        (base.shape, base.stride(), base.dtype, base.device),
    )


def _visit(node: Any, nr: int, depth: int, prog: list, leaves: list, find: Any = None) -> int:
    """Adds the tensor at edge (node, nr) to the chain: a leaf if the step keeps it, else the op that
    made it (its inputs first). Returns its operand index (leaves are renumbered after the walk).
    `find(node, nr)`: the kept tensor at that edge, or None (default: the pool's entry tagged there)."""
    if depth > 0:
        x = (find or _entry_at)(node, nr)
        if x is None and hasattr(node, "variable"):  # AccumulateGrad: a parameter (or leaf input)
            x = node.variable
        if x is not None:
            if isinstance(x, Entry) and _version(x) != x.version:
                raise _Unsupported  # changed in place since it was saved: the op may have read another value
            leaves.append(x)
            return -len(leaves)  # leaf k is -(k+1) until renumbered
    name = type(node).__name__
    op = OPS.get(name)
    if op is None or nr != 0 or depth >= MAX_OPS:
        raise _Unsupported
    args = op.read(node)
    edges = node.next_functions
    if args is None or len(edges) < op.inputs:
        raise _Unsupported
    operands = []
    for n, k in edges[: op.inputs]:
        if n is None:
            raise _Unsupported  # no grad, or an absent input (bias=None): the node does not say which
        operands.append(_visit(n, k, depth + 1, prog, leaves, find))
    prog.append((name, op, args, operands))
    if depth == 0:  # the walk is done: operands index leaves first, then results
        nleaves = len(leaves)
        for i, (nm, o, a, ops) in enumerate(prog):
            prog[i] = (nm, o, a, [-k - 1 if k < 0 else nleaves + k for k in ops])
    return len(prog) - 1


def _run(prog: list, inputs: list, variant: Any, cuda: bool) -> torch.Tensor:
    """Runs the chain with grad and autocast off (every autocast cast is a node of its own). Their
    contexts are entered only where on: they cost microseconds per rebuild, and a backward (the usual
    one, outside autocast and without create_graph) has both off already."""
    on = [d for d in (("cpu", "cuda") if cuda else ("cpu",)) if torch.is_autocast_enabled(d)]
    if not on and not torch.is_grad_enabled():
        return _ops(prog, inputs, variant)
    with torch.no_grad(), contextlib.ExitStack() as stack:
        for d in on:
            stack.enter_context(torch.autocast(d, enabled=False))
        return _ops(prog, inputs, variant)


def _ops(prog: list, inputs: list, variant: Any) -> torch.Tensor:
    values = list(inputs)
    for _, op, args, operands in prog:
        values.append(op.run(args, variant, *[values[k] for k in operands]))
    return values[-1]


def _entry_at(node: Any, nr: int) -> Entry | None:
    refs = node.metadata.get(_TAG)
    ref = refs.get(nr) if refs else None
    return ref() if ref is not None else None


def _version(x: Entry) -> int:
    holder = x.watch if x.watch is not None else x.tensor
    return holder._version if holder is not None else x.version


def _away_by_op(x: Entry | None) -> bool:
    return (
        x is not None
        and x.state in (State.LEAVING, State.AWAY)
        and isinstance(x.recipe, OpReplay)
        and x.treatment is not None
        and x.treatment.rebuilds
    )
