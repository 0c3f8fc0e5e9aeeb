"""Every private PyTorch name supermem uses, in one module.

Each is here with what supermem needs it for, so that a PyTorch release that moves one breaks here,
once, and the rest of the code reads in public words. What PyTorch documents (torch.autograd.graph's
saved_tensors_hooks, torch.cuda.memory's public functions) is used directly elsewhere.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

# ---------------------------------------------------------------- while torch itself is importing
# (supermem's autoload hook runs inside `import torch`: these import it when called, so that they work
# from a module that is itself importing torch below)


def has_custom_allocator_hooks() -> bool:
    """This PyTorch can take a pluggable allocator (a CUDA build)."""
    import torch

    return hasattr(torch._C, "_cuda_customAllocator")


def replace_c_function(name: str, fn: Any) -> None:
    """Replaces torch._C's `name` (where this PyTorch has it): PyTorch's own allocator queries that a
    pluggable allocator does not answer (memory.py looks them up per call)."""
    import torch

    if hasattr(torch._C, name):
        setattr(torch._C, name, fn)


def cuda_lazy_call(fn: Any) -> None:
    """Runs `fn` at CUDA's initialisation in this process (at once if it happened)."""
    import torch

    torch.cuda._lazy_call(fn)


def push_saved_hooks_importing(pack: Any, unpack: Any) -> None:
    """push_saved_hooks, for callers that may run while torch is importing."""
    import torch

    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


import torch  # noqa: E402  (below the functions above, which must exist while torch is importing)
from torch.nn.modules import module as _module  # noqa: E402
from torch.utils._pytree import tree_flatten, tree_is_leaf, tree_leaves, tree_map, tree_unflatten  # noqa: E402, F401

# ---------------------------------------------------------------- autograd

# The saved-tensor hooks' stack, which torch.autograd.graph.saved_tensors_hooks pushes and pops as a
# context manager: the pool pushes and pops around one call without making a context object per call,
# and reads the top to see whose hooks are on (None where this PyTorch has no such getter).
push_saved_hooks = torch._C._autograd._push_saved_tensors_default_hooks
pop_saved_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
top_saved_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def saved_hooks_in_force() -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None:
    """The (pack, unpack) on top of the saved-tensor hooks' stack, or None: none are on, or this
    PyTorch has no getter (callers then act as if none were on). One call more than top_saved_hooks,
    for callers off the per-call path."""
    return top_saved_hooks(False) if top_saved_hooks is not None else None


# Grad mode without a context object (a region call switches it twice per call).
set_grad_enabled = torch._C._set_grad_enabled
# Whether a __torch_function__ mode is on (a call's state, to run it again as it was).
torch_function_mode_enabled = torch._C._is_torch_function_mode_enabled
# autograd.Function.apply without the functorch check of its Python wrapper (a light call's node).
FUNCTION_APPLY = torch._C._FunctionBase.__dict__["apply"]
# One kernel copying a list of tensors into another (a block's weights into a graph's slot).
foreach_copy_ = torch._foreach_copy_
# The engine, to run a callback when the current backward ends.
execution_engine = torch.autograd.Variable._execution_engine


class _BackwardWatch:
    """Stands in for autograd's engine object (torch.autograd.Variable._execution_engine, which
    torch.autograd.graph._engine_run_backward reads per call: Tensor.backward and autograd.grad both
    run through it): calls `begins` before each backward runs and `ends` after it returned or raised.
    Every other attribute is the engine's (queue_callback, is_checkpoint_valid)."""

    def __init__(self, engine: Any, begins: Callable[[], None], ends: Callable[[], None]):
        self._engine, self._begins, self._ends = engine, begins, ends
        self.on = True

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.on:
            return self._engine.run_backward(*args, **kwargs)
        self._begins()
        try:
            return self._engine.run_backward(*args, **kwargs)
        finally:
            self._ends()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def watch_backward(begins: Callable[[], None], ends: Callable[[], None]) -> Callable[[], None]:
    """Calls begins() when a backward starts (before its first node runs, the loss's included) and
    ends() when it is over (every saved tensor it released is freed), on the thread that started it;
    nested backwards (a reentrant checkpoint's) call both too. Returns the function that stops it. A
    watch someone else wrapped since is switched off in place, never unwrapped from under them."""
    variable: Any = torch.autograd.Variable  # (its engine attribute is typed as the C++ engine alone)
    watch = _BackwardWatch(variable._execution_engine, begins, ends)
    variable._execution_engine = watch

    def stop() -> None:
        watch.on = False
        if variable._execution_engine is watch:
            variable._execution_engine = watch._engine

    return stop


