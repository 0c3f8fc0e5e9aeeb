"""Activations named without a saved-tensor hook: a recording observes what autograd saves for its first
backwards only (context.py), then names activations from the phases (owners.py: made in a forward, freed
by its backward). On CPU models (allocations from torch.profiler: supermem.trace.cpu_source); what
autograd saved is read by the test itself (owners_workload.record_saves), never from the trace tool."""

import json

import numpy as np
import pytest
import torch
from corpus import CASES
from owners_workload import record_saves, saved_bytes
from small_models import ResNet

from supermem import registry
from supermem import torch_private as tp
from supermem.trace import recorder as rec_mod
from supermem.trace import run_script
from supermem.trace.analysis import analyze, summary_text
from supermem.trace.cli_trace import TRACE_ENV
from supermem.trace.cpu_source import ProfiledCPU
from supermem.trace.owners import stack_owners
from supermem.trace.recorder import Recorder
from supermem.trace.timeline import lifetimes, series


def _resnet(size):
    def batch(g):
        return torch.randn(2, 3, 16, 16, generator=g), torch.randint(0, 10, (2,), generator=g)

    return ResNet(), batch, lambda m, x: torch.nn.functional.cross_entropy(m(x[0]), x[1])


BUILDS = {"resnet": _resnet, "gpt2": CASES["gpt2"]}


