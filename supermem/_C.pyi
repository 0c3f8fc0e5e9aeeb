# Types of the extension module (csrc/bindings.cpp, csrc/plugin.cpp). The plug-in's functions exist only in
# a build with CUDA and a CUDA torch (has_cuda); callers check with hasattr first. Classes and functions
# not listed here are Any for now.
from collections.abc import Callable
from typing import Any

has_cuda: bool
has_relu_kernels: bool

def cuda_device_count() -> int: ...
def format_size(size_bytes: int) -> str: ...

CachingAllocator: Any
Device: Any
SimDevice: Any
CudaDevice: Any
PinnedHostDevice: Any

def plugin_install() -> None: ...
def plugin_devices() -> list[int]: ...
def plugin_allocator(device: int, create: bool) -> Any: ...
def plugin_configure(
    limit_bytes: int,
    limit_fraction: float,
    passthrough: bool,
    debug: int,
    ring_events: int,
    expandable_segments: bool = ...,
) -> None: ...
def plugin_add_oom_observer(observer: Callable[..., Any]) -> None: ...
def __getattr__(name: str) -> Any: ...