# The node backward is running on this thread (None outside one): where a step's backward began, the
# root of a walk of the graph under it (outside_uses.py).
current_autograd_node = torch._C._current_autograd_node


_AD_INPLACE_OR_VIEW = torch._C.DispatchKey.ADInplaceOrView


def detach_sharing_version(t: torch.Tensor) -> torch.Tensor:
    """`t.detach()`, which shares `t`'s version counter, also where the caller runs inside an op below
    autograd (the allocator's pressure handler runs inside the op that allocates): the sharing is the
    ADInplaceOrView kernel's, which dispatch skips there, and the detached tensor got a counter of its
    own (a T5's saved int64 buckets, offloaded under pressure in SDPA, then read version 0 for 1)."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    if not excluded.has(_AD_INPLACE_OR_VIEW):
        return t.detach()
    with torch._C._ForceDispatchKeyGuard(
        torch._C._dispatch_tls_local_include_set(), excluded.remove(_AD_INPLACE_OR_VIEW)
    ):
        return t.detach()


def set_versions(tensors: list[torch.Tensor] | tuple, versions: list[int] | tuple) -> None:
    """Sets autograd's version counters (a replay that wrote into a saved buffer puts them back)."""
    try:
        torch._C._autograd._unsafe_set_version_counter(tuple(tensors), tuple(versions))
    except TypeError:  # older PyTorch: one tensor, one int
        for t, v in zip(tensors, versions):
            torch._C._autograd._unsafe_set_version_counter(t, v)


# ---------------------------------------------------------------- transforms and tracing

is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
functorch_transforms_active = torch._C._are_functorch_transforms_active
jit_tracing_state = torch._C._get_tracing_state
AOT_MODULE = "torch._functorch._aot_autograd"  # where compiled graphs' autograd.Functions are made


def dynamo_tracing() -> bool:
    """Inside a torch.compile trace (fake tensors: nothing to pool)."""
    import torch._guards

    return torch._guards.TracingContext.try_get() is not None


def set_compile_memory_budget(share: float) -> None:
    """torch.compile's activation memory budget (its partitioner recomputes to stay under it)."""
    import torch._functorch.config

    torch._functorch.config.activation_memory_budget = share


def compile_memory_budget() -> float:
    """torch.compile's activation memory budget now: a share in [0, 1] of what the min-cut partitioner
    saves for speed (0: only the graph's inputs, every activation recomputed). Read when a graph is
    partitioned (partitioners.py, min_cut_rematerialization_partition), which is at its compile."""
    import torch._functorch.config

    return torch._functorch.config.activation_memory_budget


class RandomGraphsAt:
    """A joint-graph pass (torch._functorch.config.joint_custom_pass), after the one it wraps: a graph
    that draws random numbers (an op tagged nondeterministic_seeded: dropout, rand_like) partitions at
    `share`, whatever the config's activation_memory_budget (the partitioner takes a float
    node.meta["memory_budget"] before the config's). Below 1.0 the min-cut partitioner may put a
    random op in the backward too, where it draws fresh randomness: dropout's backward then applies
    another mask than its forward did, and the gradients are silently wrong (pytorch/pytorch#190758,
    open; torch 2.11 and 2.13, CUDA and CPU). `pinned`: the graphs it kept at `share`."""

    def __init__(self, inner: Any, share: float):
        self.inner = inner
        self.share = share
        self.pinned = 0

    def __call__(self, graph: Any, inputs: Any) -> Any:
        if self.inner is not None:
            graph = self.inner(graph, inputs)
        if any(n.op == "call_function" and draws_random(n) for n in graph.graph.nodes):
            next(iter(graph.graph.nodes)).meta["memory_budget"] = float(self.share)
            self.pinned += 1
        return graph


