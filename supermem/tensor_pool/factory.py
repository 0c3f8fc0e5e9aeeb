"""supermem.pool(...): one Pool per set of options as the Pool resolves them, made once and reused;
and the pool SUPERMEM_CONF asks for."""

from __future__ import annotations

from typing import Any

from ..units import parse_bytes
from .pool import Pool
from .treatments import treatment_names

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
    ("offload", "recompute", "compress").

    One pool however the options are spelled: it is found by the options as the Pool resolves them
    (budget and host_limit in bytes, the policy's name, the device), so budget=1 << 20, "1MiB" and
    "1 MiB" are one pool, and budget="8GiB" is the pool of budget="8GiB", policy="planned"."""
    if kwargs.get("treatments") is not None:
        kwargs["treatments"] = treatment_names(kwargs["treatments"])  # hashable: the same pool each call
    try:
        key = _resolved(budget, policy, host_limit, kwargs)
    except (ValueError, TypeError, RuntimeError):  # a bad option: the Pool's own error names it
        return Pool(budget, policy, host_limit, **kwargs)
    for k in [k for k, p in _pools.items() if p.closed]:  # Pool.close(): the same options make a new one
        del _pools[k]
    if key not in _pools:
        _pools[key] = Pool(budget, policy, host_limit, **kwargs)
    return _pools[key]


def _resolved(budget: Any, policy: str | None, host_limit: Any, kwargs: dict) -> tuple:
    """The cache key: the options as Pool.__init__ resolves them. The device is part of it, so a
    process using two GPUs (or a rank that switched device) gets a pool per device."""
    import psutil
    import torch

    options = dict(kwargs)
    device = options.pop("device", None)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cpu" and not (device.type == "cuda" and torch.cuda.is_available()):
        raise ValueError(f"no such device here: {device}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    budget_bytes = None if budget is None else parse_bytes(budget, total)
    if policy is None:
        policy = "planned" if budget is not None else "cost_aware"
    host_bytes = parse_bytes("50%" if host_limit is None else host_limit, psutil.virtual_memory().total)
    if options.get("min_bytes") is None:
        options["min_bytes"] = 1 << 20 if device.type == "cuda" else 0
    options["treatments"] = options.get("treatments") or ("offload", "recompute")
    options.setdefault("graphs", True)
    return (budget_bytes, policy, host_bytes, str(device), tuple(sorted(options.items())))


def env_pool(cfg: Any) -> Pool:
    """The pool SUPERMEM_CONF asks for (pool:lru,budget:...), made at its first use: supermem.activate
    sends every saved tensor here, and the Pool is built at the first one, when CUDA may be touched."""
    if "pool" not in _global:
        p = _global["pool"] = pool(cfg.budget, cfg.pool, cfg.host_limit, graphs=cfg.graphs)
        p.always_active = True  # its hooks serve every thread's backward
        p.start()
    return _global["pool"]


def global_pool() -> Pool | None:
    """The pool SUPERMEM_CONF activated (None before its first saved tensor, or when not set)."""
    return _global.get("pool")
