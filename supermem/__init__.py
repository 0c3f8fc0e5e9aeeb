"""supermem: a GPU memory manager for PyTorch.

Importing supermem never initialises CUDA.
"""

import torch  # noqa: F401  (loads libc10, which supermem._C links against)

from . import _C
from .errors import ConfigError, OutOfMemoryError, UsageError

__version__ = "0.1.0"
__all__ = ["ConfigError", "OutOfMemoryError", "UsageError", "__version__"]
has_cuda_build: bool = _C.has_cuda