def draws_random(node: Any) -> bool:
    """Whether an fx call draws random numbers: its op is tagged nondeterministic_seeded, and a dropout
    probability it takes ("p", "dropout_p": native_dropout, the attention kernels) is not a literal 0
    (the attention kernels are tagged so at dropout_p 0.0 too, where they draw nothing)."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = getattr(node.target, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        if arg.name in ("p", "dropout_p"):
            value = node.kwargs.get(arg.name, node.args[i] if i < len(node.args) else arg.default_value)
            return not (isinstance(value, (int, float)) and value == 0)
    return True


def keep_random_graphs_at(share: float | None) -> RandomGraphsAt | None:
    """Graphs compiled from now on that draw random numbers partition at `share` (RandomGraphsAt, put
    in front of the config's joint_custom_pass), and AOTAutograd's cache is off meanwhile (its key
    leaves the joint pass out: an entry partitioned without it would be reused). None: both as they
    were. The pass in force, or None."""
    import torch._functorch.config as config

    global _random_at, _cache_before
    if share is None:
        at, _random_at = _random_at, None
        if at is not None:
            inner = at.inner
            if getattr(config, "joint_custom_pass", None) is at:
                config.joint_custom_pass = inner
            config.enable_autograd_cache = _cache_before
        return None
    if _random_at is None:  # (getattr: a config key deleted, as unittest.mock does, reads as absent)
        _random_at = RandomGraphsAt(getattr(config, "joint_custom_pass", None), share)
        _cache_before = getattr(config, "enable_autograd_cache", True)
        config.joint_custom_pass = _random_at
        config.enable_autograd_cache = False
    _random_at.share = share
    return _random_at


_random_at: RandomGraphsAt | None = None
_cache_before: Any = None


def has_partitioner_offload() -> bool:
    """This PyTorch's partitioner can offload what compiled graphs save to the CPU
    (torch._functorch.config.enable_activation_offloading: the nodes a joint-graph pass marks)."""
    import torch._functorch.config

    return hasattr(torch._functorch.config, "enable_activation_offloading")


def enable_partitioner_offload() -> None:
    """Graphs compiled from now on offload every saved activation the partitioner can (not views, model
    outputs or non-contiguous tensors: its can_offload) to the CPU, on a side stream, and reload them
    ahead of their use in backward (its prefetch). The waits are not sunk to the graph's end: that holds
    every offloaded tensor on the GPU until a whole model's forward ends (its own note)."""
    import torch._functorch.config as config

    def mark_all(graph: Any, _inputs: Any) -> Any:  # the partitioner keeps node.meta
        for node in graph.graph.nodes:
            node.meta["should_offload"] = True
        return graph

    repair_record_stream_fake()
    config.enable_activation_offloading = True
    config.activation_offload_separate_stream = True
    config.activation_reload_prefetch = True
    config.joint_custom_pass = mark_all


def repair_record_stream_fake() -> bool:
    """The partitioner's offload on a side stream puts streams::record_stream(tensor, stream_index) in
    the forward graph. torch 2.11 registered that op's fake implementation with another op's parameters
    (src_stream_index, wait_event_index, to_dealloc), so Inductor fails to compile any graph that holds
    it ("missing 1 required positional argument: 'to_dealloc'"), and did not mark the op side-effectful,
    so a graph pass may drop it as dead (it returns nothing). Later releases fix both (a fake of the
    op's own two parameters; has_side_effect). Repairs both where they are broken; whether it did."""
    import inspect

    try:
        from torch._dynamo.variables import streams
    except ImportError:
        return False
    op = getattr(streams, "record_stream", None)
    fake = getattr(op, "_abstract_fn", None)
    if op is None or fake is None or len(inspect.signature(fake).parameters) == 2:
        return False

    def record_stream_fake(tensor: Any, stream_index: int) -> None:
        return None

    op.register_fake(record_stream_fake)
    torch.fx.has_side_effect(torch.ops.streams.record_stream.default)
    return True


def in_backward() -> bool:
    """Whether this thread runs inside autograd's backward now (a graph task of the engine)."""
    return torch._C._current_graph_task_id() != -1


_compiles = [0]  # compiles begun since compiles() was first asked


def _compile_started(_args: Any) -> None:
    _compiles[0] += 1


def compiles() -> int | None:
    """How many compiles began in this process since the first call: dynamo's of a frame and
    AOTAutograd's lazy one of a backward at its first run (torch/_dynamo/callback.py's start callbacks;
    both fire them), in any thread. None where this torch has no such callbacks, or before dynamo is
    loaded (nothing compiled yet; an eager caller does not import it). torch._dynamo.reset() drops the
    callbacks: found gone, it is put back and counted as a compile (one may have begun unseen). A step
    in which one ran had the compiler allocate on the device (a backward is compiled inside it)."""
    if "torch._dynamo" not in sys.modules:
        return None
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:
        return None
    if _compile_started not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_compile_started)
        _compiles[0] += 1
    return _compiles[0]


