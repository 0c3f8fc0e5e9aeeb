"""Repairs of the installed torch that supermem applies before it relies on the part repaired."""

import pytest
import torch

from supermem import torch_private as tp


def test_a_record_stream_fake_with_another_ops_parameters_is_repaired_and_a_right_one_left_alone():
    streams = pytest.importorskip("torch._dynamo.variables.streams")
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = streams.record_stream
    right = op._abstract_fn
    assert not tp.repair_record_stream_fake()  # this torch's own fake: two parameters
    assert op._abstract_fn is right

    def broken(src_stream_index, wait_event_index, to_dealloc):  # torch 2.11's
        return None

    op.register_fake(broken)
    try:
        with FakeTensorMode(), pytest.raises(TypeError, match="to_dealloc"):
            torch.ops.streams.record_stream.default(torch.randn(4), 0)
        assert tp.repair_record_stream_fake()
        with FakeTensorMode():
            torch.ops.streams.record_stream.default(torch.randn(4), 0)
        assert torch.ops.streams.record_stream.default in torch.fx.node._side_effectful_functions
    finally:
        op.register_fake(right)


def _dropout_step(share, keep=None):
    """A compiled function with dropout at activation_memory_budget `share` (graphs that draw random
    numbers kept at `keep`): its loss, its input's gradient, and whether backward drew random numbers."""
    import torch._functorch.config as config

    torch._dynamo.reset()
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 32)

    def f(x):
        h = torch.nn.functional.dropout(torch.nn.functional.gelu(lin(x)), 0.2, True)
        return torch.nn.functional.dropout(h * h.sin(), 0.2, True).sum()

    x = torch.randn(16, 32, requires_grad=True)
    with config.patch(activation_memory_budget=share):
        tp.keep_random_graphs_at(keep)
        try:
            compiled = torch.compile(f, backend="aot_eager")
            compiled(x).backward()  # (compiles)
            x.grad = None
            torch.manual_seed(1)
            loss = compiled(x)
            before = torch.get_rng_state()
            loss.backward()
            drew = not torch.equal(before, torch.get_rng_state())
        finally:
            tp.keep_random_graphs_at(None)
    return loss.detach(), x.grad, drew


def test_a_graph_that_draws_random_numbers_keeps_its_share_and_its_gradients():
    pytest.importorskip("torch._dynamo")
    import torch._functorch.config as config

    pass_before, cache_before = config.joint_custom_pass, config.enable_autograd_cache
    loss, grad, drew = _dropout_step(1.0)
    assert not drew
    kept_loss, kept_grad, kept_drew = _dropout_step(0.3, keep=1.0)
    assert torch.equal(kept_loss, loss) and torch.equal(kept_grad, grad) and not kept_drew
    assert (config.joint_custom_pass, config.enable_autograd_cache) == (pass_before, cache_before)


@pytest.mark.parametrize(("p", "random"), [(0.0, False), (0.1, True)])
def test_only_graphs_whose_dropout_draws_are_kept_at_the_share(p, random):
    """Attention kernels are tagged as seeded at dropout_p 0.0 too, where they draw nothing."""
    pytest.importorskip("torch._dynamo")

    def f(q):
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.0, is_causal=True)
        return torch.nn.functional.dropout(a, p, True).sum()

    torch._dynamo.reset()
    kept = tp.keep_random_graphs_at(1.0)
    try:
        torch.compile(f, backend="aot_eager")(torch.randn(1, 2, 8, 16, requires_grad=True)).backward()
    finally:
        tp.keep_random_graphs_at(None)
    assert kept is not None and kept.pinned == int(random)
