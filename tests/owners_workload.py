"""Training a corpus model under a trace, and what the model says its memory is, computed apart from the
trace tool: for the owner tests on CPU (allocations from torch.profiler, supermem.trace.cpu_source) and
on a GPU (supermem's allocator)."""

from __future__ import annotations

import torch

from supermem.trace.recorder import Recorder


def storages(tensors) -> dict[int, int]:
    """data_ptr -> nbytes of the tensors' storages, each once."""
    out = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr():
            out[s.data_ptr()] = s.nbytes()
    return out


def parameter_bytes_by_module(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of each module's own parameters and buffers, keyed as the trace names modules."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or not ptr:
            continue
        seen.add(ptr)
        owner = name.rpartition(".")[0] or type(model).__name__
        out[owner] = out.get(owner, 0) + t.untyped_storage().nbytes()
    return out


def saved_storages(model, inputs, loss_of) -> dict[int, int]:
    """data_ptr -> nbytes of the storages autograd saves in one forward of the loss, the model's state and
    the batch left out: what the trace should call activations."""
    loss, saved = record_saves(model, inputs, lambda: loss_of(model, inputs))
    del loss
    return saved


def record_saves(model, inputs, forward):
    """(forward(), the storages autograd saved in it: data_ptr -> nbytes, the model's state and the batch
    left out). Read twice, apart from the trace tool: through a saved-tensor hook, and from the graph's
    nodes (`_saved_*`), which also hold the wrapped Python scalars autograd saves (`0.5 * x`: an 8-byte
    CPU tensor) and no hook is shown."""
    state = storages([*model.parameters(), *model.buffers()])
    batch = storages(inputs if isinstance(inputs, (tuple, list)) else [inputs])
    saved: dict[int, int] = {}

    def keep(t):
        s = t.untyped_storage()
        if s.data_ptr() and s.data_ptr() not in state and s.data_ptr() not in batch:
            saved[s.data_ptr()] = s.nbytes()

    def pack(t):
        keep(t)
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    todo, seen = [loss.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for name in dir(node):
            if name.startswith("_saved_"):
                for v in _tensors(getattr(node, name)):
                    keep(v)
        todo.extend(n for n, _ in node.next_functions)
    return loss, saved


def _tensors(v):
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (tuple, list)):
        for x in v:
            yield from _tensors(x)


def saved_bytes(model, inputs, loss_of) -> int:
    """Bytes of saved_storages."""
    return sum(saved_storages(model, inputs, loss_of).values())


def train_traced(
    build, device: str, allocators=None, steps: int = 2, autocast=None, optimizer=None, hook_backwards=0
):
    """A fresh model trained `steps` steps (AdamW, or `optimizer(params)`) under a recording started
    before it was built (as `supermem trace` runs a script). hook_backwards: backwards the recording's
    saved-tensor hook is on for (0: activations named by the phase rule alone, as after a recording's
    first backwards; None: the whole run). Returns (trace, model, optimizer, inputs, loss_of)."""
    rec = Recorder(allocators, activation_hook_backwards=hook_backwards).start()
    try:
        torch.manual_seed(0)
        model, batch, loss_of = build()
        model = model.to(device).train()
        inputs = batch(torch.Generator().manual_seed(1))
        if isinstance(inputs, torch.Tensor):
            inputs = inputs.to(device)
        else:
            inputs = tuple(x.to(device) for x in inputs)
        params = model.parameters()
        opt = optimizer(params) if optimizer else torch.optim.AdamW(params, lr=1e-3)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(torch.device(device).type, autocast or torch.float32, enabled=bool(autocast)):
                loss = loss_of(model, inputs)
            loss.backward()
            opt.step()
            del loss
        trace = rec.build()
    finally:
        rec.stop()
    return trace, model, opt, inputs, loss_of


def print_peak_table(name: str, rep) -> None:
    """The peak's owners, for a closing note (pytest -s)."""
    from supermem.units import format_bytes

    for d in rep.devices:
        peak = format_bytes(d.peak_bytes)
        print(f"\n{name}: device {d.device} ({d.name}), peak {peak}; coverage {d.coverage}")
        for r in d.peak_owners[:15]:
            share = r["bytes"] / d.peak_bytes if d.peak_bytes else 0
            print(f"  {r['category']:16} {r['module']:48} {format_bytes(r['bytes']):>12} {share:6.1%}")
