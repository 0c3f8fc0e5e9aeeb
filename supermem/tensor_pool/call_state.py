"""The global state a module call ran under that decides what it computes and saves: the CPU (and
CUDA) RNG state, the autocast state per device type, the attention backends enabled (on CUDA). A
region captures it at the call; its replay runs under it, with grad on, and puts back what it found.

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

_SDPA = tuple(
    n for n in ("flash", "mem_efficient", "math", "cudnn") if hasattr(torch.backends.cuda, f"enable_{n}_sdp")
)
# (torch._C's getters where they exist: torch.backends.cuda's wrap them in a Python call each)
_SDPA_GET = tuple(
    getattr(torch._C, f"_get_{n}_sdp_enabled", None) or getattr(torch.backends.cuda, f"{n}_sdp_enabled")
    for n in _SDPA
)
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


class CallState:
    """Captured at a call; `with state.replay():` runs code under it (grad on)."""

    __slots__ = ("device", "rng_cpu", "rng_cuda", "autocast", "cache_enabled", "sdpa")

    def __init__(self, device: torch.device):
        # (a light call takes one in its forward, where a planned step is host-bound: torch.get_rng_state,
        # torch.cuda.get_rng_state and a generator over the device types cost it ~35 us on an H100's host)
        self.device = device
        self.rng_cpu = _CPU_RNG.get_state()
        cpu = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
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

    __slots__ = ("call", "rng_cpu", "rng_cuda", "grad", "cache_enabled", "autocast", "sdpa")

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
        try:
            _CPU_RNG.set_state(c.rng_cpu)
            if c.rng_cuda is not None:
                _cuda_generator(c.device).set_state(c.rng_cuda)
            self._enter_autocast(c)
            self.sdpa = switch_sdpa(c.sdpa)
            torch._C._set_grad_enabled(True)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _enter_autocast(self, c: CallState) -> None:
        mode = torch._C._is_torch_function_mode_enabled()
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
        torch._C._set_grad_enabled(self.grad)
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
