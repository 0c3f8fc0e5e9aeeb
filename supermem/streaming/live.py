"""The streamers alive in the process: the optimizer hooks that sync them around every optimizer step
(and run their device or overlapped steps), and supermem.checkpoint's lookup of a streamed unit."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .units import _Unit

Streamer = Any  # streamer.py imports this module: named, not imported (no circle)

_live: weakref.WeakSet[Streamer] = weakref.WeakSet()
_optimizer_hook: Any = None


def streamed_unit(module: torch.nn.Module) -> tuple[Streamer, _Unit] | None:
    """The streamer and unit that fetch exactly `module`'s parameters, all of them its own (a unit of
    its own, sharing none with another unit), or None. supermem.checkpoint's graphs copy such a unit's
    host block into their own device buffer instead of calling the module."""
    for streamer in list(_live):
        unit = streamer._unit_of.get(module)
        if unit is not None and unit.module is module and not unit.deps and unit.flat is not None:
            own = {id(slot.param) for slot in unit.params}
            if all(id(p) in own for p in module.parameters()):
                return streamer, unit
    return None


def _install_optimizer_hook() -> None:
    """Every optimizer step first syncs the streamers (their gradients must have landed) and runs the
    device steps; after it, the gradients those hid come back."""
    global _optimizer_hook
    if _optimizer_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _optimizer_hook = (
            register_optimizer_step_pre_hook(_sync_all),
            register_optimizer_step_post_hook(_after_step),
        )


def _sync_all(optimizer: Any, args: Any, kwargs: Any) -> None:
    for streamer in list(_live):
        if streamer._stepping or streamer._hidden_grads:
            continue  # inside a step already under way (an optimizer calling super().step(), say)
        streamer._before_optimizer_step()
        # args[0] is the optimizer; a closure re-runs the model: that step stays on the host
        closure = (len(args) > 1 and args[1] is not None) or kwargs.get("closure") is not None
        if streamer.optimizer_step == "device" and not closure:
            from ..streaming_step import device_step

            device_step(streamer, optimizer)
        elif streamer._overlap is not None:
            streamer._overlap.before_step(optimizer)


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    for streamer in list(_live):
        if streamer._hidden_grads:
            from ..streaming_step import restore_grads

            restore_grads(streamer)
