"""supermem: a GPU memory manager for PyTorch.

    SUPERMEM=1 python train.py            # zero code change: supermem's allocator serves CUDA memory
    supermem.install("limit:12GiB")       # or in code, before the first CUDA tensor
    with supermem.pool(budget="8GiB"):    # offload saved activations beyond the budget
        loss = model(x).sum(); loss.backward()

Importing supermem never initialises CUDA. This module loads lazily: PyTorch imports
supermem._autoload at every `import torch`, which must stay cheap and cannot fail.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

__version__ = "0.1.0"

if TYPE_CHECKING:  # the real names for type checkers; at run time they load on first use (below)
    import torch

    from . import checkpoint as checkpoint
    from . import trace as trace
    from .activate import install as install
    from .config import options as options
    from .errors import ActivationError as ActivationError
    from .errors import ConfigError as ConfigError
    from .errors import OutOfMemoryError as OutOfMemoryError
    from .errors import UsageError as UsageError
    from .losses import linear_cross_entropy as linear_cross_entropy
    from .registry import device_allocator as device_allocator
    from .registry import installed as installed
    from .streaming import stream as stream
    from .tensor_pool import Pool as Pool

    has_cuda_build: bool


class PoolFactory(Protocol):
    """supermem.pool's signature: tensor_pool.pool passes its keywords on to Pool(...) as **kwargs, which
    a type checker would take whatever they are (tests/cpu/package/test_typing.py keeps the two equal)."""

    def __call__(
        self,
        budget: int | float | str | None = None,
        policy: str | None = None,
        host_limit: int | float | str | None = "50%",
        *,
        device: torch.device | str | None = None,
        min_bytes: int | None = None,
        treatments: tuple[str, ...] | str | None = None,
        graphs: bool = True,
    ) -> Pool: ...


if TYPE_CHECKING:
    pool: PoolFactory

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
