"""torch.compile: the pool steps aside for the tensors a compiled graph saves, and says so once.

Why it cannot lower their peak (torch 2.13's AOTAutograd, runtime_wrappers.py): a compiled graph is one
autograd.Function. Its forward runs the whole graph, every activation it saves alive at the end, and only
then calls save_for_backward, where the pool's pack hook sees them: the graph's peak is already behind.
Its backward reads `ctx.saved_tensors` all at once, before its first kernel, so whatever the pool moved
comes back together, synchronously: the peak is the same again and the step waits for every copy. On an
H100 that was a compiled ResNet-50 going from 28.7 to 71.6 ms at the same peak. Recompute by regions
cannot reach inside a graph either (its module calls run as kernels, not as hooked calls). The compiler
has its own tools for this: torch._functorch.config.activation_memory_budget (recompute, chosen by the
min-cut partitioner) plans inside the graph. Tensors saved by eager code around a compiled graph (a loss
outside it, an uncompiled head, the code between graph breaks) stay the pool's.

How the pool tells: the pack hook runs inside torch.autograd.Function.apply of AOTAutograd's
CompiledFunction (nothing on the tensor says so). One frame walk per saved tensor: well under a microsecond
for eager code, whose pack hooks are called from the op's own frame.
"""

from __future__ import annotations

import sys
import threading

import torch

from .. import torch_private as tp

_APPLY = torch.autograd.function.Function.apply.__func__.__code__
_AOT_MODULE = tp.AOT_MODULE  # where CompiledFunction classes are made
_OWN = __name__.split(".")[0] + "."  # the pool's own frames, between the hook and its caller

MESSAGE = (
    "supermem: the tensor pool leaves the tensors that torch.compile'd graphs save for backward where they "
    "are (a compiled graph saves them all at once after its peak and takes them back all at once, so moving "
    "them costs time and saves nothing); to save activation memory under torch.compile set "
    "torch._functorch.config.activation_memory_budget (e.g. 0.5)"
)


class CompiledGraphs:
    """Recognises tensors saved by a compiled graph; counts them; warns once (per pool)."""

    def __init__(self) -> None:
        self.kept = 0  # tensors left to the compiled graph
        self.kept_bytes = 0
        self._warned = False
        self._lock = threading.Lock()

    def saved_by_graph(self, t: torch.Tensor) -> bool:
        """Whether `t` is being saved by a compiled graph; call it from the pack hook."""
        f = sys._getframe(1)
        while f is not None and f.f_globals.get("__name__", "").startswith(_OWN):
            f = f.f_back
        if f is None or f.f_code is not _APPLY:
            return False
        cls = f.f_locals.get("cls")  # a custom autograd.Function: only AOTAutograd's are compiled graphs
        if not getattr(cls, "__module__", "").startswith(_AOT_MODULE):
            return False
        with self._lock:
            self.kept += 1
            self.kept_bytes += t.numel() * t.element_size()
            if not self._warned:
                self._warned = True
                print(MESSAGE, file=sys.stderr)
        return True
