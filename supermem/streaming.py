"""Weight streaming: parameters, their gradients and optimizer state live in pinned host memory; each
module's weights come to the device just in time for its forward and again for its backward.

    streamer = supermem.stream(model)                      # or SUPERMEM_CONF=stream:weights
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)   # steps on the host
    loss = model(x).sum(); loss.backward(); opt.step(); opt.zero_grad()

How: the model is cut into units (a module whose parameters, children's included, are at most
`unit_bytes`, else its own parameters alone; e.g. one ResNet block). A unit's parameters sit in one flat
pinned host block and come to the device in one copy. A forward pre-hook on the unit's module swaps the
device views in (through `_Fetch`, whose backward sends each gradient to the host on a side stream as
soon as it is produced) and a forward hook swaps the host parameters back and drops the copy. Autograd's
saved weights are packed as tokens, not kept: the backward fetches the unit again at the first unpack and
drops it after the last. The order of fetches of the first step is recorded; later steps replay it,
prefetching `prefetch` units ahead. A module holding parameters that is called outside its unit's call
(a block rebuilt by supermem.checkpoint.binomial, say) fetches its unit by itself.
The Parameter objects stay the same (their `.data` moves to the host), so an optimizer built over
`model.parameters()` before or after streaming steps on the host; its state is created there.

Results are bitwise those of unstreamed training: the same kernels see the same weights, and each
parameter's gradient contributions are summed in the order autograd would have summed them (except
when one unit call uses a weight several times and the unit is called several times per step: then the
contributions are summed per call first).
Limits: parameters are on the device only during a call (through `__call__`, not `.forward(...)`) of
their module or of a unit around it; nn.ModuleList/ModuleDict are never units (never called), so code
that iterates an nn.Sequential by hand should hold its layers in a ModuleList; `torch.autograd.grad`
with respect to streamed parameters gives None (gradients reach `.grad` only); RNN flat weights are
not supported.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import psutil
import torch

from . import torch_private as tp
from .errors import UsageError
from .units import parse_bytes

if TYPE_CHECKING:
    from .streaming_overlap import Overlap
    from .transfer.host import HostBlock

_live: weakref.WeakSet[Streamer] = weakref.WeakSet()
_optimizer_hook: Any = None


def stream(
    model: torch.nn.Module,
    device: torch.device | str | None = None,
    *,
    prefetch: int = 2,
    host_limit: int | float | str = "50%",
    unit_bytes: int = 64 << 20,
    optimizer_step: str = "host",
) -> Streamer:
    """Streams `model`'s parameters from host memory to `device` (default: the current CUDA device,
    else "cpu", where a host tier and a compute tier both on the CPU exercise the same machinery).

    prefetch: units fetched ahead of use (in the order the first step used them).
    unit_bytes: a module whose parameters (with its children's) are at most this many bytes is fetched
        as one unit, in one copy; larger ones are split into their children.
    host_limit: host memory for parameters and gradients (bytes, "32GiB" or a percentage of RAM).
    optimizer_step: "host" (the optimizer steps where the parameters live), "device" (unit by unit on
        the device, its state in host blocks: streaming_step.py) or "overlap" (on the host, each unit
        as soon as its gradients land, during backward: streaming_overlap.py, which says when it may
        be used). Which of host and device is faster depends on the optimizer, the link and the host;
        tests/gpu/test_stream_gpu.py prints both.
    Returns the Streamer (also a context manager: leaving it stops streaming, parameters stay on the host).
    """
    return Streamer(
        model,
        device,
        prefetch=prefetch,
        host_limit=host_limit,
        unit_bytes=unit_bytes,
        optimizer_step=optimizer_step,
    )


ALIGN = 512  # bytes between parameters in a flat buffer, as PyTorch's allocator: kernels choose alike


class _Param:
    """One streamed parameter: its host data lives in its owner unit's flat block (`param.data` views
    it); its gradient lands in a persistent host buffer."""

    __slots__ = ("param", "owner", "offset", "nbytes", "grad_block", "grad_view", "shape", "stride")

    def __init__(self, param: torch.nn.Parameter, owner: _Unit, offset: int):
        self.param = param
        self.owner = owner
        self.offset = offset
        self.nbytes = param.numel() * param.element_size()
        self.grad_block: HostBlock | None = None
        self.grad_view: torch.Tensor | None = None  # grad_block seen as the gradient
        self.shape = param.shape
        self.stride = _contiguous_stride(param.shape)

    def device_view(self) -> torch.Tensor:
        """The parameter's view of its unit's device copy: one op (the copy is viewed as each dtype once
        per fetch), not a slice and two views (~3 us each, per parameter and call)."""
        unit, p = self.owner, self.param
        typed = unit.typed.get(p.dtype)
        if typed is None:
            typed = unit.typed[p.dtype] = unit.copy.view(p.dtype)
        return typed.as_strided(self.shape, self.stride, self.offset // p.element_size())


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


class _Unit:
    """What is fetched as one: a module (with its whole subtree when that is at most `unit_bytes`, else
    its own parameters only). Its own parameters sit in one flat host block and come over in one copy;
    parameters it shares with units met earlier belong to those (`deps`), held along with it."""

    __slots__ = (
        "module",
        "slots",
        "params",
        "deps",
        "flat",
        "nbytes",
        "copy",
        "ready",
        "used_on",
        "version",
        "holds",
        "typed",
        "inner",
    )

    def __init__(self, module: torch.nn.Module, slots: list[tuple[torch.nn.Module, str, _Param]]):
        self.module = module
        self.slots = slots  # (module, name, param) for every parameter the unit's modules hold
        self.params: list[_Param] = []  # the ones stored in this unit's flat block
        self.deps: list[_Unit] = []
        self.flat: HostBlock | None = None
        self.nbytes = 0
        self.copy: torch.Tensor | None = None  # the flat device copy, while held
        self.ready: Any = None  # the event the copy ends with (None on CPU)
        self.used_on = -1  # the stream last made to wait for `ready`
        self.version: tuple[int, ...] = ()  # the host versions the copy was made from
        self.holds = 0
        self.typed: dict[torch.dtype, torch.Tensor] = {}  # the device copy viewed as each dtype
        # (module, pre-hook id, hook id) of the hooked modules inside: muted during the unit's call
        self.inner: list[tuple[torch.nn.Module, int, int]] = []

    def host_version(self) -> tuple[int, ...]:
        return tuple(p.param._version for p in self.params)


class _Use:
    """One call of a module that swapped device weights in: the host parameters it swapped out, and, as
    its backward sees it, the weight tokens saved and how many were unpacked (the device copy is held
    from the first unpack to the last)."""

    __slots__ = ("unit", "saved", "pushed", "tokens", "unpacked", "muted")

    def __init__(self, unit: _Unit):
        self.unit = unit
        self.muted: list[tuple[torch.nn.Module, int, int]] = []  # inner hooks taken out for the call
        self.saved: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
        self.pushed = False  # whether the call pushed saved-tensor hooks (grad mode was on)
        self.tokens = 0
        self.unpacked = 0


class _Token:
    """A saved weight, packed: which unit's copy it views, how, and the host versions it was made from."""

    __slots__ = ("use", "unit", "dtype", "size", "stride", "offset", "version")

    def __init__(self, use: _Use, unit: _Unit, t: torch.Tensor):
        self.use, self.unit, self.dtype = use, unit, t.dtype
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        self.version = unit.version


