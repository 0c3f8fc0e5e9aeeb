"""The pool's own work as named ranges in torch.profiler's traces (and so in Perfetto and TensorBoard):
supermem::pack and supermem::unpack (the saved-tensor hooks), supermem::<treatment> (a tensor leaving
the device: offload, recompute, compress), supermem::<treatment>.restore (coming back: a prefetch, a
rebuild, an unpack) and supermem::plan."""

from __future__ import annotations

import contextlib
from typing import Any

import torch.autograd.profiler as _profiler
from torch.profiler import record_function

_NONE = contextlib.nullcontext()


def recording() -> bool:
    """Whether a profiler records now."""
    return _profiler._is_profiler_enabled


def label(name: str, suffix: str = "") -> Any:
    """A range named supermem::<name><suffix> while a profiler records; else nothing (a range costs
    about a microsecond even unrecorded, and the pack hook runs for every saved tensor)."""
    if not _profiler._is_profiler_enabled:
        return _NONE
    return record_function(f"supermem::{name}{suffix}")
