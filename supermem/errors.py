"""supermem's exceptions. The OOM error is a torch.OutOfMemoryError, so code that catches PyTorch's
OOM (or matches "CUDA out of memory.") handles supermem's too.

This module does not import torch: `import torch` runs supermem's autoload hook, which needs
ConfigError, and may have been started by this very module. The torch subclass is made on first use.
"""

import threading
from typing import Any


class UsageError(ValueError):
    """The API was misused: double free, foreign or interior pointer, negative size, ..."""


class ConfigError(ValueError):
    """A bad option name or value (SUPERMEM_CONF, supermem.options(...), CLI flags)."""


class DeviceError(RuntimeError):
    """The device or driver failed for a reason other than a lack of memory."""


class InvariantError(RuntimeError):
    """The allocator's invariant walker found corrupted bookkeeping: a bug in supermem."""


class ActivationError(RuntimeError):
    """supermem could not be swapped into PyTorch (e.g. CUDA was already initialised)."""


_lock = threading.Lock()


def __getattr__(name: str) -> Any:
    if name != "OutOfMemoryError":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _lock:
        if name not in globals():
            import torch

            class OutOfMemoryError(torch.OutOfMemoryError):
                """The allocator could not find memory after releasing its cache and asking the pool
                to evict."""

            OutOfMemoryError.__module__, OutOfMemoryError.__qualname__ = __name__, name
            globals()[name] = OutOfMemoryError
    return globals()[name]