class _Box:
    """Carries the streamer and the parameters into _Fetch.apply (a non-tensor argument)."""

    __slots__ = ("streamer", "params")

    def __init__(self, streamer: Streamer, params: list[_Param]):
        self.streamer, self.params = streamer, params


class _Fetch(torch.autograd.Function):
    """host parameters -> their device views; the gradients go to the host, not through autograd."""

    @staticmethod
    def forward(ctx: Any, box: _Box, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.box = box
        ctx.set_materialize_grads(False)
        views = tuple(p.device_view() for p in box.params)
        frozen = [v for p, v in zip(box.params, views) if not p.param.requires_grad]
        ctx.mark_non_differentiable(*frozen)  # as in plain training: no gradient computed for them
        return views

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        ready = [(p, g) for p, g in zip(ctx.box.params, grads) if g is not None and p.param.requires_grad]
        if ready:
            ctx.box.streamer._grads_ready(ready)
        return (None,) * (1 + len(grads))


class Streamer:
    """See the module docstring. `stats()` reports bytes moved and prefetch hits."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device | str | None = None,
        *,
        prefetch: int = 2,
        host_limit: int | float | str = "50%",
        unit_bytes: int = 64 << 20,
        optimizer_step: str = "host",
    ):
        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"stream: model must be an nn.Module, got {type(model).__name__}")
        if getattr(model, "_supermem_streamer", None) is not None:
            raise UsageError("stream: this model is already streamed")
        for name, value in (("prefetch", prefetch), ("unit_bytes", unit_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UsageError(f"stream: {name} must be an int >= 0, got {value!r}")
        if optimizer_step not in ("host", "device", "overlap"):
            raise UsageError(
                f'stream: optimizer_step must be "host", "device" or "overlap", got {optimizer_step!r}'
            )
        self.optimizer_step = optimizer_step
        self._overlap: Overlap | None = None
        if optimizer_step == "overlap":
            from .streaming_overlap import Overlap

            self._overlap = Overlap(self)
        self._hidden_grads: list[tuple[torch.nn.Parameter, torch.Tensor | None]] = []  # during a user's step
        self._stepping = False  # a device step is running
        self._state_views: list[tuple[dict, str, torch.Tensor]] = []  # optimizer state in host blocks
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda = self.device.type == "cuda"
        try:
            host_bytes = parse_bytes(host_limit, total_bytes=psutil.virtual_memory().total)
        except ValueError as e:
            raise UsageError(f"stream: bad host_limit: {e}") from None
        # imported here, not at the top: SUPERMEM_CONF=stream:weights imports this module in `import torch`
        from .transfer.copy import CopyEngine
        from .transfer.host import shared_host_pool

        self.host = shared_host_pool(self.device, host_bytes)  # one per device, shared with the tensor pool
        self.copies = CopyEngine(self.device)
        self.host.copy_streams.update(self.copies.stream_ids)
        self.prefetch = prefetch
        self.unit_bytes = unit_bytes
        self.model = model
        self._lock = threading.RLock()
        self._by_ptr: dict[int, _Unit] = {}  # device copies alive, by storage address
        self._active: list[_Use | None] = []  # module calls in progress, innermost last
        self._pending: dict[_Param, list[tuple[torch.Tensor, Any, HostBlock | None]]] = {}
        self._callback_queued = False
        self._sequence: list[_Unit] = []  # the first step's acquisitions, replayed by later steps
        self._recording = True
        self._steps = 0
        self._step_due = True  # the next fetch starts a step (until the root's pre-hook says so first)
        self._cursor = 0
        self._ahead: dict[int, _Unit] = {}  # sequence position -> prefetched unit
        self._counters = dict.fromkeys(("fetches", "prefetch_hits", "grads_to_host"), 0)
        self.units: list[_Unit] = []
        self._unit_of: dict[torch.nn.Module, _Unit] = {}  # units by their module
        # a module that holds parameters -> the first unit with them, and its own slots in that unit
        self._fallback: dict[torch.nn.Module, _Unit] = {}
        self._own_slots: dict[torch.nn.Module, list] = {}
        self._params: dict[int, _Param] = {}  # by id(parameter)
        self._handles: list[Any] = []
        self._moved: list[tuple[torch.nn.Parameter, torch.Tensor, Any]] = []  # (param, data, grad) before
        try:
            self._plan(model)
        except BaseException:  # the host limit, say: the model stays as it was
            for h in self._handles:
                h.remove()
            for p, data, grad in reversed(self._moved):
                p.grad = None
                p.data = data
                p.grad = grad
            raise
        self._moved = []
        model._supermem_streamer = self
        # first, before the root's own fetch: a step starts before anything of it is fetched
        self._handles.append(model.register_forward_pre_hook(self._step_start, prepend=True))
        _live.add(self)
        _install_optimizer_hook()

    # ------------------------------------------------------------------ set-up

    def _plan(self, model: torch.nn.Module) -> None:
        """Cuts the model into units, top down, moves parameters to the host and buffers to the device,
        and hooks every unit's module and every module that holds parameters itself (called on its own,
        outside its unit, it fetches its unit and swaps in its own parameters)."""
        visited: set[int] = set()
        containers = (torch.nn.ModuleList, torch.nn.ModuleDict)  # never called: cannot be units

        def slots_of(modules: list[torch.nn.Module]) -> list[tuple[torch.nn.Module, str, torch.nn.Parameter]]:
            return [(m, n, p) for m in modules for n, p in m._parameters.items() if p is not None]

        def visit(m: torch.nn.Module) -> None:
            if id(m) in visited:
                return
            visited.add(id(m))
            subtree = list(m.modules())
            unique = {id(p): p for _, _, p in slots_of(subtree)}
            nbytes = sum(p.numel() * p.element_size() for p in unique.values())
            if nbytes == 0:
                return
            if not isinstance(m, containers) and nbytes <= self.unit_bytes:
                self._add_unit(m, slots_of(subtree))
                visited.update(id(c) for c in subtree)
                return
            if m._parameters:
                self._add_unit(m, slots_of([m]))
            for c in m.children():
                visit(c)

        visit(model)
        for module in model.modules():
            for name, b in module._buffers.items():
                if b is not None and b.device != self.device:
                    module._buffers[name] = b.to(self.device)
        hooked = {id(m): m for m in [u.module for u in self.units] + list(self._fallback)}
        hook_ids: dict[int, tuple[int, int]] = {}
        for module in hooked.values():
            pre = module.register_forward_pre_hook(self._enter)
            post = module.register_forward_hook(self._exit, always_call=True)
            self._handles += [pre, post]
            hook_ids[id(module)] = (pre.id, post.id)
        for unit in self.units:  # the hooked modules inside a unit, all of whose parameters it swaps in
            swapped = {(id(m), n) for m, n, _ in unit.slots}
            unit.inner = [
                (m, *hook_ids[id(m)])
                for m in unit.module.modules()
                if m is not unit.module
                and id(m) in hook_ids
                and all((id(m), n) in swapped for n, p in m._parameters.items() if p is not None)
            ]

    def _add_unit(
        self, module: torch.nn.Module, raw: list[tuple[torch.nn.Module, str, torch.nn.Parameter]]
    ) -> None:
        unit = _Unit(module, [])
        offset = 0
        for m, name, p in raw:
            slot = self._params.get(id(p))
            if slot is None:
                offset = -(-offset // ALIGN) * ALIGN
                slot = _Param(p, unit, offset)
                self._params[id(p)] = slot
                unit.params.append(slot)
                offset += slot.nbytes
            elif slot.owner is not unit and slot.owner not in unit.deps:
                unit.deps.append(slot.owner)
            unit.slots.append((m, name, slot))
            if self._fallback.setdefault(m, unit) is unit:
                self._own_slots.setdefault(m, []).append((m, name, slot))
        unit.nbytes = -(-offset // ALIGN) * ALIGN
        if unit.params:
            unit.flat = self._take(unit.nbytes)
            for slot in unit.params:
                p = slot.param
                self._moved.append((p, p.data, p.grad))
                host = unit.flat.tensor[slot.offset : slot.offset + slot.nbytes].view(p.dtype).view(p.shape)
                with torch.no_grad():
                    host.copy_(p.data)
                p.data = host
                if p.grad is not None:
                    p.grad = None  # a gradient on the old device would not match the host parameter
        self._unit_of[module] = unit
        self.units.append(unit)

    def _take(self, nbytes: int) -> HostBlock:
        host = self.host
        block = host.take(max(nbytes, 1))
        if block is None:
            raise torch.OutOfMemoryError(
                f"supermem.stream: no host memory for {nbytes} more bytes: the streamer holds "
                f"{host.in_use_bytes} of its host_limit {host.limit_bytes} bytes; the device's host pool "
                f"(shared with the tensor pool) {host.reserved_bytes} of {host.pool.limit_bytes}"
            )
        return block

    # ------------------------------------------------------------------ forward

    def _step_start(self, module: torch.nn.Module, args: Any) -> None:
        with self._lock:
            if not any(use is not None for use in self._active):  # else a nested call of the root
                self._begin_step()

    def _begin_step(self) -> None:
        """A step begins (the root is called, or the first fetch after an optimizer step): the first step
        records its fetches, later ones replay them with prefetch."""
        self._step_due = False
        self._steps += 1
        if self._steps == 2:
            self._recording = False
        for unit in self._ahead.values():
            self._release(unit)
        self._ahead.clear()
        self._cursor = 0
        if not self._recording:
            self._prefetch_from(-1)

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        with self._lock:
            if self._step_due and not any(use is not None for use in self._active):
                self._begin_step()
            unit = self._unit_of.get(module)
            if unit is not None and unit.module is module:
                slots = unit.slots
            else:
                unit, slots = self._fallback[module], self._own_slots[module]
            todo = [(m, n, slot) for m, n, slot in slots if m._parameters[n] is slot.param]
            if not todo:  # a unit around this call already swapped its weights in
                self._active.append(None)
                return
            self._acquire(unit)
            use = _Use(unit)
            use.pushed = torch.is_grad_enabled()
            params = list({id(slot): slot for _, _, slot in todo}.values())
            if use.pushed and any(slot.param.requires_grad for slot in params):
                views = dict(
                    zip(map(id, params), _Fetch.apply(_Box(self, params), *(s.param for s in params)))
                )
            else:
                views = {id(slot): slot.device_view() for slot in params}
            for m, n, slot in todo:
                use.saved.append((m, n, slot.param))
                m._parameters[n] = views[id(slot)]
            if unit.module is module and len(todo) == len(slots):
                # Every module inside finds its weights swapped in already: its hooks would do nothing
                # but cost PyTorch's slow call path (~20 us a module call); they are taken out until
                # _exit puts them back.
                use.muted = unit.inner
                for m, pre, post in use.muted:
                    m._forward_pre_hooks.pop(pre, None)
                    m._forward_hooks.pop(post, None)
            self._active.append(use)
        if use.pushed:
            tp.push_saved_hooks(*self._hooks_over_current())

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        with self._lock:
            use = self._active.pop()
            if use is None:
                return
            if use.pushed:
                tp.pop_saved_hooks()
            for m, n, p in use.saved:
                m._parameters[n] = p
            use.saved = []
            for m, pre, post in use.muted:
                m._forward_pre_hooks[pre] = self._enter
                m._forward_hooks[post] = self._exit
            use.muted = []
            self._release(use.unit)

    # ------------------------------------------------------------------ saved weights

    def _hooks_over_current(self) -> tuple[Any, Any]:
        """Pack/unpack hooks that turn this streamer's weights into tokens and hand every other tensor
        to the hooks that were in force (a supermem.pool, say)."""
        outer = tp.top_saved_hooks(False)
        outer_pack, outer_unpack = outer if outer else (None, None)

        def pack(t: torch.Tensor) -> Any:
            token = self._pack(t)
            if token is not None:
                return token
            return outer_pack(t) if outer_pack else t

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, _Token):
                return self._unpack(packed)
            return outer_unpack(packed) if outer_unpack else packed

        return pack, unpack

    def _pack(self, t: torch.Tensor) -> _Token | None:
        if t.device != self.device or t.numel() == 0:
            return None
        with self._lock:
            unit = self._by_ptr.get(t.untyped_storage().data_ptr())
            if unit is None:
                return None
            for use in reversed(self._active):
                if use is not None and (use.unit is unit or unit in use.unit.deps):
                    use.tokens += 1
                    return _Token(use, unit, t)
        return None

    def _unpack(self, token: _Token) -> torch.Tensor:
        use, unit = token.use, token.unit
        with self._lock:
            first = use.unpacked % use.tokens == 0
            if first and unit.host_version() != token.version:  # once per use: a unit may be large
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    "operation: a streamed parameter changed between forward and backward (an optimizer "
                    "step before backward?)"
                )
            use.unpacked += 1
            if first:
                self._acquire(use.unit)
            out = unit.copy.view(token.dtype).as_strided(token.size, token.stride, token.offset)
            if use.unpacked % use.tokens == 0:
                self._release(use.unit)
        return out

    # ------------------------------------------------------------------ device copies

    def _acquire(self, unit: _Unit) -> None:
        """Holds `unit`'s device copies (fetching what is missing) and prefetches what comes next."""
        position = self._advance(unit)
        if position is not None and position in self._ahead:
            self._ahead.pop(position)  # the prefetch's hold becomes this acquisition's
            self._counters["prefetch_hits"] += 1
        else:
            self._hold(unit)
        if self._recording:
            self._sequence.append(unit)
        elif position is not None:
            self._prefetch_from(position)
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        stream = compute.cuda_stream if self.cuda else 0
        for u in (unit, *unit.deps):
            if u.copy is not None and u.used_on != stream:  # once per copy and stream is enough
                self.copies.use(u.copy, u.ready, compute)
                u.used_on = stream

    def _hold(self, unit: _Unit) -> None:
        for u in (unit, *unit.deps):
            if u.copy is not None and u.version != u.host_version():
                self._drop(u)  # the host parameters changed since: fetch them again
            if u.copy is None and u.flat is not None:
                u.version = u.host_version()
                u.copy, u.ready = self.copies.to_device(u.flat.tensor[: u.nbytes])
                u.typed = {}
                self._by_ptr[u.copy.untyped_storage().data_ptr()] = u
                self._counters["fetches"] += 1
            u.holds += 1

    def _release(self, unit: _Unit) -> None:
        for u in (unit, *unit.deps):
            u.holds -= 1
            if u.holds <= 0:
                self._drop(u)

    def _drop(self, unit: _Unit) -> None:
        if unit.copy is not None:
            self._by_ptr.pop(unit.copy.untyped_storage().data_ptr(), None)
        unit.copy, unit.ready, unit.used_on, unit.holds, unit.typed = None, None, -1, 0, {}

    def _advance(self, unit: _Unit) -> int | None:
        """The position of this acquisition in the recorded sequence (None while recording or when the
        step strays from it); prefetches skipped over are released."""
        if self._recording:
            return None
        window = self._sequence[self._cursor : self._cursor + 64]
        for i, u in enumerate(window):
            if u is unit:
                position = self._cursor + i
                for q in [q for q in self._ahead if q < position]:
                    self._release(self._ahead.pop(q))
                self._cursor = position + 1
                return position
        return None

    def _prefetch_from(self, position: int) -> None:
        for q in range(position + 1, min(position + 1 + self.prefetch, len(self._sequence))):
            if q not in self._ahead:
                unit = self._sequence[q]
                self._hold(unit)
                self._ahead[q] = unit

    # ------------------------------------------------------------------ gradients

    def _grads_ready(self, ready: list[tuple[_Param, torch.Tensor]]) -> None:
        """Starts copying gradient contributions (one unit call's) to the host, all in one batch; the
        sums land in `.grad` at the end of this backward (in arrival order, as autograd's own sum)."""
        with self._lock:
            if self._hidden_grads:  # a device step's optimizer raised before its post-hook gave them back
                from .streaming_step import restore_grads

                restore_grads(self)
            pairs, landing = [], []
            for slot, grad in ready:
                items = self._pending.get(slot)
                p = slot.param
                if not items and p.grad is None:
                    if slot.grad_block is None:
                        slot.grad_block = self._take(slot.nbytes)
                        slot.grad_view = slot.grad_block.tensor[: slot.nbytes].view(p.dtype).view(p.shape)
                    dst, scratch = slot.grad_view, None
                else:
                    scratch = self._take(slot.nbytes)
                    dst = scratch.tensor[: slot.nbytes].view(p.dtype).view(p.shape)
                pairs.append((grad, dst))
                landing.append((slot, dst, scratch))
            event = self.copies.to_host_many(pairs)
            stepped = (
                self._overlap.take([(s, d, b is None) for s, d, b in landing], event) if self._overlap else ()
            )
            for slot, dst, scratch in landing:
                if slot not in stepped:  # the overlapped optimizer step has those
                    self._pending.setdefault(slot, []).append((dst, event, scratch))
            self._counters["grads_to_host"] += len(pairs)
            if not self._callback_queued:
                self._callback_queued = True
                tp.execution_engine.queue_callback(self.sync)

    def sync(self) -> None:
        """Waits for the gradients on their way to the host and puts them in `.grad` (autograd calls this
        at the end of each backward; optimizer steps call it first)."""
        with self._lock:
            self._callback_queued = False
            if self._overlap is not None:  # the parameters stepped during backward have their `.grad`
                for slot, (dst, event) in self._overlap.wait().items():
                    self._pending.setdefault(slot, []).insert(0, (dst, event, None))
            pending, self._pending = self._pending, {}
            waited: set[int] = set()
            for slot, items in pending.items():
                for _, event, _ in items:
                    if id(event) not in waited:  # a batch's gradients share one event
                        waited.add(id(event))
                        self.copies.wait(event)
                total = items[0][0]
                for dst, _, _ in items[1:]:
                    total.add_(dst)
                p = slot.param
                if items[0][2] is None and p.grad is None:
                    p.grad = total
                elif p.grad is None:
                    p.grad = total.clone()
                else:
                    p.grad.add_(total)
                for _, _, scratch in items:
                    if scratch is not None:
                        self.host.give_back(scratch)
            self.copies.collect()

    def _before_optimizer_step(self) -> None:
        self.sync()
        with self._lock:
            self._step_due = True
            for unit in self._ahead.values():
                self._release(unit)
            self._ahead.clear()
            if self.cuda:  # no copy may read a parameter while the optimizer writes it
                self.copies.h2d.synchronize()

    # ------------------------------------------------------------------ public

    def stats(self) -> dict[str, Any]:
        """Counts and bytes: units, fetches (device copies made), prefetch_hits, grads_to_host, h2d_bytes,
        d2h_bytes, h2d_gbps, d2h_gbps, wait_s (compute stalled for copies), host_bytes (its host blocks:
        parameters and gradients)."""
        s = self.copies.collect()
        return {
            "units": len(self.units),
            **self._counters,
            "h2d_bytes": s.h2d_bytes,
            "d2h_bytes": s.d2h_bytes,
            "h2d_gbps": s.h2d_bytes / s.h2d_seconds / 1e9 if s.h2d_seconds else 0.0,
            "d2h_gbps": s.d2h_bytes / s.d2h_seconds / 1e9 if s.d2h_seconds else 0.0,
            "wait_s": s.wait_seconds,
            "host_bytes": self.host.in_use_bytes,
        }

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for slot in self._params.values():
            yield slot.param

    def close(self) -> None:
        """Stops streaming. Parameters and gradients move to ordinary host memory and their pinned blocks
        return to the pool (each when its last view dies: at once, unless the caller kept one); the
        Parameter objects stay the same."""
        self.sync()
        if self._overlap is not None:
            self._overlap.stop()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for slot in self._params.values():
            p = slot.param
            p.data = p.data.clone()
            if p.grad is not None:
                p.grad = p.grad.clone()
        for unit in self.units:
            self._drop(unit)
            unit.flat = None
        for slot in self._params.values():
            slot.grad_block = slot.grad_view = None
        for state, key, view in self._state_views:  # the device step's optimizer state
            if state.get(key) is view:
                state[key] = view.clone()
        self._state_views = []
        self.model._supermem_streamer = None
        _live.discard(self)

    def __enter__(self) -> Streamer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def streamed_unit(module: torch.nn.Module) -> tuple[Streamer, _Unit] | None:
    """The streamer and unit that fetch exactly `module`'s parameters, all of them its own (a unit of
    its own, sharing none with another unit), or None. supermem.checkpoint's graphs copy such a unit's
    host block into their own device buffer instead of calling the module."""
    for streamer in list(_live):
        unit = streamer._unit_of.get(module)
        if unit is not None and unit.module is module and not unit.deps and unit.flat is not None:
            own = {id(slot.param) for slot in unit.params}
            if all(id(p) in own for p in module.parameters()):
                return streamer, unit
    return None


