"""The optimizer step of a streamed model on the device, unit by unit: stream(..., optimizer_step="device").

The host step (the default) runs the user's optimizer where the parameters live, on the host. The
device step runs the same optimizer over one unit at a time on the device: the unit's parameters (one
flat copy), gradients and per-element optimizer state come over, the optimizer steps there (the kernels
unstreamed training on that device runs), and parameters and state go back. The next unit's copies are
issued before this unit steps, so they overlap it; the device holds two units' worth at most. The state
lives in host blocks of the streamer's share (pinned on a GPU), made at the first step.

How the optimizer is confined to one unit: its param_groups' lists are swapped for the unit's members
for a call of its undecorated step (no step hooks run per unit); then the streamed parameters'
gradients are hidden (None) during the user's own call, which so steps only what is not streamed, and
come back right after it. Per-element state is every tensor of a parameter's state shaped like the
parameter, except "step" (PyTorch's optimizers keep that scalar on the host unless capturable).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # streaming/live.py imports this module when a step runs: types only here (and the
    # streamer named as units.py names it, not imported: streamer.py imports live.py, a circle)
    from .streaming.units import Streamer, _Unit


class _OnDevice:
    """One unit's parameters, gradients and state on the device, while it steps."""

    __slots__ = ("unit", "groups", "flat", "waits", "swapped")

    def __init__(self, unit: _Unit, groups: list[list[torch.nn.Parameter]]):
        self.unit = unit
        self.groups = groups  # the unit's parameters in each param group, in the group's order
        self.flat: torch.Tensor | None = None
        self.waits: list[tuple[torch.Tensor, Any]] = []  # (device tensor, its copy's event)
        # per parameter: (host data, host grad, {state key: host tensor})
        self.swapped: dict[int, tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]] = {}


def device_step(streamer: Streamer, optimizer: torch.optim.Optimizer) -> bool:
    """Steps `optimizer` over the streamer's parameters on its device and hides their gradients from
    the optimizer's own step (`restore_grads` gives them back). False if the optimizer cannot be
    confined to a unit (no undecorated step): then it steps on the host as usual."""
    step = getattr(type(optimizer).step, "__wrapped__", None)
    if step is None:
        return False
    groups = optimizer.param_groups
    members: dict[_Unit, list[list[torch.nn.Parameter]]] = {}
    for i, g in enumerate(groups):
        for p in g["params"]:
            slot = streamer._params.get(id(p))
            if slot is not None and p.grad is not None:
                members.setdefault(slot.owner, [[] for _ in groups])[i].append(p)
    if not members:
        return True
    saved = [g["params"] for g in groups]
    pending: list[Any] = []  # copies back to the host, waited for at the end
    todo = [_OnDevice(unit, unit_groups) for unit, unit_groups in members.items()]
    streamer._stepping = True  # an optimizer whose step calls super().step() runs the hooks again
    try:
        _bring(streamer, optimizer, todo[0])
        for i, here in enumerate(todo):
            if i + 1 < len(todo):
                _bring(streamer, optimizer, todo[i + 1])  # overlaps this unit's step
            for tensor, event in here.waits:
                streamer.copies.use(tensor, event)
            for g, ps in zip(groups, here.groups):
                g["params"] = ps
            step(optimizer)
            pending += _send_back(streamer, optimizer, here)
            here.flat, here.waits = None, []  # the device copies go (after the copies that read them)
    finally:
        streamer._stepping = False
        for g, ps in zip(groups, saved):
            g["params"] = ps
        for here in todo:
            if here.flat is not None:  # brought, not sent back: a step raised; the host copies stay
                _swap_back(optimizer, here)
    for event in pending:
        streamer.copies.wait(event)  # the next forward's fetches read these host copies
    for here in todo:
        for ps in here.groups:
            for p in ps:
                streamer._hidden_grads.append((p, p.grad))
                p.grad = None
    return True


def restore_grads(streamer: Streamer) -> None:
    for p, g in streamer._hidden_grads:
        p.grad = g
    streamer._hidden_grads = []


def _host_flat(unit: _Unit) -> torch.Tensor:
    """The unit's own parameters, flat on the host (a unit with a parameter to step has its block)."""
    if unit.flat is None:
        raise RuntimeError(f"supermem.stream: a {type(unit.module).__name__} unit has no host block")
    return unit.flat.tensor[: unit.nbytes]


def _is_elementwise(key: str, t: Any, p: torch.nn.Parameter) -> bool:
    return key != "step" and isinstance(t, torch.Tensor) and t.shape == p.shape


def _bring(streamer: Streamer, optimizer: torch.optim.Optimizer, here: _OnDevice) -> None:
    """Starts the unit's copies to the device and swaps the device tensors into its parameters."""
    copies = streamer.copies
    here.flat, ready = copies.to_device(_host_flat(here.unit))
    here.waits.append((here.flat, ready))
    by_id = {id(s.param): s for s in here.unit.params}
    for ps in here.groups:
        for p in ps:
            slot = by_id[id(p)]
            host_data, host_grad = p.data, p.grad
            assert host_grad is not None  # device_step chose the parameters with a gradient
            grad, event = copies.to_device(host_grad)
            here.waits.append((grad, event))
            state = optimizer.state[p]
            host_state: dict[str, torch.Tensor] = {}
            for key, t in list(state.items()):
                if _is_elementwise(key, t, p):
                    state[key], event = copies.to_device(t)
                    here.waits.append((state[key], event))
                    host_state[key] = t
            p.grad = None  # a gradient must be on its parameter's device
            p.data = here.flat[slot.offset : slot.offset + slot.nbytes].view(p.dtype).view(p.shape)
            p.grad = grad
            here.swapped[id(p)] = (host_data, host_grad, host_state)


def _send_back(streamer: Streamer, optimizer: torch.optim.Optimizer, here: _OnDevice) -> list[Any]:
    """Starts the copies of the stepped parameters and state to the host and swaps the host tensors
    back; returns the copies' events. State made by this step gets host blocks of its own."""
    copies, flat = streamer.copies, here.flat
    assert flat is not None  # _bring made it
    events = [copies.to_host(flat, _host_flat(here.unit))]
    for ps in here.groups:
        for p in ps:
            host_state = here.swapped[id(p)][2]
            state = optimizer.state[p]
            for key, t in list(state.items()):
                if not _is_elementwise(key, t, p):
                    continue
                host = host_state.get(key)
                if host is None:  # made by this step
                    nbytes = t.numel() * t.element_size()
                    host = host_state[key] = (
                        streamer._take(nbytes).tensor[:nbytes].view(t.dtype).view(t.shape)
                    )
                    streamer._state_views.append((state, key, host))
                events.append(copies.to_host(t, host))
    _swap_back(optimizer, here)
    return events


def _swap_back(optimizer: torch.optim.Optimizer, here: _OnDevice) -> None:
    """The host tensors back into the unit's parameters and state (state the device step made stays
    in host blocks: _send_back put it there)."""
    for ps in here.groups:
        for p in ps:
            host_data, host_grad, host_state = here.swapped[id(p)]
            optimizer.state[p].update(host_state)
            p.grad = None
            p.data = host_data
            p.grad = host_grad
