"""supermem: a GPU memory manager for PyTorch.

    SUPERMEM=1 python train.py            # zero code change: supermem's allocator serves CUDA memory
    supermem.install("limit:12GiB")       # or in code, before the first CUDA tensor
    with supermem.pool(budget="8GiB"):    # offload saved activations beyond the budget
        loss = model(x).sum(); loss.backward()

Importing supermem never initialises CUDA. This module loads lazily: PyTorch imports
supermem._autoload at every `import torch`, which must stay cheap and cannot fail.
"""

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {  # public name -> module that defines it
    "install": "activate",
    "installed": "registry",
    "device_allocator": "registry",
    "options": "config",
    "linear_cross_entropy": "losses",
    "pool": "tensor_pool",
    "stream": "streaming",
    "Pool": "tensor_pool",
    "ActivationError": "errors",
    "ConfigError": "errors",
    "OutOfMemoryError": "errors",
    "UsageError": "errors",
}
__all__ = [*_LAZY, "__version__", "checkpoint", "has_cuda_build", "trace"]


def __getattr__(name: str) -> Any:
    if name in ("trace", "checkpoint"):  # modules: supermem.trace("x.smtrace"), supermem.checkpoint.binomial
        return importlib.import_module(f".{name}", __name__)
    if name == "has_cuda_build":  # supermem._C has the CUDA device and the PyTorch plug-in
        from . import _C

        return _C.has_cuda
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'supermem' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
