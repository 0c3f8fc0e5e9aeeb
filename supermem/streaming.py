"""Weight streaming: parameters, their gradients and optimizer state live in pinned host memory; each
module's weights come to the device just in time for its forward and again for its backward.

    streamer = supermem.stream(model)                      # or SUPERMEM_CONF=stream:weights
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)   # steps on the host
    loss = model(x).sum(); loss.backward(); opt.step(); opt.zero_grad()

How: a forward pre-hook on every module that owns parameters swaps device copies of them in (through
`_Fetch`, whose backward sends the weight's gradient to the host on a side stream as soon as it is
produced) and a forward hook swaps the host parameters back and drops the copies. Autograd's saved
weights are packed as tokens, not kept: the backward fetches them again at unpack. The order of
fetches of the first step is recorded; later steps replay it, prefetching `prefetch` modules ahead.
The Parameter objects stay the same (their `.data` moves to the host), so an optimizer built over
`model.parameters()` before or after streaming steps on the host; its state is created there.

Results are bitwise those of unstreamed training: the same kernels see the same weights, and each
parameter's gradient contributions are summed in the order autograd would have summed them.
Limits: a module must reach its own parameters through `__call__` (not `module.forward(...)`, nor
another module reading `child.weight`); `torch.autograd.grad` with respect to streamed parameters
gives None (gradients reach `.grad` only); RNN flat weights are not supported.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

import psutil
import torch

from .errors import UsageError
from .tensor_pool.copy import CopyEngine
from .tensor_pool.host import HostBlock, HostPool, pinned_available
from .units import parse_bytes

_live: weakref.WeakSet[Streamer] = weakref.WeakSet()
_optimizer_hook: Any = None


def stream(
    model: torch.nn.Module,
    device: torch.device | str | None = None,
    *,
    prefetch: int = 2,
    host_limit: int | float | str = "50%",
) -> Streamer:
    """Streams `model`'s parameters from host memory to `device` (default: the current CUDA device,
    else "cpu", where a host tier and a compute tier both on the CPU exercise the same machinery).

    prefetch: modules fetched ahead of use (in the order the first step used them).
    host_limit: host memory for parameters and gradients (bytes, "32GiB" or a percentage of RAM).
    Returns the Streamer (also a context manager: leaving it stops streaming, parameters stay on the host).
    """
    return Streamer(model, device, prefetch=prefetch, host_limit=host_limit)


class _Param:
    """One streamed parameter: its host data (`param.data`), its device copy while someone holds it,
    and a persistent host gradient buffer."""

    __slots__ = ("param", "block", "grad_block", "copy", "ready", "version", "holds")

    def __init__(self, param: torch.nn.Parameter, block: HostBlock):
        self.param = param
        self.block = block
        self.grad_block: HostBlock | None = None
        self.copy: torch.Tensor | None = None  # the device copy
        self.ready: Any = None  # the event its copy ends with (None on CPU)
        self.version = -1  # the host version the copy was made from
        self.holds = 0


class _Module:
    """A module that owns parameters directly (not through children)."""

    __slots__ = ("module", "slots", "prefetched", "index")

    def __init__(self, module: torch.nn.Module, slots: list[tuple[str, _Param]], index: int):
        self.module = module
        self.slots = slots
        self.prefetched = 0  # holds taken by prefetches not yet consumed
        self.index = index


class _Use:
    """One forward call of a module, as its backward sees it: the weight tokens saved, and how many were
    unpacked (the device copy is held from the first unpack to the last)."""

    __slots__ = ("record", "tokens", "unpacked", "saved", "pushed")

    def __init__(self, record: _Module):
        self.record = record
        self.saved: dict[str, Any] = {}  # the host parameters swapped out during the call
        self.pushed = False  # whether the call pushed saved-tensor hooks (grad mode was on)
        self.tokens = 0
        self.unpacked = 0


class _Token:
    __slots__ = ("use", "slot", "size", "stride", "offset", "version")

    def __init__(self, use: _Use, slot: _Param, t: torch.Tensor):
        self.use, self.slot = use, slot
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        self.version = slot.param._version


class _Box:
    """Carries a device copy into _Fetch.apply (a non-tensor argument, so the output is a new tensor)."""

    __slots__ = ("streamer", "slot")

    def __init__(self, streamer: Streamer, slot: _Param):
        self.streamer, self.slot = streamer, slot


class _Fetch(torch.autograd.Function):
    """host parameter -> its device copy; the gradient goes back to the host, not through autograd."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, box: _Box) -> torch.Tensor:
        ctx.box = box
        return box.slot.copy.view_as(box.slot.copy)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        ctx.box.streamer._grad_ready(ctx.box.slot, grad)
        return None, None


