"""torch.compile: the pool plans what compiled graphs save through the compiler, by their measured bytes.

Why the pool does not move what a compiled graph saves (torch 2.13's AOTAutograd, runtime_wrappers.py):
a compiled graph is one autograd.Function. Its forward runs the whole graph, every activation it saves
alive at the end, and only then calls save_for_backward, where the pool's pack hook sees them: the
graph's peak is already behind. Its backward reads `ctx.saved_tensors` all at once, before its first
kernel, so whatever the pool moved comes back together, synchronously: the peak is the same again and
the step waits for every copy (a compiled ResNet-50 on an H100: 28.7 -> 71.6 ms at the same peak).
Recompute by regions cannot reach inside a graph either. So the pool leaves those tensors where they
are, and plans them where they are decided: the compiler's min-cut partitioner saves, of what backward
needs, the set that fits torch._functorch.config.activation_memory_budget (a share in [0, 1] between
recomputing everything but the graph's inputs, 0, and saving for speed, 1; read when a graph is
compiled), recomputing the rest inside the compiled backward.

Under a budget the pool measures each step that compiled graphs saved in (from the first save to the
end of its backward, autograd's queue_callback): their saved bytes (parameters and leaf inputs left
out: alive anyway) and the step's peak (on CUDA, the allocator's watermark with supermem's allocator,
else PyTorch's peak counter, reset at the step's first save while the pool plans, or, once a step
fits, the bytes allocated when the compiled backward begins; on CPU, the graphs' bytes plus the most
the pool itself held; on CUDA a step in which the compiler ran is not measured: it allocated there
too). Over the budget, it cuts the excess, and a margin, from the graphs' bytes: the
share that saves that many (next_share: proportional at first, then along the line through the last
two measures), applied while the pool's context is entered, and the cache entries of the graphs that
saved in the step dropped, so that they compile again under it at their next call inside the pool
(torch_private.recompile_at_next_call: other compiled code, other models of the same class with
other guards included, keeps its entries; a model that shares the very entry, same class, same
guards, compiles again at its next call, under whatever config is on then). At most MAX_RECOMPILES
times per pool, and once more to go back; it says once where the graphs cannot fit (the share at 0,
a recompile that saved no fewer bytes: a backend without the min-cut partitioner, such as aot_eager;
or a lower share that peaked no lower than a higher one, when they compile once more at the share of
the lowest peak), and plans no more (a budget changed later included). Peaks are compared between
steps as if of one shape: a step of a larger batch at a lower share can read as no lower.
A graph that draws random numbers (dropout) keeps the user's share (torch_private.RandomGraphsAt):
below it the partitioner may recompute its dropout in backward with a new mask. Once the graphs fit
after compiling again, the memory cached at the peaks before goes back to the device (_give_back).
Without a budget nothing changes: the pool says once that it steps aside, and how to save memory
under compile.

Where the share cannot fit and a graph is the forward of a model with blocks (repeated_blocks: a
decoder's layers), the pool checkpoints the blocks inside the graph, once: each block's forward becomes
torch's non-reentrant checkpoint of it while dynamo traces inside the pool's context (a module global
dynamo guards on, so outside the pool the same model keeps a graph without them), the graphs compile
again at the user's share, and the share is planned anew from there. A chain compiled as one graph
may recompute at share 0 all it did not save before its first gradient, so that no share lowers its
peak; with its blocks checkpointed, its backward recomputes one block at a time. On GPT-24 compiled
whole with the chunked loss (an H200), every block checkpointed so (torch's checkpoint in the model,
the bench's compile checkpoint row): 0.91-0.94x native's eager step at 4.89 GiB; share 0.2 alone:
0.74x at 7.61 GiB (docs/measurements.md). So the share comes first: at the budgets it reaches it is the
faster. Once a step fits with every block checkpointed, at the user's share, where the budget has room
for some blocks saved whole (each, on average, the peak the checkpoints took off the first step's), the
last of them are checkpointed no more, once (their recompute saved; over the budget after all, they
are checkpointed again).

Blocks compiled one by one (a graph whose every call saves at most BLOCK_SHARE of the step's compiled
bytes) are the other exception where the share cannot fit: such a graph saves while later blocks still
run and reads back in its own backward only, so from then on the pool plans what it saves as it does
eager code's (offload, recompute by regions: a replay calls the compiled block again), at the share
reached. Not before: on GPT-24 (blocks compiled alone, an H200) the pool's plan of the blocks' saves
took 2.0x native's step at 75% of its peak, where the share took 1.23x (docs/measurements.md). Tensors
saved by eager code around a compiled graph (a loss outside it, an uncompiled head, the code between
graph breaks) stay the pool's, planned anew whenever the graphs compile again (the plans were made
beside the old graphs' peak), never from a step in which the compiler ran (plan_run.py). Not yet: the
partitioner's CPU offload (enable_activation_offloading, nodes marked should_offload by a
joint_custom_pass; torch 2.11's side-stream version compiles once torch_private.repair_record_stream_fake
has run, but raised the peak: docs/measurements.md), and per-graph shares (one share for every graph
compiled under the pool).

How the pool tells: the pack hook is called from torch.autograd.Function.apply of AOTAutograd's
CompiledFunction (nothing on the tensor says so): its caller's frame, read once per saved tensor (eager
ops' saves are called from other frames). Such a save takes the pool's fast path, in both hooks: GPT-24
compiled whole saves about 300 tensors a step (its weights among them), and the pool's general path
cost about 3-5 us each (pack and unpack, development CPU).
"""

