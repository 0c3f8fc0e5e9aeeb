"""The state a module call ran under that decides what it computes and saves: the CPU (and CUDA) RNG
state, the autocast state per device type, the attention backends enabled (on CUDA), and the module's
own attributes and those of its submodules (a user who sets `eval()`, a dropout's `p`, a LayerNorm's
`eps` or swaps a submodule between forward and backward: plain autograd's backward uses what the
forward saved, so a replay must run the module as it was). A region captures it at the call; its
replay runs under it, with grad on, and puts back what it found.

This is what torch.random.fork_rng, torch.autocast, the attention backend switches and
torch.enable_grad do, set directly: those contexts cost about 50 us a replay on a CPU inside a
training step (the step is host-bound on an H100 under the pool). An autocast that is off at the call
and now, with the same dtype, is not entered (nothing is cast either way); an attention backend is
switched only where it differs. Under a torch function mode (export's pre-dispatch tracing watches
autocast contexts) autocast goes through torch.autocast itself.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import torch_private as tp

_SDPA = tuple(
    n for n in ("flash", "mem_efficient", "math", "cudnn") if hasattr(torch.backends.cuda, f"enable_{n}_sdp")
)
_SDPA_GET = tuple(tp.sdp_enabled_getter(n) for n in _SDPA)
_SDPA_SET = tuple(getattr(torch.backends.cuda, f"enable_{n}_sdp") for n in _SDPA)


_CPU_RNG = torch.default_generator
_CUDA_RNG: dict[int, torch.Generator] = {}  # device index -> its default generator


def _cuda_generator(device: torch.device) -> torch.Generator:
    """The device's default CUDA generator (what torch.cuda.get_rng_state reads, without its wrapper)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    gen = _CUDA_RNG.get(index)
    if gen is None:
        torch.cuda.init()
        gen = _CUDA_RNG[index] = torch.cuda.default_generators[index]
    return gen


def sdpa_backends() -> tuple[bool, ...]:
    return tuple(get() for get in _SDPA_GET)


def switch_sdpa(backends: tuple[bool, ...] | None) -> list[tuple[Any, bool]]:
    """Enables the attention backends as `backends` says (None: leaves them), switching only those that
    differ; returns what put_back_sdpa needs to undo it."""
    switched = []
    if backends is not None:
        for get, set_, on in zip(_SDPA_GET, _SDPA_SET, backends):
            was = get()
            if was != on:
                set_(on)
                switched.append((set_, was))
    return switched


def put_back_sdpa(switched: list[tuple[Any, bool]]) -> None:
    for set_, was in reversed(switched):
        set_(was)


def module_state(module: torch.nn.Module | None) -> list[tuple]:
    """The module's and each submodule's attributes, children and parameters, as shallow copies (the
    dicts a change of them goes through: Module.__setattr__, train(), a swapped child or parameter)."""
    out: list[tuple] = []
    stack = [module] if module is not None else []
    while stack:
        m = stack.pop()
        d = m.__dict__
        out.append((m, d.copy(), d["_modules"].copy(), d["_parameters"].copy()))
        stack.extend(c for c in d["_modules"].values() if c is not None)
    return out


def _set_state(m: torch.nn.Module, attrs: dict, children: dict, params: dict) -> None:
    d = m.__dict__
    d.clear()
    d.update(attrs)
    for now, then in ((d["_modules"], children), (d["_parameters"], params)):
        now.clear()
        now.update(then)


def put_state(state: list[tuple]) -> list[tuple]:
    """Sets each module of `state` back where it changed since; returns what undoes it."""
    undo = []
    for m, attrs, children, params in state:
        d = m.__dict__
        try:
            same = d == attrs and d["_modules"] == children and d["_parameters"] == params
        except Exception:  # noqa: BLE001  (a tensor attribute replaced: compared elementwise)
            same = False
        if not same:
            undo.append((m, d.copy(), d["_modules"].copy(), d["_parameters"].copy()))
            _set_state(m, attrs, children, params)
    return undo


def undo_state(undo: list[tuple]) -> None:
    for m, attrs, children, params in reversed(undo):
        _set_state(m, attrs, children, params)


