"""supermem: a GPU memory manager for PyTorch.

    SUPERMEM=1 python train.py            # zero code change: supermem's allocator serves CUDA memory
    supermem.install("limit:12GiB")       # or in code, before the first CUDA tensor

Importing supermem never initialises CUDA.
"""

import torch  # noqa: F401  (first: with a CUDA torch, supermem._C links its libraries)

from . import _C
from .activate import device_allocator, install, installed
from .config import options
from .errors import ActivationError, ConfigError, OutOfMemoryError, UsageError

__version__ = "0.1.0"
__all__ = [
    "ActivationError",
    "ConfigError",
    "OutOfMemoryError",
    "UsageError",
    "__version__",
    "device_allocator",
    "install",
    "installed",
    "options",
]
has_cuda_build: bool = _C.has_cuda