def _install_optimizer_hook() -> None:
    """Every optimizer step first syncs the streamers (their gradients must have landed) and runs the
    device steps; after it, the gradients those hid come back."""
    global _optimizer_hook
    if _optimizer_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _optimizer_hook = (
            register_optimizer_step_pre_hook(_sync_all),
            register_optimizer_step_post_hook(_after_step),
        )


def _sync_all(optimizer: Any, args: Any, kwargs: Any) -> None:
    for streamer in list(_live):
        if streamer._stepping or streamer._hidden_grads:
            continue  # inside a step already under way (an optimizer calling super().step(), say)
        streamer._before_optimizer_step()
        # args[0] is the optimizer; a closure re-runs the model: that step stays on the host
        closure = (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None
        if streamer.optimizer_step == "device" and not closure:
            from .streaming_step import device_step

            device_step(streamer, optimizer)
        elif streamer._overlap is not None:
            streamer._overlap.before_step(optimizer)


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    for streamer in list(_live):
        if streamer._hidden_grads:
            from .streaming_step import restore_grads

            restore_grads(streamer)


def activate_from_config(cfg: Any) -> None:
    """SUPERMEM_CONF=stream:weights: the first outermost module called with its parameters on a CUDA
    device, or with CPU parameters and a CUDA input, is the model: it is streamed to that device from
    then on. Finding it takes two global module hooks, which run on every module call of the process;
    they are removed once the model is found, so later calls cost nothing (PyTorch's hook-free path).
    Other models are not streamed: give them to supermem.stream(). Runs during `import torch`: nothing
    here may touch CUDA."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    depth = threading.local()
    handles: list[Any] = []

    def pre(module: torch.nn.Module, args: Any) -> None:
        level = getattr(depth, "n", 0)
        depth.n = level + 1
        if level:
            return
        device = _target_device(module, args)
        if device is None:
            return
        for h in handles:  # safe here: PyTorch iterates over a copy of the global hooks
            h.remove()
        if getattr(module, "_supermem_streamer", None) is None:  # else streamed by hand already
            streamer = Streamer(module, device, host_limit=cfg.host_limit)
            # this call already passed the module's own pre-hooks: run the ones streaming just added
            streamer._step_start(module, args)
            if module in streamer._unit_of or module in streamer._fallback:
                streamer._enter(module, args)

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        depth.n = max(getattr(depth, "n", 1) - 1, 0)

    handles.append(register_module_forward_pre_hook(pre))
    handles.append(register_module_forward_hook(post, always_call=True))


def _target_device(module: torch.nn.Module, args: Any) -> torch.device | None:
    p = next(module.parameters(), None)
    if p is None:
        return None
    if p.device.type == "cuda":
        return p.device
    for a in args if isinstance(args, tuple) else (args,):
        if isinstance(a, torch.Tensor) and a.device.type == "cuda":
            return a.device
    return None
