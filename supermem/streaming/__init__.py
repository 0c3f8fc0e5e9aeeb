"""Weight streaming: parameters, their gradients and optimizer state live in pinned host memory; each
module's weights come to the device just in time for its forward and again for its backward.

    streamer = supermem.stream(model)                      # or SUPERMEM_CONF=stream:weights
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)   # steps on the host
    loss = model(x).sum(); loss.backward(); opt.step(); opt.zero_grad()

How: the model is cut into units (a module whose parameters, children's included, are at most
`unit_bytes`, else its own parameters alone; e.g. one ResNet block). A unit's parameters sit in one flat
pinned host block and come to the device in one copy. A forward pre-hook on the unit's module swaps the
device views in (through `_Fetch`, whose backward sends each gradient to the host on a side stream as
soon as it is produced) and a forward hook swaps the host parameters back and drops the copy. Autograd's
saved weights are packed as tokens, not kept: the backward fetches the unit again at the first unpack and
drops it after the last. The order of fetches of the first step is recorded; later steps replay it,
prefetching `prefetch` units ahead. A module holding parameters that is called outside its unit's call
(a block rebuilt by supermem.checkpoint.binomial, say) fetches its unit by itself.
The Parameter objects stay the same (their `.data` moves to the host), so an optimizer built over
`model.parameters()` before or after streaming steps on the host; its state is created there.

Results are bitwise those of unstreamed training: the same kernels see the same weights, and each
parameter's gradient contributions are summed in the order autograd would have summed them (except
when one unit call uses a weight several times and the unit is called several times per step: then the
contributions are summed per call first).
Limits: parameters are on the device only during a call (through `__call__`, not `.forward(...)`) of
their module or of a unit around it; nn.ModuleList/ModuleDict are never units (never called), so code
that iterates an nn.Sequential by hand should hold its layers in a ModuleList; `torch.autograd.grad`
with respect to streamed parameters gives None (gradients reach `.grad` only); RNN flat weights are
not supported.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .live import streamed_unit as streamed_unit
from .streamer import Streamer as Streamer
from .units import ALIGN as ALIGN
from .units import STREAMER_ATTR


def stream(
    model: torch.nn.Module,
    device: torch.device | str | None = None,
    *,
    prefetch: int = 2,
    host_limit: int | float | str = "50%",
    unit_bytes: int = 64 << 20,
    optimizer_step: str = "host",
) -> Streamer:
    """Streams `model`'s parameters from host memory to `device` (default: the current CUDA device,
    else "cpu", where a host tier and a compute tier both on the CPU exercise the same machinery).

    prefetch: units fetched ahead of use (in the order the first step used them).
    unit_bytes: a module whose parameters (with its children's) are at most this many bytes is fetched
        as one unit, in one copy; larger ones are split into their children.
    host_limit: host memory for parameters and gradients (bytes, "32GiB" or a percentage of RAM).
    optimizer_step: "host" (the optimizer steps where the parameters live), "device" (unit by unit on
        the device, its state in host blocks: streaming_step.py) or "overlap" (on the host, each unit
        as soon as its gradients land, during backward: streaming_overlap.py, which says when it may
        be used). Which of host and device is faster depends on the optimizer, the link and the host;
        tests/gpu/test_stream_gpu.py prints both.
    Returns the Streamer (also a context manager: leaving it stops streaming, parameters stay on the host).
    """
    return Streamer(
        model,
        device,
        prefetch=prefetch,
        host_limit=host_limit,
        unit_bytes=unit_bytes,
        optimizer_step=optimizer_step,
    )


def activate_from_config(cfg: Any) -> None:
    """SUPERMEM_CONF=stream:weights: the first outermost module called with its parameters on a CUDA
    device, or with CPU parameters and a CUDA input, is the model: it is streamed to that device from
    then on. Finding it takes two global module hooks, which run on every module call of the process;
    they are removed once the model is found, so later calls cost nothing (PyTorch's hook-free path).
    Other models are not streamed: give them to supermem.stream(). Runs during `import torch`: nothing
    here may touch CUDA."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    depth = threading.local()
    handles: list[Any] = []

    def pre(module: torch.nn.Module, args: Any) -> None:
        level = getattr(depth, "n", 0)
        depth.n = level + 1
        if level:
            return
        device = _target_device(module, args)
        if device is None:
            return
        for h in handles:  # safe here: PyTorch iterates over a copy of the global hooks
            h.remove()
        if getattr(module, STREAMER_ATTR, None) is None:  # else streamed by hand already
            streamer = Streamer(module, device, host_limit=cfg.host_limit)
            # this call already passed the module's own pre-hooks: run the ones streaming just added
            streamer._step_start(module, args)
            if module in streamer._unit_of or module in streamer._fallback:
                streamer._enter(module, args)

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        depth.n = max(getattr(depth, "n", 1) - 1, 0)

    handles.append(register_module_forward_pre_hook(pre))
    handles.append(register_module_forward_hook(post, always_call=True))


def _target_device(module: torch.nn.Module, args: Any) -> torch.device | None:
    p = next(module.parameters(), None)
    if p is None:
        return None
    if p.device.type == "cuda":
        return p.device
    for a in args if isinstance(args, tuple) else (args,):
        if isinstance(a, torch.Tensor) and a.device.type == "cuda":
            return a.device
    return None
