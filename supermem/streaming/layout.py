"""Cutting a model into units: which modules are fetched as one, their parameters moved into flat pinned
host blocks, buffers moved to the device, and the hooks that fetch each unit for its module's call."""

from __future__ import annotations

from typing import Any

import torch

from .units import ALIGN, _Param, _Unit

Streamer = Any  # streamer.py imports this module: named, not imported (no circle)


def plan_units(streamer: Streamer, model: torch.nn.Module) -> None:
    """Cuts the model into units, top down, moves parameters to the host and buffers to the device,
    and hooks every unit's module and every module that holds parameters itself (called on its own,
    outside its unit, it fetches its unit and swaps in its own parameters)."""
    visited: set[int] = set()
    containers = (torch.nn.ModuleList, torch.nn.ModuleDict)  # never called: cannot be units

    def slots_of(modules: list[torch.nn.Module]) -> list[tuple[torch.nn.Module, str, torch.nn.Parameter]]:
        return [(m, n, p) for m in modules for n, p in m._parameters.items() if p is not None]

    def visit(m: torch.nn.Module) -> None:
        if id(m) in visited:
            return
        visited.add(id(m))
        subtree = list(m.modules())
        unique = {id(p): p for _, _, p in slots_of(subtree)}
        nbytes = sum(p.numel() * p.element_size() for p in unique.values())
        if nbytes == 0:
            return
        if not isinstance(m, containers) and nbytes <= streamer.unit_bytes:
            _add_unit(streamer, m, slots_of(subtree))
            visited.update(id(c) for c in subtree)
            return
        if m._parameters:
            _add_unit(streamer, m, slots_of([m]))
        for c in m.children():
            visit(c)

    visit(model)
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and b.device != streamer.device:
                module._buffers[name] = b.to(streamer.device)
    hooked = {id(m): m for m in [u.module for u in streamer.units] + list(streamer._fallback)}
    hook_ids: dict[int, tuple[int, int]] = {}
    for module in hooked.values():
        pre = module.register_forward_pre_hook(streamer._enter)
        post = module.register_forward_hook(streamer._exit, always_call=True)
        streamer._handles += [pre, post]
        hook_ids[id(module)] = (pre.id, post.id)
    for unit in streamer.units:  # the hooked modules inside a unit, all of whose parameters it swaps in
        swapped = {(id(m), n) for m, n, _ in unit.slots}
        unit.inner = [
            (m, *hook_ids[id(m)])
            for m in unit.module.modules()
            if m is not unit.module
            and id(m) in hook_ids
            and all((id(m), n) in swapped for n, p in m._parameters.items() if p is not None)
        ]


def _add_unit(
    streamer: Streamer, module: torch.nn.Module, raw: list[tuple[torch.nn.Module, str, torch.nn.Parameter]]
) -> None:
    unit = _Unit(module, [])
    offset = 0
    for m, name, p in raw:
        slot = streamer._params.get(id(p))
        if slot is None:
            offset = -(-offset // ALIGN) * ALIGN
            slot = _Param(p, unit, offset)
            streamer._params[id(p)] = slot
            unit.params.append(slot)
            offset += slot.nbytes
        elif slot.owner is not unit and slot.owner not in unit.deps:
            unit.deps.append(slot.owner)
        unit.slots.append((m, name, slot))
        if streamer._fallback.setdefault(m, unit) is unit:
            streamer._own_slots.setdefault(m, []).append((m, name, slot))
    unit.nbytes = -(-offset // ALIGN) * ALIGN
    if unit.params:
        unit.flat = streamer._take(unit.nbytes)
        for slot in unit.params:
            p = slot.param
            streamer._moved.append((p, p.data, p.grad))
            host = unit.flat.tensor[slot.offset : slot.offset + slot.nbytes].view(p.dtype).view(p.shape)
            with torch.no_grad():
                host.copy_(p.data)
            p.data = host
            if p.grad is not None:
                p.grad = None  # a gradient on the old device would not match the host parameter
    streamer._unit_of[module] = unit
    streamer.units.append(unit)
