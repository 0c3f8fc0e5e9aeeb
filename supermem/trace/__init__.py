"""supermem's memory trace tool: record, export, report, replay.

    with supermem.trace("run.smtrace", model=model, optimizer=opt):   # records, writes on exit
        train()

    supermem.trace.load("run.smtrace")                 # -> Trace (also reads PyTorch snapshot pickles)
    supermem.trace.to_torch_snapshot(trace)            # -> dict for torch.cuda._memory_viz / memory_viz
    supermem.trace.write_report(trace, "report.html")  # self-contained HTML (+ PNG)
    supermem.trace.write_oom_snapshot()                # what the allocator calls on OOM

The module itself is callable (`supermem.trace(...)` is `supermem.trace.record(...)`). Submodules load
on first use, so importing supermem stays cheap.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_LAZY = {
    "Recorder": "recorder",
    "register_allocator": "recorder",
    "unregister_allocator": "recorder",
    "discover_allocators": "recorder",
    "active": "recorder",
    "Trace": "table",
    "TraceFormatError": "format",
    "load": "loader",
    "to_torch_snapshot": "torch_snapshot",
    "from_torch_snapshot": "torch_snapshot",
    "write_torch_snapshot": "torch_snapshot",
    "analyze": "analysis",
    "write_report": "report_html",
    "write_png": "png_report",
    "write_oom_snapshot": "oom",
    "oom_snapshot_path": "oom",
    "replay": "replay",
}


def record(
    path: str | None = None,
    *,
    model: Any = None,
    optimizer: Any = None,
    stacks: bool = False,
    capacity_events: int | None = None,
    allocators: list[Any] | None = None,
    report: bool = False,
    context: bool = True,
    exact_activations: bool = False,
):
    """A recording of this process's GPU memory events, as a context manager that writes `path`
    (.smtrace) on exit, also when the block raises (an OOM trace is the useful one).

    model/optimizer: an nn.Module / Optimizer (or lists) whose parameters, gradients and state are
        attributed by category; None: found by a gc scan.
    stacks: record the Python stack that made each tensor (a dispatch mode: ~10-20 us per op).
    capacity_events: events kept per device (newest win); default 10^6 (~100 MB of host memory).
    allocators: CachingAllocators (or (device, allocator) pairs) to record; None: discover.
    report: also write an HTML report (and PNG) next to `path`.
    context: record the module call and phase (forward, backward, optimizer) each block was made in
        (nn.Module.__call__ wrapped and global optimizer hooks: ~1 us per module call); activations are named
        from the phases (made in a forward, freed in a backward), checked against what autograd saves
        over the first two backwards (a saved-tensor hook, then taken off).
    exact_activations: keep that hook on for the whole recording: activations are what autograd saved
        (~2 us per saved tensor and a Python call per unpack: +20% of a host-bound step).
    """
    from . import recorder
    from .recorder import DEFAULT_CAPACITY_EVENTS, Recorder

    return Recorder(
        allocators,
        capacity_events=capacity_events or DEFAULT_CAPACITY_EVENTS,
        stacks=stacks,
        model=model,
        optimizer=optimizer,
        path=path,
        report=report,
        context=context,
        activation_hook_backwards=None if exact_activations else recorder.ACTIVATION_HOOK_BACKWARDS,
    )


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'supermem.trace' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any):
        return record(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