from __future__ import annotations

import functools
import threading
import weakref
from types import FrameType
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from .. import torch_private as tp
from ..log import logger, warn
from ..units import format_bytes
from .budget import OVER
from .entry import Kept, alive_anyway
from .port import PoolOwner

_apply: Any = torch.autograd.function.Function.apply  # (a bound classmethod; to mypy, with no __func__)
APPLY_CODE = _apply.__func__.__code__  # the frame a custom Function's pack hooks are called from
_AOT_MODULE = tp.AOT_MODULE  # where CompiledFunction classes are made

MAX_RECOMPILES = 3  # per pool: each is a compile of every graph that saved in the step (seconds each)
BLOCK_SHARE = 0.25  # of a step's compiled bytes: a graph whose calls each save no more is a block's
MARGIN = 0.05  # of the budget: aimed under it, for the partitioner's estimate and the next step's noise

MESSAGE = (
    "supermem: the tensor pool leaves the tensors that torch.compile'd graphs save for backward where they "
    "are (a compiled graph saves them all at once after its peak and takes them back all at once, so moving "
    "them costs time and saves nothing); to save activation memory under torch.compile set "
    "torch._functorch.config.activation_memory_budget (e.g. 0.5), or give the pool a budget"
)
PLANNED_MESSAGE = (
    "supermem: the tensor pool plans the tensors that torch.compile'd graphs save for backward through the "
    "compiler: over its budget, the graphs compiled under it compile again with a lower "
    "torch._functorch.config.activation_memory_budget (their partitioner recomputes the rest)"
)


MIN_BLOCKS = 4  # a model's blocks: the children of its longest ModuleList or Sequential of one class


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of `model`'s longest nn.ModuleList or nn.Sequential whose children, MIN_BLOCKS or
    more, are all of one class (a decoder's layers, a ResNet stage's blocks); [] where none is."""
    best: list[torch.nn.Module] = []
    for m in model.modules():
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            kids = list(m.children())
            if len(kids) >= max(MIN_BLOCKS, len(best) + 1) and len({type(k) for k in kids}) == 1:
                best = kids
    return best


CHECKPOINTING = False  # a pool that checkpoints blocks inside graphs is entered (dynamo reads it: a guard)
_checkpointing_pools = 0


def _checkpointing(delta: int) -> None:
    global CHECKPOINTING, _checkpointing_pools
    _checkpointing_pools += delta
    CHECKPOINTING = _checkpointing_pools > 0


def _checkpointed_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A block's forward once the pool checkpoints it (CompiledGraphs._checkpoint): as dynamo traces it
    inside a pool's context, torch's non-reentrant checkpoint of its class's forward, which the compiled
    graph recomputes in its backward; else (eager code, outside the pool: dynamo keeps a graph for each)
    the forward itself."""
    forward = type(self).forward
    if CHECKPOINTING and torch.compiler.is_compiling():
        return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)
    return forward(self, *args, **kwargs)