def _train(build, steps, rec, last_saves=False):
    """`steps` AdamW steps of a fresh model under `rec` (started here unless it is recording, before the
    model is built, as `supermem trace` runs a script). Returns (trace, model, inputs, loss_of, what
    autograd saved in the last forward when asked)."""
    if rec_mod.active() is not rec:
        rec.start()
    try:
        torch.manual_seed(0)
        model, batch, loss_of = build("tiny")
        model.train()
        inputs = batch(torch.Generator().manual_seed(1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        saved = {}
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            if last_saves and step == steps - 1:
                loss, saved = record_saves(model, inputs, lambda: loss_of(model, inputs))
            else:
                loss = loss_of(model, inputs)
            loss.backward()
            opt.step()
            del loss
        trace = rec.build()
    finally:
        rec.stop()
    return trace, model, inputs, loss_of, saved


@pytest.mark.parametrize("name", list(BUILDS))
def test_a_step_with_the_hook_gone_names_the_activations_at_its_peak(name):
    """Three steps under the default recording: the hook checks the first two backwards and comes off; at
    the third step's peak, what autograd saved is named activation, with a module path."""
    trace, model, inputs, loss_of, saved = _train(BUILDS[name], 3, Recorder([ProfiledCPU()]), last_saves=True)
    rule = trace.meta["activation_rule"]
    assert rule["hook_backwards"] == 2 and rule["hook_off_ns"] is not None
    assert not tp.saved_hooks_in_force()  # the recording's hook is off, and stopping took nothing else off
    assert rule["hook_bytes"] > 0 and rule["both_bytes"] >= 0.99 * rule["hook_bytes"]
    # (the rule's extra bytes: autograd's wrapped scalars, which the hook is not shown; 8 bytes each)
    assert rule["rule_bytes"] - rule["both_bytes"] <= 0.01 * rule["hook_bytes"]
    assert "the rule found" in summary_text(analyze(trace))

    lt = lifetimes(trace, 0)
    t = trace.cols["time_ns"]
    s = series(trace, 0, lt)
    after = s.time_ns > rule["hook_off_ns"]  # the third step: no hook
    peak = int(s.index[np.flatnonzero(after)[np.argmax(s.active[after])]])
    live = lt.live_at(peak) & (lt.start >= 0) & (t[lt.start.clip(0)] > rule["hook_off_ns"])
    modules, phases = stack_owners(trace)
    # What the forward saved, by address: not a block the backward made at a saved tensor's address
    # once that one was freed (a gradient or autograd's own, live at a peak a little past backward's
    # start: 1 run in 6 on a loaded CPU)
    in_backward = np.array([i >= 0 and phases[int(i)] == "backward" for i in lt.stack])
    saved_live = live & np.isin(lt.address, list(saved)) & ~in_backward
    act = trace.categories.index("activation")
    named = (
        saved_live
        & (lt.category == act)
        & np.array([bool(modules[int(i)]) if i >= 0 else False for i in lt.stack])
    )
    saved_b, named_b = int(lt.size[saved_live].sum()), int(lt.size[named].sum())
    assert saved_b > 0.5 * int(lt.size[live].sum())  # the peak is the backward's start: activations
    assert named_b >= 0.95 * saved_b, (named_b, saved_b)
    wrong = live & (lt.category == act) & ~saved_live  # and the rule names nothing autograd did not save
    assert int(lt.size[wrong].sum()) <= 0.01 * saved_b


def test_exact_activations_keeps_the_hook_for_the_whole_recording():
    trace, *_ = _train(_resnet, 3, Recorder([ProfiledCPU()], activation_hook_backwards=None))
    rule = trace.meta["activation_rule"]
    assert rule["hook_backwards"] == 3 and rule["hook_off_ns"] is None
    assert "on for the whole recording" in summary_text(analyze(trace))
    assert not tp.saved_hooks_in_force()  # stop() took it off


def test_the_hook_stays_where_another_is_on_top_of_it():
    """The pool's hooks (or a user's) pushed above the recording's: popping would take theirs off."""
    rec = Recorder([ProfiledCPU()], activation_hook_backwards=1).start()
    try:
        x = torch.randn(4, requires_grad=True)
        mine = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with mine:
            x.exp().sum().backward()
            assert tp.saved_hooks_in_force()[0] == mine.pack_hook  # theirs still on top
        assert rec.context.hook_off_ns is None  # so ours stayed
        x.exp().sum().backward()  # the next backward's end takes it off
        assert rec.context.hook_off_ns is not None and not tp.saved_hooks_in_force()
    finally:
        rec.stop()


def test_backward_marks_the_loss_outside_the_model():
    """The backward begins when the engine is called, before the loss's own nodes (computed outside the
    model) run: their saves (log_softmax's output) are freed inside it and named activations."""
    trace, model, inputs, loss_of, _ = _train(
        _resnet, 2, Recorder([ProfiledCPU()], activation_hook_backwards=0)
    )
    lt = lifetimes(trace, 0)
    modules, phases = stack_owners(trace)
    act = trace.categories.index("activation")
    outside = [
        i
        for i in range(len(lt))
        if lt.category[i] == act and lt.stack[i] >= 0 and not modules[int(lt.stack[i])]
    ]
    assert outside and {phases[int(lt.stack[i])] for i in outside} == {"forward"}
    assert torch.autograd.Variable._execution_engine is tp.execution_engine  # the watch is gone


def test_launched_ranks_name_activations_without_the_hook(tmp_path, monkeypatch):
    """A rank under `supermem trace -- torchrun` records with no saved-tensor hook (gloo's teardown):
    its activations come from the phases, no longer "temporary"."""
    src = ProfiledCPU()
    registry.register(src, 0)
    writes = []
    monkeypatch.setattr("atexit.register", writes.append)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv(
        TRACE_ENV,
        json.dumps({"output": str(tmp_path / "r{rank}.smtrace"), "capacity": 10**6, "stacks": False}),
    )
    try:
        assert run_script.start_from_env(install=False)
        rec = rec_mod.active()
        assert rec is not None and rec.context.hook_backwards == 0 and not tp.saved_hooks_in_force()
        trace, model, inputs, loss_of, _ = _train(_resnet, 2, rec)
    finally:
        registry.unregister(src)
        src.close()
    assert trace.meta["activation_rule"]["hook_backwards"] == 0
    lt = lifetimes(trace, 0)
    t = trace.cols["time_ns"]
    last = max(
        int(t[i])
        for i in range(len(t))
        if trace.actions[int(trace.cols["action"][i])] == "phase"
        and trace.strings[int(trace.cols["detail"][i])] == "forward"
    )
    act = trace.categories.index("activation")
    began = (lt.start >= 0) & (t[lt.start.clip(0)] >= last)
    model.zero_grad(set_to_none=True)
    assert int(lt.size[began & (lt.category == act)].sum()) == saved_bytes(model, inputs, loss_of)


def test_a_forward_freed_by_a_later_backward_than_the_next():
    """Two forwards, then their backwards in the other order (a pipeline's micro-batches, a GAN's two
    losses): the first forward's saves are freed by the second backward, and are activations too."""
    rec = Recorder([ProfiledCPU()], activation_hook_backwards=0).start()
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
        xa, xb = torch.randn(8, 16), torch.randn(8, 16)
        a, saved_a = record_saves(model, (xa, xb), lambda: model(xa).square().mean())
        b, saved_b = record_saves(model, (xa, xb), lambda: model(xb).square().mean())
        b.backward()
        a.backward()
        trace = rec.build()
    finally:
        rec.stop()
    lt = lifetimes(trace, 0)
    act = trace.categories.index("activation")
    assert saved_a and saved_b
    assert int(lt.size[lt.category == act].sum()) == sum(saved_a.values()) + sum(saved_b.values())
