"""The tensor pool: saved activations under a device memory budget (see pool.py)."""

from __future__ import annotations

from typing import Any

from .pool import Pool

__all__ = ["Pool", "pool"]

_pools: dict[tuple, Pool] = {}


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