def _module_compiled(frame: FrameType | None) -> torch.nn.Module | None:
    """The module dynamo's compiled `frame` runs: the forward's `self`, what dynamo's wrapper of a
    compiled module calls (external_utils.wrap_inline's `fn`: the module, or a method of it), or the one
    module among a compiled function's locals (`torch.compile(lambda x: model(x))`: its closure's);
    None where none is."""
    if frame is None:
        return None
    f_locals = frame.f_locals
    for found in (f_locals.get("self"), f_locals.get("fn")):
        found = getattr(found, "__self__", found)  # (a bound method: its module)
        if isinstance(found, torch.nn.Module):
            return found
    modules = [v for v in f_locals.values() if isinstance(v, torch.nn.Module)]
    return modules[0] if len(modules) == 1 else None


class GraphKept(Kept):
    """A tensor a compiled graph saved: left where it is; its unpack marks the graphs' backward."""

    __slots__ = ("graphs",)

    def __init__(self, tensor: torch.Tensor, graphs: CompiledGraphs):  # (Kept's, inlined: a fast path)
        self.tensor = tensor if tensor.grad_fn is None else tensor.detach()  # (entry._graphless)
        self.version = tensor._version
        self.graphs = graphs

    def unpack(self) -> torch.Tensor:
        if not self.graphs.backward:
            self.graphs.unpacked()
        return super().unpack()


def next_share(measures: list[tuple[float, int]], target_bytes: int) -> float:
    """The compile budget share expected to make the graphs save `target_bytes`, from (share, bytes
    saved) measures, the latest last. The partitioner aims at inputs + share x (saved for speed -
    inputs), a line in the share: from one measure, proportional (a line through 0: aims low where the
    inputs count); from two of different shares, the line through them. In [0, the latest share)."""
    share, saved = measures[-1]
    guess = share * target_bytes / saved if saved > 0 else 0.0
    if len(measures) > 1:
        share0, saved0 = measures[-2]
        if share0 != share and saved0 != saved:
            slope = (saved - saved0) / (share - share0)
            if slope > 0:
                guess = share + (target_bytes - saved) / slope
    return min(max(guess, 0.0), share * 0.9)  # (a step down at least: the line may flatten)


