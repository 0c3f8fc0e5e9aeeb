"""The tensor pool: saved activations under a device memory budget (see pool.py)."""

from __future__ import annotations

from typing import Any

from .pool import Pool
from .treatments import treatment_names

__all__ = ["Pool", "env_pool", "global_pool", "pool"]

_pools: dict[tuple, Pool] = {}
_global: dict[str, Pool] = {}


def pool(
    budget: int | float | str | None = None,
    policy: str | None = None,
    host_limit: int | float | str | None = "50%",
    **kwargs: Any,
) -> Pool:
    """A Pool for these options, created once and reused (its host memory and streams are kept), so
    `with supermem.pool(budget="8GiB"):` can wrap every training step. `treatments` may name them:
    ("offload", "recompute", "compress")."""
    if kwargs.get("treatments") is not None:
        kwargs["treatments"] = treatment_names(kwargs["treatments"])  # hashable: the same pool each call
    key = (budget, policy, host_limit, _default_device(kwargs), tuple(sorted(kwargs.items())))
    if key not in _pools:
        _pools[key] = Pool(budget, policy, host_limit, **kwargs)
    return _pools[key]


def _default_device(kwargs: dict) -> int | None:
    """The CUDA device a Pool made without `device` would serve: part of the cache key, so that a
    process using two GPUs (or a rank that switched device) gets a pool per device."""
    import torch

    if kwargs.get("device") is not None or not torch.cuda.is_available():
        return None
    return torch.cuda.current_device()


def env_pool(cfg: Any) -> Pool:
    """The pool SUPERMEM_CONF asks for (pool:lru,budget:...), made at its first use: supermem.activate
    sends every saved tensor here, and the Pool is built at the first one, when CUDA may be touched."""
    if "pool" not in _global:
        p = _global["pool"] = pool(cfg.budget, cfg.pool, cfg.host_limit, graphs=cfg.graphs)
        p.always_active = True  # its hooks serve every thread's backward
        p._start()
    return _global["pool"]


def global_pool() -> Pool | None:
    """The pool SUPERMEM_CONF activated (None before its first saved tensor, or when not set)."""
    return _global.get("pool")