class CallState:
    """Captured at a call; `with state.replay():` runs code under it (grad on)."""

    __slots__ = ("device", "rng_cpu", "rng_cuda", "autocast", "cache_enabled", "sdpa", "modules")

    def __init__(self, device: torch.device, module: torch.nn.Module | None = None):
        # (a light call takes one in its forward, where a planned step is host-bound: torch.get_rng_state,
        # torch.cuda.get_rng_state and a generator over the device types cost it ~35 us on an H100's host)
        self.device = device
        self.modules = module_state(module)
        self.rng_cpu = _CPU_RNG.get_state()
        cpu = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        self.rng_cuda: torch.Tensor | None
        self.sdpa: tuple[bool, ...] | None
        self.autocast: tuple[tuple[str, bool, torch.dtype], ...]  # (device type, enabled, dtype)
        if device.type == "cuda":
            self.rng_cuda = _cuda_generator(device).get_state()
            on = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
            self.autocast = (("cpu", *cpu), ("cuda", *on))
            self.sdpa = sdpa_backends()  # `with sdpa_kernel(...)` is global state
        else:
            self.rng_cuda = self.sdpa = None
            self.autocast = (("cpu", *cpu),)
        self.cache_enabled = torch.is_autocast_cache_enabled()

    def replay(self) -> _Replay:
        return _Replay(self)


class _Replay:
    """Sets a CallState and grad on; puts back what it found, in reverse (also when entering fails)."""

    __slots__ = ("call", "rng_cpu", "rng_cuda", "grad", "cache_enabled", "autocast", "sdpa", "undo")

    def __init__(self, call: CallState):
        self.call = call

    def __enter__(self) -> _Replay:
        c = self.call
        self.rng_cpu = _CPU_RNG.get_state()
        self.rng_cuda = _cuda_generator(c.device).get_state() if c.rng_cuda is not None else None
        self.grad = torch.is_grad_enabled()
        self.cache_enabled = torch.is_autocast_cache_enabled()
        self.autocast: list[Any] = []  # entered: torch.autocast, or (device type, enabled, dtype) before
        self.sdpa: list[tuple[Any, bool]] = []  # switched: (setter, value before)
        self.undo: list[tuple] = []  # modules set back as they were at the call
        try:
            self.undo = put_state(c.modules)
            _CPU_RNG.set_state(c.rng_cpu)
            if c.rng_cuda is not None:
                _cuda_generator(c.device).set_state(c.rng_cuda)
            self._enter_autocast(c)
            self.sdpa = switch_sdpa(c.sdpa)
            tp.set_grad_enabled(True)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _enter_autocast(self, c: CallState) -> None:
        mode = tp.torch_function_mode_enabled()
        for dt, enabled, dtype in c.autocast:
            now, now_dtype = torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt)
            if not enabled and not now and dtype == now_dtype:
                continue
            if mode:
                ctx = torch.autocast(dt, enabled=enabled, dtype=dtype, cache_enabled=c.cache_enabled)
                ctx.__enter__()
                self.autocast.append(ctx)
                continue
            torch.autocast_increment_nesting()
            self.autocast.append((dt, now, now_dtype))  # from here __exit__ undoes it
            torch.set_autocast_enabled(dt, enabled)
            torch.set_autocast_dtype(dt, dtype)
            torch.set_autocast_cache_enabled(c.cache_enabled)

    def __exit__(self, *exc: Any) -> None:
        undo_state(self.undo)
        tp.set_grad_enabled(self.grad)
        put_back_sdpa(self.sdpa)
        for x in reversed(self.autocast):
            if isinstance(x, torch.autocast):
                x.__exit__(None, None, None)
                continue
            dt, enabled, dtype = x
            if torch.autocast_decrement_nesting() == 0:  # as torch.autocast: the casts cached go
                torch.clear_autocast_cache()
            torch.set_autocast_enabled(dt, enabled)
            torch.set_autocast_dtype(dt, dtype)
        torch.set_autocast_cache_enabled(self.cache_enabled)
        _CPU_RNG.set_state(self.rng_cpu)
        if self.rng_cuda is not None:
            _cuda_generator(self.call.device).set_state(self.rng_cuda)