class CompiledGraphs:
    """Recognises tensors saved by a compiled graph and counts them; under the pool's budget, measures
    each compiled step and sets the compile budget share (module docstring). Holds the pool weakly."""

    def __init__(self, pool: PoolOwner) -> None:
        self._pool = weakref.ref(pool)
        self.kept = 0  # tensors left to the compiled graphs
        self.kept_bytes = 0
        self.share: float | None = None  # the compile budget share the pool compiles under; None: untouched
        self.measures: list[tuple[float, int]] = []  # (share, graphs' saved bytes) of each compiled step
        self.recompiles = 0
        self._max_recompiles = MAX_RECOMPILES  # (MAX_RECOMPILES more once blocks are checkpointed)
        self.best: tuple[int, float] | None = None  # (peak, share): the lowest peak measured, its share
        self._first: tuple[float, int] | None = None  # (share, peak) of the first measured step
        self._released: list[weakref.ref] | None = None  # blocks checkpointed no more (_release); once
        self.last_step_bytes = 0  # the graphs' saved bytes (activations) in the last measured step
        self.last_peak_bytes = 0  # and its peak as the pool measured it
        self._fits = False  # the last measured step was within the budget: planning is over
        self._counting = False  # PyTorch's peak counter was reset at this step's first save (_count_peak)
        self._compiles: int | None = -1  # tp.compiles() at the last step's end (-1: none yet, measured)
        self._step_bytes = 0
        self._calls: list[list] = []  # [dynamo's code, bytes saved] of each graph call in the step
        self._call_args: Any = None  # the args of the call saving now (held until its step's backward)
        self.blocks: set = set()  # the user's code of graphs whose calls each save a small part of a step
        self.movable: set = set()  # those of them the pool plans as eager code (where the share cannot fit)
        self._code_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # CompiledFunction -> codes
        self._module_of: dict[Any, weakref.ref] = {}  # dynamo's code -> the module it compiled, if one
        self.checkpointed: list[weakref.ref] = []  # blocks checkpointed inside their graphs (_checkpoint)
        self.backward = False  # the step's compiled backward began (its first unpack)
        self._backward_bytes = 0  # bytes allocated on the device then
        self._warned = False
        self._said_unfit = False
        self.warned_unfit = False  # the pool warned that the graphs cannot fit (no other warning then)
        self.unsettled = False  # the last step's graphs still compiling toward the budget (take_unsettled)
        self.settling = False  # the same, not taken: the graphs' peak is about to change (plan_run.py)
        self._entered = 0  # the pool's contexts entered, all threads: the share is on while any is
        self._share_before: float | None = None  # the config's share, to put back at the last exit
        self._random: tp.RandomGraphsAt | None = None  # the pass keeping random graphs at the user's share
        self._lock = threading.Lock()

    def take_unsettled(self) -> bool:
        """Whether the graphs of the step that ended were still compiling toward the budget (none of
        their measured steps fit yet, nor did the pool say they cannot): a step over the budget then is
        one the pool acts on. Read once, as the next step opens (Budget's over-budget warning)."""
        unsettled, self.unsettled = self.unsettled, False
        return unsettled

    # ------------------------------------------------------------------ recognising

    def keep(self, t: torch.Tensor, caller: FrameType) -> GraphKept | None:
        """`t` as the pool keeps it where a compiled graph saves it (left where it is), else None; from
        the pack hook, `caller` its caller's frame, autograd.Function.apply's (the pool's fast path:
        about 300 such saves a step on GPT-24 compiled whole)."""
        f_locals = caller.f_locals
        cls = f_locals.get("cls")  # a custom autograd.Function: only AOTAutograd's are compiled graphs
        codes = self._code_of.get(cls)
        if codes is None:
            if not getattr(cls, "__module__", "").startswith(_AOT_MODULE):
                return None
            # once per graph: the dynamo code that runs it (what a recompile drops), the user's code it
            # was made of (a recompile's too), and the module it is the forward of
            frame = tp.dynamo_frame_calling(caller.f_back)
            code = frame.f_code if frame is not None else None
            codes = self._code_of[cls] = (code, tp.source_code(code))
            module = _module_compiled(frame)
            if module is not None:
                self._module_of[code] = weakref.ref(module)
        code, source = codes
        if source in self.movable:
            return None
        args = f_locals.get("args")  # (the call's own tuple: a new one tells the next call)
        nbytes = t.numel() * t.element_size()
        replay = tp.in_backward()  # a graph run again inside backward (a region's replay): not the step's
        with self._lock:
            self.kept += 1
            self.kept_bytes += nbytes
            if self.backward and not replay:  # a save after the last backward began, which never ended
                self.backward = False
                self._counting = False
                self._step_bytes = 0
                self._calls.clear()
            if not (self._counting or replay or self._fits or self._said_unfit):
                self._count_peak()
            if not alive_anyway(t) and not replay:
                if args is not self._call_args or not self._calls:
                    self._call_args = args
                    self._calls.append([code, 0])
                self._step_bytes += nbytes
                self._calls[-1][1] += nbytes
            if not self._warned:
                self._warned = True
                pool = self._pool()
                planned = pool is not None and pool.budget_bytes is not None
                logger.warning(PLANNED_MESSAGE if planned else MESSAGE)
        return GraphKept(t, self)

    # ------------------------------------------------------------------ the step's events

    def _count_peak(self) -> None:
        """Caller holds the lock. With PyTorch's allocator, while the pool plans (over the budget or not
        yet measured; not said unfit), PyTorch's peak counter is reset at the step's first compiled save
        and read at its backward's end: the bytes allocated when the compiled backward begins miss what
        that backward allocates itself (its gradients, what the partitioner has it recompute), more the
        lower the share. An 8-layer MLP on an H200 at share 0.51: about 0.94 GiB there, so the pool
        stopped, while the step peaked at 1.14 GiB over a budget of 1.0. The counter is the user's:
        reset only in the steps planned (MAX_RECOMPILES + 1 at most, in the common case), not once
        one fits."""
        pool = self._pool()
        if pool is None or not pool.cuda or pool.budget_bytes is None or self._fits or self._said_unfit:
            return
        if pool.budget.allocator() is not None:  # supermem's watermark counts the whole step already
            return
        torch.cuda.reset_peak_memory_stats(pool.device)
        self._counting = True

    def unpacked(self) -> None:
        """The step's first unpack of a compiled graph's saved tensor: its compiled backward began (the
        peak of what compiled graphs save is about now; the pool's step clock is told), and the step is
        measured at its end."""
        pool = self._pool()
        if pool is not None:
            pool.backward_began()
        with self._lock:
            if self.backward:
                return
            self.backward = True
            self._call_args = None
            if pool is None or pool.budget_bytes is None:
                return
            self._backward_bytes = torch.cuda.memory_allocated(pool.device) if pool.cuda else 0
        try:
            tp.execution_engine.queue_callback(self.backward_ended)
        except RuntimeError:  # unpacked outside a backward (a user reading grad_fn._saved_*): no step
            pass

    def backward_ended(self) -> None:
        """The compiled step's backward ended: measure it, and plan the compile budget share from it."""
        pool = self._pool()
        if pool is None:
            return
        with self._lock:
            if not self.backward:
                return
            graph_bytes, calls = self._step_bytes, self._calls
            self._step_bytes, self._calls = 0, []
            codes = self._note_blocks(calls, graph_bytes)
            peak = self._peak(pool, graph_bytes)
            compiles, self._compiles = self._compiles, tp.compiles()
            # (on CUDA a step in which the compiler ran, the first too, is not measured: it allocated on
            # the device there, the lazy backward's autotuning)
            if not (pool.cuda and compiles != self._compiles):
                self.last_step_bytes, self.last_peak_bytes = graph_bytes, peak
                if graph_bytes:
                    fitted = self._fits
                    self._plan(pool, graph_bytes, peak, codes)
                    if self._fits and not fitted and self.recompiles:
                        self._give_back(pool)
            self.unsettled = bool(graph_bytes) and not (self._fits or self._said_unfit)
            self.settling = self.unsettled

    def _note_blocks(self, calls: list[list], graph_bytes: int) -> dict[Any, int]:
        """Caller holds the lock. The bytes each graph saved in the step; a graph whose every call saved
        at most BLOCK_SHARE of the step's compiled bytes (a block compiled on its own, called once per
        block) joins `blocks`."""
        most: dict[Any, int] = {}
        codes: dict[Any, int] = {}
        for code, nbytes in calls:
            most[code] = max(most.get(code, 0), nbytes)
            codes[code] = codes.get(code, 0) + nbytes
        self.blocks.update(
            tp.source_code(c) for c in most if c is not None and most[c] <= BLOCK_SHARE * graph_bytes
        )
        return codes

    def _peak(self, pool: Any, graph_bytes: int) -> int:
        """The step's peak as the budget counts it: on CPU the graphs' saved bytes and the most the pool
        held; on CUDA the allocator's watermark (supermem's: read and kept for the budget's own margin),
        or with PyTorch's allocator its peak counter where _count_peak reset it, and at least the
        bytes allocated when the compiled backward began."""
        budget = pool.budget
        if not pool.cuda:
            return graph_bytes + budget.seen_peak
        alloc = budget.allocator()
        if alloc is None:
            peak = max(self._backward_bytes, budget.seen_peak)
            if self._counting:
                self._counting = False
                peak = max(peak, torch.cuda.max_memory_allocated(pool.device))
            return peak
        high = alloc.take_watermark()
        budget.inside_peak = max(budget.inside_peak, high)
        return max(high, self._backward_bytes)

    def _give_back(self, pool: Any) -> None:
        """The graphs fit the budget after the pool had them compile again (their steps before peaked
        over it: GPT-24 compiled whole at a 5.29 GiB budget left 11.8 GiB reserved, 4.89 allocated,
        from the steps before its blocks were checkpointed): the memory cached over the budget goes
        back to the device, so that the process holds no more than the budget once the graphs settle."""
        if not pool.cuda:
            return
        alloc = pool.budget.allocator()
        if alloc is not None:
            reserved, empty_cache = alloc.stats()["reserved_bytes"], alloc.empty_cache
        else:
            reserved, empty_cache = torch.cuda.memory_reserved(pool.device), torch.cuda.empty_cache
        if reserved <= pool.budget_bytes * OVER:
            return
        empty_cache()
        logger.info(
            "supermem: compiled graphs settled under the budget of %s, %s reserved: the cache given back",
            format_bytes(pool.budget_bytes),
            format_bytes(reserved),
        )

    # ------------------------------------------------------------------ planning

    def _plan(self, pool: Any, graph_bytes: int, peak: int, codes: dict[Any, int]) -> None:
        """Over the budget: the share that cuts the excess (and MARGIN) from the graphs' bytes, and the
        graphs that saved in the step compiled again; within it, nothing. A lower share that peaked no
        lower than the best share measured (a chain compiled as one graph: its backward recomputes what
        was not saved all at once, before its first gradient, so saving less lowers no peak) has the
        graphs compile again at that best share, and the pool says it can do no more."""
        if self._said_unfit:
            return
        share = self.share if self.share is not None else tp.compile_memory_budget()
        self.measures.append((share, graph_bytes))
        best, excess = self.best, peak - pool.budget_bytes
        if best is None or peak < best[0]:
            self.best = (peak, share)
        if self._first is None:
            self._first = (share, peak)
        self._fits = excess <= 0
        if self._fits:
            return self._release(codes, pool, share, peak)
        if self._released:  # the blocks released peaked over the budget: checkpointed again, for good
            blocks = [b for ref in self._released if (b := ref()) is not None]
            self._released = []
            self._compile_again(codes, share, "the pool's budget: blocks checkpointed inside the graph again")
            self._wrap(blocks)
            self.checkpointed += [weakref.ref(b) for b in blocks]
            return
        del self.measures[:-8]
        before = self.measures[-2] if len(self.measures) > 1 else None
        if best is not None and share < best[1] and peak >= best[0]:
            back = self._compile_again(codes, best[1], "the pool's budget, the share of its lowest peak")
            why = f"a lower activation_memory_budget ({share:.3f}) peaked no lower ({format_bytes(peak)})"
            why += f" than {best[1]:.3f} did ({format_bytes(best[0])})"
            if back:
                why += f"; its graphs compile again at {best[1]:.3f}"
            return self._unfit(pool, peak, why, codes)
        if before is not None and before[0] > share and graph_bytes >= before[1]:
            why = "a lower share saved no fewer bytes (a backend whose partitioner takes no memory budget?)"
            return self._unfit(pool, peak, why, codes)
        if share <= 0:
            return self._unfit(pool, peak, "its graphs recompute all they can already (share 0)", codes)
        if self.recompiles >= self._max_recompiles:
            return self._unfit(pool, peak, f"{self.recompiles} recompiles did not reach it", codes)
        if None in codes:
            why = "a graph was not compiled by torch.compile (no code to recompile)"
            return self._unfit(pool, peak, why, codes)
        target = graph_bytes - excess - int(MARGIN * pool.budget_bytes)
        new = next_share(self.measures, target)
        dropped = self._compile_again(codes, new, "the pool's budget, a lower activation_memory_budget")
        if not dropped:
            return self._unfit(pool, peak, "this torch cannot drop a compiled graph's cache entry", codes)
        logger.info(
            "supermem: compiled graphs saved %s, the step peaked at %s over a budget of %s: %d graph(s) "
            "compile again with activation_memory_budget %.3f (was %.3f)",
            *(format_bytes(graph_bytes), format_bytes(peak), format_bytes(pool.budget_bytes)),
            *(dropped, new, share),
        )

    def _compile_again(self, codes: dict[Any, int], share: float, why: str) -> int:
        """Caller holds the lock. The graphs of `codes` compile again at their next call under `share`,
        for `why` (dynamo's recompile reason); how many could be dropped (0: none, the share unchanged)."""
        why = "supermem: " + why
        dropped = sum(1 for code in codes if code is not None and tp.recompile_at_next_call(code, why))
        if dropped:
            self.recompiles += 1
            self._set_share(share)
            pool = self._pool()
            if pool is not None:  # the eager plans were made beside the old graphs' peak
                pool.plans.graphs_changed()
        return dropped

    def _unfit(self, pool: Any, peak: int, why: str, codes: dict[Any, int]) -> None:
        """The share cannot fit the budget: where graphs are blocks', the pool plans what they save from
        the next step on, as eager code's; where a graph is a model's with blocks, they are checkpointed
        inside it, once (module docstring); else it says so, once."""
        if self._said_unfit:
            return
        if not self.blocks and self._checkpoint(codes, pool, peak, why):
            return
        self._said_unfit = True
        if self._random is not None and self._random.pinned:
            why += (
                f"; {self._random.pinned} graph compile(s) drew random numbers (dropout) and kept the share"
                f" {self._random.share:.3f}: below it PyTorch's partitioner may recompute them with fresh"
                " randomness in backward, and the gradients would be wrong (pytorch/pytorch#190758)"
            )
        if self.blocks:
            self.movable.update(self.blocks)
            logger.info(
                "supermem: a step with torch.compile'd blocks peaked at %s over a budget of %s (%s): the "
                "pool plans what %d block graph(s) save as it does eager code's",
                *(format_bytes(peak), format_bytes(pool.budget_bytes), why, len(self.blocks)),
            )
            return
        self.warned_unfit = True
        warn(
            f"supermem pool: a step with torch.compile'd graphs peaked at {format_bytes(peak)}, over the"
            f" budget of {format_bytes(pool.budget_bytes)}, and the pool cannot lower what the graphs save:"
            f" {why}."
        )

    def _checkpoint(self, codes: dict[Any, int], pool: Any, peak: int, why: str) -> bool:
        """Caller holds the lock. Where the share cannot fit, the blocks of the models whose forward the
        step's graphs are (repeated_blocks) are checkpointed inside them: the graphs compile again at the
        user's share, each block recomputed in its backward, and the share is planned from there anew,
        with MAX_RECOMPILES more. Once per pool; False where no graph is a model's with blocks."""
        if self.checkpointed or None in codes:
            return False
        roots = [ref() for code in codes if (ref := self._module_of.get(code)) is not None]
        blocks = [
            b for m in roots if m is not None for b in repeated_blocks(m) if "forward" not in b.__dict__
        ]
        if not blocks:
            return False
        self._wrap(blocks)
        self.checkpointed = [weakref.ref(b) for b in blocks]
        share = self._share_before if self._share_before is not None else tp.compile_memory_budget()
        self._compile_again(codes, share, "the pool's budget: blocks checkpointed inside the graph")
        self._set_share(share)  # (also where going back to the lowest peak's share dropped them already)
        self.measures.clear()
        self.best = None
        self._max_recompiles = self.recompiles + MAX_RECOMPILES
        if self._entered or pool.always_active:
            _checkpointing(+1)
        logger.info(
            "supermem: a step with torch.compile'd graphs peaked at %s over a budget of %s (%s): %d "
            "block(s) are checkpointed inside the graphs, which compile again at activation_memory_budget "
            "%.3f",
            *(format_bytes(peak), format_bytes(pool.budget_bytes), why, len(blocks), share),
        )
        return True

    def _wrap(self, blocks: list[torch.nn.Module]) -> None:
        """Caller holds the lock. `blocks` checkpointed inside their graphs from their next compile (a
        partial: the model still pickles and deep-copies, its state_dict unchanged)."""
        for b in blocks:
            b.forward = functools.partial(_checkpointed_forward, b)

    def _release(self, codes: dict[Any, int], pool: Any, share: float, peak: int) -> None:
        """Caller holds the lock. A step fits with the blocks checkpointed, at the share of the first
        step measured: where the budget has room for some of them whole (each, on average, the peak
        the checkpoints took off the first step's), the last of them are checkpointed no more, once,
        and their recompute is saved (GPT-24 compiled whole: 11.31 GiB, 4.89 with its 24 blocks
        checkpointed, about 0.27 GiB a block). Blocks from the end: the last one's checkpoint takes
        nothing off the peak (its backward recomputes it first). Over the budget then, they are
        checkpointed again, for good."""
        if self._released is not None or not self.checkpointed or self._first is None:
            return
        self._released = []
        first_share, first_peak = self._first
        blocks = [b for ref in self.checkpointed if (b := ref()) is not None]
        if share != first_share or first_peak <= peak or self.recompiles >= self._max_recompiles - 1:
            return
        per_block = (first_peak - peak) / len(blocks)
        room = pool.budget_bytes - int(MARGIN * pool.budget_bytes) - peak
        n = min(int(room // per_block), len(blocks) - 1)
        if n < 1:
            return
        # (the entries dropped first: a module's attribute changed may drop them as dynamo's guards see it)
        if not self._compile_again(
            codes, share, "the pool's budget: fewer blocks checkpointed inside the graph"
        ):
            return
        released = blocks[-n:]
        for b in released:
            del b.forward  # (the partial, from the instance: its class's forward again)
        self._released = [weakref.ref(b) for b in released]
        self.checkpointed = [weakref.ref(b) for b in blocks[:-n]]
        self._fits = False  # (the next step is measured)
        logger.info(
            "supermem: compiled graphs with %d checkpointed block(s) peaked at %s under a budget of %s: "
            "the last %d are checkpointed no more, and the graphs compile again",
            *(len(blocks), format_bytes(peak), format_bytes(pool.budget_bytes), n),
        )

    # ------------------------------------------------------------------ the share, while the pool is entered

    def _set_share(self, share: float) -> None:
        """Caller holds the lock. The new share is on at once where a context of the pool is entered (or
        the pool serves every backward: SUPERMEM_CONF's), else from the next entry."""
        self.share = share
        pool = self._pool()
        if self._entered or (pool is not None and pool.always_active):
            self._put_share(share)

    def _put_share(self, share: float) -> None:
        """Caller holds the lock. The config's share becomes `share`; graphs that draw random numbers
        keep the user's (torch_private.RandomGraphsAt: below it PyTorch's partitioner may recompute
        dropout with fresh randomness in backward, and the gradients would be wrong)."""
        if self._share_before is None:
            self._share_before = tp.compile_memory_budget()
        tp.set_compile_memory_budget(share)
        self._random = tp.keep_random_graphs_at(self._share_before)

    def entered(self) -> None:
        """A context of the pool was entered (any thread): graphs compiled inside compile at its share."""
        with self._lock:
            self._entered += 1
            if self._entered == 1 and self.share is not None and self._share_before is None:
                self._put_share(self.share)
            if self._entered == 1 and self.checkpointed:
                _checkpointing(+1)

    def exited(self) -> None:
        with self._lock:
            self._entered -= 1
            pool = self._pool()
            if pool is not None and pool.always_active:
                return
            if self._entered == 0 and self._share_before is not None:
                tp.set_compile_memory_budget(self._share_before)
                tp.keep_random_graphs_at(None)
                self._share_before = None
            if self._entered == 0 and self.checkpointed:
                _checkpointing(-1)
