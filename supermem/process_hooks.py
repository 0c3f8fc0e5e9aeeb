"""The tensor pool's process-wide saved-tensor hooks (SUPERMEM_CONF=pool:...), and their copies in PyTorch's
thread-local state snapshots.

PyTorch keeps saved-tensor hooks in the thread-local state and copies that state wherever work hops
threads. gloo does it for every collective (ProcessGroupGloo::AsyncWork keeps an at::ThreadLocalState) and
frees the work, copy included, on its run-loop thread when the caller has dropped its handle; dropping the
hooks there takes the GIL (c10::SafePyObject). With the pool's hooks on for the whole process that goes
wrong in two ways (tests/cpu/package/test_distributed.py reproduces both):
- DDP's Reducer owns its process group and frees it holding the GIL (at the end of a main() after
  destroy_process_group, or in the garbage collector); ~ProcessGroupGloo joins the run-loop threads, one of
  which waits for that GIL: a deadlock.
- At exit, a run-loop thread that asks for the GIL once finalisation began is unwound through a noexcept
  destructor: "terminate called without an active exception" (abort).
PyTorch's own scoped hooks (torch.autograd.graph.saved_tensors_hooks) carry the same hazard while they are
on; supermem's are on all the time, so supermem cleans up after them. Every copy holds a reference to the
pack hook, so its reference count says how many copies live: after each destroy_process_group and at
exit, supermem lets go of the GIL until gloo's threads have freed theirs.
"""

from __future__ import annotations

import atexit
import functools
import sys
import time
from collections.abc import Callable
from typing import Any

_hooks: list[Callable] = []  # [pack, unpack] once pushed
_own_refs = 0  # the pack hook's references without any copy: ours and the main thread's stack entry


def push(get_pool: Callable[[], Any]) -> None:
    """Pushes pack/unpack hooks that send every saved tensor of this thread to get_pool()'s pool, and makes
    the process's teardown wait for gloo's copies of them."""
    global _own_refs
    from . import torch_private as tp

    def pack(t: Any) -> Any:
        return get_pool().pack(t)

    def unpack(packed: Any) -> Any:
        return get_pool().unpack(packed)

    tp.push_saved_hooks_importing(pack, unpack)
    _hooks[:] = [pack, unpack]
    del pack, unpack  # counted below: only _hooks and the thread-local stack hold them now
    _own_refs = _pack_refs()
    _drain_after_destroy_process_group()
    atexit.register(drain)


def pushed() -> bool:
    """Whether the pool's process-wide hooks are on (they stay on for the process)."""
    return bool(_hooks)


def _pack_refs() -> int:
    return sys.getrefcount(_hooks[0])


def copies() -> int:
    """Copies of the hooks alive in thread-local state snapshots (gloo works, autograd graph tasks)."""
    return _pack_refs() - _own_refs if _hooks else 0


def drain(settle_s: float = 0.5, timeout_s: float = 10.0) -> int:
    """Lets go of the GIL until gloo's threads have freed their copies of the hooks: until none is left, or
    none was freed for settle_s (what is left belongs to something Python holds, a work handle in a
    variable say, which this thread frees itself), or after timeout_s. Returns the copies left."""
    left = copies()
    start_s = changed_s = time.monotonic()
    while left > 0:
        time.sleep(0.002)  # a run-loop thread waiting for the GIL takes it now
        now_s, n = time.monotonic(), copies()
        if n != left:
            left, changed_s = n, now_s
        elif now_s - changed_s >= settle_s or now_s - start_s >= timeout_s:
            break
    return left


def _drain_after_destroy_process_group() -> None:
    """Wraps torch.distributed.destroy_process_group: the group's works may still be freed by gloo's
    threads when the call returns, and the group's last owner (DDP's Reducer) may join them next."""
    import torch.distributed

    if not torch.distributed.is_available():
        return
    from torch.distributed import distributed_c10d as c10d

    original = c10d.destroy_process_group
    if getattr(original, "_drains_pool_hooks", False):
        return

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        finally:
            drain()

    destroy_process_group._drains_pool_hooks = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group
    if getattr(torch.distributed, "destroy_process_group", None) is original:
        torch.distributed.destroy_process_group = destroy_process_group
