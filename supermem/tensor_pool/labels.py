"""The pool's own work as named ranges in torch.profiler's traces (and so in Perfetto and TensorBoard):
supermem::pack and supermem::unpack (the saved-tensor hooks), supermem::<treatment> (a tensor leaving
the device: offload, recompute, compress), supermem::<treatment>.restore (coming back: a prefetch, a
rebuild, an unpack) and supermem::plan."""

from __future__ import annotations

import contextlib
from typing import Any

from torch.profiler import record_function

from .. import torch_private as tp

_NONE = contextlib.nullcontext()


def recording() -> bool:
    """Whether a profiler records now."""
    return tp.profiler_recording()


def label(name: str, suffix: str = "") -> Any:
    """A range named supermem::<name><suffix> while a profiler records; else nothing (a range costs
    about a microsecond even unrecorded, and the pack hook runs for every saved tensor)."""
    if not tp.profiler_recording():
        return _NONE
    return record_function(f"supermem::{name}{suffix}")
