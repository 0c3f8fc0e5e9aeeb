"""Module calls as a trace records them: nn.Module.__call__ wrapped (torch_private.wrap_module_calls),
not PyTorch's global module hooks, which put every module call on its slow path."""

import pytest
import torch

from supermem import torch_private as tp


def test_wrapped_module_calls_see_each_call_raise_through_and_come_off():
    """wrap_module_calls: pre before and post after every module call (post also where it raised,
    output None), no global module hook (each call keeps PyTorch's fast path), undone by its return."""
    from torch.nn.modules import module as nn_module

    seen = []
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    undo = tp.wrap_module_calls(
        lambda mod, args: seen.append(("pre", type(mod).__name__)),
        lambda mod, args, kwargs, out: seen.append(("post", type(mod).__name__, out is None)),
    )
    try:
        assert not nn_module._global_forward_hooks and not nn_module._global_forward_pre_hooks
        m(torch.ones(1, 2))
        with pytest.raises(RuntimeError):
            m(torch.ones(1, 3))  # the Linear raises: its post runs, and the Sequential's
    finally:
        undo()
    names = [("pre", "Sequential"), ("pre", "Linear"), ("post", "Linear", False), ("pre", "ReLU")]
    assert seen[:4] == names and seen[4:6] == [("post", "ReLU", False), ("post", "Sequential", False)]
    assert seen[6:] == [
        ("pre", "Sequential"),
        ("pre", "Linear"),
        ("post", "Linear", True),
        ("post", "Sequential", True),
    ]
    seen.clear()
    m(torch.ones(1, 2))
    assert seen == [] and torch.nn.Module.__call__ is torch.nn.Module._wrapped_call_impl


def test_a_patch_on_top_of_the_wrapper_stays_and_the_wrapper_passes_calls_through():
    seen = []
    undo = tp.wrap_module_calls(lambda mod, args: seen.append(mod), lambda *a: None)
    mine = torch.nn.Module.__call__
    torch.nn.Module.__call__ = lambda self, *a, **k: mine(self, *a, **k)  # someone else's, on top
    theirs = torch.nn.Module.__call__
    try:
        undo()
        assert torch.nn.Module.__call__ is theirs
        torch.nn.ReLU()(torch.ones(1))
        assert seen == []
    finally:
        torch.nn.Module.__call__ = torch.nn.Module._wrapped_call_impl


def test_a_compiled_model_under_the_wrapper_has_no_graph_break():
    import torch._dynamo

    undo = tp.wrap_module_calls(lambda mod, args: None, lambda *a: None)
    try:
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        explained = torch._dynamo.explain(m)(torch.randn(4, 8))
    finally:
        undo()
        torch._dynamo.reset()
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_a_compiled_model_under_a_recording_has_no_graph_break():
    """The recording's own module call (Context._module_call) passes dynamo's tracing through too."""
    import torch._dynamo

    from supermem.trace.attribution import Observations
    from supermem.trace.context import Context

    c = Context(Observations()).start()
    try:
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        explained = torch._dynamo.explain(m)(torch.randn(4, 8))
    finally:
        c.stop()
        torch._dynamo.reset()
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_a_recording_leaves_no_global_module_hook():
    from torch.nn.modules import module as nn_module

    from supermem.trace.attribution import Observations
    from supermem.trace.context import Context

    c = Context(Observations()).start()
    try:
        torch.nn.Linear(2, 2)(torch.ones(1, 2))
        assert not nn_module._global_forward_hooks and not nn_module._global_forward_pre_hooks
        assert c.paths == ["Linear"]
    finally:
        c.stop()
    assert torch.nn.Module.__call__ is torch.nn.Module._wrapped_call_impl


def test_a_recorded_call_runs_what_module_call_runs_a_compiled_modules_graph_and_hooks_included():
    """A recording runs PyTorch's Module.__call__ in place (one frame less a call): a module given a
    compiled call (Module.compile sets _compiled_call_impl) runs that, another its hooks and forward;
    both are recorded."""
    from supermem.trace.attribution import Observations
    from supermem.trace.context import Context

    compiled, plain = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    compiled._compiled_call_impl = lambda *a, **k: ("compiled", a, k)
    seen = []
    plain.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    x = torch.ones(1, 2)
    c = Context(Observations()).start()
    try:
        assert compiled(x, k=1) == ("compiled", (x,), {"k": 1})
        assert plain(x).shape == (1, 2) and seen == [(1, 2)]
    finally:
        c.stop()
    assert c.paths == ["Linear"] and [row[1] for row in c.log][-4:] == [0, -1, 0, -1] and len(c.calls) == 2
