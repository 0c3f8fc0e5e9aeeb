"""The pool's own work as named ranges in torch.profiler's traces (and so in Perfetto and TensorBoard):
supermem::pack and supermem::unpack (the saved-tensor hooks), supermem::<treatment> (a tensor leaving
the device: offload, recompute, compress), supermem::<treatment>.restore (coming back: a prefetch, a
rebuild, an unpack) and supermem::plan.

The same names as NVTX ranges, for Nsight Systems: under torch.autograd.profiler.emit_nvtx() a profiler
records and turns every record_function range into an NVTX range itself (named "supermem::offload,
op_id = 12"), so nothing more is done. Run without it (`nsys profile --trace=cuda,nvtx`), a CUDA pool
made with SUPERMEM_NVTX=1 pushes and pops torch.cuda.nvtx ranges of these names; while a torch.profiler
records, its ranges are the ones made (never both: that would name one piece of work twice)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch.profiler import record_function

from .. import torch_private as tp

NVTX_ENV = "SUPERMEM_NVTX"

_NONE = contextlib.nullcontext()


def recording() -> bool:
    """Whether a profiler records now."""
    return tp.profiler_recording()


def nvtx_wanted(cuda: bool) -> bool:
    """Whether a pool names its work in NVTX ranges too: a CUDA pool, made with SUPERMEM_NVTX=1 (read
    once, when the pool is made: the hooks test the pool's flag, not the environment)."""
    return cuda and os.environ.get(NVTX_ENV, "").strip().lower() in ("1", "true", "on", "yes")


class _NvtxRange:
    """An NVTX range around a `with` block (torch.cuda.nvtx.range is a generator: slower to enter)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __enter__(self) -> None:
        torch.cuda.nvtx.range_push(self.name)

    def __exit__(self, *exc: object) -> None:
        torch.cuda.nvtx.range_pop()


def label(name: str, suffix: str = "", nvtx: bool = False) -> Any:
    """A range named supermem::<name><suffix> while a profiler records, else an NVTX range where `nvtx`
    (the pool's SUPERMEM_NVTX flag); else nothing (a range costs about a microsecond even unrecorded,
    and the pack hook runs for every saved tensor)."""
    if tp.profiler_recording():
        return record_function(f"supermem::{name}{suffix}")
    if nvtx:
        return _NvtxRange(f"supermem::{name}{suffix}")
    return _NONE