class Streamer:
    """See the module docstring. `stats()` reports bytes moved and prefetch hits."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device | str | None = None,
        *,
        prefetch: int = 2,
        host_limit: int | float | str = "50%",
    ):
        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"stream: model must be an nn.Module, got {type(model).__name__}")
        if getattr(model, "_supermem_streamer", None) is not None:
            raise UsageError("stream: this model is already streamed")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise UsageError(f"stream: prefetch must be an int >= 0, got {prefetch!r}")
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
        self.host = HostPool(host_bytes, pinned=self.cuda and pinned_available())
        self.copies = CopyEngine(self.device)
        self.prefetch = prefetch
        self.model = model
        self._lock = threading.RLock()
        self._by_ptr: dict[int, _Param] = {}  # device copies alive, by storage address
        self._active: list[_Use] = []  # module calls in progress, innermost last
        self._pending: dict[_Param, list[tuple[torch.Tensor, Any, HostBlock | None]]] = {}
        self._callback_queued = False
        self._sequence: list[_Module] = []  # the first step's acquisitions, replayed by later steps
        self._recording = True
        self._steps = 0
        self._cursor = 0
        self._ahead: dict[int, _Module] = {}  # sequence position -> prefetched module
        self._counters = dict.fromkeys(("fetches", "prefetch_hits", "grads_to_host"), 0)
        self.records: list[_Module] = []
        self._handles: list[Any] = []
        self._move(model)
        model._supermem_streamer = self
        self._handles.append(model.register_forward_pre_hook(self._step_start))
        _live.add(self)
        _install_optimizer_hook()

    # ------------------------------------------------------------------ set-up

    def _move(self, model: torch.nn.Module) -> None:
        slots: dict[int, _Param] = {}
        for module in model.modules():
            own = []
            for name, p in module._parameters.items():
                if p is None:
                    continue
                if id(p) not in slots:
                    slots[id(p)] = self._to_host(p)
                own.append((name, slots[id(p)]))
            for name, b in module._buffers.items():
                if b is not None and b.device != self.device:
                    module._buffers[name] = b.to(self.device)
            if own:
                rec = _Module(module, own, len(self.records))
                self.records.append(rec)
                self._handles.append(module.register_forward_pre_hook(self._make_pre(rec)))
                self._handles.append(module.register_forward_hook(self._make_post(rec), always_call=True))

    def _to_host(self, p: torch.nn.Parameter) -> _Param:
        block = self._take(p.numel() * p.element_size())
        host = _view(block, p.dtype, p.shape)
        with torch.no_grad():
            host.copy_(p.data)
        p.data = host
        if p.grad is not None:
            p.grad = None  # a gradient on the old device would not match the host parameter
        return _Param(p, block)

    def _take(self, nbytes: int) -> HostBlock:
        block = self.host.take(max(nbytes, 1))
        if block is None:
            raise torch.OutOfMemoryError(
                f"supermem.stream: host_limit reached ({self.host.reserved_bytes} bytes of host memory used)"
            )
        return block

    # ------------------------------------------------------------------ forward

    def _step_start(self, module: torch.nn.Module, args: Any) -> None:
        with self._lock:
            if self._active:
                return  # a nested call of the root, not a new step
            self._steps += 1
            if self._steps == 2:
                self._recording = False
            for rec in self._ahead.values():
                self._release_prefetch(rec)
            self._ahead.clear()
            self._cursor = 0
            if not self._recording:
                self._prefetch_from(-1)

    def _make_pre(self, rec: _Module) -> Any:
        def pre(module: torch.nn.Module, args: Any) -> None:
            with self._lock:
                self._acquire(rec)
                use = _Use(rec)
                use.pushed = torch.is_grad_enabled()
                for name, slot in rec.slots:
                    use.saved[name] = module._parameters[name]
                    p = slot.param
                    module._parameters[name] = (
                        _Fetch.apply(p, _Box(self, slot)) if use.pushed and p.requires_grad else slot.copy
                    )
                self._active.append(use)
            if use.pushed:
                torch._C._autograd._push_saved_tensors_default_hooks(*self._hooks_over_current())

        return pre

    def _make_post(self, rec: _Module) -> Any:
        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            with self._lock:
                use = self._active.pop()
                if use.pushed:
                    torch._C._autograd._pop_saved_tensors_default_hooks()
                module._parameters.update(use.saved)
                use.saved = {}
                self._release(rec)

        return post

    # ------------------------------------------------------------------ saved weights

    def _hooks_over_current(self) -> tuple[Any, Any]:
        """Pack/unpack hooks that turn this streamer's weights into tokens and hand every other tensor
        to the hooks that were in force (a supermem.pool, say)."""
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
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
            slot = self._by_ptr.get(t.untyped_storage().data_ptr())
            if slot is None:
                return None
            for use in reversed(self._active):
                if any(s is slot for _, s in use.record.slots):
                    use.tokens += 1
                    return _Token(use, slot, t)
        return None

    def _unpack(self, token: _Token) -> torch.Tensor:
        use, slot = token.use, token.slot
        if slot.param._version != token.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a streamed parameter of shape {tuple(slot.param.shape)} changed between "
                "forward and backward (an optimizer step before backward?)"
            )
        with self._lock:
            first = use.unpacked % use.tokens == 0
            use.unpacked += 1
            last = use.unpacked % use.tokens == 0
            if first:
                self._acquire(use.record)
            copy = slot.copy
            out = copy.as_strided(token.size, token.stride, token.offset)
            if last:
                self._release(use.record)
        return out

    # ------------------------------------------------------------------ device copies

    def _acquire(self, rec: _Module) -> None:
        """Holds `rec`'s device copies (fetching what is missing) and prefetches what comes next."""
        position = self._advance(rec)
        if position is not None and position in self._ahead:
            self._ahead.pop(position)
            rec.prefetched -= 1
            self._counters["prefetch_hits"] += 1
        else:
            self._hold(rec)
        if self._recording:
            self._sequence.append(rec)
        elif position is not None:
            self._prefetch_from(position)
        for _, slot in rec.slots:
            self.copies.use(slot.copy, slot.ready)

    def _hold(self, rec: _Module) -> None:
        for _, slot in rec.slots:
            if slot.copy is not None and slot.version != slot.param._version:
                self._drop(slot)  # the host parameter changed since: fetch it again
            if slot.copy is None:
                slot.version = slot.param._version
                slot.copy, slot.ready = self.copies.to_device(slot.param.data)
                self._by_ptr[slot.copy.untyped_storage().data_ptr()] = slot
                self._counters["fetches"] += 1
            slot.holds += 1

    def _release(self, rec: _Module) -> None:
        for _, slot in rec.slots:
            slot.holds -= 1
            if slot.holds <= 0:
                self._drop(slot)

    def _drop(self, slot: _Param) -> None:
        if slot.copy is not None:
            self._by_ptr.pop(slot.copy.untyped_storage().data_ptr(), None)
        slot.copy, slot.ready, slot.holds = None, None, 0

    def _release_prefetch(self, rec: _Module) -> None:
        rec.prefetched -= 1
        self._release(rec)

    def _advance(self, rec: _Module) -> int | None:
        """The position of this acquisition in the recorded sequence (None while recording or when the
        step strays from it); prefetches skipped over are released."""
        if self._recording:
            return None
        window = self._sequence[self._cursor : self._cursor + 64]
        for i, r in enumerate(window):
            if r is rec:
                position = self._cursor + i
                for q in [q for q in self._ahead if q < position]:
                    self._release_prefetch(self._ahead.pop(q))
                self._cursor = position + 1
                return position
        return None

    def _prefetch_from(self, position: int) -> None:
        for q in range(position + 1, min(position + 1 + self.prefetch, len(self._sequence))):
            if q not in self._ahead:
                rec = self._sequence[q]
                self._hold(rec)
                rec.prefetched += 1
                self._ahead[q] = rec

    # ------------------------------------------------------------------ gradients

    def _grad_ready(self, slot: _Param, grad: torch.Tensor) -> None:
        """Starts copying one gradient contribution to the host; the sum lands in `.grad` at the end of
        this backward (in arrival order, as autograd's own sum)."""
        if grad is None:
            return
        with self._lock:
            items = self._pending.setdefault(slot, [])
            p = slot.param
            if not items and p.grad is None:
                if slot.grad_block is None:
                    slot.grad_block = self._take(p.numel() * p.element_size())
                dst, scratch = _view(slot.grad_block, p.dtype, p.shape), None
            else:
                scratch = self._take(p.numel() * p.element_size())
                dst = _view(scratch, p.dtype, p.shape)
            event = self.copies.to_host(grad, dst)
            items.append((dst, event, scratch))
            self._counters["grads_to_host"] += 1
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self.sync)

    def sync(self) -> None:
        """Waits for the gradients on their way to the host and puts them in `.grad` (autograd calls this
        at the end of each backward; optimizer steps call it first)."""
        with self._lock:
            self._callback_queued = False
            pending, self._pending = self._pending, {}
            for slot, items in pending.items():
                for _, event, _ in items:
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
            for rec in self._ahead.values():
                self._release_prefetch(rec)
            self._ahead.clear()
            if self.cuda:  # no copy may read a parameter while the optimizer writes it
                self.copies.h2d.synchronize()

    # ------------------------------------------------------------------ public

    def stats(self) -> dict[str, Any]:
        """Counts and bytes: fetches (device copies made), prefetch_hits, grads_to_host, h2d_bytes,
        d2h_bytes, h2d_gbps, d2h_gbps, wait_s (compute stalled for copies), host_bytes."""
        s = self.copies.collect()
        return {
            **self._counters,
            "h2d_bytes": s.h2d_bytes,
            "d2h_bytes": s.d2h_bytes,
            "h2d_gbps": s.h2d_bytes / s.h2d_seconds / 1e9 if s.h2d_seconds else 0.0,
            "d2h_gbps": s.d2h_bytes / s.d2h_seconds / 1e9 if s.d2h_seconds else 0.0,
            "wait_s": s.wait_seconds,
            "host_bytes": self.host.reserved_bytes,
        }

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for rec in self.records:
            for _, slot in rec.slots:
                yield slot.param

    def close(self) -> None:
        """Stops streaming. Parameters and gradients move to ordinary host memory (their pinned blocks
        return to the pool); the Parameter objects stay the same."""
        self.sync()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        seen: set[int] = set()
        for rec in self.records:
            for _, slot in rec.slots:
                if id(slot) in seen:
                    continue
                seen.add(id(slot))
                p = slot.param
                p.data = p.data.clone()
                if p.grad is not None:
                    p.grad = p.grad.clone()
                self._drop(slot)
        self.model._supermem_streamer = None
        _live.discard(self)

    def __enter__(self) -> Streamer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _view(block: HostBlock, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    return block.tensor[:nbytes].view(dtype).view(shape)


def _install_optimizer_hook() -> None:
    """Every optimizer step first syncs the streamers: their gradients must have landed."""
    global _optimizer_hook
    if _optimizer_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _optimizer_hook = register_optimizer_step_pre_hook(_sync_all)


def _sync_all(optimizer: Any, args: Any, kwargs: Any) -> None:
    for streamer in list(_live):
        streamer._before_optimizer_step()


def activate_from_config(cfg: Any) -> None:
    """SUPERMEM_CONF=stream:weights: the first outermost module called with its parameters on a CUDA
    device, or with CPU parameters and a CUDA input, is streamed to that device from then on. Runs
    during `import torch`: nothing here may touch CUDA."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    depth = threading.local()

    def pre(module: torch.nn.Module, args: Any) -> None:
        level = getattr(depth, "n", 0)
        depth.n = level + 1
        if level or getattr(module, "_supermem_streamer", None) is not None:
            return
        device = _target_device(module, args)
        if device is not None:
            streamer = Streamer(module, device, host_limit=cfg.host_limit)
            # this call already passed the module's own pre-hooks: run the ones streaming just added
            streamer._step_start(module, args)
            for rec in streamer.records:
                if rec.module is module:
                    streamer._make_pre(rec)(module, args)

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        depth.n = max(getattr(depth, "n", 1) - 1, 0)

    register_module_forward_pre_hook(pre)
    register_module_forward_hook(post, always_call=True)


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
