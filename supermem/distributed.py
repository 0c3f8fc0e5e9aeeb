"""Which rank this process is, for the per-process parts of supermem (traces, OOM snapshots, the control
socket, the tensor pool's device) under torch.distributed.

Every rank is a process of its own, with its own allocator, pool, budget and control socket; nothing is
shared between ranks. The rank comes from torch.distributed once a process group is initialised, else
from the environment the launchers set (torchrun, torch.multiprocessing with the usual RANK /
WORLD_SIZE / LOCAL_RANK): supermem's allocator is installed at `import torch`, long before
init_process_group, and a trace or OOM snapshot path must name the rank even then.

Accounting under DDP/FSDP2 (what the pool and the allocator see, read from torch 2.11's code):
- DDP's gradient buckets and FSDP2's all-gather/reduce-scatter buffers are ordinary CUDA tensors made
  through the swapped allocator on the rank's device (DDP: Reducer::initialize_buckets; FSDP2: on its
  own streams, freed with record_stream / events). They count in the allocator's allocated bytes like
  any temporary, so the pool's budget (which counts every allocated byte) includes them: nothing is
  double-counted and nothing goes missing. They are never saved tensors, so the pool never offloads them.
- NCCL's own buffers (its channels, proxy FIFOs, and with NVLS the multicast memory) come from cudaMalloc /
  cuMem inside libnccl, not through PyTorch's allocator: supermem does not see them, like PyTorch's own
  allocator does not. They make the card's free memory smaller than limit - allocated, so a fraction
  budget or limit ("90%") should leave room for them (a few hundred MiB per communicator).
- A fraction of the card resolves against the rank's device: the pool is made on the current device
  (torch.cuda.set_device(local_rank), as every DDP script does), or LOCAL_RANK's device when the script
  has not set one, and the allocator's limit fraction is applied per device when its allocator is made.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def _env_int(name: str) -> int | None:
    v = os.environ.get(name, "").strip()
    return int(v) if v.isdigit() else None


def _group() -> Any:
    """torch.distributed when a default process group exists in this process (never imports torch)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist
    except Exception:  # noqa: BLE001  (a half-imported torch during `import torch`)
        pass
    return None


def rank() -> int:
    """This process's global rank: torch.distributed's, else RANK, else 0."""
    dist = _group()
    if dist is not None:
        return dist.get_rank()
    r = _env_int("RANK")
    return 0 if r is None else r


def world_size() -> int:
    """Processes in the job: torch.distributed's, else WORLD_SIZE, else 1."""
    dist = _group()
    if dist is not None:
        return dist.get_world_size()
    w = _env_int("WORLD_SIZE")
    return 1 if w is None else max(w, 1)


def local_rank() -> int | None:
    """LOCAL_RANK (the rank on this host, the device a launcher's worker should use), or None."""
    return _env_int("LOCAL_RANK")


def is_distributed() -> bool:
    """True in a rank of a torch.distributed job (launched by torchrun or with RANK set)."""
    return _group() is not None or _env_int("RANK") is not None


def info() -> dict[str, int]:
    """{"rank", "world_size"} (and "local_rank" when known): what traces and `supermem top` carry."""
    out = {"rank": rank(), "world_size": world_size()}
    lr = local_rank()
    if lr is not None:
        out["local_rank"] = lr
    return out


def expand_path(template: str | os.PathLike, **more: Any) -> str:
    """`template` with {rank}, {world_size}, {local_rank} and {pid} filled in (and any `more`, e.g.
    n=3 for an OOM's number). Only these names are replaced: other braces stay as they are."""
    lr = local_rank()
    values = {
        "rank": rank(),
        "world_size": world_size(),
        "local_rank": rank() if lr is None else lr,
        "pid": os.getpid(),
        **more,
    }
    out = str(template)
    for name, value in values.items():
        out = out.replace("{" + name + "}", str(value))
    return out


def is_template(path: str | os.PathLike) -> bool:
    """True when `path` names a per-process file ({rank}, {pid}, ...)."""
    return any("{" + n + "}" in str(path) for n in ("rank", "world_size", "local_rank", "pid"))
