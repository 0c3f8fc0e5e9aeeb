"""supermem: a GPU memory manager for PyTorch.

Importing supermem never initialises CUDA.
"""

import torch  # noqa: F401  (loads libc10, which supermem._C links against)

from . import _C
from .errors import ConfigError, OutOfMemoryError, UsageError

__version__ = "0.1.0"


def __getattr__(name: str):
    # supermem.trace(...) and supermem.trace.* load on first use: importing supermem stays cheap.
    if name == "trace":
        import importlib

        return importlib.import_module(".trace", __name__)
    raise AttributeError(f"module 'supermem' has no attribute {name!r}")


__all__ = ["ConfigError", "OutOfMemoryError", "UsageError", "__version__"]
has_cuda_build: bool = _C.has_cuda
