"""Swapping supermem's allocator into PyTorch, and keeping PyTorch's memory tools working.

PyTorch lets an allocator be swapped only before CUDA is initialised, and once. supermem installs
a C++ subclass of PyTorch's CUDAPluggableAllocator (csrc/plugin.cpp). torch.cuda.memory_stats & co.
would raise for a pluggable allocator; supermem answers them with its own numbers by replacing the
torch._C functions they call (memory.py looks them up per call). CUDA graph trees need allocator
checkpointing, which supermem lacks: while installed, Inductor uses plain CUDA graphs instead.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any

from . import config, registry
from .errors import ActivationError
from .log import logger
from .units import parse_bytes

# No torch, _C or allocator import here: PyTorch's autoload hook imports this module while
# `import torch` is still running, perhaps started by another supermem module (see registry.py).

_TOO_LATE = (
    "supermem must replace PyTorch's CUDA allocator before CUDA is initialised, but CUDA is already "
    "in use in this process. Either set SUPERMEM=1 (or SUPERMEM_CONF=...) in the environment of the "
    "unchanged script, run it with `supermem run script.py`, or call supermem.install() before the "
    "first CUDA tensor or torch.cuda call (also before libraries that touch CUDA at import)."
)
_said_no_cuda = False

installed = registry.installed
device_allocator = registry.device_allocator


class PluginSource:
    """The PyTorch plug-in's per-device allocators (csrc/plugin.cpp), as registry.DeviceSource."""

    def __init__(
        self,
        limit_bytes: int,
        limit_fraction: float,
        passthrough: bool,
        debug: int,
        expandable_segments: bool = False,
    ):
        self._options = (limit_bytes, limit_fraction, passthrough, debug)
        self._expandable = expandable_segments

    def devices(self) -> list[int]:
        from . import _C

        return list(_C.plugin_devices())

    def allocator(self, device: int) -> Any:
        from . import _C
        from .allocator import CachingAllocator

        impl = _C.plugin_allocator(device, False)
        return None if impl is None else CachingAllocator.wrap(impl)

    def set_new_ring_events(self, n: int) -> None:
        from . import _C

        _C.plugin_configure(*self._options, n, expandable_segments=self._expandable)


def _limit_args(limit: Any) -> tuple[int, float]:
    """(bytes, fraction of the card) from the `limit` option; fractions resolve per device."""
    if limit is None:
        return 0, 0.0
    if isinstance(limit, float):
        return 0, limit
    if isinstance(limit, str) and limit.strip().endswith("%"):
        return 0, float(limit.strip()[:-1]) / 100
    return parse_bytes(limit), 0.0


def install(conf: str | dict | None = None) -> bool:
    """Swaps supermem's caching allocator into PyTorch. Call before CUDA is initialised.

    conf: options as a SUPERMEM_CONF string ("limit:12GiB,trace:100000") or a dict; they update the
    process's options (supermem.config.current()), all or none. As under SUPERMEM_CONF, `pool` gives
    every backward of the process a pool and `stream` streams the weights (once a process). Returns
    True when supermem serves CUDA memory, False when there is nothing to swap (`allocator:native`, or
    a PyTorch build without CUDA). Raises ActivationError when CUDA is already initialised,
    ConfigError for bad options.
    """
    cfg = config.current()
    if conf:
        cfg.set(**(config.parse_conf(conf) if isinstance(conf, str) else conf))
    swapped = _swap(cfg)
    if cfg.pool != "off" and "pool" not in _serving:
        pool_every_backward()
        _serving.add("pool")
    if cfg.stream != "off" and "stream" not in _serving:
        from .streaming import activate_from_config as stream_from_config

        stream_from_config(cfg)
        _serving.add("stream")
    return swapped


_serving: set[str] = set()  # what install() turned on for the whole process: "pool", "stream"


def _swap(cfg: config.Config) -> bool:
    """install()'s allocator half."""
    global _said_no_cuda
    import torch  # under SUPERMEM=1 this may run the autoload hook, which installs: look after it

    if registry.installed():
        return True
    if cfg.allocator == "native":
        return False
    from . import _C
    from . import torch_private as tp

    if not hasattr(_C, "plugin_install") or not tp.has_custom_allocator_hooks():
        if not _said_no_cuda:  # info, not a warning: under SUPERMEM=1 every `import torch` comes here
            _said_no_cuda = True
            logger.info("supermem: this PyTorch or supermem build has no CUDA; the allocator is not swapped")
        return False
    if torch.cuda.is_initialized():
        raise ActivationError(_TOO_LATE)
    from .trace import oom

    torch_conf_said = config.honour_torch_alloc_conf(cfg)  # before the limit is read
    source = PluginSource(*_limit_args(cfg.limit), cfg.passthrough, cfg.debug, cfg.expandable_segments)
    # the `trace` option, or a small always-on ring for OOM snapshots
    registry.set_device_source(source, oom.ring_events_for_config())
    try:
        _C.plugin_install()
    except RuntimeError as e:  # "Can't swap an already initialized allocator"
        registry.set_device_source(None)
        raise ActivationError(_TOO_LATE) from e
    _C.plugin_add_oom_observer(oom.on_oom)  # records it for `top`; writes the oom_snapshot trace
    if torch_conf_said:
        logger.warning(torch_conf_said)
    _patch_torch()
    if cfg.control:
        from . import control

        if control.start_server() is not None:
            control.register_provider("allocator", control.allocator_provider())
    return True


