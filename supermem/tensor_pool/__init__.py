"""The tensor pool: saved activations under a device memory budget (see pool.py)."""

from .pool import Pool  # noqa: I001  (first: the factory's function `pool` is the package's name, not the module)
from .factory import env_pool, global_pool, pool
from .stats import PlanStats, PoolStats

__all__ = ["PlanStats", "Pool", "PoolStats", "env_pool", "global_pool", "pool"]
