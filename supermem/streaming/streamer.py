"""The Streamer: each unit's device copy fetched for its module's call and again for its backward,
prefetched in the first step's order; saved weights packed as tokens; gradients sent to the host as they
are produced and summed into `.grad` at the end of backward. The package's docstring says how."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import psutil
import torch

from .. import torch_private as tp
from ..errors import UsageError
from ..units import parse_bytes
from .layout import plan_units
from .live import _install_optimizer_hook, _live
from .units import STREAMER_ATTR, _Box, _Fetch, _Param, _Token, _Unit, _Use

if TYPE_CHECKING:
    from ..streaming_overlap import Overlap
    from ..transfer.host import HostBlock


class Streamer:
    """See the package docstring (streaming/__init__.py). `stats()` reports bytes moved and prefetch hits."""

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
        if getattr(model, STREAMER_ATTR, None) is not None:
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
            from ..streaming_overlap import Overlap

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
        from ..transfer.copy import CopyEngine
        from ..transfer.host import shared_host_pool

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
            plan_units(self, model)
        except BaseException:  # the host limit, say: the model stays as it was
            for h in self._handles:
                h.remove()
            for p, data, grad in reversed(self._moved):
                p.grad = None
                p.data = data
                p.grad = grad
            raise
        self._moved = []
        setattr(model, STREAMER_ATTR, self)
        # first, before the root's own fetch: a step starts before anything of it is fetched
        self._handles.append(model.register_forward_pre_hook(self._step_start, prepend=True))
        _live.add(self)
        _install_optimizer_hook()

    # ------------------------------------------------------------------ set-up

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
        outer = tp.saved_hooks_in_force()
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
            out = unit.held_copy().view(token.dtype).as_strided(token.size, token.stride, token.offset)
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
        stream = compute.cuda_stream if compute is not None else 0
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
                from ..streaming_step import restore_grads

                restore_grads(self)
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device gradient, host destination)
            landing: list[tuple[_Param, torch.Tensor, HostBlock | None]] = []
            scratch: HostBlock | None
            for slot, grad in ready:
                items = self._pending.get(slot)
                p = slot.param
                if not items and p.grad is None:
                    dst, scratch = slot.grad_view, None
                    if dst is None:  # (grad_block and grad_view are set, and cleared, together)
                        slot.grad_block = block = self._take(slot.nbytes)
                        dst = slot.grad_view = block.tensor[: slot.nbytes].view(p.dtype).view(p.shape)
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
        setattr(self.model, STREAMER_ATTR, None)
        _live.discard(self)

    def __enter__(self) -> Streamer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
