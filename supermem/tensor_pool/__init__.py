"""The tensor pool: saved activations under a device memory budget (see pool.py)."""

from __future__ import annotations

from typing import Any

from .pool import Pool

__all__ = ["Pool", "activate_from_config", "global_pool", "pool"]

_pools: dict[tuple, Pool] = {}
_global: dict[str, Pool] = {}


def pool(
    budget: int | float | str | None = None,
    policy: str = "lru",
    host_limit: int | float | str | None = "50%",
    **kwargs: Any,
) -> Pool:
    """A Pool for these options, created once and reused (its host memory and streams are kept), so
    `with supermem.pool(budget="8GiB"):` can wrap every training step."""
    key = (budget, policy, host_limit, tuple(sorted(kwargs.items())))
    if key not in _pools:
        _pools[key] = Pool(budget, policy, host_limit, **kwargs)
    return _pools[key]


def activate_from_config(cfg: Any) -> None:
    """SUPERMEM_CONF=pool:lru,budget:...: the pool serves every backward of this thread. The Pool is
    built at the first saved tensor, not here: this runs during `import torch`, before CUDA may be
    touched."""
    import torch

    def current() -> Pool:
        if "pool" not in _global:
            p = _global["pool"] = pool(cfg.budget, cfg.pool, cfg.host_limit)
            p.always_active = True
            p._start()
        return _global["pool"]

    torch._C._autograd._push_saved_tensors_default_hooks(
        lambda t: current()._pack(t), lambda packed: current()._unpack(packed)
    )


def global_pool() -> Pool | None:
    """The pool SUPERMEM_CONF activated (None before its first saved tensor, or when not set)."""
    return _global.get("pool")
