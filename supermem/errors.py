"""supermem's exceptions. The OOM error is a torch.OutOfMemoryError, so code that catches PyTorch's
OOM (or matches "CUDA out of memory.") handles supermem's too.

The classes that do not need torch come first: `import torch` runs supermem's autoload hook, which
needs ConfigError while this module may still be importing torch (python -m supermem imports it first).
"""


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


import torch  # noqa: E402


class OutOfMemoryError(torch.OutOfMemoryError):
    """The allocator could not find memory after releasing its cache and asking the pool to evict."""