def wrap_module_calls(pre: Any, post: Any) -> Any:
    """Every nn.Module call wrapped (nn.Module.__call__ replaced): pre(module, args) before it,
    post(module, args, kwargs, output) after, in a finally (output None where it raised); neither while
    dynamo traces. Returns the undo. PyTorch's global module hooks do the same, but while any exists
    every module call takes _call_impl's slow path: +4.4 us a call, where this wrapper costs +0.8
    (300 tiny modules on the development CPU); a host-bound ResNet-50 step on an H200 ran 23% slower
    traced with global hooks, and as fast traced with this wrapper (docs/measurements.md). A class
    with a __call__ of its own is not seen (it rarely skips Module's)."""
    import torch

    compiling = torch.compiler.is_compiling

    def make(orig: Any, on: list[bool]) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not on[0] or compiling():
                return orig(self, *args, **kwargs)
            pre(self, args)
            out = None
            try:
                out = orig(self, *args, **kwargs)
                return out
            finally:
                post(self, args, kwargs, out)

        return call

    return patch_module_call(make)


def is_torchs_module_call(fn: Any) -> bool:
    """Whether `fn` is PyTorch's own nn.Module.__call__ (_wrapped_call_impl: the module's
    _compiled_call_impl where Module.compile set one, else its _call_impl), which a wrapper may run in
    place (trace/context.py: a frame less a module call)."""
    import torch

    return fn is torch.nn.Module._wrapped_call_impl


def patch_module_call(make: Any) -> Any:
    """nn.Module.__call__ replaced by make(orig, on): a function of (module, *args, **kwargs) that calls
    orig(module, *args, **kwargs), and only that where on[0] is False or dynamo traces (wrap_module_calls
    is one; a hot path writes its own, one Python call a module call). Returns the undo. A later patch
    on top of this one is left in place by the undo, and this one then only passes calls through."""
    import torch

    orig = torch.nn.Module.__call__
    on = [True]
    call = make(orig, on)
    torch.nn.Module.__call__ = call  # type: ignore[method-assign]

    def undo() -> None:
        on[0] = False
        if torch.nn.Module.__call__ is call:
            torch.nn.Module.__call__ = orig  # type: ignore[method-assign]

    return undo


def dynamo_frame_calling(frame: Any, depth: int = 64) -> Any:
    """The frame, `frame` or one of its `depth` callers, that runs code dynamo made of a compiled frame
    (its cache entry's code, which calls the compiled graph; a compiled module's: its forward, `self`
    among its locals); None where none is (a graph run by aot_function, not by torch.compile).
    (torch/_dynamo/convert_frame.py: output_codes tracks each such code.)"""
    from torch._dynamo import convert_frame

    made = convert_frame.output_codes
    while frame is not None and depth > 0:
        if frame.f_code in made:
            return frame
        frame, depth = frame.f_back, depth - 1
    return None