def install_from_env() -> None:
    """The zero-code path (SUPERMEM=1 / SUPERMEM_CONF): install with the environment's options, and
    the tensor pool for every backward when `pool` is set."""
    os.environ.setdefault("SUPERMEM", "1")  # child processes (spawn workers, torchrun) inherit it
    install()


def pool_every_backward() -> None:
    """SUPERMEM_CONF=pool:...: the pool serves every backward of this thread. tensor_pool is imported
    at the first saved tensor, not now: this runs inside `import torch`, which tensor_pool itself may
    have started, and the Pool must not touch CUDA before the program does."""
    from . import process_hooks

    made: list[Any] = []

    def env_pool() -> Any:
        if not made:
            from .tensor_pool import env_pool

            made.append(env_pool(config.current()))
        return made[0]

    process_hooks.push(env_pool)


# ---------------------------------------------------------------- torch.cuda.memory_* answers


def _allocator(device: int | None) -> Any:
    import torch

    from . import _C

    index = torch.cuda.current_device() if device is None else int(device)
    return _C.plugin_allocator(index, True)


def _memory_fraction(device: int | None) -> float:
    return _allocator(device).memory_fraction()  # what set_per_process_memory_fraction set, 0.0 included


def _memory_snapshot(*args: Any, **kwargs: Any) -> dict:
    """PyTorch's snapshot shape: segments of every device (with their blocks) and empty traces."""
    from . import _C

    segments: list[dict] = []
    traces: list[list] = []
    for device in _C.plugin_devices():
        segments += torch_segments(_C.plugin_allocator(device, False).snapshot(), device)
        traces.append([])
    return {"segments": segments, "device_traces": traces}


def torch_segments(segments: list[dict], device: int) -> list[dict]:
    """An allocator's snapshot() segments with every key of native's: torch/csrc/cuda/Module.cpp's
    segmentInfoToDict, PyTorch 2.1 to 2.13 (PyTorch's own tests read `is_expandable`: an expandable
    segment is, as in native's, one segment per run of mapped pages). Its sums as
    c10's CUDACachingAllocator snapshot() makes them: allocated over allocated blocks; active and
    requested over active ones (allocated, or freed with stream work pending). No stacks: `frames` is
    empty, as native's without _record_memory_history."""
    out = []
    for seg in segments:
        blocks = [dict(b, frames=[]) for b in seg["blocks"]]
        active = [b for b in blocks if b["state"] != "inactive"]
        out.append(
            dict(
                seg,
                device=device,
                allocated_size=sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
                active_size=sum(b["size"] for b in active),
                requested_size=sum(b["requested_size"] for b in active),
                is_expandable=bool(seg.get("is_expandable", False)),
                frames=[],
                blocks=blocks,
            )
        )
    return out


def _no_checkpointing(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(
        "supermem: CUDA graph trees need allocator checkpointing, which supermem does not provide; "
        "supermem turns torch._inductor.config.triton.cudagraph_trees off so that "
        "torch.compile(mode='reduce-overhead') uses plain CUDA graphs. Leave it off while supermem "
        "is installed."
    )


class _InductorConfigHook(importlib.abc.MetaPathFinder):
    """Sets triton.cudagraph_trees = False when torch._inductor.config is first imported (importing
    it here would cost a second at every `import torch`)."""

    name = "torch._inductor.config"

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return None
        loader, exec_module = spec.loader, spec.loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            module.triton.cudagraph_trees = False

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _plain_cuda_graphs_for_inductor() -> None:
    if _InductorConfigHook.name in sys.modules:
        sys.modules[_InductorConfigHook.name].triton.cudagraph_trees = False
    else:
        sys.meta_path.insert(0, _InductorConfigHook())


def _patch_torch() -> None:
    from . import torch_private as tp

    patches = {
        "_cuda_getCheckpointState": _no_checkpointing,
        "_cuda_setCheckpointPoolState": _no_checkpointing,
        "_cuda_getMemoryFraction": _memory_fraction,
        "_cuda_memorySnapshot": _memory_snapshot,
    }
    for name, fn in patches.items():
        tp.replace_c_function(name, fn)
    _plain_cuda_graphs_for_inductor()
