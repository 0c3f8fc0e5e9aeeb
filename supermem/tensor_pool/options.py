"""The pool's options, checked and resolved: each bad one raises a ConfigError that names it."""

from __future__ import annotations

from typing import Any

import psutil
import torch

from ..errors import ConfigError
from ..policies import make_policy
from ..units import parse_bytes


def device_of(device: torch.device | str | None) -> torch.device:
    """The pool's device: the current CUDA device where there is one, else the CPU; a CUDA device
    always with its index."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    cuda = resolved.type == "cuda"
    if resolved.type != "cpu" and not (cuda and torch.cuda.is_available()):
        raise ConfigError(f"bad pool option device={device!r}: give cpu, or cuda where PyTorch has CUDA")
    if cuda and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def budget_bytes_of(budget: Any, total: int | None, device: torch.device) -> int | None:
    """The budget in bytes (None: none); `total`: the device's bytes a fraction is taken of (None on CPU)."""
    if budget is not None and total is None and _is_fraction(budget):
        raise ConfigError(
            f"bad pool option budget={budget!r}: a fraction or percentage needs a device total, and "
            f"{device} has no device memory to take it of; give bytes (e.g. 64MiB)"
        )
    return None if budget is None else _size("budget", budget, total)


def policy_of(policy: str | None, budget: Any) -> Any:
    if policy is None:  # a plan needs a budget to plan under
        policy = "planned" if budget is not None else "cost_aware"
    return _checked("policy", make_policy, policy)


def check_graphs_and_min_bytes(graphs: Any, min_bytes: Any) -> None:
    if not isinstance(graphs, bool):
        raise ConfigError(f"bad pool option graphs={graphs!r}: give True or False")
    if min_bytes is not None and (type(min_bytes) is not int or min_bytes < 0):
        raise ConfigError(f"bad pool option min_bytes={min_bytes!r}: give an int >= 0 (bytes)")


def host_bytes_of(host_limit: Any) -> int:
    """Pinned host bytes the pool may use: bytes, a size string or a share of the host's RAM."""
    return _size("host_limit", "50%" if host_limit is None else host_limit, psutil.virtual_memory().total)


def _checked(name: str, parse: Any, value: Any) -> Any:
    try:
        return parse(value)
    except ValueError as e:
        raise ConfigError(f"bad pool option {name}={value!r}: {e}") from None


def _is_fraction(value: Any) -> bool:
    return (isinstance(value, float) and 0 < value <= 1) or (
        isinstance(value, str) and value.strip().endswith("%")
    )


def _size(name: str, value: Any, total: int | None) -> int:
    return _checked(name, lambda v: parse_bytes(v, total), value)