def source_code(code: Any) -> Any:
    """The code of the user's frame that dynamo made `code` of (the code dynamo_frame_calling's frame
    runs): the same for every cache entry of that frame, recompiles included; `code` itself where dynamo
    knows none."""
    from torch._dynamo.utils import orig_code_map

    return orig_code_map.get(code, code) if code is not None else None


def recompile_at_next_call(code: Any, why: str) -> bool:
    """Drops dynamo's cache entry whose code is `code` (dynamo_frame_calling's frame's), so that its frame
    compiles again at its next call, under the config then; the frame's other entries (other models
    of the same class with other guards, other shapes) stay. torch._dynamo.reset() would drop every
    compiled frame of the process, and reset_code(frame's code) every entry of a frame that all
    compiled nn.Modules share (external_utils' `inner`). The way dynamo invalidates an entry whose
    guarded object died (guards.py, CheckFunctionManager.invalidate). The dropped entry stays in the
    frame's list, counted against recompile_limit: the limit grows by one, so the user's own
    recompiles keep their allowance. False where this torch has not the parts (or no entry is found)."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo import config, convert_frame
        from torch._dynamo.guards import DeletedGuardManagerWrapper
        from torch._dynamo.utils import orig_code_map
    except ImportError:
        return False
    frame_code = orig_code_map.get(code)
    if frame_code is None:
        return False
    try:
        with convert_frame.compile_lock:
            for entry in _debug_get_cache_entry_list(frame_code):
                if entry.code is not code:
                    continue
                guards = entry.guard_manager
                extra_state = getattr(guards, "extra_state", None)
                if extra_state is None or isinstance(guards, DeletedGuardManagerWrapper):
                    return False
                extra_state.invalidate(guards.cache_entry, DeletedGuardManagerWrapper(why))
                config.recompile_limit += 1
                return True
    except (AttributeError, TypeError):  # another torch's cache entries: the pool says it cannot fit
        return False
    return False


# ---------------------------------------------------------------- modules

BatchNorm = torch.nn.modules.batchnorm._BatchNorm  # the base of BatchNorm1d/2d/3d (its running stats)


def global_module_hooks() -> list[dict]:
    """The dicts of hooks registered on every module (register_module_forward_hook and friends)."""
    return [
        _module._global_forward_pre_hooks,
        _module._global_forward_hooks,
        _module._global_backward_pre_hooks,
        _module._global_backward_hooks,
    ]


def global_forward_hook_dicts() -> list[dict]:
    """The forward hook dicts register_module_forward(_pre)_hook fill, always_called's included."""
    return [
        _module._global_forward_pre_hooks,
        _module._global_forward_hooks,
        _module._global_forward_hooks_always_called,
    ]


# ---------------------------------------------------------------- CUDA


def sdp_enabled_getter(name: str) -> Any:
    """The C getter of an SDPA backend's switch where there is one (torch.backends.cuda's wraps it in
    one more Python call), else the public one."""
    return getattr(torch._C, f"_get_{name}_sdp_enabled", None) or getattr(
        torch.backends.cuda, f"{name}_sdp_enabled"
    )


def cuda_sleep(cycles: int) -> None:
    """A kernel that spins `cycles` GPU clock cycles (timing: kernels queued behind it run back to back)."""
    torch.cuda._sleep(cycles)


# ---------------------------------------------------------------- profiler


def profiler_recording() -> bool:
    """Whether torch.profiler records now."""
    return torch.autograd.profiler._is_profiler_enabled


def allocation_event_type() -> Any:
    """The profiler's event type of a memory allocation (its events on CPU tensors)."""
    return torch._C._profiler._EventType.Allocation


def torch_dispatch_mode() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode
